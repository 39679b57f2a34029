"""Loss math against open_clip and float64 transcriptions of each paper's formula."""

import math

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from mmcl.config import LossConfig
from mmcl.errors import ConfigError, DataError
from mmcl.losses import (
    TiledLogSumExp,
    align_loss,
    build_objective,
    clip_loss,
    gather_features,
    infonce_rows,
    logsumexp_rows,
    uniform_loss,
)


def _features(n, d, dtype=torch.float32, seed=0, correlated=True):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, d, generator=g, dtype=torch.float64)
    txt = torch.randn(n, d, generator=g, dtype=torch.float64)
    if correlated:  # positives more similar than negatives, as in a trained model
        txt = img + 0.7 * txt
    return F.normalize(img, dim=1).to(dtype), F.normalize(txt, dim=1).to(dtype)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


# ---------------------------------------------------------------------- float64 references written from the papers


def ref_clip(img, txt, s):
    img, txt = img.double(), txt.double()
    logits = float(s) * img @ txt.T
    n = img.shape[0]
    i2t = -sum(logits[i, i] - torch.logsumexp(logits[i], 0) for i in range(n)) / n
    t2i = -sum(logits[i, i] - torch.logsumexp(logits[:, i], 0) for i in range(n)) / n
    return (i2t + t2i) / 2


# ---------------------------------------------------------------------- clip vs open_clip


@pytest.mark.parametrize("n,d", [(1, 4), (7, 16), (64, 32), (130, 8)])
@pytest.mark.parametrize("scale", [1.0, 14.3, 100.0])
@pytest.mark.parametrize("chunk", [None, 16])
def test_clip_matches_open_clip_value_and_grads(n, d, scale, chunk):
    img, txt = _features(n, d, torch.float64, seed=n)
    s = torch.tensor(scale, dtype=torch.float64)
    a = _leaves(img, txt, s)
    b = _leaves(img, txt, s)
    ours = clip_loss(a[0], a[1], a[2], chunk_size=chunk)
    theirs = ClipLoss()(b[0], b[1], b[2])
    # float64 on both sides; only summation order differs.
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for ga, gb in zip(_grads(ours, a), _grads(theirs, b)):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


def test_clip_float32_close_to_float64_reference():
    img, txt = _features(50, 24, torch.float32, seed=3)
    s = torch.tensor(30.0)
    for chunk in (None, 7):
        got = clip_loss(img, txt, s, chunk_size=chunk)
        # float32 logits up to 30 carry ~30 * 6e-8 absolute error each.
        assert abs(got.item() - ref_clip(img, txt, 30.0).item()) < 1e-5


# ---------------------------------------------------------------------- tiled == dense


@pytest.mark.parametrize("n,chunk", [(96, 32), (100, 32), (100, 1), (100, 100), (100, 256), (37, 5)])
@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_tiled_matches_dense_float32(n, chunk, scale):
    img, txt = _features(n, 32, torch.float32, seed=n + chunk)
    s = torch.tensor(scale)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    dense = clip_loss(*a)
    tiled = clip_loss(*b, chunk_size=chunk)
    # 1e-5 relative, plus an absolute floor: each float32 logit of size <= s is itself rounded by up to
    # s * 2^-24, so a near-zero loss (easy batch at s=100) is only defined to about that much in either path.
    floor = scale * 2**-23
    torch.testing.assert_close(tiled, dense, rtol=1e-5, atol=floor)
    for gd, gt in zip(_grads(dense, a), _grads(tiled, b)):
        torch.testing.assert_close(gt, gd, rtol=1e-5, atol=floor)


def test_tiled_logsumexp_gradcheck():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    s = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    for with_cols in (False, True):
        for chunk in (2, 3, 16):
            assert torch.autograd.gradcheck(lambda q, k, s: TiledLogSumExp.apply(q, k, s, chunk, with_cols), (q, k, s))


