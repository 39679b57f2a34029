"""SigLIP (`siglip_loss`, tiled by `TiledSigmoidPairs`) against open_clip's SigLipLoss and the float64 formula:
rows split over simulated ranks, tiled equal to dense, the memory of the tiled backward, half-precision inputs."""

import math

import pytest
import torch
from open_clip.loss import SigLipLoss

from mmcl.losses import Gathered, siglip_loss

from helpers import fresh_leaves, grads_wrt, pair_features


@pytest.mark.parametrize("n,d,scale,bias", [(1, 4, 1.0, 0.0), (9, 16, 10.0, -10.0), (40, 8, 100.0, -3.0)])
def test_siglip_matches_open_clip_and_float64_formula(n, d, scale, bias):
    img, txt = pair_features(n, d, torch.float64, seed=n)
    s = torch.tensor(scale, dtype=torch.float64)
    b = torch.tensor(bias, dtype=torch.float64)
    a1, a2 = fresh_leaves(img, txt, s, b), fresh_leaves(img, txt, s, b)
    ours = siglip_loss(*a1)
    theirs = SigLipLoss()(*a2)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)  # float64 both
    for g1, g2 in zip(grads_wrt(ours, a1), grads_wrt(theirs, a2)):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    logits = scale * img @ txt.T + bias
    ref = -sum(
        math.log(1 / (1 + math.exp(-(1 if i == j else -1) * logits[i, j].item()))) for i in range(n) for j in range(n)
    ) / n
    assert abs(ours.item() - ref) <= 1e-10 * max(1.0, abs(ref))  # float64 vs Python floats


def test_siglip_local_rows_split_reproduces_global_batch():
    img, txt = pair_features(12, 8, torch.float64, seed=14)
    s, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s, bias), fresh_leaves(img, txt, s, bias)
    ref = siglip_loss(*a)
    split = torch.stack([
        siglip_loss(b[0][r * 4:(r + 1) * 4], b[1][r * 4:(r + 1) * 4], b[2], b[3],
                    gathered=Gathered(None, b[1], offset=r * 4))
        for r in range(3)
    ]).mean()
    torch.testing.assert_close(split, ref, rtol=1e-12, atol=1e-12)  # float64, summation order only
    for ga, gb in zip(grads_wrt(ref, a), grads_wrt(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale,bias_value", [(10.0, -10.0), (100.0, -3.0)])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_tiled_siglip_equals_dense_in_value_and_gradients(chunk, scale, bias_value, tiles):
    img, txt = pair_features(13, 8, torch.float64, seed=21)
    s, bias = torch.tensor(scale, dtype=torch.float64), torch.tensor(bias_value, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s, bias), fresh_leaves(img, txt, s, bias)
    dense = siglip_loss(*a)
    tiled = siglip_loss(*b, chunk_size=chunk)
    torch.testing.assert_close(tiled, dense, rtol=1e-12, atol=1e-12)  # float64: summation order only
    for gt, gd in zip(grads_wrt(tiled, b), grads_wrt(dense, a)):
        torch.testing.assert_close(gt, gd, rtol=1e-10, atol=1e-12)
    # Local rows against gathered columns: each row's positive may fall in any column tile.
    for r, (lo, hi) in enumerate(((0, 5), (5, 9), (9, 13))):
        a, b = fresh_leaves(img[lo:hi], txt, s, bias), fresh_leaves(img[lo:hi], txt, s, bias)
        dense = siglip_loss(a[0], a[1][lo:hi], a[2], a[3], gathered=Gathered(None, a[1], offset=lo))
        tiled = siglip_loss(b[0], b[1][lo:hi], b[2], b[3], gathered=Gathered(None, b[1], offset=lo), chunk_size=chunk)
        torch.testing.assert_close(tiled, dense, rtol=1e-12, atol=1e-12)
        for gt, gd in zip(grads_wrt(tiled, b), grads_wrt(dense, a)):
            torch.testing.assert_close(gt, gd, rtol=1e-10, atol=1e-12)


def test_tiled_siglip_memory_stays_one_tile():
    """Saved activations: the dense loss keeps (n, n) logits for backward, the tiled one only (views of) its
    inputs, never a tile of logits."""
    n, d = 2048, 16
    img, txt = pair_features(n, d, torch.float32, seed=3)
    s, bias = torch.tensor(10.0), torch.tensor(-10.0)

    def largest_saved(**kw):
        leaves = fresh_leaves(img, txt, s, bias)
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            siglip_loss(*leaves, **kw)
        return max(sizes)

    assert largest_saved() >= n * n  # the logits
    assert largest_saved(chunk_size=256) <= n * d  # at most the (n, d) features


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 64])
def test_siglip_half_precision_is_finite_and_close_to_float64(dtype, chunk):
    img, txt = pair_features(256, 32, dtype, seed=51)
    s, bias = torch.tensor(100.0, dtype=dtype), torch.tensor(-10.0, dtype=dtype)
    got = siglip_loss(img, txt, s, bias, chunk_size=chunk)
    assert got.dtype == torch.float32 and torch.isfinite(got)
    # Reference on the same (rounded) inputs in float64: what is left is float32 accumulation, ~1e-6 relative.
    ref = siglip_loss(img.double(), txt.double(), s.double(), bias.double())
    assert abs(got.item() - ref.item()) <= 1e-5 * abs(ref.item())
