"""Training runtime: learning, exact resume after SIGKILL, atomic checkpoints, accumulation, NaN handling,
multi-process equality."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmcl import models
from mmcl.config import LossConfig, ModelConfig, OptimConfig, load_config
from mmcl.errors import TrainingError
from mmcl.losses import build_objective
from mmcl.train import (TrainProgress, latest_checkpoint, list_checkpoints, lr_at, param_groups, train,
                        train_step)

ROOT = Path(__file__).resolve().parents[1]
# A smaller tower than configs/tiny.yaml so each step takes milliseconds on a busy 2-core machine.
MICRO = ["model.vision_cfg={layers: 2, width: 64, head_width: 32}",
         "model.text_cfg={layers: 2, width: 64, heads: 2}", "model.embed_dim=32"]


def micro_model(seed=0):
    torch.manual_seed(seed)
    cfg = load_config(None, MICRO).model
    model, *_ = models.build(cfg)
    return model


def fake_batch(n, seed, image_size=64, context=32):
    g = torch.Generator().manual_seed(seed)
    return {"image": torch.randn(n, 3, image_size, image_size, generator=g),
            "text": torch.randint(1, 1000, (n, context), generator=g),
            "label": torch.full((n,), -1, dtype=torch.long)}


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------------------- unit pieces
def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr=0.1)
    lrs = [lr_at(s, cfg, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lr_at(20, cfg, 20) == pytest.approx(0.1)
    assert lr_at(12, cfg, 20) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_no_weight_decay_on_gains_biases_and_logit_scale():
    model = micro_model()
    decay, no_decay = param_groups(model, 0.2)
    names = {id(p): n for n, p in model.named_parameters()}
    assert "logit_scale" in [names[id(p)] for p in no_decay["params"]]
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim < 2 or "logit" in names[id(p)] or names[id(p)].endswith(".bias") for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.2


def test_accumulation_equals_the_large_batch():
    """GradCache accumulation: 2 micro-batches of 6 give the loss and gradients of one batch of 12."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    objective = build_objective(LossConfig())
    big = fake_batch(12, seed=1)
    halves = [{k: v[:6] for k, v in big.items()}, {k: v[6:] for k, v in big.items()}]

    model = micro_model()
    loss_big, _, backward = train_step(model, objective, [big], acc)
    backward()
    g_big = grads_of(model)

    model = micro_model()
    loss_acc, _, backward = train_step(model, objective, halves, acc)
    backward()
    g_acc = grads_of(model)

    # float32 reductions run in a different order (two forwards of 6 vs one of 12): agreement to ~1e-6 relative.
    assert loss_acc.item() == pytest.approx(loss_big.item(), rel=1e-5)
    assert g_big.keys() == g_acc.keys() and "logit_scale" in g_big
    for name in g_big:
        torch.testing.assert_close(g_acc[name], g_big[name], rtol=1e-4, atol=1e-6, msg=name)


def _ddp_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    objective = build_objective(LossConfig())
    model = acc.prepare(micro_model())
    big = fake_batch(12, seed=1)
    n = 12 // world
    local = {k: v[rank * n:(rank + 1) * n] for k, v in big.items()}
    loss, terms, backward = train_step(model, objective, [local], acc)
    backward()
    if rank == 0:
        torch.save({"loss": terms["loss/clip"], "grads": grads_of(acc.unwrap_model(model))}, out_path)
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_process_with_the_global_batch(tmp_path):
    from accelerate import Accelerator

    out = tmp_path / "ddp.pt"
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    ddp = torch.load(out)

    acc = Accelerator(cpu=True)
    model = micro_model()
    _, terms, backward = train_step(model, build_objective(LossConfig()), [fake_batch(12, seed=1)], acc)
    backward()
    single = grads_of(model)
    # Same math, different float32 summation order across the all-gather: agreement to ~1e-6 relative.
    assert ddp["loss"] == pytest.approx(terms["loss/clip"], rel=1e-5)
    assert single.keys() == ddp["grads"].keys()
    for name in single:
        torch.testing.assert_close(ddp["grads"][name], single[name], rtol=1e-4, atol=1e-6, msg=name)