def test_logsumexp_rows_dense_and_tiled_agree_with_torch():
    q, k = _features(20, 8, torch.float64, seed=1)
    k = k[:13]
    s = torch.tensor(9.0, dtype=torch.float64)
    logits = 9.0 * q @ k.T
    for chunk in (None, 4):
        rows, cols = logsumexp_rows(q, k, s, chunk, with_cols=True)
        torch.testing.assert_close(rows, torch.logsumexp(logits, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cols, torch.logsumexp(logits, 0), rtol=1e-12, atol=1e-12)


def test_tiled_is_stable_for_large_logits():
    # Unnormalised features give logits far beyond exp's float32 range; online max-shifting must hold.
    q, k = _features(30, 8, torch.float32, seed=2)
    q = q * 50
    s = torch.tensor(100.0)
    tiled = clip_loss(q, k, s, chunk_size=8)
    assert torch.isfinite(tiled)
    ref = ref_clip(q, k, 100.0)
    assert abs(tiled.item() - ref.item()) <= 1e-5 * abs(ref.item())  # float32 relative precision


def test_half_precision_accumulates_in_float32():
    img, txt = _features(64, 16, torch.bfloat16, seed=4)
    s = torch.tensor(50.0, dtype=torch.bfloat16)
    got = clip_loss(img, txt, s, chunk_size=16)
    assert got.dtype == torch.float32
    # bf16 inputs: the logits themselves carry ~50 * 2^-8 error, the loss about that much.
    assert abs(got.item() - ref_clip(img.float(), txt.float(), 50.0).item()) < 0.2


# ---------------------------------------------------------------------- local rows vs global columns


@pytest.mark.parametrize("chunk", [None, 5])
def test_local_rows_split_reproduces_global_batch(chunk):
    """Splitting rows over W simulated ranks: mean of the per-rank losses and its gradient are global."""
    n, w = 24, 3
    img, txt = _features(n, 8, torch.float64, seed=5)
    s = torch.tensor(20.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    ref = ClipLoss()(*a)
    per = n // w
    parts = [
        clip_loss(b[0][r * per:(r + 1) * per], b[1][r * per:(r + 1) * per], b[2], chunk,
                  all_image_features=b[0], all_text_features=b[1], offset=r * per)
        for r in range(w)
    ]
    split = torch.stack(parts).mean()
    torch.testing.assert_close(split, ref, rtol=1e-12, atol=1e-12)  # float64, summation order only
    for ga, gb in zip(_grads(ref, a), _grads(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)


def test_infonce_rows_offset_picks_the_right_positive():
    q, k = _features(10, 6, torch.float64, seed=6)
    s = torch.tensor(5.0, dtype=torch.float64)
    logits = 5.0 * q[3:6] @ k.T
    expected = torch.logsumexp(logits, 1) - logits[torch.arange(3), torch.arange(3, 6)]
    for chunk in (None, 4):
        torch.testing.assert_close(infonce_rows(q[3:6], k, s, 3, chunk), expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- alignment / uniformity


def test_align_and_uniform_match_float64_formulas():
    x, y = _features(17, 5, torch.float64, seed=7)
    ref_align = sum(torch.linalg.norm(x[i] - y[i]) ** 2 for i in range(17)) / 17
    torch.testing.assert_close(align_loss(x, y), ref_align, rtol=1e-12, atol=0)
    ref_align3 = sum(torch.linalg.norm(x[i] - y[i]) ** 3 for i in range(17)) / 17
    torch.testing.assert_close(align_loss(x, y, alpha=3), ref_align3, rtol=1e-12, atol=0)
    for t in (2.0, 0.5):
        pairs = [math.exp(-t * torch.linalg.norm(x[i] - x[j]).item() ** 2) for i in range(17) for j in range(i + 1, 17)]
        ref_uniform = math.log(sum(pairs) / len(pairs))
        # float64; the |a|^2+|b|^2-2ab expansion loses ~1e-15 absolute per distance.
        assert abs(uniform_loss(x, t).item() - ref_uniform) < 1e-12


def test_uniform_gradient_finite_for_duplicates():
    x = F.normalize(torch.randn(6, 4, dtype=torch.float64), dim=1)
    x = torch.cat([x, x[:2]]).requires_grad_(True)  # identical rows: distance exactly 0
    (g,) = torch.autograd.grad(uniform_loss(x), x)
    assert torch.isfinite(g).all()


# ---------------------------------------------------------------------- objective


def test_objective_clip_terms_and_metrics():
    img, txt = _features(32, 16, torch.float32, seed=8)
    s = torch.tensor(14.0, requires_grad=True)
    obj = build_objective(LossConfig(clip=1.0, align=0.5))
    total, terms = obj(img, txt, s)
    expected_clip = clip_loss(img, txt, s)
    expected_align = align_loss(img, txt)
    torch.testing.assert_close(total, expected_clip + 0.5 * expected_align, rtol=1e-6, atol=0)  # float32 sum
    assert set(terms) == {"loss", "loss/clip", "loss/align", "align", "uniform_image", "uniform_text"}
    assert all(isinstance(v, float) for v in terms.values())
    assert terms["loss/clip"] == pytest.approx(expected_clip.item(), rel=1e-6)
    assert terms["align"] == pytest.approx(expected_align.item(), rel=1e-6)
    assert terms["uniform_image"] == pytest.approx(uniform_loss(img.double()).item(), rel=1e-5)
    assert terms["uniform_text"] == pytest.approx(uniform_loss(txt.double()).item(), rel=1e-5)
    total.backward()
    assert s.grad is not None and torch.isfinite(s.grad)


def test_objective_tiled_matches_dense_and_clamps_scale():
    img, txt = _features(40, 8, torch.float32, seed=9)
    dense = build_objective(LossConfig(chunk_size=None, max_logit_scale=50.0))
    tiled = build_objective(LossConfig(chunk_size=16, max_logit_scale=50.0))
    s = torch.tensor(80.0)
    ld, _ = dense(img, txt, s)
    lt, _ = tiled(img, txt, s)
    torch.testing.assert_close(ld, clip_loss(img, txt, torch.tensor(50.0)))
    torch.testing.assert_close(lt, ld, rtol=1e-5, atol=0)  # float32 tiled vs dense


def test_gather_features_is_identity_without_process_group():
    img, txt = _features(4, 3)
    labels = torch.arange(4)
    a, b, c, offset = gather_features(img, txt, labels)
    assert a is img and b is txt and c is labels and offset == 0


def test_bad_inputs_raise_clear_errors():
    img, txt = _features(4, 3)
    with pytest.raises(DataError, match="same shape"):
        clip_loss(img, txt[:3], torch.tensor(1.0))
    with pytest.raises(ConfigError, match="chunk_size"):
        clip_loss(img, txt, torch.tensor(1.0), chunk_size=0)
    with pytest.raises(ConfigError, match="offset"):
        clip_loss(img[:2], txt[:2], torch.tensor(1.0), all_image_features=img, all_text_features=txt, offset=3)
