"""NaFlex end to end: the step's loss over a varying number of pairs, and `mmcl train --config configs/naflex.yaml`
on the demo data, which trains, checkpoints, evaluates zero-shot, resumes exactly, exports and loads back."""

import json

import pytest
import torch
from accelerate import Accelerator

import mmcl
from mmcl import models
from mmcl.cli import main
from mmcl.config import LossConfig, ModelConfig
from mmcl.data.naflex import PATCH_KEYS, PatchNormalizer, patch_batch
from mmcl.training.step import backward, forward_loss, objective_from_config

from helpers import ROOT, final_weights, metrics

TOWER = ["model.vision_cfg={timm_model_name: naflexvit_base_patch16_siglip, timm_model_kwargs: {embed_dim: 16, "
         "depth: 1, num_heads: 2, patch_size: 8, pos_embed_grid_size: [4, 4]}}",
         "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]


def _batch(tokenizer, seed, n, seq_len):
    gen = torch.Generator().manual_seed(seed)
    images = [torch.randint(0, 255, (3, 8 * (1 + i % 2), 8 * (1 + i % 3)), generator=gen, dtype=torch.uint8)
              for i in range(n)]
    return dict(patch_batch(images, seq_len, 8), text=tokenizer([f"caption {seed} {i}" for i in range(n)]),
                label=torch.arange(n))


@pytest.mark.parametrize("term", ["clip", "siglip"])
def test_padding_to_the_capacity_gives_the_loss_and_gradients_of_the_real_pairs(term):
    torch.manual_seed(0)
    model, _, _, _, _, tokenizer = models.build(ModelConfig(name="tiny", vision_cfg={
        "timm_model_name": "naflexvit_base_patch16_siglip",
        "timm_model_kwargs": {"embed_dim": 16, "depth": 1, "num_heads": 2, "patch_size": 8}}, init_logit_bias=-5.0))
    objective = objective_from_config(LossConfig(clip=float(term == "clip"), siglip=float(term == "siglip")))
    acc, finish = Accelerator(cpu=True), PatchNormalizer((0.5,) * 3, (0.5,) * 3)
    batches = [_batch(tokenizer, 0, 5, 6), _batch(tokenizer, 1, 3, 9)]  # two micro-batches of 5 and 3 pairs
    results = []
    for capacity in (None, 7):  # unpadded (the fixed-size path) and padded to 7 pairs per micro-batch
        model.zero_grad()
        loss, _, cache = forward_loss(model, objective, batches, acc, finish, capacity=capacity)
        backward(acc, model, loss, batches, cache, finish)
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys() and any(k.startswith("visual.trunk") for k in grads_a)
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], atol=1e-5, rtol=1e-4)  # float32 sums in another order
    assert set(PATCH_KEYS) <= set(batches[0])


def _args(demo, out, *extra):
    return ["train", "--config", str(ROOT / "configs" / "naflex.yaml"), f"data.train={demo['train']}",
            f"train.output_dir={out}", "train.progress=false", "train.plot=false", "train.log_with=[]",
            "data.workers=0", "data.shuffle_buffer=64", "train.log_every=1", "train.save_every=2",
            "optim.schedule=constant", "optim.warmup_steps=0", *TOWER, *extra]


@pytest.mark.slow
def test_naflex_demo_trains_evaluates_resumes_exactly_exports_and_reloads(demo, tmp_path, capsys):
    zeroshot = f"eval.zeroshot={demo['zeroshot_colour']}"
    assert main(_args(demo, tmp_path / "whole", "train.steps=4", zeroshot)) == 0
    assert main(_args(demo, tmp_path / "parts", "train.steps=2", zeroshot)) == 0
    assert main(_args(demo, tmp_path / "parts", "train.steps=4", zeroshot)) == 0  # resumed from step 2
    whole, parts = final_weights(tmp_path / "whole"), final_weights(tmp_path / "parts")
    assert whole.keys() == parts.keys()
    for k in whole:
        torch.testing.assert_close(whole[k], parts[k], atol=0, rtol=0)
    records = metrics(tmp_path / "whole")
    assert [r["data/naflex_seq_len"] for r in records] == [r["data/naflex_seq_len"] for r in metrics(
        tmp_path / "parts")][-4:]
    for r in records:  # each batch filled to the budget: pairs * length <= max_tokens_per_batch
        assert r["data/naflex_pairs"] * r["data/naflex_seq_len"] <= 2048 and 0 <= r["data/naflex_padding_waste"] < 1
    assert records[-1]["samples"] == sum(r["data/naflex_pairs"] for r in records)
    assert "eval/zeroshot_classification/colour/acc1" in records[-1]
    assert (tmp_path / "whole" / "checkpoints").is_dir()
    export = tmp_path / "export"
    assert main(["export", "--model", str(tmp_path / "whole"), "--format", "safetensors", "--out", str(export)]) == 0
    assert main(["export", "--model", str(tmp_path / "whole"), "--format", "hf", "--out",
                 str(tmp_path / "hf")]) != 0
    assert "cannot carry a NaFlex image tower" in capsys.readouterr().err
    from PIL import Image

    ref_model, ref_pre, tok = mmcl.load(str(tmp_path / "whole"))
    model, pre, _ = mmcl.load(str(export))
    img = Image.new("RGB", (40, 24), (200, 30, 30))
    x = {k: v[None] for k, v in pre(img).items()}
    assert x["patches"].shape[1] == 64  # eval.naflex_seq_len of configs/naflex.yaml
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(x), ref_model.encode_image(x))
        torch.testing.assert_close(model.encode_text(tok(["red"])), ref_model.encode_text(tok(["red"])))
    assert json.loads((export / "mmcl_export.json").read_text())["min_cosine_vs_source"] > 0.9999
