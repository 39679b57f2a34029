"""What a run tells while it trains and how it ends: one text line per logged step (console and out.log), the exit
code of a stopped run on 1 and 2 processes under the launchers (no traceback), and the trackers' run names."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mmcl.cli import main

from helpers import ROOT, TRAINING_TOWERS, metrics, short_run

# No checkpoint (with the towers of tests of training, TRAINING_TOWERS).
SETTINGS = ("train.save_every=0",)


# ------------------------------------------------------------------------------------------ step lines
STEP_LINE = re.compile(r"mmcl: step (\d+)/(\d+) \((\d+)%\) \| samples (\d+) \| loss (\S+) \(clip (\S+)\) \| "
                       r"lr (\S+) \| logit scale (\S+) \| (\S+) samples/s \| data wait (\d+)% \| MFU n/a \| "
                       r"skipped (\d+) samples, (\d+) shards")


def _parsed(lines):
    out = []
    for ln in lines:
        m = STEP_LINE.fullmatch(ln)
        assert m, ln
        step, total, pct, samples = map(int, m.groups()[:4])
        loss, clip, lr, scale, sps = map(float, m.groups()[4:9])
        out.append({"step": step, "total": total, "pct": pct, "samples": samples, "loss": loss, "loss/clip": clip,
                    "lr": lr, "logit_scale": scale, "samples_per_s": sps, "data_time_frac": int(m.group(10)) / 100,
                    "data/skipped_samples": int(m.group(11)), "data/skipped_shards": int(m.group(12))})
    return out


def _matches_metrics(parsed, rows):
    assert [p["step"] for p in parsed] == [r["step"] for r in rows]
    for p, r in zip(parsed, rows):
        assert p["samples"] == r["samples"] and p["total"] == 5 and p["pct"] == round(100 * r["step"] / 5)
        for key, tol in (("loss", 1e-4), ("loss/clip", 1e-4), ("logit_scale", 1e-3), ("samples_per_s", 0.1)):
            assert p[key] == pytest.approx(r[key], abs=tol), key
        assert p["lr"] == pytest.approx(r["lr"], rel=1e-3)
        assert p["data_time_frac"] == pytest.approx(r["data_time_frac"], abs=0.006)
        assert (p["data/skipped_samples"], p["data/skipped_shards"]) == (r["data/skipped_samples"],
                                                                         r["data/skipped_shards"])


def test_without_the_bar_each_logged_step_is_one_line_on_the_console_and_in_out_log(small_demo, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(short_run(small_demo, out, *SETTINGS, "train.steps=5", "train.log_every=2",
                          towers=TRAINING_TOWERS)) == 0
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("mmcl: step ")]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [2, 4, 5]  # every train.log_every steps, and the last
    _matches_metrics(_parsed(printed), rows)
    logged = [ln for ln in (out / "out.log").read_text().splitlines() if ln.startswith("mmcl: step ")]
    assert logged == printed


def test_with_the_bar_the_step_lines_go_to_out_log_only(small_demo, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(short_run(small_demo, out, *SETTINGS, "train.steps=5", "train.log_every=2", "train.progress=true",
                          towers=TRAINING_TOWERS)) == 0
    console = capsys.readouterr()
    assert "mmcl: step " not in console.out + console.err and "5/5" in console.err  # the bar
    logged = [ln for ln in (out / "out.log").read_text().splitlines() if ln.startswith("mmcl: step ")]
    _matches_metrics(_parsed(logged), metrics(out))


# ------------------------------------------------------------------------------------------ speed
def test_each_run_says_its_flops_mfu_and_data_wait_and_warns_once_when_the_loader_limits_it(small_demo, tmp_path,
                                                                                          capsys, monkeypatch):
    """A loader slower than the step (each batch 2 s late) is named once, with its knob, from the second logged
    window on (the first one holds the workers' start); with a known peak (1 TFLOP/s here) every record has MFU =
    samples/s x the model's FLOPs per pair (torch's counter) / the peak, and the summary says all three."""
    from mmcl import models
    from mmcl.config import load_config
    from mmcl.data.stream import TrainStream
    from mmcl.models import flops

    slow = TrainStream.__iter__

    def late(self):
        for batch in slow(self):
            time.sleep(2.0)
            yield batch

    monkeypatch.setattr(TrainStream, "__iter__", late)
    monkeypatch.setattr(flops, "device_peak", lambda device, precision, tf32=False: 1.0)
    out = tmp_path / "run"
    argv = short_run(small_demo, out, *SETTINGS, "train.steps=4", "train.log_every=1")
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    cfg = load_config(argv[2], argv[3:])
    model, model_cfg, pp_cfg = models.build(cfg.model)[:3]
    per_pair = flops.sample_flops(model, pp_cfg["size"], model_cfg["text_cfg"]["context_length"])
    assert f"mmcl: {per_pair / 1e9:.2f} GFLOPs per pair, forward and backward at {pp_cfg['size']} px and " \
           f"{model_cfg['text_cfg']['context_length']} tokens; no known peak for cpu: MFU n/a" not in printed  # patched
    assert any(ln.startswith(f"mmcl: {per_pair / 1e9:.2f} GFLOPs per pair") for ln in printed), printed
    rows = metrics(out)
    for r in rows:
        assert r["mfu"] == pytest.approx(r["samples_per_s"] * per_pair / 1e12, rel=1e-9)
    # The first window past the share (the first one is not judged) is the one named, once.
    first = next(r["step"] for r in rows[1:] if r["data_time_frac"] > 0.25)
    warned = [ln for ln in printed if "waited for data" in ln]
    assert len(warned) == 1 and f"over steps {first}-{first}" in warned[0], warned
    assert "data.workers, now 0 per process" in warned[0]
    speed = [ln for ln in printed if ln.startswith("mmcl: speed: ")]
    assert len(speed) == 1 and re.search(r"waiting for data (\d+)% of the time; MFU \d+\.\d%$", speed[0]), speed
    share = sum(r["data_time_frac"] / r["samples_per_s"] for r in rows) / sum(1 / r["samples_per_s"] for r in rows)
    assert int(re.search(r"waiting for data (\d+)%", speed[0]).group(1)) == pytest.approx(100 * share, abs=1.01)


def test_on_a_cpu_the_start_line_counts_the_flops_and_mfu_is_n_a(small_demo, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(short_run(small_demo, out, *SETTINGS, towers=TRAINING_TOWERS)) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any(re.fullmatch(r"mmcl: \d+\.\d\d GFLOPs per pair, forward and backward at 64 px and 32 tokens; "
                            r"no known peak for cpu: MFU n/a", ln) for ln in printed), printed
    assert all("mfu" not in r for r in metrics(out))
    assert [ln for ln in printed if ln.startswith("mmcl: speed: ")][0].endswith("; MFU n/a")


# ------------------------------------------------------------------------------------------ stop signals
# Each training process writes its exit code to CODES/code-<RANK> (the launcher does not report them after a signal).
RECORD_CODE = """\
import os, sys
from mmcl.cli import main

