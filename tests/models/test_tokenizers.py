"""Tokenizers exactly as open_clip's: a model config's ``tokenizer_kwargs`` and ``tokenizer_mode`` reach the
tokenizer, so the token ids equal ``open_clip.get_tokenizer(name)``'s for every open_clip config that sets them.

Nothing is downloaded: a Hugging Face cache is built in the test (the layout huggingface_hub reads) holding a real
tokenizer under each config's ``hf_tokenizer_name``, and both sides read it offline.
"""

import json

import huggingface_hub
import open_clip
import pytest
import torch

from mmcl import models
from mmcl.config import ModelConfig, TextTowerConfig
from mmcl.errors import ConfigError

from helpers import hf_snapshot, varied_captions


def _configs_with_tokenizer_kwargs():
    names = []
    for name in open_clip.list_models():
        text_cfg = (open_clip.get_model_config(name) or {}).get("text_cfg", {})
        if "tokenizer_kwargs" in text_cfg or "tokenizer_mode" in text_cfg:
            names.append(name)
    return names


KWARG_CONFIGS = _configs_with_tokenizer_kwargs()


def _text_cfg(name):
    return open_clip.get_model_config(name)["text_cfg"]


def _group_key(name):
    """The settings that decide the ids (all configs' tokenizers are the same files in the test cache)."""
    t = _text_cfg(name)
    return json.dumps([t.get("tokenizer_kwargs"), t.get("tokenizer_mode"), t.get("context_length")], sort_keys=True)


# One representative config per distinct tokenizer setting gets the full caption set; every config gets a cheap check.
GROUPS = {}
for _name in KWARG_CONFIGS:
    GROUPS.setdefault(_group_key(_name), _name)


CAPTIONS = varied_captions()


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory, tokenizer_dir):
    """A Hugging Face hub cache (models--ORG--NAME/snapshots/<commit>/..., refs/main) holding the MiniLM tokenizer
    under every ``hf_tokenizer_name`` the configs name, read offline by open_clip and mmcl alike."""
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    repos = sorted({_text_cfg(name)["hf_tokenizer_name"] for name in KWARG_CONFIGS})
    for repo in repos:
        hf_snapshot(cache, repo, {f: tokenizer_dir / f for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                                                 "special_tokens_map.json", "config.json")})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_HUB_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        # huggingface_hub reads these at import; the functions look them up on the module at call time.
        mp.setattr(huggingface_hub.constants, "HF_HOME", str(home))
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        for repo in repos:  # the cache is what the libraries resolve, not some other copy
            found = huggingface_hub.try_to_load_from_cache(repo, "tokenizer.json")
            assert isinstance(found, str) and found.startswith(str(cache)), (repo, found)
        yield cache


def test_every_open_clip_config_with_tokenizer_kwargs_is_covered():
    # open_clip 3.x ships 34 (SigLIP/SigLIP 2: clean=canonicalize; BERT text towers: strip_sep_token).
    assert len(KWARG_CONFIGS) >= 30, KWARG_CONFIGS
    assert all(_text_cfg(name).get("hf_tokenizer_name") for name in KWARG_CONFIGS)
    kwargs = [_text_cfg(name).get("tokenizer_kwargs", {}) for name in KWARG_CONFIGS]
    assert any(k.get("clean") == "canonicalize" for k in kwargs) and any(k.get("strip_sep_token") for k in kwargs)
    assert set(GROUPS.values()) <= set(KWARG_CONFIGS) and len(GROUPS) >= 2


@pytest.mark.parametrize("name", sorted(GROUPS.values()))
def test_token_ids_equal_open_clip_on_500_captions(tokenizer_cache, name):
    ours = models.build_tokenizer(models.named_config(name))
    theirs = open_clip.get_tokenizer(name)
    got, want = ours(CAPTIONS), theirs(CAPTIONS)
    assert got.dtype == torch.long and got.shape == (len(CAPTIONS), _text_cfg(name)["context_length"])
    mismatched = [CAPTIONS[i] for i in range(len(CAPTIONS)) if not torch.equal(got[i], want[i])]
    assert not mismatched, f"{len(mismatched)} captions tokenized differently, e.g. {mismatched[:3]}"
    # The kwargs matter for these captions: without them the ids differ (so the comparison can fail).
    t = _text_cfg(name)
    plain = open_clip.tokenizer.HFTokenizer(t["hf_tokenizer_name"], context_length=t["context_length"])(CAPTIONS)
    assert (plain != want).any(dim=1).sum() > 50


def test_every_config_name_matches_open_clip(tokenizer_cache):
    """Every config, not only one per setting: a cheap check on a few captions (each builds its own tokenizer)."""
    few = CAPTIONS[:8] + ["Tom &amp; Jerry, Esq.!", "It's Café-Time... (really)?"]
    for name in KWARG_CONFIGS:
        ours = models.build_tokenizer(models.named_config(name))
        theirs = open_clip.get_tokenizer(name)
        assert torch.equal(ours(few), theirs(few)), name
        assert ours.context_length == theirs.context_length, name
        assert ours.strip_sep_token == theirs.strip_sep_token, name
        assert ours.clean_fn is theirs.clean_fn, name


def test_saved_model_directory_keeps_the_kwargs(tokenizer_cache, tokenizer_dir):
    """A saved model reads its tokenizer files from its own directory, with the kwargs of its saved config."""
    name = next(n for n in KWARG_CONFIGS if _text_cfg(n).get("tokenizer_kwargs", {}).get("clean") == "canonicalize")
    ours = models.build_tokenizer(models.named_config(name), source_dir=str(tokenizer_dir))
    assert torch.equal(ours(CAPTIONS[:100]), open_clip.get_tokenizer(name)(CAPTIONS[:100]))


def test_replaced_text_tower_drops_the_named_configs_tokenizer_settings(tokenizer_dir):
    """`model.text.hf` brings its own tokenizer: SigLIP's canonicalize does not carry over to it."""
    name = next(n for n in KWARG_CONFIGS if _text_cfg(n).get("tokenizer_kwargs", {}).get("clean") == "canonicalize")
    cfg = models.resolve_model_config(ModelConfig(name=name, text=TextTowerConfig(hf=str(tokenizer_dir))))
    assert "tokenizer_kwargs" not in cfg["text_cfg"]
    # Set explicitly, they apply.
    cfg = models.resolve_model_config(ModelConfig(name=name, text=TextTowerConfig(hf=str(tokenizer_dir)),
                                                  text_cfg={"tokenizer_kwargs": {"strip_sep_token": True}}))
    tok = models.build_tokenizer(cfg)
    assert tok.strip_sep_token and not (tok(["a photo of a dog"]) == tok.tokenizer.sep_token_id).any()


def test_bad_tokenizer_kwargs_are_one_line_config_errors(tokenizer_dir):
    cfg = {"text_cfg": {"hf_tokenizer_name": str(tokenizer_dir), "tokenizer_kwargs": {"clean": "bogus"}}}
    with pytest.raises(ConfigError, match="tokenizer_kwargs"):
        models.build_tokenizer(cfg)
    with pytest.raises(ConfigError, match="tokenizer_kwargs"):
        models.build_tokenizer({"text_cfg": {"tokenizer_kwargs": {"no_such_option": 1}}})
