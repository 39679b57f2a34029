"""NaFlex image towers: timm's NaFlexVit in an open_clip CLIP beside mmcl's text towers (mmcl.models.naflex)."""

import pytest
import timm
import torch

from mmcl import models
from mmcl.config import ModelConfig
from mmcl.data.naflex import patch_batch
from mmcl.errors import ConfigError
from mmcl.models import naflex

TINY_TOWER = {"timm_model_name": "naflexvit_base_patch16_siglip",
              "timm_model_kwargs": {"embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8,
                                    "pos_embed_grid_size": [8, 8]}}


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    return models.build(ModelConfig(name="tiny", vision_cfg=TINY_TOWER))


def test_is_naflex_names_the_tower_in_a_model_a_config_and_a_name(built):
    model, model_cfg = built[0], built[1]
    assert models.is_naflex(model) and models.is_naflex(model_cfg)
    assert models.is_naflex("naflexvit_base_patch16_siglip")
    assert not models.is_naflex("vit_base_patch16_224") and not models.is_naflex({"vision_cfg": {"layers": 2}})
    assert not models.is_naflex(models.create(models.named_config("tiny")))
    # open_clip's TimmModel layout: trunk and head
    keys = model.state_dict()
    assert "visual.head.proj.weight" in keys and any(k.startswith("visual.trunk.blocks.1.") for k in keys)
    assert naflex.patch_size_of(model) == 8 == built[2]["patch_size"]


@pytest.mark.parametrize("grid_sample", [False, True])
def test_padded_batch_embeds_each_image_as_it_does_alone(built, grid_sample):
    model = built[0].eval()
    model.visual.trunk.embeds.pos_embed_use_grid_sample = grid_sample
    gen = torch.Generator().manual_seed(0)
    images = [torch.randn(3, 8 * h, 8 * w, generator=gen) for h, w in ((2, 3), (4, 1), (3, 3))]
    with torch.no_grad():
        together = model.encode_image(patch_batch(images, 16, 8))
        alone = torch.cat([model.encode_image(patch_batch([im], h * w, 8))
                           for im, (h, w) in zip(images, ((2, 3), (4, 1), (3, 3)))])
    assert together.shape == (3, 128)
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)


def test_training_forward_with_the_text_tower_and_gradients_reach_the_tower(built):
    model, tokenizer = built[0].train(), built[5]
    gen = torch.Generator().manual_seed(1)
    batch = patch_batch([torch.randn(3, 16, 24, generator=gen), torch.randn(3, 8, 8, generator=gen)], 8, 8)
    out = model(batch, tokenizer(["a red circle", "a blue square"]))
    assert out["image_features"].shape == out["text_features"].shape == (2, 128)
    out["image_features"].sum().backward()
    assert model.visual.trunk.embeds.proj.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_an_image_tensor_and_other_export_formats_are_refused_in_one_line(built):
    model, model_cfg = built[0], built[1]
    with pytest.raises(ConfigError, match="patch dict"):
        model.encode_image(torch.zeros(1, 3, 16, 16))
    with pytest.raises(ConfigError, match="--format onnx cannot carry a NaFlex image tower"):
        naflex.check_export_format(model_cfg, "onnx")
    naflex.check_export_format(model_cfg, "safetensors")
    naflex.check_export_format(models.named_config("tiny"), "hf")  # other towers: unaffected


def test_config_patch_size_reads_kwargs_or_the_named_tower():
    assert naflex.config_patch_size({"vision_cfg": TINY_TOWER}) == 8
    assert naflex.config_patch_size({"vision_cfg": {"timm_model_name": "naflexvit_base_patch16_siglip"}}) == 16


def test_sampled_position_embeddings_read_nothing_on_the_host():
    from syncwatch import SyncWatch

    images = [torch.randn(3, 8 * h, 8 * w) for h, w in ((2, 3), (4, 1), (3, 3))]
    counts = {}
    for grid_sample in (False, True):
        tower = timm.create_model("naflexvit_base_patch16_siglip", embed_dim=16, depth=1, num_heads=2, patch_size=8,
                                  num_classes=0, pos_embed_use_grid_sample=grid_sample)
        with SyncWatch() as watch:
            tower(patch_batch(images, 16, 8)).sum().backward()
        counts[grid_sample] = watch.count
    # timm's default resizes the table per image from its grid, read on the host (two reads an image); sampled per
    # patch (configs/naflex.yaml) a step reads nothing
    assert counts == {False: 2 * len(images), True: 0}
