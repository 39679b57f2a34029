"""bench/gpu/: the GPU proof rehearsed on a CPU (every stage ends with figures or a reason it was skipped, and the
Markdown table is written), and the wheels prepare.sh carries cover what the GPU machine lacks of mmcl's
runtime requirements."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))

import wheel_check  # noqa: E402  (bench/gpu/wheel_check.py)

STAGES = ("tests", "train_step", "losses", "data")


@pytest.mark.slow
def test_the_proof_runs_end_to_end_on_a_cpu_within_its_budget(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "proof.py"), "--device", "cpu",
                           "--budget-s", "120", "--out", str(out)], capture_output=True, text=True, timeout=240,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["tiny"] and summary["elapsed_s"] <= 120 + 15
    assert set(summary["stages"]) == set(STAGES)
    for name, stage in summary["stages"].items():
        if stage["status"] == "skipped":
            assert stage.get("reason"), (name, stage)
            continue
        assert stage["status"] in ("done", "partial"), (name, stage)
        assert stage.get("results") or stage.get("skipped"), (name, stage)
    figures = {
        "tests": lambda r: sum(r["counts"].values()) > 0,
        "train_step": lambda r: r["samples_per_s"] > 0 and r["finite"],
        "losses": lambda r: r.get("oom") or r["time_s"] > 0,
        "data": lambda r: r["samples_per_s"] > 0,
    }
    for name, ok in figures.items():
        for r in summary["stages"][name].get("results", []):
            assert ok(r), (name, r)
    # On a CPU the GPU tests skip, saying why.
    tests = summary["stages"]["tests"]["results"][-1]
    assert tests["counts"].get("skipped") and "CUDA" in " ".join(tests["skip_reasons"])
    md = (out / "summary.md").read_text()
    assert "| batch | variant | samples/s |" in md and "| N | loss | implementation |" in md
    assert "Data loader alone" in md and "nvidia-smi" in md


def test_the_wheels_cover_what_the_gpu_machine_lacks_of_mmcls_requirements():
    from packaging.requirements import Requirement

    machine = wheel_check.machine_packages()
    wheels = wheel_check.wheel_list()
    direct = {wheel_check.norm(Requirement(r).name) for r in wheel_check.mmcl_requirements()}
    assert {"torch", "accelerate", "timm", "regex"} <= machine  # as the device notes list them
    assert direct - machine <= set(wheels), f"not carried: {sorted(direct - machine - set(wheels))}"
    # Through the requirements of the packages carried (ftfy's wcwidth, ...), walked on this environment's metadata.
    need = wheel_check.from_installed()
    assert need == set(wheels), f"missing {sorted(need - set(wheels))}, not needed {sorted(set(wheels) - need)}"
    # One version of each (two would stop the install there), each satisfying mmcl's own bound.
    reqs = {wheel_check.norm(Requirement(r).name): Requirement(r) for r in wheel_check.mmcl_requirements()}
    for name, version in wheels.items():
        if name in reqs:
            assert reqs[name].specifier.contains(version), (name, version, str(reqs[name].specifier))


def test_the_wheel_folder_is_ignored_by_git():
    out = subprocess.run(["git", "check-ignore", "-q", ".whl/x.whl"], cwd=REPO)
    assert out.returncode == 0
