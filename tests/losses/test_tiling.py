"""The shared tiled log-sum-exp (`TiledLogSumExp`): gradchecks (masked positives, several gammas, the masked
logits, mixed norms), equality with the dense computation (clip_loss in float32, logsumexp_rows, a dense top-k),
float32 backward across 30 orders of magnitude, large logits, and float32 accumulation of half inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from mmcl.losses import TiledLogSumExp, clip_loss, logsumexp_rows

from helpers import assert_float32_close, fresh_leaves, grads_wrt, pair_features, ref_clip


@pytest.mark.parametrize("n,chunk", [(96, 32), (100, 32), (20, 1), (100, 100), (100, 256), (37, 5)])
@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_tiled_matches_dense_float32(n, chunk, scale, tiles):
    img, txt = pair_features(n, 32, torch.float32, seed=n + chunk)
    s = torch.tensor(scale)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    dense = clip_loss(*a)
    tiled = clip_loss(*b, chunk_size=chunk)
    assert_float32_close(tiled, dense, scale)
    for gd, gt in zip(grads_wrt(dense, a), grads_wrt(tiled, b)):
        assert_float32_close(gt, gd, scale)


def test_tiled_logsumexp_gradcheck(tiles):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    s = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    for with_cols in (False, True):
        for chunk in (2, 3, 16):
            assert torch.autograd.gradcheck(lambda q, k, s: TiledLogSumExp.apply(q, k, s, chunk, with_cols), (q, k, s))
    # With the positive logit folded in: rows against a longer key set at an offset, and the square case.
    assert torch.autograd.gradcheck(lambda q, k, s: TiledLogSumExp.apply(q[:3], k, s, 2, False, 1), (q, k, s))
    assert torch.autograd.gradcheck(lambda q, k, s: TiledLogSumExp.apply(q[:5], k, s, 2, True, 0), (q, k, s))


def test_tiled_logsumexp_gradcheck_masked_and_several_gammas(tiles):
    """The negatives-only (masked) log-sum-exps of gamma * L for several gammas from one pass, as the
    hard-negative loss uses them: gradcheck of rows and columns, and the values against torch.logsumexp."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    s = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    for gammas in (None, (2.0, 1.0), (0.5, 1.0, 3.0)):
        assert torch.autograd.gradcheck(
            lambda q, k, s: TiledLogSumExp.apply(q, k, s, 3, True, None, 0, gammas), (q, k, s))
        assert torch.autograd.gradcheck(
            lambda q, k, s: TiledLogSumExp.apply(q[:4], k, s, 2, False, None, 2, gammas), (q, k, s))
    rows, cols = TiledLogSumExp.apply(q, k, s, 3, True, None, 0, (2.0, 0.5))
    logits = (2.5 * q @ k.T).masked_fill(torch.eye(7, dtype=torch.bool), -math.inf)
    for i, gamma in enumerate((2.0, 0.5)):
        torch.testing.assert_close(rows[i], torch.logsumexp(gamma * logits, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cols[i], torch.logsumexp(gamma * logits, 0), rtol=1e-12, atol=1e-12)


def test_tiled_logsumexp_returns_masked_logits_differentiably(tiles):
    """return_masked: the logits left out of the sums, read from the tiles, with their gradient folded into the
    same buffers: gradcheck rows-only at an offset and square with columns, values against q_i . k_(off+i)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(9, 3, dtype=torch.float64, generator=g, requires_grad=True)
    s = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
    for gammas in (None, (2.0, 1.0)):
        assert torch.autograd.gradcheck(
            lambda q, k, s: TiledLogSumExp.apply(q[:4], k, s, 3, False, None, 2, gammas, True), (q, k, s))
        assert torch.autograd.gradcheck(
            lambda q, k, s: TiledLogSumExp.apply(q, k[:7], s, 2, True, None, 0, gammas, True), (q, k, s))
    _, masked = TiledLogSumExp.apply(q[:4], k, s, 3, False, None, 2, None, True)
    torch.testing.assert_close(masked, 1.7 * (q[:4] * k[2:6]).sum(1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_cols", [False, True])
def test_tiled_logsumexp_backward_with_gradients_across_30_orders_of_magnitude(tiles, with_cols):
    """Incoming row gradients of 1, 1e-12 and 1e-30 (MoCHi at scale 100: synthetic negatives dominate most rows
    and leave their real-negative sums a tiny weight). The float32 backward forms every product relative to the
    largest coefficient with no subnormal: the gradients agree with float64 to float32 precision relative to
    the largest entry, rows weighted 1e-12 keep their own direction, and only rows below float32's resolution
    of the whole (1e-30) are left out."""
    q, k = pair_features(48, 16, torch.float64, seed=8, correlated=True)
    s = 100.0
    w = torch.ones(48, dtype=torch.float64)
    w[1::4], w[3::4] = 1e-12, 1e-30
    grads = {}
    for dtype in (torch.float64, torch.float32):
        qq, kk = q.detach().to(dtype).requires_grad_(True), k.detach().to(dtype).requires_grad_(True)
        out = TiledLogSumExp.apply(qq, kk, torch.tensor(s, dtype=dtype), 8, with_cols)
        rows = out[0] if with_cols else out
        (rows * w.to(dtype)).sum().backward()
        grads[dtype] = (qq.grad.double(), kk.grad.double())
    for g32, g64 in zip(grads[torch.float32], grads[torch.float64]):
        assert (g32 - g64).abs().max() <= 1e-5 * g64.abs().max()
    small32, small64 = grads[torch.float32][0][1::4], grads[torch.float64][0][1::4]
    assert 0 < small64.abs().max() < 1e-9  # the small rows' query gradients are themselves small ...
    cos = torch.nn.functional.cosine_similarity(small32 * 1e12, small64 * 1e12, dim=1)  # above its eps
    assert cos.min() > 0.999  # ... and still point where float64 says
    assert grads[torch.float32][0][3::4].abs().max() < 1e-25


def _mixed_norms(dtype, big):
    """One query far longer than the rest: a shift shared by all rows (s times the largest norm product) would
    leave the other rows' and many columns' shifted sums below M * tiny; per-row and per-column maxima must not."""
    q, k = pair_features(9, 4, dtype, seed=3, correlated=False)
    k = k[:7]
    q, k = q.clone(), k.clone()
    k[0] = q[0]  # row 0 and column 0 reach sigma and stay on the fast path
    q[0] *= big
    return q, k


def _underflowing(q, k, s):
    sigma = s * q.norm(dim=1).max() * k.norm(dim=1).max()
    e = torch.exp(s * q.double() @ k.double().T - sigma)
    tiny = torch.finfo(q.dtype).tiny
    return (e.sum(1) < k.shape[0] * tiny).sum().item(), (e.sum(0) < q.shape[0] * tiny).sum().item()


def test_tiled_logsumexp_gradcheck_with_mixed_norms(tiles):
    q, k = _mixed_norms(torch.float64, 900.0)
    bad_rows, bad_cols = _underflowing(q, k, 1.0)
    assert 0 < bad_rows < q.shape[0] and 0 < bad_cols < k.shape[0]
    q, k = q.requires_grad_(True), k.requires_grad_(True)
    s = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    for with_cols in (False, True):
        assert torch.autograd.gradcheck(lambda q, k, s: TiledLogSumExp.apply(q, k, s, 4, with_cols), (q, k, s))
    assert torch.autograd.gradcheck(lambda q, k, s: TiledLogSumExp.apply(q[:7], k, s, 4, True, 0), (q, k, s))


def test_tiled_mixed_norms_match_dense_float32(tiles):
    q, k = _mixed_norms(torch.float32, 60.0)
    s = torch.tensor(3.0)
    bad_rows, bad_cols = _underflowing(q, k, 3.0)
    assert 0 < bad_rows < q.shape[0] and 0 < bad_cols < k.shape[0]
    a, b = fresh_leaves(q, k, s), fresh_leaves(q, k, s)
    dense = logsumexp_rows(*a, with_cols=True)
    tiled = logsumexp_rows(*b, chunk_size=4, with_cols=True)
    for d, t in zip(dense, tiled):
        torch.testing.assert_close(t, d, rtol=1e-6, atol=1e-5)  # float32 log-sum-exps of size up to ~180
    (dense[0].sum() + dense[1].sum()).backward()
    (tiled[0].sum() + tiled[1].sum()).backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-6)  # float32 softmax sums


def test_tiled_is_stable_for_large_logits():
    # Unnormalised features give logits far beyond exp's float32 range; online max-shifting must hold.
    q, k = pair_features(30, 8, torch.float32, seed=2)
    q = q * 50
    s = torch.tensor(100.0)
    tiled = clip_loss(q, k, s, chunk_size=8)
    assert torch.isfinite(tiled)
    ref = ref_clip(q, k, 100.0)
    assert abs(tiled.item() - ref.item()) <= 1e-5 * abs(ref.item())  # float32 relative precision


def test_half_precision_accumulates_in_float32():
    img, txt = pair_features(64, 16, torch.bfloat16, seed=4)
    s = torch.tensor(50.0, dtype=torch.bfloat16)
    got = clip_loss(img, txt, s, chunk_size=16)
    assert got.dtype == torch.float32
    # bf16 inputs: the logits themselves carry ~50 * 2^-8 error, the loss about that much.
    assert abs(got.item() - ref_clip(img.float(), txt.float(), 50.0).item()) < 0.2


@pytest.mark.parametrize("noise", [0.5, 0.05])  # aligned pairs (cosine ~0.9) and near-duplicates (~0.999)
def test_tiled_float32_as_accurate_as_dense_when_the_positive_dominates(noise, tiles):
    """At scale 100 every row's positive dominates: the loss and its gradients are ~e^-50. The tiled path must
    form lse - positive and softmax_ii - 1 from the same rounded logit (it subtracted a separately computed
    positive, leaving one float32 ulp of a logit of 90, ~1e-6 in the loss and ~1e-8 in the gradients)."""
    g = torch.Generator().manual_seed(70)
    img = F.normalize(torch.randn(256, 64, generator=g, dtype=torch.float64), dim=1)
    txt = F.normalize(img + noise * torch.randn(256, 64, generator=g, dtype=torch.float64) / 8, dim=1)
    s = torch.tensor(100.0, dtype=torch.float64)
    ref = fresh_leaves(img, txt, s)
    ref_loss = clip_loss(*ref)
    ref_grads = grads_wrt(ref_loss, ref)
    errors = {}
    for chunk in (None, 64):
        x = fresh_leaves(img.float(), txt.float(), s.float())
        loss = clip_loss(*x, chunk_size=chunk)
        errors[chunk] = [abs(loss.item() - ref_loss.item())] + [
            (gr.double() - rg).abs().max().item() for gr, rg in zip(grads_wrt(loss, x), ref_grads)]
    # Within 10x of the dense float32 path's own error (which is ~1e-16 for the value here), plus 1e-20.
    for tiled_err, dense_err in zip(errors[64], errors[None]):
        assert tiled_err <= 10 * dense_err + 1e-20, (errors[64], errors[None])


def test_tiled_logsumexp_topk_equals_a_dense_ranking(tiles):
    """The tiled pass's top-k (MoCHi's hard negatives from the same tiles): indices and values equal torch.topk on
    the dense logits with the skipped entry left out, across column tiles and row blocks that do not divide."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(11, 6, dtype=torch.float64, generator=g)
    k = torch.randn(23, 6, dtype=torch.float64, generator=g)
    s = torch.tensor(3.0, dtype=torch.float64)
    for chunk, kk, skip in ((4, 5, 3), (3, 1, 0), (16, 22, 12), (2, 7, None)):
        lse, idx, val = TiledLogSumExp.apply(q, k, s, chunk, False, None, None, None, False, kk, skip)
        logits = 3.0 * q @ k.T
        torch.testing.assert_close(lse, torch.logsumexp(logits, 1), rtol=1e-12, atol=1e-12)
        if skip is not None:
            logits[torch.arange(11), torch.arange(11) + skip] = -math.inf
        ref = logits.topk(kk, dim=1)
        assert torch.equal(idx, ref.indices)
        torch.testing.assert_close(val, ref.values, rtol=1e-12, atol=1e-12)
