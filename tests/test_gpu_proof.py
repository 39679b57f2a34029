"""bench/gpu/: the GPU proof rehearsed on a CPU (all five stages end with figures, every arm caught on its own, and
the Markdown tables are written), and the wheels prepare.sh carries cover what the GPU machine lacks of mmcl's
runtime requirements."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))

import proof  # noqa: E402  (bench/gpu/proof.py)
import wheel_check  # noqa: E402  (bench/gpu/wheel_check.py)

STAGES = ("tests", "e2e", "equal_work", "compiled", "tiled_step")


@pytest.mark.slow
def test_the_proof_runs_all_five_stages_on_a_cpu_within_its_budget(tmp_path):
    out = tmp_path / "out"
    budget = 330
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "proof.py"), "--device", "cpu",
                           "--budget-s", str(budget), "--out", str(out)], capture_output=True, text=True,
                          timeout=budget + 240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["tiny"] and summary["elapsed_s"] <= budget + 20
    assert tuple(summary["stages"]) == STAGES
    st = summary["stages"]
    for name, stage in st.items():
        assert stage["status"] in ("done", "partial"), (name, stage)
        assert stage.get("results"), (name, stage)
    arms = {name: {r["arm"]: r for r in stage["results"]} for name, stage in st.items()}
    # 1. The CUDA tests (marker gpu), not the gpu_path tests that run on the CPU: on a CPU they skip, saying why.
    tests = arms["tests"]["pytest -m gpu"]
    assert "tests/e2e/test_gpu.py" in st["tests"]["files"]
    assert not any("test_gpu_path" in f for f in st["tests"]["files"])
    assert tests["counts"].get("skipped") and "CUDA" in " ".join(tests["skip_reasons"])
    # 2. mmcl train end to end: both decode paths ran, said which they took, evaluated in the run; the resume resumed.
    default = arms["e2e"]["default workers, decode in workers"]
    device = arms["e2e"]["default workers, data.decode=device"]
    for run in (default, device):
        assert run["status"] == "done" and run["samples_per_s"] > 0 and 0 <= run["data_wait"] <= 1, run
        assert run["zeroshot"] and any("GFLOPs per pair" in ln for ln in run["said"]), run
        assert run["mfu"] is None  # no peak for a CPU
    assert any("images decoded in the data workers" in ln for ln in default["said"])
    assert any("images decoded on the training device" in ln for ln in device["said"])
    resume = arms["e2e"]["resume of the first run"]
    assert resume["status"] == "done" and resume["resumed"], resume
    # 3. Equal work: three alternated rounds of each, both at the model's full text length, then the trimmed arm.
    eq = st["equal_work"]
    assert eq["text_tokens"]["mmcl"] == eq["text_tokens"]["open_clip"]
    rounds = [r for r in eq["results"] if "round" in r]
    assert [(r["tool"], r["round"]) for r in rounds] == [("mmcl", 0), ("open_clip", 0), ("open_clip", 1), ("mmcl", 1),
                                                         ("mmcl", 2), ("open_clip", 2)]
    assert all(r["status"] == "done" and r["finite"] and r["samples_per_s"] > 0 for r in rounds), rounds
    assert len(eq["table"]["ratios"]) == 3 and eq["table"]["tools"]["mmcl"]["rounds"] == 3
    trimmed = next(r for r in eq["results"] if r.get("tool") == "mmcl_trimmed_text")
    assert trimmed["status"] == "done" and trimmed["tokens"] < eq["text_tokens"]["open_clip"]
    # 4. Compiled: open_clip's arm first.
    assert [r["arm"] for r in st["compiled"]["results"]] == ["open_clip compiled", "mmcl compiled"]
    # 5. The tiled loss in a real step against dense.
    impls = [r for r in st["tiled_step"]["results"] if r["status"] == "done"]
    assert {r["loss_impl"].split()[0] for r in impls} == {"tiled", "dense"} and all(r["finite"] for r in impls)
    md = (out / "summary.md").read_text()
    for head in ("**1. CUDA tests**", "**2. `mmcl train` end to end**", "**3. Equal work**", "**4. Compiled**",
                 "**5. Tiled loss in a real step**", "nvidia-smi"):
        assert head in md, head


def test_an_arm_that_fails_runs_out_of_memory_or_overruns_ends_alone(tmp_path):
    summary = proof.Summary(tmp_path, {})

    def oom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 64.00 GiB")

    def broken():
        raise ValueError("a bug in one arm")

    def slow():
        import time

        time.sleep(10)

    got = [proof.arm(summary, "e2e", name, seconds, fn) for name, seconds, fn in (
        ("oom", 30, oom), ("broken", 30, broken), ("slow", 3.5, slow), ("fine", 30, lambda: {"samples_per_s": 1.0}),
        ("late", 1, lambda: {}))]
    assert [r["status"] for r in got] == ["oom", "error", "cut", "done", "skipped"]
    assert "a bug in one arm" in got[1]["reason"] and got[2]["seconds"] < 6 and got[3]["samples_per_s"] == 1.0
    written = json.loads((tmp_path / "summary.json").read_text())["stages"]["e2e"]["results"]
    assert [r["arm"] for r in written] == ["oom", "broken", "slow", "fine", "late"]


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


def test_benchmarks_gpu_rows_say_only_what_was_measured():
    """The GPU section: the gpu_path tests ran on the CPU, open_clip's compiled arm never ran at batch 1024, the
    batch-256 ratio is not equal work; its MFU column follows from the samples/s with mmcl.models.flops' peak."""
    from mmcl.models import flops

    text = (REPO / "BENCHMARKS.md").read_text()
    gpu = text[text.index("## GPU"):text.index("## Losses")]
    assert "| figure | value | MFU | command | commit |" in gpu
    assert "85 passed **on the CPU, not on CUDA**" in gpu and "GPU-path tests on CUDA" not in gpu
    assert "open_clip's compiled arm never ran" in gpu and "**not equal work**" in gpu
    peak = flops.peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    for rate, shown in ((4196, "18.4 %"), (5473, "24.0 %"), (2957, "13.0 %")):
        assert f"{100 * flops.mfu(rate, 43.4e9, peak):.1f} %" == shown and shown in gpu
