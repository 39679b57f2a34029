"""`Runtime`: the world a run trains in, derived once and frozen; the config is never rewritten for a resumed run's
batch."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from mmcl.config import load_config
from mmcl.errors import ConfigError
from mmcl.training.plan import Runtime, batch_plan, global_batch_size, gpu_launch_problem, launcher_processes_asked


def _saved_run(root, world, global_batch):
    ckpt = root / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 4, "samples": 4 * global_batch, "world_size": world,
                                               "global_batch": global_batch, "files": {}}))
    return root


def test_a_new_run_trains_with_the_config_batch(tmp_path):
    cfg = load_config(None, [f"train.output_dir={tmp_path / 'run'}", "data.batch_size=8", "train.accum_steps=2",
                             "train.samples=100"])
    rt = Runtime.plan(cfg.data, cfg.train, 3)
    assert (rt.processes, rt.batch_size, rt.accum_steps, rt.global_batch) == (3, 8, 2, 48)
    assert rt.global_batch == global_batch_size(cfg.data, cfg.train, 3)
    assert rt.total_steps == 3 and rt.length_line == "train.samples=100: 3 steps of 48 samples"
    assert rt.resized_line is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.batch_size = 4


def test_a_resumed_run_keeps_its_global_batch_and_its_config(tmp_path):
    """Written by 1 process at 24 a step; resumed on 4 with the same config: 6 per process, the steps counted at
    24 a step, and the config object itself unchanged."""
    out = _saved_run(tmp_path / "run", 1, 24)
    cfg = load_config(None, [f"train.output_dir={out}", "data.batch_size=24", "train.samples=240"])
    before = dataclasses.asdict(cfg)
    rt = Runtime.plan(cfg.data, cfg.train, 4)
    assert (rt.batch_size, rt.accum_steps, rt.global_batch, rt.total_steps) == (6, 1, 24, 10)
    assert rt.resized_line.endswith("data.batch_size 24 -> 6 per process, keeping the global batch of 24")
    assert dataclasses.asdict(cfg) == before and cfg.data.batch_size == 24
    assert batch_plan(cfg.data, cfg.train, 1).line is None  # on the processes that wrote it: nothing to keep


@pytest.mark.parametrize("saved,now,accum,expect", [(1, 2, 1, (12, 1)), (2, 1, 1, (24, 1)), (2, 3, 1, (8, 1)),
                                                    (1, 2, 2, (6, 2)), (1, 4, 4, (6, 1))])
def test_the_global_batch_is_kept_on_another_number_of_processes(tmp_path, saved, now, accum, expect):

    out = _saved_run(tmp_path / "run", saved, 24)
    cfg = load_config(None, [f"train.output_dir={out}", f"data.batch_size={24 // saved // accum}",
                             f"train.accum_steps={accum}"])
    new = batch_plan(cfg.data, cfg.train, now)
    line = new.line
    assert (new.batch_size, new.accum_steps) == expect
    assert new.batch_size * new.accum_steps * now == 24
    assert line.startswith(f"resuming on {now} process(es) a checkpoint written by {saved}: data.batch_size "
                           f"{24 // saved // accum} -> {expect[0]} per process")
    assert line.endswith("keeping the global batch of 24")
    assert ("train.accum_steps" in line) == (expect[1] != accum)
    same = batch_plan(cfg.data, cfg.train, saved)
    assert (same.batch_size, same.accum_steps, same.line) == (cfg.data.batch_size, cfg.train.accum_steps, None)


def test_a_global_batch_that_does_not_divide_among_the_processes_is_one_error(tmp_path):

    out = _saved_run(tmp_path / "run", 2, 16)
    cfg = load_config(None, [f"train.output_dir={out}", "data.batch_size=8"])
    with pytest.raises(ConfigError, match="global batch of 16 samples does not divide among them .* that divides 16"):
        batch_plan(cfg.data, cfg.train, 3)


# ------------------------------------------------------------------------------ what the launcher asked for
LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def _launcher_env(launch_file):
    """The variables accelerate's launcher sets in the training processes for `launch_file` (accelerate 1.x:
    ACCELERATE_USE_CPU, ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_FSDP)."""
    cfg = yaml.safe_load(launch_file.read_text())
    env = {"ACCELERATE_USE_CPU": str(bool(cfg.get("use_cpu", False))),
           "ACCELERATE_MIXED_PRECISION": str(cfg.get("mixed_precision", "no"))}
    if cfg.get("distributed_type") == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
    return env


@pytest.mark.parametrize("name", sorted(p.name for p in LAUNCH.glob("*.yaml")))
def test_every_launch_file_for_gpus_is_refused_on_a_machine_without_one(name):
    cfg = yaml.safe_load((LAUNCH / name).read_text())
    env = _launcher_env(LAUNCH / name)
    problem = gpu_launch_problem(cfg["num_processes"], env, device=False)
    if cfg.get("use_cpu"):
        assert problem is None
        return
    assert problem == (f"the launcher asked for GPUs ({cfg['num_processes']} process(es), {cfg['mixed_precision']} "
                       f"mixed precision{', FSDP' if cfg['distributed_type'] == 'FSDP' else ''}, use_cpu false: a GPU "
                       f"launch file such as launch/gpu-8.yaml) and this machine has none; on the CPU launch with "
                       f"--config_file launch/cpu-2proc.yaml (or cpu-1proc.yaml), or set use_cpu: true in your "
                       f"launch file")
    assert gpu_launch_problem(cfg["num_processes"], env, device=True) is None  # the same file on a GPU machine


def test_a_gpu_launch_on_the_cpu_is_one_error_line_before_anything_is_built(tmp_path, monkeypatch, capsys):
    from mmcl.cli import main

    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code = main(["train", "--config", str(LAUNCH.parent / "configs" / "tiny.yaml"), "data.train=x.tar",
                 f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("mmcl: error: the launcher asked for GPUs (1 process(es), "
                                                             "bf16 mixed precision, use_cpu false"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cmdline, asked", [
    (["python", "-m", "accelerate.commands.launch", "--num_processes", "2", "-m", "mmcl", "train"], 2),
    (["/venv/bin/accelerate", "launch", "--num-processes=4", "--cpu", "-m", "mmcl", "train"], 4),
    (["python", "-m", "mmcl", "launch", "--config_file", "launch/cpu-2proc.yaml", "-m", "mmcl", "train"], None),
    (["python", "-m", "mmcl", "train", "--num_processes", "2"], None),  # no launcher
])
def test_the_processes_a_launch_command_asked_for(cmdline, asked):
    assert launcher_processes_asked(cmdline) == asked


def test_mmcl_launch_without_dash_m_is_one_line(capsys):
    from mmcl.cli import main

    assert main(["launch", "--num_processes", "2", "mmcl", "train", "--config", "configs/tiny.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mmcl: error: mmcl launch: the training script mmcl is not a file (to run mmcl, put -m before it: "
                   "... -m mmcl train --config ...)"]


def test_a_naflex_run_says_its_batches_come_from_the_token_budget_not_data_batch_size():
    """NaFlex batches hold max_tokens_per_batch // L pairs: the start lines do not speak of data.batch_size's."""
    cfg = load_config(str(LAUNCH.parent / "configs" / "naflex.yaml"), ["train.steps=4", "data.batch_size=64"])
    rt = Runtime.plan(cfg.data, cfg.train, 1)
    assert rt.total_steps == 4
    assert rt.length_line == ("train.steps=4: 4 steps of NaFlex batches (each one's pairs set by "
                              "data.naflex.max_tokens_per_batch)")
    assert "64" not in rt.length_line
