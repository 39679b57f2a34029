"""Supervised contrastive (`supcon_loss`) against helpers.ref_supcon: dense and tiled, rows split over simulated
ranks, the reduction to clip with distinct labels, the tiled positive term's gradcheck, and bad labels."""

import pytest
import torch

from mmcl.losses import Gathered, LossInputError, clip_loss, supcon_loss

from helpers import fresh_leaves, grads_wrt, pair_features, ref_supcon

_LABELS = torch.tensor([0, 1, 0, 2, -1, 1, 0, 3, -1, 2, 5, 5, 7, 0, -1, 4, 4, 4, 9, 1])


@pytest.mark.parametrize("chunk", [None, 6])
def test_supcon_matches_float64_reference(chunk):
    img, txt = pair_features(20, 8, torch.float64, seed=10)
    s = torch.tensor(12.0, dtype=torch.float64)
    got = supcon_loss(img, txt, _LABELS, s, chunk)
    torch.testing.assert_close(got, ref_supcon(img, txt, _LABELS, 12.0), rtol=1e-12, atol=1e-12)  # float64


def test_supcon_tiled_matches_dense_grads(tiles):
    img, txt = pair_features(20, 8, torch.float32, seed=11)
    s = torch.tensor(30.0)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    dense = supcon_loss(a[0], a[1], _LABELS, a[2])
    tiled = supcon_loss(b[0], b[1], _LABELS, b[2], chunk_size=7)
    floor = 30.0 * 2**-23  # float32 rounding of logits of size <= s, as in the clip test
    torch.testing.assert_close(tiled, dense, rtol=1e-5, atol=floor)
    for gd, gt in zip(grads_wrt(dense, a), grads_wrt(tiled, b)):
        torch.testing.assert_close(gt, gd, rtol=1e-5, atol=floor)


def test_supcon_with_distinct_labels_equals_clip():
    img, txt = pair_features(33, 16, torch.float32, seed=12)
    s = torch.tensor(20.0)
    distinct = torch.randperm(33, generator=torch.Generator().manual_seed(0)) * 3
    for labels in (distinct, None, torch.full((33,), -1)):
        # Dense: the same float32 log-softmax values; only the order of the 33-term mean differs (~1 ulp each).
        torch.testing.assert_close(supcon_loss(img, txt, labels, s), clip_loss(img, txt, s), rtol=1e-6, atol=0)
        # Tiled: the positive logit comes from a row-wise dot product instead of the matmul; float32 rounding.
        torch.testing.assert_close(supcon_loss(img, txt, labels, s, 8), clip_loss(img, txt, s, 8), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 4])
def test_supcon_local_rows_split_reproduces_global_batch(chunk):
    img, txt = pair_features(20, 8, torch.float64, seed=13)
    s = torch.tensor(9.0, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    ref = supcon_loss(a[0], a[1], _LABELS, a[2])
    parts = [
        supcon_loss(b[0][r * 5:(r + 1) * 5], b[1][r * 5:(r + 1) * 5], _LABELS[r * 5:(r + 1) * 5], b[2], chunk,
                    gathered=Gathered(b[0], b[1], all_labels=_LABELS, offset=r * 5))
        for r in range(4)
    ]
    split = torch.stack(parts).mean()
    torch.testing.assert_close(split, ref, rtol=1e-12, atol=1e-12)  # float64, summation order only
    for ga, gb in zip(grads_wrt(ref, a), grads_wrt(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)


def test_supcon_rejects_bad_labels():
    img, txt = pair_features(4, 3)
    with pytest.raises(LossInputError, match="labels"):
        supcon_loss(img, txt, torch.zeros(3, dtype=torch.long), torch.tensor(1.0))
    with pytest.raises(LossInputError, match="labels"):
        supcon_loss(img, txt, torch.zeros(4), torch.tensor(1.0))


def test_supcon_positive_mean_logits_gradcheck():
    """The tiled SupCon's positive term (class means rebuilt in backward): gradcheck with repeated, single and
    unlabelled (-1) classes, rows at an offset into a longer key set, and values against the autograd form."""
    from mmcl.losses.clip import positive_logits
    from mmcl.losses.supcon import _positive_means, _PositiveMeanLogits

    g = torch.Generator().manual_seed(9)
    q = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(8, 3, dtype=torch.float64, generator=g, requires_grad=True)
    s = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    k_labels = torch.tensor([2, -1, 2, 7, -1, 4, 2, -1])
    q_labels = k_labels[2:7]
    assert torch.autograd.gradcheck(lambda q, k, s: _PositiveMeanLogits.apply(q, k, s, q_labels, k_labels, 2),
                                    (q, k, s))
    ours = _PositiveMeanLogits.apply(q, k, s, q_labels, k_labels, 2)
    ref = positive_logits(q, _positive_means(k, q_labels, k_labels, 2), s, 0)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
