"""InfoNCE (`clip_loss`, `infonce_rows`, `logsumexp_rows`) against open_clip's ClipLoss, F.cross_entropy and
helpers.ref_clip, over one process and rows split over simulated ranks; the dense autograd functions' own backward
(`DenseInfoNCE`, `DenseLogSumExp`): gradcheck, and no subnormal gradient at scale 100."""

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from mmcl.losses import Gathered, clip_loss, infonce_rows, logsumexp_rows

from helpers import fresh_leaves, grads_wrt, pair_features, ref_clip


@pytest.mark.parametrize("n,d", [(1, 4), (7, 16), (64, 32), (130, 8)])
@pytest.mark.parametrize("scale", [1.0, 14.3, 100.0])
@pytest.mark.parametrize("chunk", [None, 16])
def test_clip_matches_open_clip_value_and_grads(n, d, scale, chunk, tiles):
    img, txt = pair_features(n, d, torch.float64, seed=n)
    s = torch.tensor(scale, dtype=torch.float64)
    a = fresh_leaves(img, txt, s)
    b = fresh_leaves(img, txt, s)
    ours = clip_loss(a[0], a[1], a[2], chunk_size=chunk)
    theirs = ClipLoss()(b[0], b[1], b[2])
    # float64 on both sides; only summation order differs.
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for ga, gb in zip(grads_wrt(ours, a), grads_wrt(theirs, b)):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


def test_clip_float32_close_to_float64_reference():
    img, txt = pair_features(50, 24, torch.float32, seed=3)
    s = torch.tensor(30.0)
    for chunk in (None, 7):
        got = clip_loss(img, txt, s, chunk_size=chunk)
        # float32 logits up to 30 carry ~30 * 6e-8 absolute error each.
        assert abs(got.item() - ref_clip(img, txt, 30.0).item()) < 1e-5


