"""`Step`, one optimiser step top to bottom: what it returns, the finite-loss decision on the host and on the
device, and accumulation against the single large batch, each checked against a reference computed here."""

import copy
from pathlib import Path

import pytest
import torch

from mmcl.config import LossConfig, ShortCaptionConfig, load_config
from mmcl.training import optim
from mmcl.training.step import FiniteChecks, Step, agree_on_step, objective_from_config

from helpers import fake_batch, micro_model


def _step(model, fused: bool, **kw):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1) if kw.pop("sgd", False)
                 else torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused))
    model, optimizer = acc.prepare(model, optimizer)
    return Step(acc, model, acc.unwrap_model(model), optimizer, objective_from_config(kw.pop("loss", LossConfig())),
                grad_clip=kw.pop("grad_clip", 1.0), max_logit_scale=4.6052, **kw), model


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _nan_loss(monkeypatch):
    import mmcl.training.step as step_mod

    real = step_mod.forward_loss

    def poisoned(*args):
        loss, terms, cache = real(*args)
        return loss * float("nan"), terms, cache

    monkeypatch.setattr(step_mod, "forward_loss", poisoned)


@pytest.mark.parametrize("fused", [True, False], ids=["device-decision", "host-decision"])
def test_a_finite_step_updates_the_weights_and_reports_what_it_measured(fused):
    step, model = _step(micro_model(), fused)
    assert step.checks.on_device == fused
    before = _weights(model)
    result = step([fake_batch(8, seed=1)], 1, True)
    assert result.applied and torch.isfinite(result.loss) and result.grad_norm is not None
    assert result.stop is (None if fused else False)  # the host's all-reduce also agrees on a stop signal
    assert any(not torch.equal(before[k], v) for k, v in _weights(model).items())
    assert float(step.raw_model.logit_scale.detach().exp()) <= 100.0 + 1e-3  # the clamp ran


@pytest.mark.parametrize("fused", [True, False], ids=["device-decision", "host-decision"])
def test_a_non_finite_loss_leaves_weights_and_optimiser_state_untouched(fused, monkeypatch):
    step, model = _step(micro_model(), fused)
    step([fake_batch(8, seed=1)], 1, False)  # one real step: the optimiser has state
    before, state = _weights(model), copy.deepcopy(step.optimizer.optimizer.state_dict()["state"])
    _nan_loss(monkeypatch)
    result = step([fake_batch(8, seed=2)], 2, False)
    assert result.applied == fused  # the device path runs the update, which the optimiser itself skips
    for k, v in _weights(model).items():
        assert torch.equal(before[k], v), k
    after = step.optimizer.optimizer.state_dict()["state"]
    for i in state:
        for name in state[i]:
            assert torch.equal(torch.as_tensor(state[i][name]), torch.as_tensor(after[i][name])), (i, name)
    if fused:
        assert step.checks.resolve() == [(2, pytest.approx(float("nan"), nan_ok=True))]
        assert step.checks.resolve() == []  # read once


def test_the_ema_does_not_move_on_a_step_the_device_skipped(monkeypatch):
    from mmcl.training.ema import WeightEMA

    model = micro_model()
    ema = WeightEMA(model, 0.5)
    step, model = _step(model, True, ema=ema)
    step([fake_batch(8, seed=1)], 1, False)
    moved = {k: v.clone() for k, v in ema.state_dict().items() if torch.is_tensor(v)}
    _nan_loss(monkeypatch)
    step([fake_batch(8, seed=2)], 2, False)
    for k, v in ema.state_dict().items():
        if torch.is_tensor(v) and v.is_floating_point():
            assert torch.equal(moved[k], v), k


