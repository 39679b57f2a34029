"""`mmcl shards` inputs named the way evaluation names them, and the tar reader's memory over many members."""

import gc
import io
import tarfile
import tracemalloc

import pytest

from mmcl import data
from mmcl.cli import main
from mmcl.data.eval_data import folder_classnames
from mmcl.shards import writer as shard_writer

from helpers import png


def _shard_texts(out):
    """{member name: text} of the .txt and .cls members of every shard under `out`."""
    got = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar:
                if m.name.endswith((".txt", ".cls")):
                    got[m.name] = tar.extractfile(m).read().decode()
    return got


def test_wordnet_id_folders_become_readable_captions_and_class_names(tmp_path, capsys):
    root = tmp_path / "imagenet" / "val"
    for i, wnid in enumerate(["n01443537", "n01440764"]):  # goldfish, tench: sorted order puts tench first
        (root / wnid).mkdir(parents=True)
        (root / wnid / f"{wnid}_0.png").write_bytes(png(i, 8))
    out = tmp_path / "shards"
    assert main(["shards", "--input", str(root), "--out", str(out)]) == 0, capsys.readouterr().err
    got = _shard_texts(out)
    assert sorted((v, got[k[:-3] + "cls"]) for k, v in got.items() if k.endswith(".txt")) == [
        ("a photo of a goldfish.", "1"), ("a photo of a tench.", "0")]
    assert (out / "classnames.txt").read_text().splitlines() == ["tench", "goldfish"]
    # The names evaluation scores the same folder by, and those the shards' evaluation set reads back.
    assert folder_classnames(str(root)) == (["tench", "goldfish"], "imagenet-1k")
    assert data.build_eval_dataset(str(out / "shard-000000.tar"), None).classnames == ["tench", "goldfish"]


def test_folder_names_stay_captions_when_they_are_not_wordnet_ids(tmp_path, capsys):
    root = tmp_path / "pets"
    for i, name in enumerate(["cat_face", "n01440764"]):  # one folder not a WordNet id: every name is its folder's
        (root / name).mkdir(parents=True)
        (root / name / "a.png").write_bytes(png(i, 8))
    out = tmp_path / "shards"
    summary = shard_writer.shards_from_input(str(root), str(out), progress=False)
    assert summary["n_samples"] == 2
    assert sorted(v for k, v in _shard_texts(out).items() if k.endswith(".txt")) == [
        "a photo of a cat face.", "a photo of a n01440764."]
    assert (out / "classnames.txt").read_text().splitlines() == ["cat face", "n01440764"]


def _tar_of(n_members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(n_members):
            info = tarfile.TarInfo(f"{i:07d}.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    return buf.getvalue()


def _reader_peak(raw, stream_cls):
    """Peak traced bytes while a `TarReader` passes over every member of `raw` (reading every tenth)."""
    stream = stream_cls(raw)
    gc.collect()
    tracemalloc.start()
    try:
        reader = data.TarReader(stream)
        for i, _ in enumerate(reader):
            if i % 10 == 0:
                reader.read()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class _Pipe(io.RawIOBase):
    """A non-seekable stream, as a pipe or HTTP body is."""

    def __init__(self, raw):
        self._data, self._pos = raw, 0

    def readable(self):
        return True

    def readinto(self, buf):
        n = min(len(buf), len(self._data) - self._pos)
        buf[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


@pytest.mark.slow
def test_tar_reader_memory_does_not_grow_with_the_number_of_members():
    small, large = _tar_of(1_000), _tar_of(20_000)
    for stream_cls in (io.BytesIO, lambda raw: io.BufferedReader(_Pipe(raw))):
        few, many = _reader_peak(small, stream_cls), _reader_peak(large, stream_cls)
        # Keeping each member's header would cost ~20,000 x several hundred bytes (megabytes) more for the large
        # archive; passing over them costs the same few kilobytes whatever the count.
        assert many < few + 200_000, (few, many)
