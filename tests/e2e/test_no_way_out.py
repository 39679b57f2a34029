"""A folder mmcl writes is never a way out of it: a symbolic link (to a file, a folder, /dev/null, a FIFO) where mmcl
would write, and a manifest entry that is absolute, holds '..' or is a link, are one error line and exit 2; what
the link points at is left byte-identical with its modification time, and the link itself is left in place."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mmcl.cli import main
from mmcl.errors import ConfigError

from helpers import short_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def never_blocks():
    """A FIFO opened for writing must not hang the test: fail it after 60 s instead."""
    def fail(*_):
        raise TimeoutError("blocked")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def finished(small_demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(short_run(small_demo, out)) == 0
    return out


def state(path: Path):
    """What the user has at `path`: every file under it with its bytes and modification time."""
    if path.is_dir():
        return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns)
                for p in sorted(path.rglob("*")) if p.is_file()}
    return path.read_bytes(), path.stat().st_mtime_ns


def users_target(tmp_path: Path, kind: str) -> Path:
    """Something of the user's for a link to point at."""
    if kind == "file":
        (tmp_path / "notes.txt").write_text("the user's notes\n")
        return tmp_path / "notes.txt"
    if kind == "folder":
        project = tmp_path / "project"
        project.mkdir()
        (project / "config.json").write_text('{"mine": 1}\n')
        (project / "tokenizer.json").write_text('{"vocab": {}}\n')
        return project
    if kind == "fifo":
        os.mkfifo(tmp_path / "pipe")
        return tmp_path / "pipe"
    return Path("/dev/null")


def assert_refused(capsys, link: Path, target: Path, before, err=None):
    err = (err if err is not None else capsys.readouterr().err).strip().splitlines()
    assert [line for line in err if "error" in line] == err[-1:] and err[-1].startswith("mmcl: error: "), err
    assert "Traceback" not in "\n".join(err) and str(link.name) in err[-1]
    assert link.is_symlink() and os.readlink(link) == str(target)
    if target.is_file() or target.is_dir():
        assert state(target) == before


KINDS = ["file", "folder", "devnull", "fifo"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [".lock", "out.log", "metrics.jsonl", "config.yaml", "model", "wise_ft"])
def test_a_link_in_a_run_folder_from_elsewhere_is_refused(finished, small_demo, tmp_path, capsys, name, kind):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    target = users_target(tmp_path, kind)
    before = state(target) if kind in ("file", "folder") else None
    shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(target)
    capsys.readouterr()
    assert main(short_run(small_demo, run, "train.steps=3")) == 2
    assert_refused(capsys, run / name, target, before)


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_lock_linked_in_an_otherwise_empty_folder_is_not_truncated_nor_shown(small_demo, tmp_path, capsys, kind):
    run = tmp_path / "run"
    run.mkdir()
    target = users_target(tmp_path, kind)
    before = state(target) if kind == "file" else None
    (run / ".lock").symlink_to(target)
    assert main(short_run(small_demo, run)) == 2
    out = capsys.readouterr()
    assert "the user's notes" not in out.out + out.err
    assert_refused(capsys, run / ".lock", target, before, out.err)


def test_a_checkpoint_linked_to_a_folder_of_the_users_is_refused(finished, small_demo, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    target = tmp_path / "elsewhere"
    shutil.move(step, target)
    step.symlink_to(target)
    before = state(target)
    assert main(short_run(small_demo, run, "train.steps=4", "train.keep_checkpoints=1")) == 2
    assert_refused(capsys, step, target, before)


# ------------------------------------------------------------------------------------------------ manifests
@pytest.fixture(scope="module")
def converted(small_demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "out"
    assert main(["shards", "--input", small_demo["zeroshot_colour"], "--out", str(out)]) == 0
    return out


def with_listed(folder: Path, entry: str):
    path = folder / "mmcl-manifest.json"
    meta = json.loads(path.read_text())
    meta["files"].append(entry)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "dotdot-inside"])
def test_a_manifest_entry_outside_its_folder_is_refused(converted, small_demo, tmp_path, capsys, how):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    target = users_target(tmp_path, "file")
    before = state(target)
    entry = {"absolute": str(target), "dotdot": "../notes.txt", "dotdot-inside": "sub/../../notes.txt"}[how]
    with_listed(out, entry)
    assert main(["shards", "--input", small_demo["zeroshot_colour"], "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmcl: error: ") and "not a path inside" in err[0], err
    assert state(target) == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,listed", [("shard-000000.tar.tmp", True), ("sizes.json.tmp", False),
                                         ("sizes.json.tmp", True), ("shard-000000.tar", True)])
