"""Loading a config (mmcl/config/load.py): a YAML file and key=value overrides merged over the defaults, every
problem reported at once in one error, and the round trip through a plain dict."""

import pytest

from mmcl.config import TrainConfig, from_dict, load_config, to_dict
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
    # the same section's key in other words comes first: its initials, or its words in another order
    for typed, meant in (("optim.learning_rate", "optim.lr"), ("optim.wd", "optim.weight_decay"),
                         ("data.size_batch", "data.batch_size")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{typed}=1"])
        assert str(err.value).endswith(f"; did you mean {meant}?"), str(err.value)


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


