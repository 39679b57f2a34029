"""`Runtime`: the world a run trains in, derived once and frozen; the config is never rewritten for a resumed run's
batch."""

import dataclasses
import json

import pytest

from mmcl.config import load_config
from mmcl.errors import ConfigError
from mmcl.training.plan import Runtime, batch_plan, global_batch_size


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
