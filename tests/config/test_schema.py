"""The config's schema (mmcl/config/schema.py): the dataclass tree, read-only once loaded, and its defaults."""

import dataclasses

import pytest

from mmcl.config import TrainConfig, from_dict, load_config, to_dict
from mmcl.config import schema as schema_module
from mmcl.config.schema import PhaseConfig, freeze


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


def test_freeze_reaches_every_section_and_the_phases_list():
    cfg = TrainConfig()
    cfg.train.phases = [PhaseConfig(), PhaseConfig()]
    assert freeze(cfg) is cfg
    for section in (cfg, cfg.model.text, cfg.loss.global_contrastive, cfg.train.phases[1]):
        with pytest.raises(dataclasses.FrozenInstanceError, match="read-only once validated"):
            setattr(section, dataclasses.fields(section)[0].name, None)


def test_every_key_has_a_default_and_a_description_and_sections_are_fresh_per_config():
    def walk(schema):
        for f in dataclasses.fields(schema):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
            value = getattr(schema(), f.name)
            if isinstance(value, schema_module._Section):
                yield from walk(type(value))
            else:
                yield f

    fields = list(walk(TrainConfig))
    assert len(fields) > 100
    assert [f.name for f in fields if not f.metadata.get("help")] == []
    a, b = TrainConfig(), TrainConfig()
    assert a == b and a.data is not b.data and a.train.log_with is not b.train.log_with
    assert schema_module.described(3, "three").metadata == {"help": "three"}