code = main(sys.argv[2:])
with open(os.path.join(sys.argv[1], "code-" + os.environ.get("RANK", "0")), "w") as f:
    f.write(str(code))
sys.exit(code)
"""


def _stopped_by(cmd, out, sig, cwd):
    """Start `cmd` in its own process group, send `sig` to the group (as Ctrl-C or a scheduler does) once 2 steps
    are logged; returns (exit code, stdout, stderr)."""
    p = subprocess.Popen(cmd, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.1)
    os.killpg(p.pid, sig)
    o, e = p.communicate(timeout=180)
    return p.returncode, o, e


def _resumes(cmd, cwd, step):
    p = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"at step {step}" in p.stdout and "resuming from" in p.stdout, p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("processes,sig,code,word", [(1, signal.SIGINT, 130, "interrupted"),
                                                     (2, signal.SIGINT, 130, "interrupted"),
                                                     (2, signal.SIGTERM, 75, "preempted")])
def test_a_stopped_run_exits_with_the_stop_code_from_every_process_without_a_traceback(small_demo, tmp_path,
                                                                                       processes, sig, code, word):
    """`mmcl train` (1 process) and `mmcl launch` (accelerate's launcher, 2 processes) stopped by a signal to their
    process group: one line, no traceback, every training process and the command itself exit with the code, and
    the checkpoint resumes."""
    script, out, codes = tmp_path / "record_code.py", tmp_path / "run", tmp_path / "codes"
    script.write_text(RECORD_CODE)
    codes.mkdir()
    argv = [*short_run(small_demo, out, *SETTINGS, "train.steps=1000", "train.log_every=1", "data.batch_size=4",
                       towers=TRAINING_TOWERS),
            "data.workers=1"]  # a data worker in the training process's group gets the signal too
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "mmcl", "launch", "--config_file", str(ROOT / "launch" / "cpu-2proc.yaml")]
    rc, o, e = _stopped_by([*launcher, str(script), str(codes), *argv], out, sig, tmp_path)
    assert "Traceback" not in e, e
    lines = [ln for ln in e.splitlines() if ln.startswith("mmcl:")]
    assert len(lines) == 1 and re.fullmatch(rf"mmcl: {word} \({sig.name}\) at step (\d+); checkpoint saved to "
                                            rf".*; re-run the same command to resume", lines[0]), e
    assert rc == code
    assert sorted(f.read_text() for f in codes.iterdir()) == [str(code)] * processes
    step = int(re.search(r"at step (\d+);", lines[0]).group(1))
    argv[argv.index("train.steps=1000")] = f"train.steps={step + 1}"
    _resumes([*launcher, "-m", "mmcl", *argv], tmp_path, step)
