"""Building a run's parts (mmcl/training/setup.py): the run folder taken and, when the run fails before writing
anything, left as it was; the model, optimiser, objective and stream as the config says, at the run's batch."""

import contextlib
import dataclasses

import pytest

from mmcl import models
from mmcl.config import load_config
from mmcl.errors import ConfigError
from mmcl.storage import checkpoints
from mmcl.storage.layout import LOCK, RunLayout
from mmcl.training import optim, setup
from mmcl.training.ema import WeightEMA
from mmcl.training.plan import Runtime, accelerator_for

from helpers import ROOT, run_args

SMALL = ["data.workers=0", "data.batch_size=8", "train.log_with=[]", "train.steps=4", "optim.lr=0.01",
         "data.shuffle_buffer=8"]


def _cfg(small_demo, out, *extra):
    return load_config(str(ROOT / "configs" / "tiny.yaml"), run_args(small_demo, out, *SMALL, *extra)[2:])


def test_a_run_that_fails_before_writing_leaves_no_folder_and_a_taken_folder_is_locked(small_demo, tmp_path,
                                                                                        cpu_device):
    cfg = _cfg(small_demo, tmp_path / "new" / "run")
    accelerator = accelerator_for(cfg.train)
    layout = RunLayout(cfg.train.output_dir)
    with pytest.raises(RuntimeError, match="model.name is wrong"):
        with contextlib.ExitStack() as held:
            setup.take_folder(accelerator, layout, held)
            assert (layout.root / LOCK).is_file()
            raise RuntimeError("model.name is wrong")
    assert not (tmp_path / "new").exists()  # the folders the run made, gone with its lock
    kept = tmp_path / "kept"
    kept.mkdir()
    with contextlib.ExitStack() as held:
        setup.take_folder(accelerator, RunLayout(kept), held)
        (kept / "config.yaml").write_text("x")
    assert sorted(p.name for p in kept.iterdir()) == sorted(["config.yaml", LOCK])  # the run's files are kept


def test_the_parts_are_the_configured_model_optimiser_and_stream_at_the_runs_batch(small_demo, tmp_path,
                                                                                  cpu_device):
    cfg = _cfg(small_demo, tmp_path / "run", "train.ema_decay=0.9", "optim.weight_decay=0.1")
    rt = Runtime.plan(cfg.data, cfg.train, 1)
    assert (rt.batch_size, rt.accum_steps, rt.total_steps) == (8, 1, 4)
    with contextlib.ExitStack() as held:
        parts = setup.setup(cfg, rt, held)
        accelerator, layout = parts.accelerator, parts.layout
        assert layout.root == tmp_path / "run" and layout.lock.is_file() and parts.rt is rt
        _, want_cfg, want_pp, *_ = models.build(cfg.model)
        assert parts.model_cfg == want_cfg and parts.pp_cfg == want_pp
        assert parts.meta() == {"model_cfg": want_cfg, "preprocess_cfg": want_pp}
        assert parts.raw_model is accelerator.unwrap_model(parts.model)
        assert isinstance(parts.ema, WeightEMA) and parts.teacher is None and parts.lora is None
        assert parts.wise_ft is None and parts.plot is False
        assert parts.ckpt_bytes == checkpoints.state_bytes(parts.raw_model)
        with pytest.raises(dataclasses.FrozenInstanceError):
            parts.ema = None
        groups = optim.param_groups(parts.raw_model, cfg.optim)
        got = parts.optimizer.param_groups
        assert len(got) == len(groups)
        for g, want in zip(got, groups):
            assert [id(p) for p in g["params"]] == [id(p) for p in want["params"]]
            assert g["weight_decay"] == want["weight_decay"]
        assert {g["weight_decay"] for g in got} == {0.0, 0.1}
        trained = {id(p) for p in parts.raw_model.parameters() if p.requires_grad}
        assert {id(p) for g in got for p in g["params"]} == trained
        stream = parts.stream
        assert stream.skip_log is not None and stream.skip_log.path == layout.skipped
        it = iter(stream)
        batch = next(it)
        it.close()
        assert batch["image"].shape[0] == 8 and batch["text"].shape[0] == 8


def test_naflex_settings_without_a_naflex_tower_are_one_config_error(small_demo, tmp_path):
    cfg = _cfg(small_demo, tmp_path / "run", "data.naflex.seq_lens=[16]")
    model = models.build(cfg.model)[0]
    with pytest.raises(ConfigError, match="data.naflex.seq_lens is set but the image tower is not a NaFlex one"):
        setup.naflex_preprocess(cfg, model, {"size": 64})
    plain = _cfg(small_demo, tmp_path / "run")
    assert setup.naflex_preprocess(plain, model, {"size": 64}) == {"size": 64}
    assert setup.naflex_plan(plain, {"size": 64}) is None
