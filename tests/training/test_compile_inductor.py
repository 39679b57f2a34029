"""``train.compile`` with accumulation under inductor (code generated and run on the CPU): GradCache's second
pass replays the dropout masks of its first, so its loss and gradients are those of the large batch."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmcl.config import LossConfig
from mmcl.training.step import backward, forward_loss, objective_from_config

from helpers import fake_batch, grads_of, micro_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                                   reason="inductor needs a C compiler on the CPU")]


class DropoutTowers(nn.Module):
    """The micro model with dropout on both towers' features: a step's result depends on its masks."""

    def __init__(self, p: float):
        super().__init__()
        self.inner, self.drop = micro_model(0), nn.Dropout(p)

    def forward(self, image, text):
        out = dict(self.inner(image, text))
        out["image_features"] = F.normalize(self.drop(out["image_features"]), dim=-1)
        out["text_features"] = F.normalize(self.drop(out["text_features"]), dim=-1)
        return out


class Recorder(nn.Module):
    """What each forward of `model` returned, in order."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, image, text):
        out = self.model(image, text)
        self.seen.append((out["image_features"].detach().clone(), out["text_features"].detach().clone()))
        return out


def _step(model, batches, compiled: bool):
    from accelerate import Accelerator

    torch._dynamo.reset()
    model.train()
    step_model = Recorder(torch.compile(model, backend="inductor") if compiled else model)
    torch.manual_seed(5)
    acc = Accelerator(cpu=True)
    loss, _, cache = forward_loss(step_model, objective_from_config(LossConfig()), batches, acc)
    backward(acc, step_model, loss, batches, cache)
    return float(loss.detach()), grads_of(model), step_model.seen


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_inductor_accumulation_replays_the_dropout_masks_and_equals_the_large_batch():
    big = fake_batch(12, seed=1)
    halves = [{k: v[:6] for k, v in big.items()}, {k: v[6:] for k, v in big.items()}]
    # Without dropout: compiled accumulation = the uncompiled large batch.
    loss_big, g_big, _ = _step(DropoutTowers(0.0), [big], compiled=False)
    loss_acc, g_acc, _ = _step(DropoutTowers(0.0), halves, compiled=True)
    assert loss_acc == pytest.approx(loss_big, rel=1e-5)
    _close(g_acc, g_big)
    # With dropout: the second pass of each micro-batch draws the masks of its first (the features the loss was
    # taken on), so the gradient is that of the large batch with those masks. (Inductor draws its own masks, not
    # eager's: the compiled and uncompiled runs differ in which elements drop, not in how the step uses them.)
    _, _, seen = _step(DropoutTowers(0.3), halves, compiled=True)
    assert len(seen) == 4
    for first, again in ((seen[0], seen[2]), (seen[1], seen[3])):
        torch.testing.assert_close(again[0], first[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(again[1], first[1], rtol=1e-5, atol=1e-6)
    assert any((first[0] == 0).any() for first in seen)  # dropout did drop
