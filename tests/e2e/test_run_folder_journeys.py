"""Journeys through a run folder: a first command that fails and its corrected form into the same folder, two runs
started at once on one new folder, inputs refused before the model is built (a table given as shards, a global
batch larger than the data)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmcl import models
from mmcl.cli import main
from mmcl.config import load_config, to_dict
from mmcl.errors import ConfigError

from helpers import check_run_inputs, short_run

ROOT = Path(__file__).resolve().parents[2]


def metric_steps(out: Path):
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def error_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model is built."""
    def build(*_, **__):
        raise AssertionError("the model was built")

    monkeypatch.setattr(models, "build", build)


def test_a_table_given_as_shards_names_mmcl_shards_before_the_model_is_built(tmp_path, capsys, no_model):
    table = tmp_path / "train.csv"
    table.write_text("filepath\ttitle\n/data/images/0.jpg\ta photo of a cat\n")  # open_clip's layout
    out = tmp_path / "run"
    assert main(short_run(table, out)) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert f"`mmcl shards --input {table} --out DIR`" in lines[0] and lines[0].startswith("mmcl: error: "), lines
    assert not out.exists()


@pytest.mark.parametrize("name", ["pairs.tsv", "pairs.jsonl", "pairs.parquet", "PAIRS.CSV"])
def test_every_table_mmcl_shards_reads_is_named_as_one(tmp_path, name):
    from mmcl.training.preflight import table_problem

    (tmp_path / "shards").mkdir()
    assert f"mmcl shards --input {tmp_path / name} --out DIR" in table_problem(
        f"{tmp_path / 'shards'}::{tmp_path / name}")
    assert table_problem(f"{tmp_path / 'shards'}/shard-{{000000..000009}}.tar") is None


def test_a_global_batch_larger_than_the_data_is_refused_with_the_numbers(small_demo, tmp_path, capsys, no_model):
    out = tmp_path / "run"
    assert main(short_run(small_demo["train"], out, "data.batch_size=128")) == 2  # 64 samples in sizes.json
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert ("the global batch of 128 samples (data.batch_size=128 x 1 process x train.accum_steps=1) is larger "
            "than the data's 64 samples (sizes.json)") in lines[0], lines
    assert "at most 64" in lines[0]
    assert not out.exists()
    # processes and accumulation count too; data.train_num_samples, where given, is the data's size
    cfg = load_config(None, short_run(small_demo["train"], out, "data.batch_size=24", "train.accum_steps=2")[3:])
    with pytest.raises(ConfigError, match=r"global batch of 96 samples \(data.batch_size=24 x 2 processes x "
                                          r"train.accum_steps=2\) is larger than the data's 64 samples.*at most 16"):
        check_run_inputs(cfg, processes=2)
    check_run_inputs(cfg, processes=1)  # 48 of 64
    with pytest.raises(ConfigError, match=r"the data's 40 samples \(data.train_num_samples\)"):
        check_run_inputs(load_config(None, short_run(small_demo["train"], out, "data.train_num_samples=40",
                                                 "train.epochs=1")[3:]), 6)


@pytest.mark.slow
def test_a_run_that_failed_before_step_1_is_taken_over_by_the_corrected_command(small_demo, tmp_path, capsys):
    bad = tmp_path / "train.tar"
    bad.write_bytes(b"filepath,title\nimg.jpg,a cat\n" * 40)  # not a tar file: no sample can be read
    out = tmp_path / "run"
    assert main(short_run(bad, out)) == 2
    capsys.readouterr()
    assert (out / "config.yaml").is_file() and (out / "out.log").is_file()  # the failed run's record stays
    assert main(short_run(small_demo["train"], out)) == 0
    said = capsys.readouterr().out
    assert f"mmcl: taking over {out}: its last run stopped before step 1 (config differences: data.train" in said
    assert metric_steps(out) == [1, 2] and (out / "model").is_dir()
    assert str(small_demo["train"]) in (out / "config.yaml").read_text()
    # the failed attempt's skip (its shard could not be opened) is not kept as this run's, and out.log says so
    assert "; its skipped.jsonl (1 records of that attempt) is cleared" in said
    assert not (out / "skipped.jsonl").exists()
    assert f"mmcl: taking over {out}: its last run stopped before step 1" in (out / "out.log").read_text()


def test_an_attempt_that_never_trained_leaves_no_skip_log_to_the_next(tmp_path):
    from mmcl.config import to_yaml
    from mmcl.run.folder import clear_stale_skips, decide, write_record

    cfg = load_config(None, [f"train.output_dir={tmp_path}", "data.batch_size=8"])
    write_record(tmp_path, 1, 8)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    (tmp_path / "skipped.jsonl").write_text('{"reason": "missing_caption"}\n' * 99)
    for other, action in ((load_config(None, [f"train.output_dir={tmp_path}", "data.batch_size=8",
                                              "data.caption_key=caption"]), "start"), (cfg, "resume")):
        decision = decide(to_dict(other), 1, 10)
        assert (decision.action, decision.stale_skips) == (action, True)
        assert decision.line.endswith("; its skipped.jsonl (99 records of that attempt) is cleared"), decision.line
    keep = tmp_path.parent / f"{tmp_path.name}-link"
    os.link(tmp_path / "skipped.jsonl", keep)  # a link of the user's elsewhere keeps the file
    clear_stale_skips(tmp_path)
    assert not (tmp_path / "skipped.jsonl").exists() and len(keep.read_text().splitlines()) == 99
    assert decide(to_dict(cfg), 1, 10).stale_skips is False


