"""Training recipes: EMA of the weights, per-tower and layer-wise learning rates, FLIP patch dropout."""

import os

import pytest
import torch

from mmcl import models
from mmcl.config import LossConfig, OptimConfig, load_config
from mmcl.ema import WeightEMA
from mmcl.losses import build_objective
from mmcl.train import apply_update, build_optimizer, train_step

from test_train import MICRO, _free_port, fake_batch


def micro_model(seed=0, *extra):
    torch.manual_seed(seed)
    cfg = load_config(None, [*MICRO, *extra]).model
    model, *_ = models.build(cfg)
    models.apply_locks(model, cfg)
    return model


def train_steps(model, acc, batches, ema=None, optim=None):
    """Plain optimiser steps (AdamW, the run's groups) over `batches`; the weights after each step (float64)."""
    objective = build_objective(LossConfig())
    optimizer = build_optimizer(acc.unwrap_model(model), optim or OptimConfig(lr=1e-2, warmup_steps=0))
    raw = acc.unwrap_model(model)
    seen = []
    for b in batches:
        _, _, backward = train_step(model, objective, [b], acc)
        backward()
        apply_update(acc, model, raw, optimizer, 1.0, 4.6)
        if ema is not None:
            ema.update(raw)
        seen.append({n: p.detach().double().clone() for n, p in raw.named_parameters()})
    return seen


# ----------------------------------------------------------------------------------------------- EMA
def test_ema_matches_the_hand_computed_average_over_three_steps():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = micro_model(0, "model.lock_text=true")
    w0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    d = 0.7
    ema = WeightEMA(model, d)
    # Locked parameters get no average.
    assert "token_embedding.weight" not in ema.shadow and "visual.conv1.weight" in ema.shadow
    assert all(t.dtype == torch.float32 for t in ema.shadow.values())
    w1, w2, w3 = train_steps(model, acc, [fake_batch(8, seed=s) for s in (1, 2, 3)], ema)
    assert ema.updates == 3
    for n, avg in ema.shadow.items():
        expected = d ** 3 * w0[n] + d ** 2 * (1 - d) * w1[n] + d * (1 - d) * w2[n] + (1 - d) * w3[n]
        torch.testing.assert_close(avg.double(), expected, rtol=0, atol=2e-7, msg=n)
    moved = max((w3[n] - w0[n]).abs().max().item() for n in ema.shadow)
    assert moved > 1e-3  # the steps did change the weights, so the check above is not vacuous

    # swapped_in puts the average into the model and gives the trained weights back bit for bit.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped_in(model) as m:
        for n, p in m.named_parameters():
            want = ema.shadow[n] if n in ema.shadow else before[n]
            assert torch.equal(p, want), n
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_ema_state_round_trips_and_refuses_other_parameters():
    a = WeightEMA(micro_model(0), 0.9)
    a.shadow["visual.proj"].add_(1.0)
    a.updates = 5
    b = WeightEMA(micro_model(1), 0.9)
    b.load_state_dict(a.state_dict())
    assert b.updates == 5 and all(torch.equal(a.shadow[n], b.shadow[n]) for n in a.shadow)
    locked = WeightEMA(micro_model(0, "model.lock_image=true"), 0.9)
    with pytest.raises(ValueError, match="locked differently"):
        locked.load_state_dict(a.state_dict())


def test_ema_decay_is_validated():
    from mmcl.errors import ConfigError

    for bad in ("1.0", "0", "-0.5"):
        with pytest.raises(ConfigError, match="train.ema_decay must be in"):
            load_config(None, [f"train.ema_decay={bad}"])
    assert load_config(None, ["train.ema_decay=0.999"]).train.ema_decay == 0.999


# Adam divides by the gradient's running scale: a parameter whose gradient is zero in exact arithmetic (the key
# bias of attention) moves by about lr on float32 summation noise, which differs between 1 and 2 processes. A
# larger eps keeps such noise from being amplified, so the comparison below can be tight.
ADAM_DDP = OptimConfig(lr=1e-2, warmup_steps=0, eps=1e-3)


