"""launch/slurm.sh with stand-ins for srun, scontrol and accelerate: srun gets the CPUs per task, the overrides
reach `mmcl train` unchanged, and a run that stops for a signal (exit 75) is requeued."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def fake_bin(tmp_path: Path, accelerate_body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        # records its own options, then runs the task here
        "srun": ('#!/usr/bin/env bash\nwhile [ "${1#-}" != "$1" ]; do echo "$1" >> "$SRUN_LOG"; shift; done\n'
                 'exec "$@"\n'),
        "scontrol": ('#!/usr/bin/env bash\n'
                     'if [ "$1" = requeue ]; then echo "requeue $2" >> "$LOG"; else echo node0; fi\n'),
        "accelerate": "#!/usr/bin/env bash\n" + accelerate_body,
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_slurm(tmp_path, accelerate_body, *overrides, cpus_per_task="64"):
    bin_dir = fake_bin(tmp_path, accelerate_body)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "SLURM_JOB_NODELIST": "n",
           "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "42", "SRUN_LOG": str(tmp_path / "srun")}
    env.pop("SLURM_CPUS_PER_TASK", None)
    if cpus_per_task is not None:  # what sbatch sets from the script's #SBATCH --cpus-per-task
        env["SLURM_CPUS_PER_TASK"] = cpus_per_task
    p = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sh"), "configs/tiny.yaml", *overrides], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    return p, (log.read_text().splitlines() if log.exists() else [])


def test_overrides_reach_mmcl_unexpanded(tmp_path):
    overrides = ["data.train=/d/shard-{000000..000003}.tar", "model.vision_cfg={layers: 2, width: 64}",
                 "eval.zeroshot=/data/my set/*"]
    p, requeued = run_slurm(tmp_path, 'printf "%s\\n" "$@" >> "$LOG"\n', *overrides)
    assert p.returncode == 0, p.stderr
    args = requeued
    assert args[args.index("--machine_rank") + 1] == "1"
    assert args[args.index("--num_processes") + 1] == "16"  # 2 nodes x 8 GPUs
    assert args[args.index("--config"):] == ["--config", "configs/tiny.yaml", *overrides]


def test_a_run_stopped_by_a_signal_is_requeued(tmp_path):
    p, log = run_slurm(tmp_path, "exit 75\n")
    assert p.returncode == 0, p.stderr
    assert log == ["requeue 42"]
    (tmp_path / "again").mkdir()
    p, log2 = run_slurm(tmp_path / "again", "exit 3\n")
    assert p.returncode == 3 and log2 == []


def srun_options(tmp_path):
    return (tmp_path / "srun").read_text().splitlines()


@pytest.mark.gpu_path
def test_srun_gets_the_cpus_per_task(tmp_path):
    # Since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task: the script must pass it on, or every task
    # (one launcher and its 8 training processes with their data workers) is bound to one CPU.
    p, _ = run_slurm(tmp_path, "exit 0\n", cpus_per_task="48")
    assert p.returncode == 0, p.stderr
    assert srun_options(tmp_path) == ["--kill-on-bad-exit=1", "--cpus-per-task=48"]
    (tmp_path / "unset").mkdir()  # a job submitted without --cpus-per-task: srun's own default, no empty value
    p, _ = run_slurm(tmp_path / "unset", "exit 0\n", cpus_per_task=None)
    assert p.returncode == 0, p.stderr
    assert srun_options(tmp_path / "unset") == ["--kill-on-bad-exit=1"]


# ------------------------------------------------------------------ --num_processes without a launch file
@pytest.mark.slow
def test_num_processes_without_a_launch_file_is_honoured_or_said(demo, tmp_path, cpu_device):
    """accelerate alone starts 1 process for --num_processes 2 on a machine without GPUs: `mmcl launch` starts 2 CPU
    processes and says so; `accelerate launch` itself starts 1, and the run says what was asked and what ran."""
    import sys

    from helpers import ACCELERATE_LAUNCH, metrics, run_args

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("ACCELERATE_USE_CPU", None)  # as a user's shell has it
    common = ("train.steps=1", "data.batch_size=4", "data.workers=0", "train.save_every=0", "train.log_every=1")
    ours = subprocess.run([sys.executable, "-m", "mmcl", "launch", "--num_processes", "2", "-m", "mmcl", "train",
                           *run_args(demo, tmp_path / "ours", *common)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert ("mmcl: launching 2 CPU processes (--num_processes 2 without a launch file; accelerate alone would start "
            "1 on a machine without GPUs)") in ours.stdout
    assert "mmcl: 2 process(es), MULTI_CPU on cpu" in ours.stdout
    assert metrics(tmp_path / "ours")[-1]["samples"] == 8  # 4 per process, 2 processes
    theirs = subprocess.run([*ACCELERATE_LAUNCH, "--num_processes", "2", "-m", "mmcl", "train",
                             *run_args(demo, tmp_path / "theirs", *common)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert ("mmcl: warning: the launcher was asked for 2 processes (--num_processes 2) and started 1: without a "
            "launch file accelerate starts several processes only on several GPUs; on the CPU use `mmcl launch "
            "--num_processes 2 -m mmcl train ...` or --config_file launch/cpu-2proc.yaml") in theirs.stderr