def test_two_micro_batches_make_the_update_of_the_one_large_batch():
    big = fake_batch(12, seed=3)
    halves = [{k: v[:6] for k, v in big.items()}, {k: v[6:] for k, v in big.items()}]
    # SGD: the update is the gradient itself (AdamW's first step is about lr * sign(g), which float32 noise in a
    # near-zero gradient can flip).
    one, _ = _step(micro_model(), False, grad_clip=None, sgd=True)
    two, _ = _step(micro_model(), False, grad_clip=None, sgd=True)
    a, b = one([big], 1, True), two(halves, 1, True)
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-5)
    wa, wb = _weights(one.raw_model), _weights(two.raw_model)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-6)


def test_the_host_decision_agrees_on_finiteness_and_a_stop_signal():
    from types import SimpleNamespace

    acc = SimpleNamespace(num_processes=1)
    assert agree_on_step(acc, torch.tensor(1.0), False) == (True, False)
    assert agree_on_step(acc, torch.tensor(float("inf")), True) == (False, True)


def test_the_device_flag_is_exactly_zero_or_one():
    from types import SimpleNamespace

    checks = FiniteChecks(SimpleNamespace(num_processes=1, scaler=None),
                          torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], fused=True))
    assert checks.on_device and optim.takes_found_inf(checks.inner)
    assert float(checks.arm(torch.tensor(float("nan")), 1)) == 1.0
    assert float(checks.arm(torch.tensor(2.0), 2)) == 0.0
    assert [s for s, _ in checks.resolve()] == [1]


def test_the_host_decision_reads_a_stop_signal_that_came_during_the_forward(monkeypatch):
    """A signal during the forward (its handler sets the flag) stops the run after this step, not the next."""
    import mmcl.training.step as step_mod

    step, _ = _step(micro_model(), False)
    flag, real = [False], step_mod.forward_loss

    def signalled(*args):
        out = real(*args)
        flag[0] = True  # as StopSignals' handler does
        return out

    monkeypatch.setattr(step_mod, "forward_loss", signalled)
    assert step([fake_batch(8, seed=1)], 1, False, lambda: flag[0]).stop is True


def _with_negatives(batch, seed, k=3):
    """`batch` with negative captions (data.negatives = k): 0..k per sample, their tokens in slot order."""
    g = torch.Generator().manual_seed(seed)
    n, context = batch["text"].shape
    counts = torch.arange(n) % (k + 1)
    valid = torch.arange(k)[None, :] < counts[:, None]
    return dict(batch, negatives_valid=valid,
                negatives=torch.randint(1, 1000, (int(valid.sum()), context), generator=g))


def test_a_step_scores_each_samples_negative_captions_against_its_own_image():
    """The forward encodes the real negatives with the captions; the loss is the objective's on the features the
    model gives each of them separately."""
    from accelerate import Accelerator

    from mmcl.losses import DataNegatives
    from mmcl.training.step import forward_loss

    model = micro_model()
    batch = _with_negatives(fake_batch(8, seed=4), seed=5)
    objective = objective_from_config(LossConfig())
    loss, _, _ = forward_loss(model, objective, [batch], Accelerator(cpu=True), with_metrics=False)
    with torch.no_grad():
        out = model(batch["image"], batch["text"])
        neg = model(batch["image"], batch["negatives"])["text_features"]
    slots = torch.zeros(batch["negatives_valid"].numel(), neg.shape[1])
    slots[batch["negatives_valid"].reshape(-1)] = neg
    want, _ = objective(out["image_features"], out["text_features"], out["logit_scale"], with_metrics=False,
                        negatives=DataNegatives(slots.reshape(8, 3, -1), batch["negatives_valid"]))
    without, _, _ = forward_loss(model, objective, [fake_batch(8, seed=4)], Accelerator(cpu=True),
                                 with_metrics=False)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert loss.item() > without.item() + 1e-3  # the negatives are in it