def test_a_linked_shard_file_is_refused_listed_or_not(converted, small_demo, tmp_path, capsys, name, listed, kind):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    target = users_target(tmp_path, kind)
    before = state(target) if kind in ("file", "folder") else None
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(target)
    if listed:
        with_listed(out, name)
    assert main(["shards", "--input", small_demo["zeroshot_colour"], "--out", str(out)]) == 2
    assert_refused(capsys, out / name, target, before)


def test_demo_data_does_not_delete_a_manifest_entry_outside(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    target = users_target(tmp_path, "file")
    before = state(target)
    (out / "mmcl-manifest.json").write_text(json.dumps({"command": "demo-data", "files": ["../notes.txt"],
                                                         "data": {}}))
    assert main(["demo-data", "--out", str(out), "--n-train", "8"]) == 2
    assert capsys.readouterr().err.startswith("mmcl: error: ")
    assert state(target) == before


# ------------------------------------------------------------------------------------------------ exports, index
@pytest.mark.parametrize("kind", ["file", "devnull"])
def test_an_exports_file_linked_elsewhere_is_refused(finished, tmp_path, capsys, kind):
    out = tmp_path / "export"
    assert main(["export", "--model", str(finished), "--format", "open_clip", "--out", str(out)]) == 0
    name = "open_clip_config.json"
    target = users_target(tmp_path, kind)
    before = state(target) if kind == "file" else None
    (out / name).unlink()
    (out / name).symlink_to(target)
    capsys.readouterr()
    assert main(["export", "--model", str(finished), "--format", "open_clip", "--out", str(out)]) == 2
    assert_refused(capsys, out / name, target, before)


def test_an_export_into_a_linked_output_folder_is_the_users_choice(finished, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert main(["export", "--model", str(finished), "--format", "open_clip", "--out", str(tmp_path / "link")]) == 0
    assert (real / "open_clip_config.json").is_file() and (tmp_path / "link").is_symlink()


def test_an_index_file_linked_elsewhere_is_refused(finished, small_demo, tmp_path, capsys):
    out = tmp_path / "index"
    args = ["index", "--model", str(finished), "--data", small_demo["val"], "--out", str(out)]
    assert main(args) == 0
    name = sorted(p.name for p in out.iterdir() if p.suffix == ".jsonl")[0]
    target = users_target(tmp_path, "file")
    before = state(target)
    (out / name).unlink()
    (out / name).symlink_to(target)
    capsys.readouterr()
    assert main(args) == 2
    assert_refused(capsys, out / name, target, before)


def test_tokenizer_files_linked_out_of_a_model_folder_are_not_copied(tmp_path):
    from mmcl.storage.weights import write_text_tower_files

    model, dest = tmp_path / "model", tmp_path / "dest"
    model.mkdir(), dest.mkdir()
    secret = users_target(tmp_path, "file")
    (model / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ConfigError, match="symbolic link"):
        write_text_tower_files(None, {}, dest, copy_from=[model], config=False)
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_temporary_file_is_created_new_never_through_a_link(tmp_path, kind):
    from mmcl.storage.fsutil import atomic_write_text, new_file

    target = users_target(tmp_path, kind)
    before = state(target) if kind in ("file", "folder") else None
    out = tmp_path / "out"
    out.mkdir()
    (out / "part.tmp").symlink_to(target)
    (out / "result.json").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        new_file(out, "part.tmp")
    with pytest.raises(ConfigError, match="symbolic link"):
        atomic_write_text(out / "result.json", "{}")
    assert (out / "part.tmp").is_symlink() and (out / "result.json").is_symlink()
    if before is not None:
        assert state(target) == before


# ------------------------------------------------------------------------------------- hard links, late swaps
def hard_link_of_users_file(tmp_path: Path, link: Path) -> Path:
    """`link` made a second name of a file of the user's (``ln victim link``), as a backup by hard links has."""
    victim = users_target(tmp_path, "file")
    link.unlink(missing_ok=True)
    os.link(victim, link)
    return victim


@pytest.mark.slow
def test_a_hard_linked_lock_is_replaced_never_truncated(small_demo, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    victim = hard_link_of_users_file(tmp_path, run / ".lock")
    before = state(victim)
    assert main(short_run(small_demo, run)) == 0
    assert state(victim) == before and os.stat(victim).st_nlink == 1
    assert "the user's notes" not in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", [".lock", "out.log", "metrics.jsonl", "checkpoints/latest", "config.yaml"])
def test_a_run_hard_linked_to_a_user_file_changes_only_its_own_copy(finished, small_demo, tmp_path, name):
    """Each file of a run folder that a resume (forced: config.yaml is written again) writes, appends to or
    truncates, hard-linked to the user's backup of it: the backup keeps its bytes and time."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    victim = tmp_path / "backup"
    os.link(run / name, victim)
    before = state(victim)
    assert main(short_run(small_demo, run, "train.steps=4", "train.resume=force")) == 0
    assert state(victim) == before


def test_a_snapshot_made_with_hard_links_resumes_without_changing_the_original(finished, small_demo, tmp_path):
    """``cp -al run snapshot`` and resume the snapshot: every file of the original run keeps its bytes and time."""
    original = tmp_path / "original"
    shutil.copytree(finished, original)
    before = state(original)
    snapshot = tmp_path / "snapshot"
    subprocess.run(["cp", "-al", str(original), str(snapshot)], check=True)
    assert os.stat(snapshot / "out.log").st_nlink == 2
    assert main(short_run(small_demo, snapshot, "train.steps=4", "train.keep_checkpoints=1")) == 0
    assert state(original) == before
    assert "step 4/4" in (snapshot / "out.log").read_text() and "step 4/4" not in (original / "out.log").read_text()


def test_a_hard_linked_skip_log_is_never_written_through(tmp_path):
    from mmcl.data.skips import SkipLog, record
    from mmcl.storage.fsutil import open_inside

    folder = tmp_path / "run"
    folder.mkdir()
    for fresh in (False, True):
        victim = hard_link_of_users_file(tmp_path, folder / "skipped.jsonl")
        before = state(victim)
        log = SkipLog(folder / "skipped.jsonl", fresh=fresh, open_fn=open_inside)
        log.write(record("decode", "a.tar", "k"))
        log.close()
        assert state(victim) == before
        kept = (folder / "skipped.jsonl").read_text()
        assert ('"reason": "decode"' in kept) and (("the user's notes" in kept) != fresh)


def test_shards_rerun_never_writes_through_a_hard_linked_skip_log(tmp_path):
    from PIL import Image

    folder = tmp_path / "captions"
    folder.mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(folder / f"{i}.jpg")
        (folder / f"{i}.txt").write_text(f"caption {i}")
    (folder / "9.txt").write_text("a caption without its image")  # a skip: skipped.jsonl is written
    out = tmp_path / "out"
    assert main(["shards", "--input", str(folder), "--out", str(out)]) == 0
    victim = hard_link_of_users_file(tmp_path, out / "skipped.jsonl")
    before = state(victim)
    assert main(["shards", "--input", str(folder), "--out", str(out)]) == 0
    assert state(victim) == before and "missing_image" in (out / "skipped.jsonl").read_text()


@pytest.mark.slow
def test_checkpoints_swapped_for_a_link_during_a_run_are_never_followed(finished, small_demo, tmp_path):
    """Mid-run, ``run/checkpoints`` is replaced by a link to another run's: rotation, ``latest`` and the rename of
    a new checkpoint never reach the other run (its files keep their bytes and times); the run ends in one line."""
    import time

    from helpers import run_args

    signal.alarm(0)  # this test waits on its own clock
    other = tmp_path / "other"
    shutil.copytree(finished, other)
    before = state(other / "checkpoints")
    run = tmp_path / "run"
    args = run_args(small_demo, run, "data.shuffle_buffer=8", "data.batch_size=8", "data.workers=0",
                    "train.save_every=1", "train.keep_checkpoints=1", "train.log_with=[]", "train.steps=300",
                    "train.log_every=1")
    proc = subprocess.Popen([sys.executable, "-m", "mmcl", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        def saved_past_two():  # keep_checkpoints=1: each checkpoint lives one step; any of step 3 or later will do
            return any(int(p.name.split("-")[1]) >= 3 for p in (run / "checkpoints").glob("step-[0-9]*"))

        while not saved_past_two() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.2)
        os.rename(run / "checkpoints", tmp_path / "moved-aside")
        (run / "checkpoints").symlink_to(other / "checkpoints")
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert state(other / "checkpoints") == before
    assert sorted(p.name for p in (other / "checkpoints").iterdir()) == sorted(
        p.name for p in (finished / "checkpoints").iterdir())
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("mmcl: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "checkpoints" in lines[0] and "Traceback" not in err, err
    assert (run / "checkpoints").is_symlink()


# ------------------------------------------------------------------------ late swaps: every folder mmcl writes
def victim_folder(tmp_path: Path) -> Path:
    """A folder of the user's that a link swapped in points at."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("the user's notes\n")
    return victim


def swap_for_link(folder: Path, victim: Path) -> None:
    """``mv folder folder.aside; ln -s victim folder``: what a colleague's script might do while mmcl writes."""
    if folder.exists() or folder.is_symlink():
        os.rename(folder, folder.with_name(folder.name + ".aside"))
    folder.symlink_to(victim)


def swap_when_called(monkeypatch, owner, name: str, folder: Path, victim: Path, after: bool = False) -> None:
    """`folder` swapped for a link to `victim` the first time ``owner.name`` is called (before it runs, or once it
    has returned: `after`), i.e. after the command's start checks and at the moment it writes."""
    original = getattr(owner, name)
    done = []

    def swapping(*args, **kwargs):
        if not done and not after:
            done.append(swap_for_link(folder, victim))
        result = original(*args, **kwargs)
        if not done and after:
            done.append(swap_for_link(folder, victim))
        return result

    monkeypatch.setattr(owner, name, swapping)


def assert_swap_refused(capsys, rc: int, folder: Path, victim: Path, before) -> None:
    """One ``mmcl: error:`` line naming the swapped folder, exit 2, the link left in place and the victim as it was."""
    out = capsys.readouterr()
    assert out.err.count("error") == 1, out.err  # (a progress bar cut short may precede the line)
    errors = [ln[ln.index("mmcl: error: "):] for ln in out.err.splitlines() if "mmcl: error: " in ln]
    assert rc == 2 and len(errors) == 1, out.err
    assert folder.name in errors[0] and "Traceback" not in out.out + out.err, errors
    assert folder.is_symlink() and os.readlink(folder) == str(victim)
    assert state(victim) == before


@pytest.mark.parametrize("swapped", ["run", "model"])
def test_a_run_folder_or_its_model_swapped_for_a_link_before_the_final_save(small_demo, tmp_path, capsys,
                                                                          monkeypatch, swapped):
    """The run folder itself, or its ``model/``, becomes a link to another folder after the run started: the
    final model is not saved into it (nothing there changes), the run ends in one line."""
    from mmcl.storage import weights

    run, victim = tmp_path / "run", victim_folder(tmp_path)
    before = state(victim)
    swap_when_called(monkeypatch, weights, "save_model_dir", run if swapped == "run" else run / "model", victim)
    rc = main(short_run(small_demo, run))
    assert_swap_refused(capsys, rc, run if swapped == "run" else run / "model", victim, before)


def test_a_runs_plots_folder_swapped_for_a_link_is_never_written(small_demo, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from mmcl.evaluation import plot

    run, victim = tmp_path / "run", victim_folder(tmp_path)
    before = state(victim)
    swap_when_called(monkeypatch, plot, "make_figures", run / "plots", victim)
    rc = main(short_run(small_demo, run, "train.plot=true"))
    assert_swap_refused(capsys, rc, run / "plots", victim, before)
    assert (run / "model" / "open_clip_config.json").is_file()  # saved before: the model is kept


def test_an_interpolation_folder_swapped_for_a_link_is_never_written(finished, tmp_path, capsys, monkeypatch):
    """`mmcl interpolate` (and a run's train.wise_ft, which writes the same way): --out replaced by a link after it
    was taken, when an alpha's model is saved."""
    from mmcl.storage import weights

    out, victim = tmp_path / "wise", victim_folder(tmp_path)
    before = state(victim)
    swap_when_called(monkeypatch, weights, "save_model_dir", out, victim)
    rc = main(["interpolate", "--from", str(finished), "--to", str(finished), "--alpha", "0.5", "--out", str(out)])
    assert_swap_refused(capsys, rc, out, victim, before)


def test_an_export_swapped_for_a_link_while_it_is_verified(finished, tmp_path, capsys, monkeypatch):
    """The export is in place and being verified when --out is replaced by a link: its record is not written
    through the link, and the link is left as it is."""
    from mmcl.storage import export

    out, victim = tmp_path / "export", victim_folder(tmp_path)
    before = state(victim)
    swap_when_called(monkeypatch, export, "verify_export", out, victim, after=True)
    rc = main(["export", "--model", str(finished), "--format", "open_clip", "--out", str(out)])
    assert_swap_refused(capsys, rc, out, victim, before)


def test_an_index_folder_swapped_for_a_link_while_it_is_written(finished, small_demo, tmp_path, capsys, monkeypatch):
    """An earlier index at --out is replaced by a link while the new one is written: the swap is refused, the
    link and what it names are left as they are."""
    faiss = pytest.importorskip("faiss")
    out, victim = tmp_path / "index", victim_folder(tmp_path)
    args = ["index", "--model", str(finished), "--data", small_demo["val"], "--out", str(out)]
    assert main(args) == 0
    before = state(victim)
    swap_when_called(monkeypatch, faiss, "write_index", out, victim)
    capsys.readouterr()
    assert_swap_refused(capsys, main(args), out, victim, before)


def test_a_shards_output_folder_swapped_for_a_link_while_it_is_written(tmp_path, capsys, monkeypatch):
    from PIL import Image

    from mmcl.shards import writer

    folder = tmp_path / "captions"
    folder.mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(folder / f"{i}.jpg")
        (folder / f"{i}.txt").write_text(f"caption {i}")
    out, victim = tmp_path / "out", victim_folder(tmp_path)
    before = state(victim)
    swap_when_called(monkeypatch, writer.ShardWriter, "_open_next", out, victim)
    rc = main(["shards", "--input", str(folder), "--out", str(out)])
    assert_swap_refused(capsys, rc, out, victim, before)


def test_a_demo_folder_swapped_for_a_link_while_it_is_written(tmp_path, capsys, monkeypatch):
    from mmcl.shards import demo

    out, victim = tmp_path / "demo", victim_folder(tmp_path)
    before = state(victim)
    swap_when_called(monkeypatch, demo, "_write_folder", out, victim)
    rc = main(["demo-data", "--out", str(out), "--n-train", "8"])
    assert_swap_refused(capsys, rc, out, victim, before)


def test_a_negatives_folder_swapped_for_a_link_while_it_is_written(small_demo, tmp_path, capsys, monkeypatch):
    from mmcl.shards import negatives

    out, victim = tmp_path / "neg", victim_folder(tmp_path)
    before = state(victim)
    swap_when_called(monkeypatch, negatives, "_negatives_shard", out, victim)
    rc = main(["negatives", "--input", small_demo["val"], "--out", str(out), "--no-progress"])
    assert_swap_refused(capsys, rc, out, victim, before)


def test_a_curate_folder_swapped_for_a_link_while_it_is_written(finished, small_demo, tmp_path, capsys, monkeypatch):
    import importlib

    curate = importlib.import_module("mmcl.curation.curate")  # the module (the package names its function so)
    out, victim = tmp_path / "curated", victim_folder(tmp_path)
    before = state(victim)
    swap_when_called(monkeypatch, curate, "_write_shard", out, victim)
    rc = main(["curate", "--model", str(finished), "--data", small_demo["val"], "--out", str(out), "--no-progress",
               "--min-caption-len", "1"])
    assert_swap_refused(capsys, rc, out, victim, before)


def test_evaluation_results_are_never_written_through_a_hard_link(finished, small_demo, tmp_path, capsys):
    """``mmcl zeroshot --out results.json`` where results.json is another name of a file of the user's: a new file
    takes the name, the user's file keeps its bytes."""
    out = tmp_path / "results.json"
    victim = hard_link_of_users_file(tmp_path, out)
    before = state(victim)
    assert main(["zeroshot", "--model", str(finished), "--data", small_demo["zeroshot_colour"], "--out",
                 str(out), "--workers", "0"]) == 0
    assert state(victim) == before and "acc1" in out.read_text()
