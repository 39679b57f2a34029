"""Several machines on one host: two `accelerate launch` calls (one process each, machine ranks 0 and 1, over
127.0.0.1) train as one run and end with the weights of a single-node 2-process run."""

import os
import subprocess

import pytest

from mmcl.storage.checkpoints import latest_checkpoint

from helpers import ACCELERATE_LAUNCH, ROOT, final_weights, metrics, run_args
from spawned import free_port as _free_port

COMMON = ["train.steps=4", "train.log_every=1", "data.batch_size=4", "data.workers=0", "train.save_every=2"]


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def machine_cmd(machine_rank: int, port: int, args):
    """The command each node runs (docs/scale.md, "Several nodes"): the 2-process CPU config, spread over 2 machines."""
    return [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "launch" / "cpu-2proc.yaml"), "--num_machines", "2",
            "--num_processes", "2", "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port), "-m", "mmcl", "train", *args]


@pytest.mark.slow
def test_two_machines_on_one_host_equal_one_machine_with_two_processes(demo, tmp_path):
    single, nodes = tmp_path / "single", tmp_path / "nodes"
    port = _free_port()
    # The reference and the two machines run at the same time (the wall time of one run).
    cmds = [[*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "launch" / "cpu-2proc.yaml"), "--main_process_port",
             str(_free_port()), "-m", "mmcl", "train", *run_args(demo, single, *COMMON)]]
    cmds += [machine_cmd(r, port, run_args(demo, nodes, *COMMON)) for r in (0, 1)]
    procs = [subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=300))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, out + err
    outs = outs[1:]

    a, b = final_weights(single), final_weights(nodes)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, worst
    assert [r["samples"] for r in metrics(nodes)] == [8, 16, 24, 32]
    # One run: rank 0 (machine 0) alone speaks, takes the output directory and writes `latest`.
    assert "mmcl: 2 process(es), MULTI_CPU on cpu, fp32; global batch 8" in outs[0][0]
    assert "mmcl:" not in outs[1][0]
    ckpt = latest_checkpoint(nodes / "checkpoints")
    assert (nodes / "checkpoints" / "latest").read_text().strip() == ckpt.name == "step-00000004"
    # The data position of each process, written by that process into the shared directory.
    assert sorted(f.name for f in ckpt.glob("rank_state_*.pt")) == ["rank_state_0.pt", "rank_state_1.pt"]
    assert not list((nodes / "checkpoints").glob(".tmp-*"))
