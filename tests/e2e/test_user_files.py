"""The data files users already have: open_clip's CSV layout for `mmcl shards`, and a LAION download with holes
for `mmcl train` (one rule, shared by preflight and the data layer)."""

import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmcl.cli import main
from mmcl.config import load_config
from mmcl.data import epoch_shard_plan, missing_shards
from mmcl.training.preflight import input_problems

from helpers import TRAINING_TOWERS, inputs_of

ROOT = Path(__file__).resolve().parents[2]


def _images(folder: Path, n: int):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def _shard_rows(out: Path):
    """(caption, RGB pixels) of every sample in the shards under `out`, in order."""
    import io

    rows = []
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = {}
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                members.setdefault(key, {})[ext] = tar.extractfile(m).read()
        for key in sorted(members):
            files = members[key]
            image = next(files[e] for e in ("png", "jpg", "webp") if e in files)
            rows.append((files["txt"].decode(), np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))))
    return rows


# ------------------------------------------------------------------------------------- open_clip's CSV layout
@pytest.mark.parametrize("name", ["train.csv", "train.tsv"])
def test_open_clip_csv_layout_is_read_as_open_clip_reads_it(tmp_path, monkeypatch, capsys, name):
    """open_clip_train's default CSV: tab-separated ``filepath`` and ``title`` columns, whatever the file's name.
    The shards hold the same (caption, pixels) pairs as open_clip's own CsvDataset reads from it."""
    from open_clip_train.data import CsvDataset

    monkeypatch.chdir(tmp_path)  # open_clip resolves paths against the current directory, mmcl against the CSV's
    paths = _images(tmp_path / "imgs", 3)
    captions = ["a red, noisy square", "two dogs; one cat", "a \"quoted\" title"]
    table = tmp_path / name
    table.write_text("filepath\ttitle\n" + "".join(f"imgs/{p.name}\t{c}\n" for p, c in zip(paths, captions)))
    assert main(["shards", "--input", str(table), "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    ours = _shard_rows(tmp_path / "out")
    theirs = CsvDataset(str(table), lambda im: np.asarray(im.convert("RGB")), "filepath", "title", sep="\t",
                        tokenizer=lambda texts: texts)
    assert [c for c, _ in ours] == [str(c) for c in theirs.captions] == captions
    for (_, pixels), path in zip(ours, theirs.images):
        np.testing.assert_array_equal(pixels, np.asarray(Image.open(path).convert("RGB")))


def test_sep_and_column_options_match_open_clips_flags(tmp_path, capsys):
    paths = _images(tmp_path / "imgs", 2)
    table = tmp_path / "pairs.csv"  # relative paths resolve against the table's folder, wherever mmcl runs
    table.write_text("id|path|text\n" + "".join(f"{i}|imgs/{p.name}|caption {i}\n" for i, p in enumerate(paths)))
    argv = ["shards", "--input", str(table), "--out", str(tmp_path / "out")]
    assert main([*argv, "--sep", "|", "--image-col", "path", "--caption-col", "text"]) == 0
    assert [c for c, _ in _shard_rows(tmp_path / "out")] == ["caption 0", "caption 1"]
    # A tab typed as open_clip users type it, and a comma CSV with mmcl's own columns, still read.
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("path\ttext\n" + "".join(f"imgs/{p.name}\tt{i}\n" for i, p in enumerate(paths)))
    assert main(["shards", "--input", str(tsv), "--out", str(tmp_path / "t"), "--sep", "\\t", "--image-col",
                 "path", "--caption-col", "text"]) == 0
    assert [c for c, _ in _shard_rows(tmp_path / "t")] == ["t0", "t1"]
    comma = tmp_path / "comma.csv"
    comma.write_text("image,caption\n" + "".join(f"imgs/{p.name},c{i}\n" for i, p in enumerate(paths)))
    assert main(["shards", "--input", str(comma), "--out", str(tmp_path / "c")]) == 0
    assert [c for c, _ in _shard_rows(tmp_path / "c")] == ["c0", "c1"]
    capsys.readouterr()
    # A column that is not there is one error line naming it and the columns found.
    assert main([*argv[:3], "--out", str(tmp_path / "x"), "--sep", "|", "--image-col", "filepath"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmcl: error: ") and "'filepath'" in err[0]
    assert "got id, path, text" in err[0]


# ---------------------------------------------------------------------------------- a range with holes
def _holes(tmp_path: Path):
    for i in (0, 1, 3):
        (tmp_path / "shards" / f"s-{i}.tar").parent.mkdir(exist_ok=True)
        (tmp_path / "shards" / f"s-{i}.tar").write_bytes(b"")
    return str(tmp_path / "shards" / "s-{0..3}.tar")


def test_holes_are_one_rule_for_preflight_and_the_data_layer(tmp_path):
    from mmcl.data import expand_sources
    from mmcl.errors import DataError

    spec = _holes(tmp_path)
    assert missing_shards(spec, require_all=False) == []
    assert input_problems(*inputs_of(load_config(None, [f"data.train={spec}"]))) == []
    with pytest.warns(UserWarning, match=r"^1 of 4 shards of .* do not exist, e\.g\. .*s-2\.tar; using the 3 that do"):
        assert [os.path.basename(u) for u in expand_sources(spec)[0]] == ["s-0.tar", "s-1.tar", "s-3.tar"]
    strict = load_config(None, [f"data.train={spec}", "data.require_all_shards=true"])
    assert input_problems(*inputs_of(strict)) == [f"data.train: 1 of the 4 paths that '{spec}' names are missing "
                                      f"({tmp_path}/shards/s-2.tar)"]
    with pytest.raises(DataError, match="1 of 4 shards .* do not exist.*data.require_all_shards=true"):
        expand_sources(spec, require_all=True)
    # The training stream, built without preflight (from Python), follows the same key.
    from mmcl.config import DataConfig
    from mmcl.data import build_train_stream

    with pytest.raises(DataError, match="1 of 4 shards .* do not exist"):
        build_train_stream(DataConfig(train=spec, require_all_shards=True, workers=0), lambda x: x, lambda t: t,
                           seed=0)
    # A range of which no shard exists is refused whatever the key says.
    gone = str(tmp_path / "none" / "s-{0..3}.tar")
    assert input_problems(*inputs_of(load_config(None, [f"data.train={gone}"]))) == [
        f"data.train: all of the 4 paths that '{gone}' names are missing ({tmp_path}/none/s-0.tar, "
        f"{tmp_path}/none/s-1.tar, {tmp_path}/none/s-2.tar, ...)"]


@pytest.mark.slow
def test_mmcl_train_on_a_range_with_holes(demo, tmp_path, capsys):
    train_dir = shutil.copytree(Path(demo["train"]).parent, tmp_path / "train")  # the shared demo stays whole
    shards = sorted(train_dir.glob("shard-*.tar"))
    assert len(shards) == 8
    hole = shards[2]
    hole.unlink()
    spec = str(train_dir / "shard-{000000..000007}.tar")
    args = ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={spec}", "eval.zeroshot=null",
            "train.progress=false", "train.plot=false", "data.shuffle_buffer=16", "data.workers=0",
            "data.batch_size=8", "train.steps=3", "train.save_every=0", *TRAINING_TOWERS]
    capsys.readouterr()
    assert main([*args, f"train.output_dir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err
    warned = [ln for ln in err.splitlines() if "do not exist" in ln]
    assert warned == [f"mmcl: warning: 1 of 8 shards of '{spec}' do not exist, e.g. {hole}; using the 7 that do "
                      f"(data.require_all_shards=true refuses the run instead)"], err
    assert (tmp_path / "run" / "model").is_dir()
    # With the key set, the same range is one error line before anything is built.
    assert main([*args, f"train.output_dir={tmp_path / 'strict'}", "data.require_all_shards=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"mmcl: error: missing input .*data\.train: 1 of the 8 paths that '.*' "
                                      r"names are missing \(.*shard-000002\.tar\)$", err[0]), err
    assert not (tmp_path / "strict" / "checkpoints").exists()


# ----------------------------------------------------------------------------- weights against open_clip
def test_readme_states_how_the_weights_differ_from_open_clip():
    """docs/data.md's settings table and its CSV section say where mmcl differs from open_clip."""
    text = (ROOT / "docs" / "data.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(data\.[a-z_]+)`.*$", text, re.MULTILINE)}
    captions = rows["data.caption_key_weights"]
    assert "weight 0" in captions and "never" in captions and "first non-empty" in captions
    assert "--train-data-upsampling-factors" in rows["data.weights"]
    assert "data.require_all_shards" in rows
    assert "filepath" in text and "title" in text and "--csv-separator" in text


def test_data_weights_from_open_clip_upsampling_factors():
    """The conversion in docs/data.md: open_clip's factor F of a source with n shards is mmcl's weight F * n
    (open_clip's factor multiplies each shard's weight; mmcl's weight is the source's share). Checked against
    open_clip's own
    expansion of the factors, with mmcl's resampled shard plan drawn over many epochs."""
    from open_clip_train.data import expand_urls

    sources = [[f"a-{i}.tar" for i in range(3)], [f"b-{i}.tar" for i in range(1)]]
    factors = [1.0, 2.0]
    urls, shard_weights = expand_urls("a-{0..2}.tar::b-0.tar", "1::2")
    assert urls == sources[0] + sources[1]
    theirs = sum(w for u, w in zip(urls, shard_weights) if u.startswith("b")) / sum(shard_weights)
    weights = [f * len(s) for f, s in zip(factors, sources)]
    draws = [u for epoch in range(3000) for u, _ in epoch_shard_plan(sources, epoch, 0, 0, 1, True, weights)]
    ours = sum(u.startswith("b") for u in draws) / len(draws)
    assert theirs == pytest.approx(0.4) and ours == pytest.approx(theirs, abs=0.02)