def _ema_ddp_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    raw = micro_model(0)
    ema = WeightEMA(raw, 0.6)
    model = acc.prepare(raw)
    n = 12 // world
    batches = [{k: v[rank * n:(rank + 1) * n] for k, v in fake_batch(12, seed=s).items()} for s in (1, 2, 3)]
    train_steps(model, acc, batches, ema, ADAM_DDP)
    if rank == 0:
        torch.save(ema.state_dict(), out_path)
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ema_two_processes_equal_one_process(tmp_path):
    from accelerate import Accelerator

    out = tmp_path / "ema.pt"
    torch.multiprocessing.spawn(_ema_ddp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    ddp = torch.load(out)["shadow"]

    acc = Accelerator(cpu=True)
    model = micro_model(0)
    ema = WeightEMA(model, 0.6)
    train_steps(model, acc, [fake_batch(12, seed=s) for s in (1, 2, 3)], ema, ADAM_DDP)
    assert ddp.keys() == ema.shadow.keys()
    for n in ddp:  # float32 summation order differs across the all-gather and all-reduce
        torch.testing.assert_close(ddp[n], ema.shadow[n], rtol=1e-4, atol=2e-6, msg=n)


# ------------------------------------------------------------------------------ per-tower and layer-wise rates
def test_learning_rates_per_group_match_hand_computed_ones():
    from mmcl.optim import param_groups, set_lr
    from mmcl.train import lr_at

    model = micro_model(0)  # 2 image blocks, 2 text blocks: layer ids 0 (embeddings), 1-2 (blocks), 3 (head)
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2, image_lr_mult=0.5, image_layer_decay=0.8,
                      text_lr_mult=2.0, text_layer_decay=0.5)
    groups = param_groups(model, cfg)
    optimizer = build_optimizer(model, cfg, groups)
    expected = {  # tower multiplier x decay ** (3 - layer id)
        "visual.conv1.weight": 0.5 * 0.8 ** 3, "visual.class_embedding": 0.5 * 0.8 ** 3,
        "visual.positional_embedding": 0.5 * 0.8 ** 3, "visual.ln_pre.weight": 0.5 * 0.8 ** 3,
        "visual.transformer.resblocks.0.attn.in_proj_weight": 0.5 * 0.8 ** 2,
        "visual.transformer.resblocks.1.mlp.c_fc.bias": 0.5 * 0.8,
        "visual.ln_post.weight": 0.5, "visual.proj": 0.5,
        "token_embedding.weight": 2.0 * 0.5 ** 3, "positional_embedding": 2.0 * 0.5 ** 3,
        "transformer.resblocks.0.ln_1.weight": 2.0 * 0.5 ** 2, "transformer.resblocks.1.attn.out_proj.weight": 1.0,
        "ln_final.bias": 2.0, "text_projection": 2.0, "logit_scale": 1.0,
    }
    # The weight-decay split is kept: 1-d tensors (gains, biases, the class embedding) and the logit scale are
    # not decayed; matrices (positional embeddings included) are.
    no_decay = {"visual.class_embedding", "visual.ln_pre.weight", "logit_scale", "visual.ln_post.weight",
                "visual.transformer.resblocks.1.mlp.c_fc.bias", "transformer.resblocks.0.ln_1.weight", "ln_final.bias"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(n for g in groups for n in g["names"]) == sorted(trainable)  # each parameter in one group
    by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    for step in (0, 1, 5, 9):  # warmup, peak, cosine decay: every group follows the schedule proportionally
        set_lr(optimizer, lr_at(step, cfg, 10))
        for name, scale in expected.items():
            g = by_param[id(named[name])]
            assert g["lr"] == pytest.approx(lr_at(step, cfg, 10) * scale, rel=1e-12), (step, name)
            assert g["weight_decay"] == (0.0 if name in no_decay else 0.1), name
    # One group per (scale, weight decay). Scales: image 0.256, 0.32, 0.4, 0.5; text 0.25, 0.5 (shared with the
    # image head), 1.0 (shared with the logit scale), 2.0: 7 scales, each with and without decay except the text
    # embeddings' 0.25 (token and positional embeddings are matrices): 13 groups.
    assert len(groups) == len({(g["lr_scale"], g["weight_decay"]) for g in groups}) == 13


def test_default_rates_keep_the_two_weight_decay_groups():
    from mmcl.optim import param_groups

    model = micro_model(0, "model.lock_text=true")
    groups = param_groups(model, OptimConfig(weight_decay=0.2))
    assert [(g["lr_scale"], g["weight_decay"]) for g in groups] == [(1.0, 0.2), (1.0, 0.0)]
    names = {n for g in groups for n in g["names"]}
    assert names == {n for n, p in model.named_parameters() if p.requires_grad}
    assert "token_embedding.weight" not in names and "transformer.resblocks.0.attn.in_proj_weight" not in names


def test_layer_decay_is_validated():
    from mmcl.errors import ConfigError

    with pytest.raises(ConfigError, match="optim.image_layer_decay must be in"):
        load_config(None, ["optim.image_layer_decay=0"])
    with pytest.raises(ConfigError, match="optim.text_lr_mult must be >= 0"):
        load_config(None, ["optim.text_lr_mult=-1"])
