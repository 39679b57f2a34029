"""Training under injected faults: stop signals (1 and 2 processes, mid-step and mid-save), a read-only and a full
output filesystem (real tmpfs mounts; these tests need root, as CI has), damaged checkpoints, two runs on one
directory, a user error on one of 2 processes. Each ends in one line and a non-zero exit, loses nothing, and a
plain re-run of the same command continues."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmcl.cli import main
from mmcl.errors import TrainingError
from mmcl.run.lock import RunLock
from mmcl.storage import checkpoints

from helpers import ACCELERATE_LAUNCH, ROOT, final_weights, metrics, run_args


def one_line_error(err: str) -> str:
    """The single `mmcl: error:` line of `err`, which must hold no traceback."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("mmcl: error:")]
    assert len(lines) == 1, err
    return lines[0]


def ended_with(e: str, code: int) -> None:
    """Each process the launcher reports ended with mmcl's `code`, except one still exiting when the launcher saw
    its peer's exit (the launcher then sends it SIGTERM: a race of process teardown, not of mmcl's agreement)."""
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+) ", e)]
    assert code in codes, e
    assert all(c in (code, -15) for c in codes), e
    assert codes.count(code) == 2 or "closing signal SIGTERM" in e, e


def same_weights(a, b):
    # One process, same seed, same data order, same float32 kernels: a resume replays the run bit for bit.
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def args(demo, out, *extra):
    return ["train", *run_args(demo, out, "train.steps=4", "train.save_every=2", "data.batch_size=8",
                               "data.workers=0", "train.log_every=1", *extra)]


@pytest.fixture(scope="module")
def reference(demo, tmp_path_factory):
    """An uninterrupted 4-step run (1 process) to compare resumed runs with."""
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(args(demo, out)) == 0
    return out


# ------------------------------------------------------------------------------------------ stop signals
@pytest.mark.slow  # end to end: a reference, an interrupted and a resumed run
@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 75, "preempted"), (signal.SIGUSR1, 75, "preempted"),
                                           (signal.SIGINT, 130, "interrupted")])
