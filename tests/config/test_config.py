import pytest

from mmcl.config import TrainConfig, from_dict, load_config, to_dict, valid_keys
from mmcl.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_and_overrides_parse_by_field_type(tmp_path):
    cfg = load_config(write(tmp_path, "data:\n  batch_size: 8\n"),
                      ["train.steps=7", "loss.chunk_size=16", "optim.lr=1e-3", "model.lock_text=true",
                       "data.train=[a.tar,b.tar]", "loss.mochi.weight=0.5"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.data.batch_size == 8 and cfg.train.steps == 7 and cfg.loss.chunk_size == 16
    assert cfg.optim.lr == pytest.approx(1e-3) and cfg.model.lock_text is True
    assert list(cfg.data.train) == ["a.tar", "b.tar"] and cfg.loss.mochi.weight == 0.5


def test_unknown_key_names_the_nearest_valid_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'data.batchsize'.*data\.batch_size"):
        load_config(None, ["data.batchsize=3"])
    with pytest.raises(ConfigError, match=r"'optim.warmup'.*optim\.warmup_steps"):
        load_config(write(tmp_path, "optim:\n  warmup: 5\n"))


def test_moved_key_is_one_error_line_naming_its_new_key(tmp_path):
    """The logit-scale clamp acts in the model (after each optimiser step), so its key is model.max_logit_scale;
    the old loss.max_logit_scale, in a file or an override, is one line naming the new key, not a fuzzy guess."""
    cfg = load_config(None, ["model.max_logit_scale=50"])
    assert cfg.model.max_logit_scale == 50.0 and not hasattr(cfg.loss, "max_logit_scale")
    for args in ((None, ["loss.max_logit_scale=50"]), (write(tmp_path, "loss:\n  max_logit_scale: 50.0\n"), None)):
        with pytest.raises(ConfigError) as err:
            load_config(*args)
        msg = str(err.value)
        assert "\n" not in msg and "'loss.max_logit_scale' is now 'model.max_logit_scale'" in msg, msg
    with pytest.raises(ConfigError, match=r"model\.max_logit_scale must be >= 1 \(got 0\.5\)"):
        load_config(None, ["model.max_logit_scale=0.5"])


def test_bad_value_type_is_reported_with_the_key():
    with pytest.raises(ConfigError, match=r"data\.batch_size.*abc"):
        load_config(None, ["data.batch_size=abc"])


def test_all_problems_are_reported_at_once(tmp_path):
    path = write(tmp_path, "data:\n  batchsize: 3\ntrain:\n  stepz: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["optim.lr=x"])
    msg = str(err.value)
    assert "data.batchsize" in msg and "train.stepz" in msg and "optim.lr" in msg


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


def test_missing_file_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["data.batch_size"])
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_round_trip_through_dict():
    cfg = load_config(None, ["data.batch_size=5", "model.text.hf=/x/y"])
    again = from_dict(to_dict(cfg))
    assert again == cfg


def test_valid_keys_cover_nested_sections():
    keys = valid_keys()
    for k in ("data.train", "data.batch_size", "train.steps", "train.output_dir", "train.seed", "loss.clip",
              "loss.mochi.queue_size", "model.text.hf"):
        assert k in keys


def test_loaded_config_is_read_only():
    import dataclasses

    cfg = load_config(None, ["data.batch_size=3"])
    for section, key in ((cfg.train, "steps"), (cfg.data, "batch_size"), (cfg.loss.mochi, "weight"), (cfg, "eval")):
        with pytest.raises(dataclasses.FrozenInstanceError, match="read-only"):
            setattr(section, key, None)
    assert cfg.data.batch_size == 3 and cfg.train.steps == 150  # unchanged by the refused assignments
    again = from_dict(to_dict(cfg))
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.train.seed = 1
    copy = dataclasses.replace(cfg.data, workers=0)  # a changed copy is the way to vary a loaded config
    assert copy.workers == 0 and cfg.data.workers is None and copy.batch_size == 3
    assert TrainConfig().train.steps == 150  # a config built in code stays assignable until frozen


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