def test_two_micro_batches_with_negatives_make_the_update_of_the_one_large_batch():
    big = _with_negatives(fake_batch(12, seed=3), seed=6)
    counts = big["negatives_valid"].sum(1)
    first = int(counts[:6].sum())
    halves = [dict({k: v[:6] for k, v in big.items() if k != "negatives"}, negatives=big["negatives"][:first]),
              dict({k: v[6:] for k, v in big.items() if k != "negatives"}, negatives=big["negatives"][first:])]
    one, _ = _step(micro_model(), False, grad_clip=None, sgd=True)
    two, _ = _step(micro_model(), False, grad_clip=None, sgd=True)
    a, b = one([big], 1, True), two(halves, 1, True)
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-5)
    wa, wb = _weights(one.raw_model), _weights(two.raw_model)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-6)


SHORT = LossConfig(short_caption=ShortCaptionConfig(weight=0.5, components=3))


def _with_short_captions(batch, seed):
    """`batch` with each image's short caption (loss.short_caption), as the data layer gives them."""
    g = torch.Generator().manual_seed(seed)
    return dict(batch, short_text=torch.randint(1, 1000, batch["text"].shape, generator=g))


def test_a_step_scores_the_short_captions_against_the_images_principal_components():
    """The forward encodes the short captions with the captions and the negatives, in one text forward; the loss is
    the objective's on the features the model gives each of them separately."""
    from accelerate import Accelerator

    from mmcl.losses import DataNegatives
    from mmcl.training.step import forward_loss

    model = micro_model()
    batch = _with_short_captions(_with_negatives(fake_batch(8, seed=4), seed=5), seed=7)
    objective = objective_from_config(SHORT)
    loss, terms, _ = forward_loss(model, objective, [batch], Accelerator(cpu=True), with_metrics=False)
    with torch.no_grad():
        out = model(batch["image"], batch["text"])
        neg = model(batch["image"], batch["negatives"])["text_features"]
        short = model(batch["image"], batch["short_text"])["text_features"]
    slots = torch.zeros(batch["negatives_valid"].numel(), neg.shape[1])
    slots[batch["negatives_valid"].reshape(-1)] = neg
    want, want_terms = objective(out["image_features"], out["text_features"], out["logit_scale"], with_metrics=False,
                                 negatives=DataNegatives(slots.reshape(8, 3, -1), batch["negatives_valid"]),
                                 short_text=short)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert terms["loss/short_caption"].item() == pytest.approx(want_terms["loss/short_caption"].item(), rel=1e-5)


def test_two_micro_batches_with_short_captions_make_the_update_of_the_one_large_batch():
    """GradCache holds the short captions' features as leaves like the captions': the principal directions are the
    whole step's batch's, and the update is the large batch's."""
    big = _with_short_captions(_with_negatives(fake_batch(12, seed=3), seed=6), seed=8)
    first = int(big["negatives_valid"][:6].sum())
    halves = [dict({k: v[:6] for k, v in big.items() if k != "negatives"}, negatives=big["negatives"][:first]),
              dict({k: v[6:] for k, v in big.items() if k != "negatives"}, negatives=big["negatives"][first:])]
    one, _ = _step(micro_model(), False, grad_clip=None, sgd=True, loss=SHORT)
    two, _ = _step(micro_model(), False, grad_clip=None, sgd=True, loss=SHORT)
    a, b = one([big], 1, True), two(halves, 1, True)
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-5)
    assert b.terms["loss/short_caption"] == pytest.approx(a.terms["loss/short_caption"], rel=1e-5)
    wa, wb = _weights(one.raw_model), _weights(two.raw_model)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-6)


def test_the_validation_objective_leaves_out_the_terms_scored_on_training_views():
    """SigLIP 2's self-distillation and masked prediction read crops, masks and a teacher that only a training step
    makes: the validation loss's objective has them at weight 0 and keeps every other term (the captioning one)."""
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "siglip2.yaml"), []).loss
    train, val = objective_from_config(cfg), objective_from_config(cfg, validation=True)
    assert {"siglip", "caption", "self_distill", "masked"} <= set(train.active_terms())
    assert set(val.active_terms()) == set(train.active_terms()) - {"self_distill", "masked"}
    assert val.weights["caption"] == train.weights["caption"] > 0