def test_signal_mid_step_saves_then_a_rerun_finishes_with_the_same_weights(demo, reference, tmp_path, monkeypatch,
                                                                          capsys, sig, code, word):
    import mmcl.training.step as step_mod

    real, calls = step_mod.forward_loss, [0]

    def signalled(*a):
        calls[0] += 1
        if calls[0] == 3:  # during the third step's forward pass
            os.kill(os.getpid(), sig)
        return real(*a)

    monkeypatch.setattr(step_mod, "forward_loss", signalled)
    before = signal.getsignal(sig)  # SIG_IGN for SIGINT when the suite itself runs in the background
    out = tmp_path / "run"
    assert main(args(demo, out)) == code
    err = capsys.readouterr().err
    assert err.strip() == (f"mmcl: {word} ({sig.name}) at step 3; checkpoint saved to {out / 'checkpoints'}"
                           f"/step-00000003; re-run the same command to resume")
    assert checkpoints.verify_checkpoint(out / "checkpoints" / "step-00000003") is None
    assert not (out / "model").exists()
    assert signal.getsignal(sig) == before  # handlers restored

    monkeypatch.setattr(step_mod, "forward_loss", real)
    assert main(args(demo, out)) == 0
    assert "resuming from" in capsys.readouterr().out
    same_weights(reference, out)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_signal_during_a_checkpoint_save_lets_it_finish(demo, reference, tmp_path, monkeypatch, capsys):
    from accelerate import Accelerator

    real = Accelerator.save_state

    def signalled(self, *a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the checkpoint of step 2 is being written
        return real(self, *a, **kw)

    monkeypatch.setattr(Accelerator, "save_state", signalled)
    out = tmp_path / "run"
    assert main(args(demo, out)) == 75
    assert "preempted (SIGTERM) at step 2; checkpoint saved to" in capsys.readouterr().err
    ckpts = out / "checkpoints"
    assert [p.name for p in ckpts.iterdir() if p.is_dir()] == ["step-00000002"]  # no temp dir, no second save
    assert checkpoints.verify_checkpoint(ckpts / "step-00000002") is None
    monkeypatch.setattr(Accelerator, "save_state", real)
    assert main(args(demo, out)) == 0
    same_weights(reference, out)


# ------------------------------------------------------------------------------------------- storage
@pytest.fixture
def tmpfs(tmp_path):
    """A fresh tmpfs mounted at tmp_path/mnt; yields a function (options) -> remount with them."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(mnt)], check=True)

    def remount(options):
        subprocess.run(["mount", "-o", f"remount,{options}", str(mnt)], check=True)

    yield mnt, remount
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_read_only_output_dir_new_run_and_resume(demo, tmpfs, capsys):
    mnt, remount = tmpfs
    out = mnt / "run"
    assert main(args(demo, out, "train.steps=2")) == 0
    capsys.readouterr()
    before = {p: p.stat().st_size for p in out.rglob("*") if p.is_file()}
    remount("ro")
    # Resume of a finished run with more steps; then a new run in a directory that does not exist yet.
    assert main(args(demo, out)) == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert f"output directory {out}" in line and "Read-only file system" in line, line
    assert "process(es)" not in captured.out  # stopped before building anything
    assert main(args(demo, mnt / "new")) == 2
    line = one_line_error(capsys.readouterr().err)
    assert str(mnt / "new") in line and "Read-only file system" in line, line
    remount("rw")
    assert {p: p.stat().st_size for p in out.rglob("*") if p.is_file()} == before  # nothing changed
    assert main(args(demo, out)) == 0
    assert "resuming from" in capsys.readouterr().out
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("size", ["60m", "46m"])  # the disk fills in optimizer.bin (torch) or model.safetensors
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(demo, reference, tmpfs, capsys, size):
    mnt, remount = tmpfs
    remount(f"size={size}")  # one 40.7 MB checkpoint fits, a second one does not
    out = mnt / "run"
    assert main(args(demo, out)) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"cannot write checkpoint step-00000004 to {out / 'checkpoints'}: no space left on device" in line, line
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000002"]  # the temp dir is gone
    assert (ckpts / "latest").read_text() == "step-00000002"
    assert checkpoints.verify_checkpoint(ckpts / "step-00000002") is None

    # Re-run on the still full disk: a warning before training, then the same one line.
    assert main(args(demo, out)) == 2
    captured = capsys.readouterr()
    warned = re.search(r"mmcl: warning: ([\d.]+) MB free at .*, below the ([\d.]+) MB one checkpoint needs",
                       captured.out)
    assert warned, captured.out
    size = sum(p.stat().st_size for p in (ckpts / "step-00000002").iterdir()) / 2**20
    assert float(warned[2]) == pytest.approx(size, rel=0.02)  # parameters + AdamW moments: the checkpoint's size
    assert float(warned[1]) < size
    one_line_error(captured.err)
    remount("size=200m")
    assert main(args(demo, out)) == 0
    same_weights(reference, out)


def test_a_disk_full_before_the_first_step_ends_in_one_line(demo, tmpfs, capsys):
    mnt, remount = tmpfs
    remount("size=1m")
    filler = mnt / "user-data.bin"
    with open(filler, "wb", buffering=0) as f:  # fill the disk to the last block
        try:
            while True:
                f.write(b"\1" * 4096)
        except OSError:
            pass
    kept = filler.read_bytes()
    out = mnt / "run"
    assert main(args(demo, out)) == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert line == f"mmcl: error: output directory {out} cannot be written: No space left on device", line
    assert "process(es)" not in captured.out  # before building anything
    assert filler.read_bytes() == kept
    assert not out.exists()  # no half-written config or metrics: a run that wrote nothing leaves no folder


# --------------------------------------------------------------------------------- damaged checkpoints
def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _flip_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated weights": (lambda c: _truncate(c / "model.safetensors"), "model.safetensors has"),
    "truncated optimizer": (lambda c: _truncate(c / "optimizer.bin"), "optimizer.bin has"),
    "altered weights": (lambda c: _flip_byte(c / "model.safetensors"), "model.safetensors differs"),
    "truncated rank state": (lambda c: _truncate(c / "rank_state_0.pt"), "rank_state_0.pt has"),
    "deleted RNG state": (lambda c: (c / "random_states_0.pkl").unlink(), "random_states_0.pkl is missing"),
    "garbage marker": (lambda c: (c / "COMPLETE").write_bytes(b"\x00{garbage"), "marker is unreadable"),
}


@pytest.fixture(scope="module")
def saved_run(demo, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, copied by each test that damages it."""
    out = tmp_path_factory.mktemp("saved") / "run"
    assert main(args(demo, out, "train.keep_checkpoints=2")) == 0
    return out


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_falls_back_past_a_damaged_checkpoint_and_keeps_it(demo, saved_run, reference, tmp_path, capsys,
                                                                   damage):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    shutil.rmtree(out / "model")
    ckpts = out / "checkpoints"
    harm, reason = DAMAGE[damage]
    harm(ckpts / "step-00000004")
    damaged_files = {p.name: p.read_bytes() for p in (ckpts / "step-00000004").iterdir()}
    assert checkpoints.newest_verified_checkpoint(ckpts) == ckpts / "step-00000002"

    # The same command with 6 steps: resumes from step 2, saves a new step 4 and 6 with keep_checkpoints=2.
    assert main(args(demo, out, "train.keep_checkpoints=2", "train.steps=6")) == 0
    said = capsys.readouterr().out
    warning = [ln for ln in said.splitlines() if ln.startswith("mmcl: warning: checkpoint step-00000004 is damaged")]
    assert len(warning) == 1 and reason in warning[0], said
    assert warning[0].endswith(f"; kept as {ckpts / 'damaged-step-00000004'}; resuming from step-00000002")
    assert f"resuming from {ckpts / 'step-00000002'} at step 2" in said
    kept = ckpts / "damaged-step-00000004"
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == damaged_files  # untouched, survived rotation
    assert sorted(p.name for p in ckpts.iterdir()) == ["damaged-step-00000004", "latest", "step-00000004",
                                                       "step-00000006"]
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))


