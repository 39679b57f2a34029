"""The weight average (`train.ema_decay`): the hand-computed average over steps, with locked towers, a state that
round-trips and refuses other parameters, and 2 processes giving the average of 1."""

import os

import pytest
import torch

from mmcl.config import LossConfig, OptimConfig, load_config
from mmcl.training.ema import WeightEMA
from mmcl.training.optim import build_optimizer
from mmcl.training.step import apply_update, backward, forward_loss
from mmcl.training.step import objective_from_config as build_objective

from helpers import fake_batch, micro_model
from spawned import end_worker, spawn
from spawned import free_port as _free_port


def train_steps(model, acc, batches, ema=None, optim=None):
    """Plain optimiser steps (AdamW, the run's groups) over `batches`; the weights after each step (float64)."""
    objective = build_objective(LossConfig())
    optimizer = build_optimizer(acc.unwrap_model(model), optim or OptimConfig(lr=1e-2, warmup_steps=0))
    raw = acc.unwrap_model(model)
    seen = []
    for b in batches:
        loss, _, cache = forward_loss(model, objective, [b], acc)
        backward(acc, model, loss, [b], cache)
        apply_update(acc, model, raw, optimizer, 1.0, 4.6)
        if ema is not None:
            ema.update(raw)
        seen.append({n: p.detach().double().clone() for n, p in raw.named_parameters()})
    return seen


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
    end_worker()


@pytest.mark.slow
def test_ema_two_processes_equal_one_process(tmp_path):
    from accelerate import Accelerator

    out = tmp_path / "ema.pt"
    spawn(_ema_ddp_worker, args=(2, _free_port(), str(out)), nprocs=2)
    ddp = torch.load(out)["shadow"]

    acc = Accelerator(cpu=True)
    model = micro_model(0)
    ema = WeightEMA(model, 0.6)
    train_steps(model, acc, [fake_batch(12, seed=s) for s in (1, 2, 3)], ema, ADAM_DDP)
    assert ddp.keys() == ema.shadow.keys()
    for n in ddp:  # float32 summation order differs across the all-gather and all-reduce
        torch.testing.assert_close(ddp[n], ema.shadow[n], rtol=1e-4, atol=2e-6, msg=n)
