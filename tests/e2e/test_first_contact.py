"""What a new user meets first: the start of a run says what each data source resolved to (a folder names the
shards its sizes.json does not list), warnings never share the progress bar's line, skipped data is counted in
samples and shards apart, a resume whose weights do not fit names the keys, and a run that fails to build leaves
no folder."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest

from mmcl.cli import main
from mmcl.data.sources import expand_sources

from helpers import png, short_run, write_tar


def test_the_start_lines_say_what_each_source_resolved_to_and_a_folder_names_unlisted_shards(small_demo, tmp_path):
    from mmcl.data.sizes import describe_sources

    folder = tmp_path / "train"
    shutil.copytree(Path(small_demo["train"]).parent, folder)
    assert describe_sources(f"{folder}::{small_demo['val']}") == [
        f"data.train source 1 of 2: '{folder}' (a folder: its shards): 2 shard(s) "
        f"(shard-000000.tar .. shard-000001.tar), 64 samples",
        f"data.train source 2 of 2: '{small_demo['val']}': 1 shard(s) (shard-000000.tar), 8 samples"]
    # A folder takes every shard file in it; one its sizes.json does not list (an evaluation shard copied in beside
    # the training set) is named in one warning, and the samples are then unknown.
    shutil.copy(small_demo["val"], folder / "val-000000.tar")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (urls,) = expand_sources(str(folder))
    assert [os.path.basename(u) for u in urls] == ["shard-000000.tar", "shard-000001.tar", "val-000000.tar"]
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "1 of the 3 shard files" in said[0] and "(val-000000.tar)" in said[0], said
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # describing the sources warns nothing: the data stream does, once
        assert describe_sources(str(folder), num_samples=100) == [
            f"data.train: '{folder}' (a folder: its shards): 3 shard(s) (shard-000000.tar .. val-000000.tar), "
            f"samples unknown", "data.train_num_samples=100 samples per epoch"]


def _damaged_shards(root: Path, good: int = 30) -> Path:
    """a.tar: a corrupt image first, then `good` samples, then a sample cut off mid-image (a truncated shard);
    b.tar: not a tar file (a shard that cannot be opened)."""
    root.mkdir()
    members = [("bad.png", b"\x89PNG not an image"), ("bad.txt", b"a broken picture")]
    for i in range(good + 1):
        members += [(f"s{i:03d}.png", png(i)), (f"s{i:03d}.txt", f"caption {i}".encode())]
    write_tar(root / "a.tar", members)
    with tarfile.open(root / "a.tar") as tar:
        cut = [m for m in tar.getmembers() if m.name == f"s{good:03d}.png"][0].offset_data + 10
    with open(root / "a.tar", "r+b") as f:
        f.truncate(cut)
    (root / "b.tar").write_bytes(b"\x00not a tar file" * 64)
    return root


def _rendered(console: str):
    """The console's lines as a terminal shows them: a carriage return goes back to the line's start and what
    follows overwrites it."""
    lines = []
    for raw in console.split("\n"):
        cells, col = [], 0
        for ch in raw:
            if ch == "\r":
                col = 0
                continue
            if col < len(cells):
                cells[col] = ch
            else:
                cells.append(ch)
            col += 1
        lines.append("".join(cells).rstrip())
    return lines


@pytest.mark.slow
def test_warnings_are_written_through_the_bar_and_skips_are_counted_by_unit(tmp_path):
    shards = _damaged_shards(tmp_path / "shards")
    out = tmp_path / "run"
    args = short_run(f"{shards}/*.tar", out, "train.progress=true", "train.steps=12", "data.batch_size=4",
                    "data.shuffle_buffer=4", "train.save_every=0", "train.log_every=4")
    # stdout and stderr into one pipe, as on a terminal: the progress bar (stderr) and the lines between its redraws;
    # read as bytes, since text mode would turn the bar's carriage returns into newlines
    p = subprocess.run([sys.executable, "-m", "mmcl", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    console = p.stdout.decode()
    assert p.returncode == 0, console
    assert "\r" in console  # the bar redraws in place
    lines = _rendered(console)
    warned = [ln for ln in lines if "mmcl: warning:" in ln]
    assert any("truncated or corrupt" in ln for ln in warned), console  # met while the bar was shown
    assert any("cannot open shard" in ln for ln in warned), console
    for ln in lines:  # every line of mmcl's starts its own line, never after the bar's text
        assert "mmcl: " not in ln or ln.startswith("mmcl: "), repr(ln)
    assert any(ln.startswith("train: 100%") for ln in lines), console  # the bar was shown, and finished
    # One pass over the data is 30 samples: the 48 read pass a.tar's corrupt first sample twice; a.tar broke off
    # once (the second pass stops before its end) and b.tar failed once or twice (in the second pass it may come
    # before or after a.tar).
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert "data/skipped" not in last
    assert last["data/skipped_samples"] == 2 and last["data/skipped_shards"] in (2, 3), last
    summary = next(ln for ln in lines if ln.startswith("mmcl: run finished: "))
    assert (f"skipped: {last['data/skipped_samples']} samples, {last['data/skipped_shards']} shards, 0 steps"
            in summary), summary
    # The start of the run said what data.train resolved to.
    assert f"mmcl: data.train: '{shards}/*.tar': 2 shard(s) (a.tar .. b.tar), samples unknown" in lines, console


@pytest.mark.slow
def test_a_resume_whose_weights_do_not_fit_names_the_keys(small_demo, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(short_run(small_demo["train"], out)) == 0
    capsys.readouterr()
    # Another loss in the same folder, forced on: SigLIP's model has a logit bias the checkpoint lacks.
    code = main(short_run(small_demo["train"], out, "train.steps=3", "loss.clip=0", "loss.siglip=1",
                         "model.init_logit_bias=-10", "train.resume=force"))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "its weights do not fit this run's model" in err, err
    assert "1 missing key(s) (logit_bias)" in err and "another train.output_dir" in err, err
    assert "Error(s) in loading state_dict" not in err


@pytest.mark.slow
def test_a_run_that_cannot_build_its_model_leaves_no_folder(small_demo, tmp_path, capsys):
    out = tmp_path / "runs" / "new"
    code = main(short_run(small_demo["train"], out, "model.name=no-such-model"))
    err = capsys.readouterr().err
    assert code == 2 and "no-such-model" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()
    # A folder that was there before stays, and so does what is in it.
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    assert main(short_run(small_demo["train"], out, "model.name=no-such-model")) == 2
    assert (out / "notes.txt").read_text() == "mine"
