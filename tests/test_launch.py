"""launch/slurm.sh with stand-ins for srun, scontrol and accelerate: the overrides reach `mmcl train` unchanged,
and a run that stops for a signal (exit 75) is requeued."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fake_bin(tmp_path: Path, accelerate_body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": '#!/usr/bin/env bash\nshift\nexec "$@"\n',  # drops --kill-on-bad-exit=1, runs the task here
        "scontrol": '#!/usr/bin/env bash\nif [ "$1" = requeue ]; then echo "requeue $2" >> "$LOG"; else echo node0; fi\n',
        "accelerate": "#!/usr/bin/env bash\n" + accelerate_body,
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_slurm(tmp_path, accelerate_body, *overrides):
    bin_dir = fake_bin(tmp_path, accelerate_body)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "SLURM_JOB_NODELIST": "n",
           "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "42"}
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