def test_newest_verified_checkpoint_for_loading_weights_only(saved_run, tmp_path):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(saved_run / "checkpoints", ckpts)
    weights = ("model.safetensors",)
    _truncate(ckpts / "step-00000004" / "optimizer.bin")
    assert checkpoints.newest_verified_checkpoint(ckpts) == ckpts / "step-00000002"
    assert checkpoints.newest_verified_checkpoint(ckpts, only=weights) == ckpts / "step-00000004"  # weights intact
    _flip_byte(ckpts / "step-00000004" / "model.safetensors")
    assert checkpoints.newest_verified_checkpoint(ckpts, only=weights) == ckpts / "step-00000002"
    _truncate(ckpts / "step-00000002" / "model.safetensors")
    assert checkpoints.newest_verified_checkpoint(ckpts, only=weights) is None
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000002", "step-00000004"]  # read only


def test_resume_refuses_when_every_checkpoint_is_damaged(demo, saved_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    ckpts = out / "checkpoints"
    _truncate(ckpts / "step-00000004" / "model.safetensors")
    _truncate(ckpts / "step-00000002" / "optimizer.bin")
    assert main(args(demo, out, "train.keep_checkpoints=2", "train.steps=6")) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "no checkpoint in" in line and "step-00000004: model.safetensors has" in line, line
    assert "nothing was changed" in line
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000002", "step-00000004"]


# ----------------------------------------------------------------------------------- two runs, one dir
@pytest.mark.slow
def test_a_second_run_on_the_same_directory_stops_at_once(demo, tmp_path, capsys):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    first = subprocess.Popen([sys.executable, "-m", "mmcl", *args(demo, out, "train.steps=6")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lock = out / ".lock"
    deadline = time.time() + 120
    while not (lock.is_file() and lock.read_text()) and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    assert main(args(demo, out, "train.steps=6")) == 2
    took = time.perf_counter() - t0
    line = one_line_error(capsys.readouterr().err)
    assert f"{out} is in use by another run (host " in line and f"PID {first.pid}," in line, line
    assert took < 5, took  # before building the model or reading data
    log, _ = first.communicate(timeout=300)
    assert first.returncode == 0, log
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert lock.read_text() == ""  # released


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(demo, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    # The holder forks a child that outlives it with the lock file open, as data loader workers do for a moment
    # after the training process is SIGKILLed: the lock must die with the holder all the same.
    holder = subprocess.Popen([sys.executable, "-c", "import os, time; from mmcl.run.lock import RunLock; "
                               f"RunLock({str(out)!r}).acquire(); child = os.fork(); "
                               # the parent says its child's PID
                               "child and print(child, flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(TrainingError, match=f"in use by another run .*PID {holder.pid},"):
            RunLock(out).acquire()
        holder.kill()
        holder.wait()
        assert main(args(demo, out, "train.steps=2")) == 0
    finally:
        os.kill(child, signal.SIGKILL)
    said = capsys.readouterr().out
    assert "mmcl: warning: took over the lock of a run that ended without releasing it (host " in said
    assert f"PID {holder.pid}," in said


# ----------------------------------------------------------------------------------------- 2 processes
def launch(script_or_module, *argv, timeout=300):
    cmd = [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "launch" / "cpu-2proc.yaml"), *script_or_module,
           *argv]
    return subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def args2(demo, out, *extra):
    return run_args(demo, out, "train.steps=4", "train.save_every=2", "data.batch_size=4", "data.workers=0",
                    "train.log_every=1", *extra)


@pytest.fixture(scope="module")
def reference2(demo, tmp_path_factory):
    """An uninterrupted 4-step run on 2 processes."""
    out = tmp_path_factory.mktemp("ref2") / "run"
    p = launch(["-m", "mmcl", "train"], *args2(demo, out))
    o, e = p.communicate(timeout=300)
    assert p.returncode == 0, o + e
    return out


def mmcl_lines_only(err: str):
    """stderr of a launch: mmcl's own processes printed no traceback (the launcher's summary is its own)."""
    rest = "\n".join(ln for ln in err.splitlines() if not ln.startswith("mmcl: "))
    assert "/mmcl/" not in rest and "Connection closed" not in rest and "gloo" not in rest.lower(), err


SIGNAL_ONE_RANK = f"""\
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from preempt import sigterm_during_step
from mmcl.cli import main

sigterm_during_step(3, rank=1)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_on_one_of_two_processes_stops_both_after_the_same_step(demo, reference2, tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "stop_rank1.py"
    script.write_text(SIGNAL_ONE_RANK)
    p = launch([str(script), "train"], *args2(demo, out))
    o, e = p.communicate(timeout=300)
    assert p.returncode != 0, o + e
    assert e.count("mmcl: preempted (SIGTERM) at step 3; checkpoint saved to") == 1, e
    ended_with(e, 75)
    mmcl_lines_only(e)
    ckpt = out / "checkpoints" / "step-00000003"
    assert checkpoints.verify_checkpoint(ckpt) is None
    assert sorted(f.name for f in ckpt.glob("rank_state_*.pt")) == ["rank_state_0.pt", "rank_state_1.pt"]
    p = launch(["-m", "mmcl", "train"], *args2(demo, out))
    o, e = p.communicate(timeout=300)
    assert p.returncode == 0, o + e
    assert "resuming from" in o and "at step 3" in o
    same_weights(reference2, out)


SLOW_SAVE = """\
import sys, time
from pathlib import Path
import torch
import mmcl.storage.checkpoints
from mmcl.cli import main

real = torch.save


def slow(obj, path, *a, **kw):
    if Path(str(path)).name.startswith("rank_state_") and "step-00000002" in str(path):
        Path(sys.argv[1]).touch()  # tells the test that the save of step 2 is under way
        time.sleep(2)
    return real(obj, path, *a, **kw)


torch.save = slow
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_sigterm_to_the_launcher_during_a_save_on_two_processes(demo, reference2, tmp_path):
    out = tmp_path / "run"
    script, marker = tmp_path / "slow_save.py", tmp_path / "saving"
    script.write_text(SLOW_SAVE)
    p = launch([str(script), str(marker), "train"], *args2(demo, out))
    deadline = time.time() + 200
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGTERM)  # the launcher forwards it to both processes
    o, e = p.communicate(timeout=120)
    assert p.returncode != 0
    assert e.count("mmcl: preempted (SIGTERM) at step 2; checkpoint saved to") == 1, e
    mmcl_lines_only(e)
    ckpts = out / "checkpoints"
    assert sorted(d.name for d in ckpts.iterdir() if d.is_dir()) == ["step-00000002"]
    assert checkpoints.verify_checkpoint(ckpts / "step-00000002") is None
    p = launch(["-m", "mmcl", "train"], *args2(demo, out))
    o, e = p.communicate(timeout=300)
    assert p.returncode == 0, o + e
    same_weights(reference2, out)


REFUSE_ON_RANK_1 = """\
import os, sys
import mmcl.run.resume as resume_mod
from mmcl.cli import main
from mmcl.errors import CheckpointError

real = resume_mod.check_resumable


def refused(*args):
    if os.environ.get("RANK") == "1":
        raise CheckpointError("cannot resume: refused on process 1 only")
    return real(*args)


resume_mod.check_resumable = refused
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_user_error_on_one_of_two_processes_ends_the_launch_with_one_line(demo, reference2, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference2, out)
    before = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    script = tmp_path / "refuse.py"
    script.write_text(REFUSE_ON_RANK_1)
    p = launch([str(script), "train"], *args2(demo, out, "train.steps=6"))
    o, e = p.communicate(timeout=300)
    assert p.returncode != 0
    assert [ln for ln in e.splitlines() if ln.startswith("mmcl:")] == [
        "mmcl: error: cannot resume: refused on process 1 only"], e
    ended_with(e, 2)
    mmcl_lines_only(e)
    assert {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()} == before


FAIL_ON_RANK_1_MID_RUN = """\
import os, sys
import mmcl.training.step as step_mod
from mmcl.cli import main
from mmcl.errors import DataError

real, calls = step_mod.forward_loss, [0]


def failing(*args):
    calls[0] += 1
    if calls[0] == 3 and os.environ.get("RANK") == "1":
        raise DataError("shard unreadable on process 1 only")
    return real(*args)


step_mod.forward_loss = failing
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_an_error_on_one_process_mid_step_leaves_the_other_with_one_line_too(demo, tmp_path):
    """Outside the agreed blocks (here: during a step) the failing process says why; the other one, cut off in
    its next collective, says that another process ended, in one line instead of gloo's traceback."""
    out = tmp_path / "run"
    script = tmp_path / "fail_rank1.py"
    script.write_text(FAIL_ON_RANK_1_MID_RUN)
    p = launch([str(script), "train"], *args2(demo, out))
    o, e = p.communicate(timeout=300)
    assert p.returncode != 0
    lines = [ln for ln in e.splitlines() if ln.startswith("mmcl:")]
    assert len(lines) == 2 and "mmcl: error: shard unreadable on process 1 only" in lines, e
    other = [ln for ln in lines if "another process" in ln]
    assert len(other) == 1 and re.fullmatch(
        r"mmcl: error: another process of this run ended \((.*)Connection (reset|closed) by peer(.*)\); its own "
        r"output says why; re-run the same command to resume from the newest checkpoint", other[0]), e
    mmcl_lines_only(e)
    assert checkpoints.verify_checkpoint(out / "checkpoints" / "step-00000002") is None
    p = launch(["-m", "mmcl", "train"], *args2(demo, out))
    o, e = p.communicate(timeout=300)
    assert p.returncode == 0, o + e
    assert "at step 2" in o


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_with_data_workers(demo, tmp_path):
    """SLURM at a time limit (and `kill -- -PGID`) signals every process of the job, data loader workers included:
    the workers must outlive the signal so that the training process can finish its step and save."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mmcl", *args(demo, out)]
    cmd = [c for c in cmd if c not in ("train.steps=4", "data.workers=0")] + ["train.steps=100000", "data.workers=2"]
    p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.time() + 240
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 3):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGTERM)
    o, e = p.communicate(timeout=120)
    assert p.returncode == 75, o + e
    line = one_line_error(e.replace("mmcl: preempted", "mmcl: error: preempted"))
    step = int(re.search(r"at step (\d+);", line).group(1))
    assert step >= 3
    assert checkpoints.verify_checkpoint(out / "checkpoints" / f"step-{step:08d}") is None
