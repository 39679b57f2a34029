"""Facts the config shares with the code that acts on them, each written once: the loss terms (the losses' list),
the tracker names, the prompt-template names, and the tree of sections (read from the dataclasses)."""

import dataclasses

import open_clip
import pytest

from mmcl import data, losses
from mmcl.config import TRACKERS, TrainConfig, from_dict, get, load_config, term_keys, valid_keys, validate
from mmcl.errors import ConfigError
from mmcl.evaluation import evaluate
from mmcl.run import records as tracking


def _with(values):
    """A config with the dotted ``key: value`` pairs of `values` set."""
    tree = {}
    for key, value in values.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return from_dict(tree)


def test_every_loss_term_has_one_weight_key_and_counts_as_active():
    keys = term_keys()
    assert list(keys) == list(losses.TERMS)
    assert keys["mochi"] == "loss.mochi.weight" and keys["clip"] == "loss.clip"
    assert set(keys.values()) <= set(valid_keys())
    for name, key in keys.items():
        # Only this term weighs anything: the config must not call that "no loss term is active".
        cfg = _with({**{k: 0.0 for k in keys.values()}, key: 0.5})
        assert get(cfg, key) == 0.5
        assert not any("no loss term" in p for p in validate(cfg)), name
        with pytest.raises(ConfigError, match=f"{key} must be >= 0"):
            load_config(None, [f"{key}=-1"])
    assert any("no loss term" in p for p in validate(_with({k: 0.0 for k in keys.values()})))


def test_tracker_names_are_checked_once_by_the_config():
    for name in TRACKERS:
        assert not any("log_with" in p for p in validate(dataclasses.replace(
            TrainConfig(), train=dataclasses.replace(TrainConfig().train, log_with=[name]))))
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) 'tensorbored' \(choose from tensorboard, wandb"):
        load_config(None, ["train.log_with=[tensorbored]"])
    # The tracker module only says which of the (valid) names lack their package.
    assert tracking.check(["tensorboard"]) == []


@pytest.mark.parametrize("alias", sorted(evaluate.TEMPLATE_ALIASES))
def test_template_aliases_name_open_clip_sets(alias):
    full = evaluate.TEMPLATE_ALIASES[alias]
    assert full in evaluate.TEMPLATE_SETS
    got = evaluate.load_templates(alias)
    assert got == evaluate.load_templates(full) == list(getattr(open_clip, evaluate.TEMPLATE_SETS[full]))
    assert evaluate.is_template_name_or_text(alias) and evaluate.is_template_name_or_text(full)


def test_template_names_and_files_are_told_apart(tmp_path):
    assert evaluate.is_template_name_or_text(evaluate.AUTO_TEMPLATES)
    path = tmp_path / "t.txt"
    path.write_text("a photo of a {}.\n")
    assert not evaluate.is_template_name_or_text(str(path))
    assert evaluate.load_templates(str(path)) == ["a photo of a {}."]
    with pytest.raises(Exception, match="unknown templates 'imagenett'.*openai_imagenet_template, "
                                        "simple_imagenet_template"):
        evaluate.load_templates("imagenett")


def test_the_section_tree_is_read_from_the_dataclasses():
    keys = valid_keys()
    for section in ("model", "model.text", "data", "loss", "loss.mochi", "optim", "train", "eval", "distill"):
        assert section in keys
    assert "model.text.hf" in keys and "loss.mochi.queue_size" in keys


def test_decode_sample_lives_with_decoding_and_stays_exported():
    from mmcl.data import decode

    assert data.decode_sample is decode.decode_sample
    assert data.pil_to_uint8 is decode.pil_to_uint8
