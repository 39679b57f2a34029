"""bench/bench_train.py's GPU mode (sequential runs, mmcl and open_clip's training script, plain and compiled, bf16,
peak memory, model FLOPs utilisation) run on a CPU through the same code, so that it still runs on the day a GPU is
there. Only the device differs: ``--device cpu``, and dynamo off in the runs (TORCHDYNAMO_DISABLE=1: the compiled
runs go through ``train.compile=true`` / ``--torchcompile`` and their compiled wrappers without generating code)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_train.py"


def bench(*args, timeout=900):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.slow
def test_the_gpu_mode_runs_on_a_cpu_and_reports_every_figure(tmp_path):
    proc = bench("--device", "cpu", "--mode", "sequential", "--compile", "yes", "--precision", "bf16",
                 "--steps", "3", "--skip-steps", "1", "--log-every", "1", "--rounds", "1", "--batch-size", "4",
                 "--workers", "1", "--pure-steps", "1", "--pure-batches", "1", "--peak-tflops", "1",
                 "--env", "TORCHDYNAMO_DISABLE=1", "--work-dir", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    runs = {x["measurement"]: x for x in lines}
    assert set(runs) == {"mmcl", "open_clip", "mmcl_compiled", "open_clip_compiled", "pure", "summary"}
    for name in ("mmcl", "open_clip", "mmcl_compiled", "open_clip_compiled"):
        run = runs[name]
        assert run["device"] == "cpu" and run["precision"] == "bf16" and run["last_step"] == 3, name
        assert run["samples_per_s"] > 0 and run["window_samples"] == 8, name  # steps 1 -> 3 of batch 4
        # The peak resident set of the run's own process: at least the torch it imported (> 100 MiB).
        assert run["peak_memory_kind"] == "max_rss" and 0.1 < run["peak_memory_gib"] < 64, name
    summary = runs["summary"]
    assert set(summary["samples_per_s_per_device"]) == {"mmcl", "open_clip", "mmcl_compiled", "open_clip_compiled",
                                                        "pure"}
    assert set(summary["peak_memory_gib"]) == set(summary["samples_per_s_per_device"])
    assert summary["compiled_speedup_vs_open_clip_compiled"] > 0
    assert summary["flops_per_sample"] > 1e6  # counted by FlopCounterMode over the tiny model's step
    for name in ("mmcl", "open_clip", "mmcl_compiled", "open_clip_compiled"):
        # --peak-tflops 1: MFU is FLOPs per sample x samples/s over 1e12.
        expected = summary["flops_per_sample"] * summary["samples_per_s_per_device"][name] / 1e12
        assert summary[f"mfu_{name}"] == pytest.approx(expected), name


def test_compiled_runs_need_the_sequential_mode():
    proc = bench("--device", "cpu", "--compile", "yes", "--mode", "sliced", timeout=120)
    assert proc.returncode != 0 and "--compile yes is measured in --mode sequential" in proc.stderr


def test_both_tools_get_the_same_settings_and_their_compile_flags(tmp_path):
    """The commands the runs start: the same precision, batch, steps and model; compiled runs with each tool's own
    compile switch; open_clip kept on the CPU when --device cpu (its default device is cuda)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_train
    finally:
        sys.path.remove(str(ROOT / "bench"))

    args = bench_train.argparse.Namespace(model="tiny", batch_size=4, workers=1, steps=3, precision="bf16",
                                          log_every=1, device="cpu", mmcl_override=[])
    mmcl = bench_train.mmcl_command(args, tmp_path, "shards.tar", tmp_path / "run", ("train.compile=true",))
    assert {"train.precision=bf16", "data.batch_size=4", "train.steps=3", "model.name=tiny",
            "train.compile=true"} <= set(mmcl)
    for compiled in (False, True):
        oc = bench_train.open_clip_command(args, tmp_path, tmp_path / "train.csv", 12, tmp_path, "oc", compiled)
        flags = dict(zip(oc, oc[1:]))
        assert flags["--precision"] == "amp_bf16" and flags["--batch-size"] == "4" and flags["--epochs"] == "1"
        assert flags["--model"] == "mmcl-tiny" and "--device=cpu" in oc
        assert ("--torchcompile" in oc) == compiled
