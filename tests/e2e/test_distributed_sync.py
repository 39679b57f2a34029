"""No host sync on ordinary steps: the finite-loss decision stays on the device (the fused AdamW's found_inf) and
is read on logged and saved steps only; a skipped step leaves weights and optimiser state exactly unchanged."""

import traceback

import pytest
import torch

from mmcl.config import load_config
from mmcl.training.loop import train
from mmcl.training.optim import build_optimizer

from helpers import fake_batch, metrics, micro_model, run_args

# Every read in the training process counts, the model's forward and the objective's included; the data loader's
# worker process (which cuts the token batches, `models.TrimmedTokenizer`) is another process and is not seen.
SYNCS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__")


def test_a_flagged_step_leaves_weights_and_optimiser_state_exactly_as_they_were():
    from mmcl.config import LossConfig, OptimConfig
    from mmcl.training.step import objective_from_config as build_objective

    model = micro_model()
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    assert opt.defaults.get("fused")
    objective = build_objective(LossConfig())

    def step(seed, found_inf):
        out = model(fake_batch(8, seed)["image"], fake_batch(8, seed)["text"])
        loss, _ = objective(out["image_features"], out["text_features"], out["logit_scale"], None,
                            torch.full((8,), -1))
        loss.backward()
        opt.found_inf = torch.tensor(found_inf)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(1, 0.0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    step(2, 1.0)  # skipped: nothing may move, not even the step count
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), k
    step(3, 0.0)  # and the next step is applied
    assert any(not torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(int(s["step"]) == 2 for s in opt.state.values())


@pytest.mark.parametrize("on_device", [True, False])
def test_no_host_sync_on_steps_that_are_neither_logged_nor_saved(demo, tmp_path, monkeypatch, on_device):
    """Counts the training loop's reads of tensors on the host (`.item()`, `.tolist()`, `bool(t)`, ...) per step
    of a 1-process run with a non-finite loss on an ordinary step (skipped all the same); the host-side fallback
    (no device-side skip) shows that the counter sees them."""
    import mmcl.training.step as step_mod

    real_loss, current, syncs = step_mod.forward_loss, [0], []

    def counted_step(*a):
        current[0] += 1
        loss, terms, cache = real_loss(*a)
        if current[0] == 3:
            loss = loss * float("nan")  # the step's update must be skipped (train.nan_policy=skip)
        return loss, terms, cache

    for name in SYNCS:
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, _real=real, _name=name, **k):
            where = traceback.extract_stack(limit=2)[0]
            syncs.append((current[0], _name, f"{where.filename}:{where.lineno}"))
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    monkeypatch.setattr(step_mod, "forward_loss", counted_step)
    if not on_device:
        real_init = step_mod.FiniteChecks.__init__

        def host_only(self, *a):
            real_init(self, *a)
            self.on_device = False

        monkeypatch.setattr(step_mod.FiniteChecks, "__init__", host_only)
    out = tmp_path / "run"
    # data.workers=1: the samples are decoded in a worker process, so only the training loop is counted here.
    cfg = load_config(None, run_args(demo, out, "train.steps=8", "train.save_every=4", "train.log_every=4",
                                     "data.batch_size=4", "data.workers=1", "train.nan_policy=skip")[2:])
    train(cfg)
    monkeypatch.undo()
    ordinary = {1, 2, 3, 5, 6, 7}
    on_ordinary = [s for s in syncs if s[0] in ordinary]
    if on_device:
        assert on_ordinary == []
        assert any(s[0] == 4 for s in syncs)  # read on the logged step
    else:
        assert {s[0] for s in on_ordinary} == ordinary
    rows = metrics(out)
    assert [r["step"] for r in rows] == [4, 8] and [r["samples"] for r in rows] == [12, 28]
    state = torch.load(out / "checkpoints" / "step-00000008" / "rank_state_0.pt", weights_only=True)["progress"]
    assert state["skipped_steps"] == 1 and state["step"] == 8 and state["samples"] == 28
