"""The captioning term against open_clip's CoCaLoss (its caption part) and a float64 formula."""

import pytest
import torch
from open_clip.loss import CoCaLoss

from mmcl import losses
from mmcl.losses.caption import caption_losses


def _batch(n=6, length=9, vocab=31, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, length, vocab, generator=g)
    labels = torch.randint(1, vocab, (n, length), generator=g)
    for i in range(n):  # captions of different lengths, padded with 0
        labels[i, 2 + i % (length - 2):] = 0
    return logits, labels


def test_the_batch_mean_equals_open_clip_coca_caption_loss():
    logits, labels = _batch()
    feats = torch.nn.functional.normalize(torch.randn(6, 8), dim=1)
    _, ref = CoCaLoss(caption_loss_weight=1.0, clip_loss_weight=0.0)(feats, feats, logits, labels, torch.tensor(10.0))
    values = caption_losses(logits, labels, pad_id=0)
    torch.testing.assert_close(losses.sample_mean(values), ref, rtol=1e-6, atol=1e-6)


def test_each_caption_sums_its_own_tokens_in_float64():
    logits, labels = _batch(seed=1)
    values = caption_losses(logits, labels, pad_id=0)
    lp = torch.log_softmax(logits.double(), dim=-1)
    for i in range(labels.shape[0]):
        keep = labels[i] != 0
        ref = -lp[i][keep].gather(1, labels[i][keep][:, None]).sum()
        assert float(values.counts[i]) == int(keep.sum())
        assert abs(float(values.sums[i]) - float(ref)) < 1e-4


def test_micro_batches_joined_equal_the_whole_batch_and_its_gradient():
    logits, labels = _batch(n=8, seed=2)
    whole = logits.clone().requires_grad_(True)
    losses.sample_mean(caption_losses(whole, labels)).backward()
    parts = [logits[:3].clone().requires_grad_(True), logits[3:].clone().requires_grad_(True)]
    joined = losses.joined(caption_losses(p, labels[i * 3:i * 3 + p.shape[0]]) for i, p in enumerate(parts))
    losses.sample_mean(joined).backward()
    torch.testing.assert_close(torch.cat([p.grad for p in parts]), whole.grad)


def test_bad_shapes_are_a_loss_input_error():
    with pytest.raises(losses.LossInputError):
        caption_losses(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
