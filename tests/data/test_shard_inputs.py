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


# ------------------------------------------------------------------------- a table's paths, as open_clip reads them
def _csv_journey_files(root):
    """mydata/train.csv in open_clip's layout under `root`: two rows with paths relative to `root` (open_clip's
    reading, run from `root`), one relative to mydata/ only, one missing, one not an image."""
    images = root / "mydata" / "images"
    images.mkdir(parents=True)
    for seed, name in enumerate(("0.png", "1.png", "only-beside.png")):
        (images / name).write_bytes(png(seed, 8))
    (images / "broken.png").write_bytes(b"not a png at all")
    rows = ["mydata/images/0.png\ta cat", "mydata/images/1.png\ta dog", "images/only-beside.png\ta bird",
            "mydata/images/gone.png\ta ghost", "mydata/images/broken.png\ta broken file"]
    table = root / "mydata" / "train.csv"
    table.write_text("filepath\ttitle\n" + "".join(r + "\n" for r in rows))
    return table


def test_table_paths_are_read_as_open_clip_reads_them_and_the_rule_is_said(tmp_path, monkeypatch, capsys):
    """Paths relative to the current directory (open_clip's CsvDataset opens them as written); a path that exists
    only beside the table is read there; the line says which rule applied to how many rows, and every missing_file
    and decode record names the path tried."""
    import json

    _csv_journey_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["shards", "--input", "mydata/train.csv", "--out", "shards"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("mmcl: image paths of")]
    assert lines == [f"mmcl: image paths of mydata/train.csv: 3 relative to the current directory {tmp_path}, as "
                     f"open_clip reads them; 1 relative to the table's folder {tmp_path / 'mydata'} (the only place "
                     f"they exist; open_clip would not find them: run from that folder or give paths from here); "
                     f"1 found in neither (missing_file)"], out
    assert "wrote 3 samples in 1 shards to shards; skipped 2" in out
    assert _shard_texts(tmp_path / "shards") == {"000000000.txt": "a cat", "000000001.txt": "a dog",
                                                 "000000002.txt": "a bird"}
    recs = [json.loads(line) for line in (tmp_path / "shards" / "skipped.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["member"]) for r in recs] == [("missing_file", "train.csv:5"),
                                                          ("decode", "train.csv:6")]
    assert recs[0]["detail"] == (f"no file mydata/images/gone.png (nor mydata/mydata/images/gone.png) relative "
                                 f"to {tmp_path}")
    assert recs[1]["detail"].startswith("mydata/images/broken.png: ")
    # the summary's first skips carry the same detail
    assert "first: train.csv:5: missing_file (no file mydata/images/gone.png" in out


def test_a_wrong_caption_column_names_the_columns_found_not_the_separator(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(png(0, 8))
    table = tmp_path / "t.tsv"
    table.write_text("filepath\ttitle\tsource\na.png\ta cat\tweb\n")
    assert main(["shards", "--input", str(table), "--out", str(tmp_path / "o"), "--caption-col", "caption"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmcl: error: ") and "--sep" not in err[0], err
    assert "(got filepath, title, source: 3 columns, read as tab-separated; name yours with --image-col and " \
           "--caption-col)" in err[0]
    # one column read from a header with commas: the separator is what to change
    comma = tmp_path / "c.tsv"
    comma.write_text("filepath,title\na.png,a cat\n")
    assert main(["shards", "--input", str(comma), "--out", str(tmp_path / "p")]) == 2
    assert "read as tab-separated; set another separator with --sep" in capsys.readouterr().err
