"""The open_clip <-> transformers CLIP key table: both directions come from one table and undo each other."""

import json

import pytest
import torch

from mmcl import models
from mmcl.errors import CheckpointError
from mmcl.storage import hf_clip


def _tiny_state():
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=2)
    cfg["text_cfg"].update(layers=3)  # towers of different depths, so a swapped count would show
    torch.manual_seed(0)
    return models.create(cfg).state_dict()


def test_open_clip_to_hf_to_open_clip_is_the_identity():
    sd = _tiny_state()
    hf, left = hf_clip.to_hf(sd, 2, 3)
    assert left == []
    assert hf["visual_projection.weight"].shape == sd["visual.proj"].t().shape
    assert len([k for k in hf if k.startswith("text_model.encoder.layers.2.")]) == 16  # 5 pairs + q, k, v pairs
    back = hf_clip.from_hf(hf)
    weights = {k: v for k, v in sd.items() if k != "attn_mask"}  # a buffer, not a weight of either layout
    assert sorted(back) == sorted(weights)
    for key, value in weights.items():
        assert torch.equal(back[key], value), key


def test_to_hf_reports_what_it_cannot_place():
    sd = _tiny_state()
    sd["visual.extra.weight"] = torch.zeros(2)
    _, left = hf_clip.to_hf(sd, 2, 3)
    assert left == ["visual.extra.weight"]
    _, left = hf_clip.to_hf(sd, 1, 3)  # a block left out is reported, not dropped in silence
    assert "visual.transformer.resblocks.1.attn.in_proj_weight" in left


def test_from_hf_with_part_of_a_packed_projection_is_a_checkpoint_error():
    hf, _ = hf_clip.to_hf(_tiny_state(), 2, 3)
    del hf["vision_model.encoder.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(CheckpointError, match=r"in_proj_bias \(got \['q', 'v'\]"):
        hf_clip.from_hf(hf)
