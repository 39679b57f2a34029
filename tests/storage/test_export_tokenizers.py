"""The ONNX export's tokenizer.json of a model with a Hugging Face tokenizer gives open_clip's token ids: the model's
``tokenizer_kwargs`` (SigLIP's ``clean=canonicalize``, CLIPA's ``strip_sep_token``) are in the file, with the
truncation and padding, and onnx_config.json records them. Offline: the MiniLM tokenizer shipped as a test package."""

from __future__ import annotations

import json

import pytest
import torch

import mmcl
from mmcl import models
from mmcl.config import ModelConfig, TextTowerConfig
from mmcl.storage import export as export_mod
from mmcl.storage import weights

from helpers import varied_captions

CAPTIONS = varied_captions()
CONTEXT = 16


def _open_clip_ids(folder, kwargs):
    from open_clip.tokenizer import HFTokenizer

    return HFTokenizer(str(folder), context_length=CONTEXT, **kwargs)(CAPTIONS)


def _file_ids(onnx_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(onnx_dir / "tokenizer.json"))  # truncates and pads by itself
    return torch.tensor([e.ids for e in tok.encode_batch(CAPTIONS)])


def _export(tmp_path, cfg):
    model_cfg = models.resolve_model_config(cfg)
    model_cfg["vision_cfg"].update(layers=1, width=32, head_width=16, image_size=32)
    src = weights.save_model_dir(models.create(model_cfg), model_cfg, models.preprocess_config(model_cfg),
                                 tmp_path / "src")
    return src, export_mod.export(src, "onnx", tmp_path / "onnx")


@pytest.mark.parametrize("kwargs", [{"clean": "canonicalize"}, {"strip_sep_token": True},
                                    {"clean": "lower", "strip_sep_token": True}])
def test_onnx_tokenizer_of_a_siglip_like_model_gives_open_clip_ids(tmp_path, tokenizer_dir, kwargs):
    # open_clip's own text transformer with a Hugging Face tokenizer named beside it, as SigLIP's configs have it.
    cfg = ModelConfig(name="tiny", embed_dim=16, context_length=CONTEXT, text_cfg={
        "hf_tokenizer_name": str(tokenizer_dir), "tokenizer_kwargs": kwargs, "vocab_size": 30522, "width": 32,
        "heads": 2, "layers": 1})
    src, onnx_dir = _export(tmp_path, cfg)
    entry = json.loads((onnx_dir / "onnx_config.json").read_text())["tokenizer"]
    assert entry["file"] == "tokenizer.json" and entry["tokenizer_kwargs"] == kwargs and entry["not_expressed"] == []
    want = _open_clip_ids(tokenizer_dir, kwargs)
    assert torch.equal(mmcl.load(src)[2](CAPTIONS), want)  # what the model was trained with
    got = _file_ids(onnx_dir)
    assert got.shape == want.shape
    differing = [CAPTIONS[i] for i in range(len(CAPTIONS)) if not torch.equal(got[i], want[i])]
    assert differing == []


@pytest.mark.slow
def test_onnx_tokenizer_of_a_hugging_face_text_tower_applies_its_kwargs(tmp_path, tokenizer_dir):
    kwargs = {"clean": "canonicalize", "strip_sep_token": True}
    cfg = ModelConfig(name="tiny", embed_dim=16, context_length=CONTEXT, text=TextTowerConfig(hf=str(tokenizer_dir)),
                      text_cfg={"tokenizer_kwargs": kwargs})
    _, onnx_dir = _export(tmp_path, cfg)
    assert json.loads((onnx_dir / "onnx_config.json").read_text())["tokenizer"]["tokenizer_kwargs"] == kwargs
    assert torch.equal(_file_ids(onnx_dir), _open_clip_ids(tokenizer_dir, kwargs))
