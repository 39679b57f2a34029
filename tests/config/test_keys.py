"""The config's keys (mmcl/config/keys.py): every dotted key read from the dataclass tree, with its type, default and
description as `mmcl train --help` prints them, and a key's value read by its name."""

import json

import pytest

from mmcl.config import TrainConfig
from mmcl.config.keys import describe_keys, get, keys_help, term_keys, valid_keys


def test_valid_keys_cover_nested_sections():
    keys = valid_keys()
    for k in ("data.train", "data.batch_size", "train.steps", "train.output_dir", "train.seed", "loss.clip",
              "loss.mochi.queue_size", "model.text.hf"):
        assert k in keys


def test_described_keys_are_the_leaves_with_their_types_defaults_and_help():
    infos = {i.key: i for i in describe_keys()}
    leaves = [k for k in valid_keys() if not any(other.startswith(k + ".") for other in valid_keys())]
    assert sorted(infos) == sorted(leaves)
    cfg = TrainConfig()
    for key in ("data.batch_size", "train.steps", "optim.lr", "loss.mochi.queue_size", "train.output_dir"):
        default = get(cfg, key)
        assert infos[key].default == (default if isinstance(default, str) else json.dumps(default)), key
        assert infos[key].description, key
    assert infos["data.batch_size"].type == "int"
    assert infos["data.workers"].type == "int or null"
    assert all(i.description for i in infos.values()), [k for k, i in infos.items() if not i.description]
    text = keys_help()
    assert all(f"  {k} (" in text for k in infos)
    assert f"  data.batch_size (int, default: {cfg.data.batch_size})" in text


def test_each_loss_term_has_its_weight_key_and_get_reads_dotted_keys():
    from mmcl.losses import TERMS

    terms = term_keys()
    assert sorted(terms) == sorted(TERMS)
    assert terms["clip"] == "loss.clip" and terms["mochi"] == "loss.mochi.weight"
    assert all(key in valid_keys() for key in terms.values())
    cfg = TrainConfig()
    assert get(cfg, "loss.mochi.weight") == cfg.loss.mochi.weight and get(cfg, "data") is cfg.data
    with pytest.raises(AttributeError):
        get(cfg, "data.nope")
