"""Towers at other input sizes (mmcl/models/resize.py): the grid resize is open_clip's `resize_pos_embed`, a tower
that follows its input's size equals the model built at that size from the same weights, and `at_size` keeps every
other parameter."""

import copy
import json

import pytest
import torch
from open_clip.model import resize_pos_embed

from mmcl import models
from mmcl.errors import ConfigError
from mmcl.models import resize


@pytest.fixture(scope="module")
def tiny():
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)  # patch 8: a 4 x 4 grid
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    return models.create(cfg).eval(), cfg


@pytest.mark.parametrize("grid", [(2, 2), (6, 6), (3, 5)])
def test_the_grid_resize_is_open_clips_resize_pos_embed(tiny, grid):
    model, cfg = tiny
    pos = model.visual.positional_embedding.detach()
    got = resize.resize_grid_embedding(pos, grid)
    assert got.shape == (1 + grid[0] * grid[1], pos.shape[1]) and torch.equal(got[0], pos[0])
    target = copy.deepcopy(model)
    target.visual.grid_size = grid
    state = {"visual.positional_embedding": pos.clone()}
    resize_pos_embed(state, target, interpolation="bicubic", antialias=True)
    assert torch.equal(got, state["visual.positional_embedding"])
    assert resize.resize_grid_embedding(pos, (4, 4)) is pos
    with pytest.raises(ValueError, match="not a square grid"):
        resize.resize_grid_embedding(pos[:-1], grid)


def test_full_sizes_reads_image_patch_and_context():
    assert resize.full_sizes({"vision_cfg": {"image_size": [64, 64], "patch_size": (8, 8)},
                              "text_cfg": {"context_length": 32}}) == (64, 8, 32)
    assert resize.full_sizes({"vision_cfg": {"image_size": 224}}) == (224, None, None)
    assert resize.full_sizes({}) == (None, None, None)


def test_a_tower_following_its_input_equals_the_model_built_at_that_size(tiny):
    model, cfg = tiny
    small, small_cfg = resize.at_size(model, cfg, 16, 12)
    assert small_cfg["vision_cfg"]["image_size"] == 16 and small_cfg["text_cfg"]["context_length"] == 12
    assert cfg["vision_cfg"]["image_size"] == 32  # the model's own config is left as it was
    want, got = model.state_dict(), small.state_dict()
    assert sorted(want) == sorted(got)
    for name in want:
        if name == "visual.positional_embedding":
            assert torch.equal(got[name], resize.resize_grid_embedding(want[name], (2, 2)))
        elif name == "positional_embedding":
            assert torch.equal(got[name], want[name][:12])
        else:
            assert torch.equal(got[name], want[name]), name
    follower = copy.deepcopy(model)
    before = {k: v.clone() for k, v in follower.state_dict().items()}
    resize.follow_input_size(follower)
    resize.follow_input_size(follower)  # idempotent
    assert all(torch.equal(v, before[k]) for k, v in follower.state_dict().items())
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the same float32 operations up to their order (open_clip's forward adds the embedding its own way)
        torch.testing.assert_close(follower.encode_image(images), small.encode_image(images), rtol=1e-5, atol=1e-6)
        full = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        assert torch.equal(follower.encode_image(full), model.encode_image(full))  # at full size: the parameter
    assert resize.at_size(model, cfg, None, None) == (model, cfg)
    assert resize.at_size(model, cfg, 32, 32)[0] is model


def test_an_image_tower_without_patch_tokens_cannot_follow_its_input():
    class NoViT(torch.nn.Module):
        visual = torch.nn.Conv2d(3, 4, 3)

    assert resize.vit_tower(NoViT()) is None
    with pytest.raises(ConfigError, match="needs an open_clip ViT image tower.*Conv2d"):
        resize.follow_input_size(NoViT())