def test_logsumexp_rows_dense_and_tiled_agree_with_torch():
    q, k = pair_features(20, 8, torch.float64, seed=1)
    k = k[:13]
    s = torch.tensor(9.0, dtype=torch.float64)
    logits = 9.0 * q @ k.T
    for chunk in (None, 4):
        rows, cols = logsumexp_rows(q, k, s, chunk, with_cols=True)
        torch.testing.assert_close(rows, torch.logsumexp(logits, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cols, torch.logsumexp(logits, 0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [None, 5])
def test_local_rows_split_reproduces_global_batch(chunk, tiles):
    """Splitting rows over W simulated ranks: mean of the per-rank losses and its gradient are global."""
    n, w = 24, 3
    img, txt = pair_features(n, 8, torch.float64, seed=5)
    s = torch.tensor(20.0, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    ref = ClipLoss()(*a)
    per = n // w
    parts = [
        clip_loss(b[0][r * per:(r + 1) * per], b[1][r * per:(r + 1) * per], b[2], chunk,
                  gathered=Gathered(b[0], b[1], offset=r * per))
        for r in range(w)
    ]
    split = torch.stack(parts).mean()
    torch.testing.assert_close(split, ref, rtol=1e-12, atol=1e-12)  # float64, summation order only
    for ga, gb in zip(grads_wrt(ref, a), grads_wrt(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)


def test_infonce_rows_offset_picks_the_right_positive():
    q, k = pair_features(10, 6, torch.float64, seed=6)
    s = torch.tensor(5.0, dtype=torch.float64)
    logits = 5.0 * q[3:6] @ k.T
    expected = torch.logsumexp(logits, 1) - logits[torch.arange(3), torch.arange(3, 6)]
    for chunk in (None, 4):
        torch.testing.assert_close(infonce_rows(q[3:6], k, s, 3, chunk), expected, rtol=1e-12, atol=1e-12)


def _subnormals(x: torch.Tensor) -> int:
    return int(((x != 0) & (x.abs() < torch.finfo(x.dtype).tiny)).sum())


def test_dense_infonce_matches_cross_entropy_and_gradchecks():
    """The dense InfoNCE's custom backward: gradcheck (rows at an offset, square with columns), and values and
    gradients equal to F.cross_entropy in float64 at scales 1 and 100."""
    from mmcl.losses.clip import DenseInfoNCE

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: DenseInfoNCE.apply(x, 2, False), (logits,))
    square = torch.randn(6, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: DenseInfoNCE.apply(x, 0, True), (square,))
    for scale in (1.0, 100.0):
        img, txt = pair_features(64, 16, torch.float64, seed=4)
        a, b = fresh_leaves(img, txt), fresh_leaves(img, txt)
        ours = clip_loss(*a, torch.tensor(scale, dtype=torch.float64))
        logits = scale * b[0] @ b[1].T
        target = torch.arange(64)
        ref = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
        for go, gr in zip(grads_wrt(ours, a), grads_wrt(ref, b)):
            torch.testing.assert_close(go, gr, rtol=1e-10, atol=1e-14)


def test_dense_clip_loss_forms_no_subnormal_gradient_at_scale_100():
    """At scale 100 with aligned pairs most softmax entries are float32 subnormals (x86 runs ~100x slower on
    them: a dense fwd+bwd at N = 2048 took 27 s instead of 0.3 s). F.cross_entropy's logit gradient is full
    of them; the dense InfoNCE's holds none and still equals float64 to float32 precision (a term below 1e-27
    of its row's coefficient may be raised to that, as the tiles do)."""
    from mmcl.losses.clip import DenseInfoNCE

    img, txt = pair_features(256, 64, torch.float64, seed=5, correlated=False)
    txt = F.normalize(img + 0.3 * txt, dim=1)  # cosine ~0.95 to its image, ~0 to the rest
    logits64 = (100.0 * img @ txt.T).requires_grad_(True)
    logits32 = logits64.detach().float().requires_grad_(True)
    target = torch.arange(256)
    (F.cross_entropy(logits32, target) + F.cross_entropy(logits32.T, target)).backward()
    assert _subnormals(logits32.grad) > 1000  # the regime is real
    grads = []
    for logits in (logits32.detach().requires_grad_(True), logits64):
        rows, cols = DenseInfoNCE.apply(logits, 0, True)
        (rows.mean() + cols.mean()).backward()
        grads.append(logits.grad)
    assert _subnormals(grads[0]) == 0
    # Every entry is within float32 precision of float64, or within N * 1e-27 of the coefficient 1/256 of a
    # row's log-sum-exp (N raised terms at most): the pairs here are so well separated that the whole float64
    # gradient is itself ~1e-23 at most.
    assert (grads[0].double() - grads[1]).abs().max() <= 1e-6 * grads[1].abs().max() + 256 * 1e-27 / 256


def test_dense_logsumexp_gradchecks_and_forms_no_subnormal():
    """DenseLogSumExp (dense SupCon, debiased, hard-negative, logsumexp_rows): gradcheck over rows and columns,
    and at scale 100 with aligned pairs a dense SupCon backward whose logit gradient holds no subnormal and
    equals float64's."""
    from mmcl.losses.clip import DenseLogSumExp

    x = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    for dim in (0, 1):
        assert torch.autograd.gradcheck(lambda x: DenseLogSumExp.apply(x, dim), (x,))
    img, txt = pair_features(128, 32, torch.float64, seed=6, correlated=False)
    txt = F.normalize(img + 0.3 * txt, dim=1)
    labels = torch.arange(128) % 10
    logits64 = (100.0 * img @ txt.T).requires_grad_(True)
    grads = []
    for logits in (logits64.detach().float().requires_grad_(True), logits64):
        positive = (labels[:, None] == labels[None, :]).to(logits.dtype)
        loss = (DenseLogSumExp.apply(logits, 1) - (logits * positive / positive.sum(1, keepdim=True)).sum(1)).mean()
        loss.backward()
        grads.append(logits.grad)
    assert _subnormals(grads[0]) == 0
    assert (grads[0].double() - grads[1]).abs().max() <= 1e-6 * grads[1].abs().max() + 1e-27