def test_a_finished_run_names_the_key_that_sets_its_length(tmp_path):
    from mmcl.config import to_yaml
    from mmcl.run.folder import decide, write_record

    for length, key in ((["train.epochs=2", "data.train_num_samples=80"], "train.epochs"),
                        (["train.samples=80"], "train.samples"), (["train.steps=10"], "train.steps")):
        out = tmp_path / key
        cfg = load_config(None, [f"train.output_dir={out}", "data.batch_size=8", *length])
        (out / "model").mkdir(parents=True)
        write_record(out, 1, 8)
        (out / "config.yaml").write_text(to_yaml(cfg))
        (out / "model" / "open_clip_config.json").write_text(json.dumps({"mmcl": {"steps": 10}}))
        decision = decide(to_dict(cfg), 1, 10)
        assert decision.action == "finished" and f"raise {key} to train on" in decision.line, decision.line


def test_a_run_that_logged_a_step_is_not_taken_over(tmp_path):
    from mmcl.config import to_yaml
    from mmcl.run.folder import decide, write_record

    cfg = load_config(None, [f"train.output_dir={tmp_path}", "data.batch_size=8"])
    write_record(tmp_path, 1, 8)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    (tmp_path / "metrics.jsonl").write_text("")
    other = load_config(None, [f"train.output_dir={tmp_path}", "data.batch_size=8", "optim.lr=0.01"])
    decision = decide(to_dict(other), 1, 10)
    assert (decision.action, decision.write_config) == ("start", True)
    assert decision.line == (f"taking over {tmp_path}: its last run stopped before step 1 (config differences: "
                             f"optim.lr 0.0005 -> 0.01)")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    with pytest.raises(ConfigError, match=r"holds another run \(step 0\): optim.lr 0.0005 -> 0.01;"):
        decide(to_dict(other), 1, 10)


PAUSED = """
import json, sys
from mmcl.cli import main
from mmcl.run.lock import RunLock

taken = RunLock.acquire
def acquire(self):  # waits for a line on stdin before it takes the lock ("before") or after ("after")
    if sys.argv[1] == "before":
        print("paused", flush=True)
        sys.stdin.readline()
    line = taken(self)
    if sys.argv[1] == "after":
        print("paused", flush=True)
        sys.stdin.readline()
    return line
RunLock.acquire = acquire
sys.exit(main(json.loads(sys.argv[2])))
"""


def paused_run(when, args, cwd):
    """`mmcl train` in a process of its own, paused at the folder's lock: returns once it waits there."""
    run = subprocess.Popen([sys.executable, "-c", PAUSED, when, json.dumps(args)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    said = []
    for line in run.stdout:
        said.append(line)
        if line.strip() == "paused":
            return run
    run.kill()
    pytest.fail("".join(said) + run.stderr.read())


@pytest.mark.slow
def test_two_runs_started_at_once_on_a_new_folder_the_refused_one_deletes_nothing(small_demo, tmp_path):
    """Both find the folder new; the second takes the lock first; the first, refused, leaves the folder alone."""
    out = tmp_path / "new" / "run"
    args = short_run(small_demo["train"], out)
    refused = paused_run("before", args, tmp_path)  # found no folder, made it, and waits to lock it
    holder = None
    try:
        holder = paused_run("after", args, tmp_path)  # holds the lock and has written nothing else yet
        _, err = refused.communicate("go\n", timeout=300)
        assert refused.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "in use by another run (host" in lines[0], lines
        assert f"PID {holder.pid}," in lines[0]
        said, err = holder.communicate("go\n", timeout=300)
    finally:
        for run in (refused, holder):
            if run is not None:
                run.kill()
    assert holder.returncode == 0, err
    assert "run finished: 2 steps" in said
    assert {p.name for p in out.iterdir()} >= {".lock", "config.yaml", "mmcl-manifest.json", "metrics.jsonl",
                                               "out.log", "model", "checkpoints"}
    assert metric_steps(out) == [1, 2]


def test_a_lock_file_its_holder_removed_just_after_it_was_opened_is_locked_anew(tmp_path, monkeypatch):
    """The holder of a folder it made removes it (lock file included) on failure, then releases the lock: a run that
    opened the lock file just before locks a new one in a new folder, not the removed file."""
    import os
    import socket

    from mmcl.run import lock as runlock

    out = tmp_path / "run"
    out.mkdir()
    real_open, opened = os.open, []

    def open_then_removed(path, *args, **kwargs):  # the lock file (opened relative to its folder's descriptor)
        fd = real_open(path, *args, **kwargs)
        if not opened and os.path.basename(str(path)) == ".lock":
            os.unlink(path, dir_fd=kwargs.get("dir_fd"))
            out.rmdir()
            opened.append(path)
        return fd

    monkeypatch.setattr(runlock.os, "open", open_then_removed)
    lock = runlock.RunLock(out)
    lock.acquire()
    monkeypatch.undo()
    try:
        other = subprocess.run([sys.executable, "-c", f"from mmcl.run.lock import RunLock; "
                                                      f"RunLock({str(out)!r}).acquire()"],
                               capture_output=True, text=True)
        assert other.returncode != 0, "the lock at the path is not held"
        assert f"in use by another run (host {socket.gethostname()}, PID {os.getpid()}," in other.stderr
    finally:
        lock.release()
