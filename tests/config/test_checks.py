"""The config's checks (mmcl/config/checks.py): every problem beyond types found at load, all at once, each naming its
key, the allowed values and the value given."""

import dataclasses

import pytest

from mmcl.config import OptimConfig, TrainConfig, load_config
from mmcl.config.checks import phase_lengths, validate
from mmcl.config.schema import PhaseConfig
from mmcl.errors import ConfigError


def test_semantic_validation():
    with pytest.raises(ConfigError, match="train.precision must be one of"):
        load_config(None, ["train.precision=fp8"])
    with pytest.raises(ConfigError, match="no loss term is active"):
        load_config(None, ["loss.clip=0"])
    with pytest.raises(ConfigError, match=r"data.batch_size must be > 0.*train.steps must be > 0"):
        load_config(None, ["data.batch_size=0", "train.steps=0"])
    with pytest.raises(ConfigError, match=r"train.samples must be > 0 \(got -5\)"):
        load_config(None, ["train.samples=-5"])
    assert load_config(None, ["train.samples=1000"]).train.samples == 1000


def test_data_weights_rule_is_checked_with_the_config_and_again_with_the_sources(tmp_path):
    """data.weights has one rule (`config.data_weight_problems`): what the config alone decides is reported by
    load_config with every other problem, before any data is opened; the count of sources by the data stream."""
    from mmcl.data.stream import TrainStream

    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.weights=[1,-1]", "data.resampled=false", "optim.lr=-1"])
    msg = str(err.value)
    assert "data.weights needs data.resampled=true" in msg and "data.weights must be non-negative" in msg
    assert "optim.lr" in msg
    with pytest.raises(ConfigError, match="must not all be zero"):
        load_config(None, ["data.weights=[0,0]", "data.resampled=true"])
    for name in ("a.tar", "b.tar"):
        (tmp_path / name).write_bytes(b"")
    cfg = load_config(None, [f"data.train={tmp_path / 'a.tar'}::{tmp_path / 'b.tar'}", "data.weights=[1,2,3]",
                             "data.resampled=true"])
    with pytest.raises(ConfigError, match=r"one weight per '::'-separated source \(got 3 weights for 2 sources\)"):
        TrainStream(cfg.data, preprocess=lambda x: x, tokenizer=lambda x: x, seed=0)


def test_every_choice_and_range_is_named_with_its_key_and_value():
    problems = validate(load_config(None, []))
    assert problems == []
    cfg = dataclasses.replace(TrainConfig(), optim=dataclasses.replace(OptimConfig(), image_layer_decay=0.0))
    assert validate(cfg) == ["optim.image_layer_decay must be in (0, 1] (got 0.0)"]
    for override, message in (("data.worker_nice=20", "data.worker_nice must be in [0, 19] (got 20)"),
                              ("model.patch_dropout=1.0", "model.patch_dropout must be in [0, 1) (got 1.0)"),
                              ("train.ema_decay=1.0", "train.ema_decay must be in (0, 1) or null (got 1.0)"),
                              ("train.wise_ft=[0.5,1.5]", "train.wise_ft must be a list of alphas in [0, 1] "
                                                          "(got [0.5, 1.5])"),
                              ("loss.siglip=1", "loss.siglip > 0 needs a model with a logit bias")):
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        assert message in str(info.value), override


@pytest.mark.parametrize("phases,total,lengths", [
    ([{"steps": 3}, {}], 10, [3, 7]),
    ([{"fraction": 0.25}, {"fraction": 0.75}], 8, [2, 6]),
    ([{"fraction": 0.3}, {"steps": 2}, {}], 10, [3, 2, 5]),
])
def test_phase_lengths_give_each_phase_its_steps_and_the_last_the_rest(phases, total, lengths):
    assert phase_lengths([PhaseConfig(**p) for p in phases], total) == lengths
    assert sum(lengths) == total


def test_phase_lengths_that_do_not_make_the_run_are_one_error():
    with pytest.raises(ConfigError, match=r"train.phases\[0\] has neither steps nor fraction"):
        phase_lengths([PhaseConfig(), PhaseConfig(steps=2)], 10)
    with pytest.raises(ConfigError, match=r"train.phases' steps are 4 \+ 4 = 8, not the run's 10"):
        phase_lengths([PhaseConfig(steps=4), PhaseConfig(steps=4)], 10)
    with pytest.raises(ConfigError, match=r"steps are 10 \+ 0 = 10"):
        phase_lengths([PhaseConfig(steps=10), PhaseConfig()], 10)


def test_the_second_stage_terms_numbers_and_what_they_do_not_run_with_are_named():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["loss.self_distill.weight=1", "loss.self_distill.start_fraction=1.0",
                           "loss.self_distill.local_scale=[0.5, 0.2]", "loss.self_distill.teacher_ema_decay=1.0",
                           "loss.masked.weight=1", "loss.masked.mask_ratio=0", "loss.masked.teacher_temp=0",
                           "data.naflex.seq_lens=[16]", "model.lock_image=true"])
    problems = str(err.value)
    for expected in ("loss.self_distill.start_fraction must be in [0, 1) (got 1.0)",
                     "loss.self_distill.local_scale must be two area fractions", "teacher_ema_decay must be in (0, 1)",
                     "loss.masked.mask_ratio must be in (0, 1) (got 0", "loss.masked.student_temp and teacher_temp",
                     "loss.self_distill and loss.masked need an open_clip ViT image tower at a fixed size",
                     "model.lock_image freezes it"):
        assert expected in problems, expected
    good = load_config(None, ["loss.self_distill.weight=1", "loss.masked.weight=1"])
    assert not [p for p in validate(good) if "self_distill" in p or "masked" in p]
