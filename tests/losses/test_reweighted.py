"""Debiased (Chuang et al. 2020) and hard-negative (Robinson et al. 2021) InfoNCE against a float64 transcription of
the formula: the floor, the reduction to clip, tiled equal to dense (also when the positive dominates), rows split
over simulated ranks."""

import math

import pytest
import torch
import torch.nn.functional as F

from mmcl.losses import Gathered, clip_loss, debiased_clip_loss, hard_negative_clip_loss

from helpers import fresh_leaves, grads_wrt, pair_features


def ref_reweighted(img, txt, s, tau_plus, beta):
    """Robinson et al. (2021) eq. (with Chuang et al. 2020 at beta=0), float64, per query, both directions."""
    img, txt = img.double(), txt.double()
    n = img.shape[0]
    big_n = n - 1

    def direction(q, k):
        total = 0.0
        for i in range(n):
            pos = math.exp(s * float(q[i] @ k[i]))
            neg = [math.exp(s * float(q[i] @ k[j])) for j in range(n) if j != i]
            imp = [x ** beta for x in neg]
            reweighted = sum(w * x for w, x in zip(imp, neg)) / (sum(imp) / len(imp))
            ng = (-tau_plus * big_n * pos + reweighted) / (1 - tau_plus)
            ng = max(ng, big_n * math.exp(-s))
            total += -math.log(pos / (pos + ng))
        return total / n

    return (direction(img, txt) + direction(txt, img)) / 2


@pytest.mark.parametrize("tau_plus,beta", [(0.0, 0.0), (0.1, 0.0), (0.1, 1.0), (0.05, 0.5), (0.6, 2.0)])
@pytest.mark.parametrize("chunk", [None, 5])
def test_hard_negative_matches_float64_formula(tau_plus, beta, chunk):
    img, txt = pair_features(13, 8, torch.float64, seed=15, correlated=False)
    got = hard_negative_clip_loss(img, txt, torch.tensor(5.0, dtype=torch.float64), tau_plus, beta, chunk)
    ref = ref_reweighted(img, txt, 5.0, tau_plus, beta)
    assert abs(got.item() - ref) <= 1e-10 * abs(ref)  # float64 log-space vs Python floats in linear space
    if beta == 0:
        deb = debiased_clip_loss(img, txt, torch.tensor(5.0, dtype=torch.float64), tau_plus, chunk)
        assert torch.equal(deb, got)


def test_debiased_floor_is_reached_and_matches_formula():
    # tau_plus = 0.9 with tight clusters makes the debiased estimate negative: the floor N e^{-s} applies.
    img, txt = pair_features(6, 4, torch.float64, seed=16)
    got = debiased_clip_loss(img, txt, torch.tensor(3.0, dtype=torch.float64), 0.9)
    assert abs(got.item() - ref_reweighted(img, txt, 3.0, 0.9, 0.0)) <= 1e-10


def test_debiased_and_hard_negative_reduce_to_clip():
    img, txt = pair_features(30, 16, torch.float32, seed=17)
    s = torch.tensor(14.0)
    a, b, c = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    clip = clip_loss(*a)
    deb = debiased_clip_loss(*b, tau_plus=0.0)
    hn = hard_negative_clip_loss(*c, tau_plus=0.0, beta=0.0)
    # float32: log-space formula vs cross-entropy, logits up to 14 rounded to ~1e-6.
    torch.testing.assert_close(deb, clip, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hn, clip, rtol=1e-6, atol=1e-6)
    for g1, g2, g3 in zip(grads_wrt(clip, a), grads_wrt(deb, b), grads_wrt(hn, c)):
        torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g3, g1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tau_plus,beta", [(0.1, 0.0), (0.1, 1.0)])
def test_hard_negative_tiled_matches_dense(tau_plus, beta, tiles):
    img, txt = pair_features(40, 8, torch.float64, seed=18, correlated=False)
    s = torch.tensor(10.0, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    dense = hard_negative_clip_loss(*a, tau_plus=tau_plus, beta=beta)
    tiled = hard_negative_clip_loss(*b, tau_plus=tau_plus, beta=beta, chunk_size=7)
    # float64; only the order of the additions differs (the tiled path masks the positive inside each tile).
    torch.testing.assert_close(tiled, dense, rtol=1e-10, atol=1e-12)
    for ga, gb in zip(grads_wrt(dense, a), grads_wrt(tiled, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-8, atol=1e-10)


def test_hard_negative_local_rows_split_reproduces_global_batch():
    img, txt = pair_features(12, 8, torch.float64, seed=19, correlated=False)
    s = torch.tensor(8.0, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    ref = hard_negative_clip_loss(*a, tau_plus=0.1, beta=0.5)
    split = torch.stack([
        hard_negative_clip_loss(b[0][r * 6:(r + 1) * 6], b[1][r * 6:(r + 1) * 6], b[2], 0.1, 0.5, 4,
                                gathered=Gathered(b[0], b[1], offset=r * 6))
        for r in range(2)
    ]).mean()
    torch.testing.assert_close(split, ref, rtol=1e-10, atol=1e-12)  # float64
    for ga, gb in zip(grads_wrt(ref, a), grads_wrt(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-8, atol=1e-10)


def _dominant_features(n, d, dtype, seed):
    """Pairs at cosine ~0.97 among random negatives: at scale 100 each row's positive exceeds its best negative
    by ~50-90 logits (a trained model), while half of the rows keep a near-duplicate negative so the loss is not
    all zero."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    txt = F.normalize(img + 0.25 * torch.randn(n, d, generator=g, dtype=torch.float64) / d ** 0.5, dim=1)
    twins = torch.arange(0, n - 1, 2)
    img[twins + 1] = F.normalize(img[twins] + 0.15 * torch.randn(len(twins), d, generator=g, dtype=torch.float64)
                                 / d ** 0.5, dim=1)
    return img.to(dtype), txt.to(dtype)


@pytest.mark.parametrize("tau_plus,beta", [(0.1, 1.0), (0.1, 0.0), (0.05, 3.0)])
def test_hard_negative_tiled_equals_dense_when_the_positive_dominates(tau_plus, beta, tiles):
    img, txt = _dominant_features(120, 64, torch.float64, seed=50)
    s = torch.tensor(100.0, dtype=torch.float64)
    logits = 100.0 * img @ txt.T
    margin = logits.diagonal() - logits.masked_fill(torch.eye(120, dtype=torch.bool), -math.inf).amax(1)
    assert (margin > 40).sum() > 30  # rows where lse + log(1 - e^(p - lse)) would cancel completely
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    dense = hard_negative_clip_loss(*a, tau_plus=tau_plus, beta=beta)
    tiled = hard_negative_clip_loss(*b, tau_plus=tau_plus, beta=beta, chunk_size=16)
    assert dense.item() > 0.1  # the twins keep it away from zero, so a relative comparison means something
    # float64: summation order only; the definition of "done" for this regime is 1e-9.
    torch.testing.assert_close(tiled, dense, rtol=1e-9, atol=1e-9)
    for ga, gb in zip(grads_wrt(dense, a), grads_wrt(tiled, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-9, atol=1e-9)
    ref = ref_reweighted(img, txt, 100.0, tau_plus, beta)
    assert abs(dense.item() - ref) <= 1e-9 * max(1.0, abs(ref))
