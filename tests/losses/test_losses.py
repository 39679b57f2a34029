"""Loss math against open_clip and float64 transcriptions of each paper's formula."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss, SigLipLoss

from mmcl import losses
from mmcl.config import LossConfig, MochiConfig
from mmcl.errors import ConfigError
from mmcl.losses import (
    FeatureQueue,
    Gathered,
    LossInputError,
    TiledLogSumExp,
    align_loss,
    clip_loss,
    debiased_clip_loss,
    gather_features,
    hard_negative_clip_loss,
    infonce_rows,
    logsumexp_rows,
    mochi_loss,
    siglip_loss,
    supcon_loss,
    uniform_loss,
)
from mmcl.training.step import objective_from_config

from helpers import ref_clip, ref_supcon


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


@pytest.fixture(params=["default_tiles", "small_tiles"])
def tiles(request, monkeypatch):
    """Run a tiled test with the production tile area (whole rows at these sizes) and with tiles of 64
    logits, so several column tiles per row block are exercised too."""
    if request.param == "small_tiles":
        monkeypatch.setattr(losses.tiling, "_TILE_ELEMENTS", 64)
    return request.param


# ---------------------------------------------------------------------- clip vs open_clip


@pytest.mark.parametrize("n,d", [(1, 4), (7, 16), (64, 32), (130, 8)])
@pytest.mark.parametrize("scale", [1.0, 14.3, 100.0])
@pytest.mark.parametrize("chunk", [None, 16])
def test_clip_matches_open_clip_value_and_grads(n, d, scale, chunk, tiles):
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


@pytest.mark.parametrize("n,chunk", [(96, 32), (100, 32), (20, 1), (100, 100), (100, 256), (37, 5)])
@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_tiled_matches_dense_float32(n, chunk, scale, tiles):
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
    q, k = _features(48, 16, torch.float64, seed=8, correlated=True)
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
    q, k = _features(9, 4, dtype, seed=3, correlated=False)
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
    a, b = _leaves(q, k, s), _leaves(q, k, s)
    dense = logsumexp_rows(*a, with_cols=True)
    tiled = logsumexp_rows(*b, chunk_size=4, with_cols=True)
    for d, t in zip(dense, tiled):
        torch.testing.assert_close(t, d, rtol=1e-6, atol=1e-5)  # float32 log-sum-exps of size up to ~180
    (dense[0].sum() + dense[1].sum()).backward()
    (tiled[0].sum() + tiled[1].sum()).backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-6)  # float32 softmax sums


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
def test_local_rows_split_reproduces_global_batch(chunk, tiles):
    """Splitting rows over W simulated ranks: mean of the per-rank losses and its gradient are global."""
    n, w = 24, 3
    img, txt = _features(n, 8, torch.float64, seed=5)
    s = torch.tensor(20.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    ref = ClipLoss()(*a)
    per = n // w
    parts = [
        clip_loss(b[0][r * per:(r + 1) * per], b[1][r * per:(r + 1) * per], b[2], chunk,
                  gathered=Gathered(b[0], b[1], offset=r * per))
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
    obj = objective_from_config(LossConfig(clip=1.0, align=0.5))
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


def test_objective_without_metrics_skips_them_and_keeps_the_loss():
    """``with_metrics=False`` (steps that are not logged) leaves out the pairwise metrics and the host read of the
    terms; loss and terms agree."""
    img, txt = _features(32, 16, torch.float32, seed=9)
    s = torch.tensor(14.0)
    obj = objective_from_config(LossConfig(clip=1.0, align=0.5))
    full_total, full = obj(img, txt, s, with_metrics=True)
    total, terms = obj(img, txt, s, with_metrics=False)
    assert set(terms) == {"loss", "loss/clip", "loss/align"}
    assert "uniform_image" in full
    assert total.item() == full_total.item()
    # Left on the device (no host read on the steps a trainer does not log), equal to the logged numbers.
    assert all(isinstance(terms[k], torch.Tensor) and terms[k].dim() == 0 for k in terms)
    assert all(terms[k].item() == pytest.approx(full[k], rel=1e-6, abs=0) for k in terms)


def test_objective_tiled_matches_dense_and_uses_the_scale_as_given():
    """The objective applies no limit of its own to the scale (the model's parameter is clamped after each
    optimiser step, `models.clamp_logit_scale`, by ``model.max_logit_scale``, 100): a scale of 150 is used as 150."""
    assert "max_logit_scale" not in {f.name for f in dataclasses.fields(LossConfig)}  # the model's key, not a loss's
    img, txt = _features(40, 8, torch.float32, seed=9)
    dense = objective_from_config(LossConfig(chunk_size=None))
    tiled = objective_from_config(LossConfig(chunk_size=16))
    s = torch.tensor(150.0)
    ld, _ = dense(img, txt, s)
    lt, _ = tiled(img, txt, s)
    torch.testing.assert_close(ld, clip_loss(img, txt, torch.tensor(150.0)), rtol=0, atol=0)
    assert ld.item() != clip_loss(img, txt, torch.tensor(100.0)).item()
    torch.testing.assert_close(lt, ld, rtol=1e-5, atol=0)  # float32 tiled vs dense


def test_gather_features_is_identity_without_process_group():
    img, txt = _features(4, 3)
    labels = torch.arange(4)
    a, b, c, offset = gather_features(img, txt, labels)
    assert a is img and b is txt and c is labels and offset == 0


def test_bad_inputs_raise_clear_errors():
    img, txt = _features(4, 3)
    with pytest.raises(LossInputError, match="same shape"):
        clip_loss(img, txt[:3], torch.tensor(1.0))
    with pytest.raises(LossInputError, match="chunk_size"):
        clip_loss(img, txt, torch.tensor(1.0), chunk_size=0)
    with pytest.raises(LossInputError, match="offset"):
        clip_loss(img[:2], txt[:2], torch.tensor(1.0), gathered=Gathered(img, txt, offset=3))
    with pytest.raises(LossInputError, match="need both all_image_features and all_text_features"):
        clip_loss(img[:2], txt[:2], torch.tensor(1.0), gathered=Gathered(None, txt))
    with pytest.raises(LossInputError, match=r"gathered features must be \(M, 3\)"):
        clip_loss(img[:2], txt[:2], torch.tensor(1.0), gathered=Gathered(img, txt[:, :2]))


def test_losses_take_the_gathered_batch_as_one_object():
    """Every loss with a distributed layout takes the global batch's columns, their labels, the teacher's columns
    and this rank's offset as one `Gathered` (keyword ``gathered``), not as separate arguments."""
    import inspect

    from mmcl.losses import distill_loss

    separate = {"all_image_features", "all_text_features", "all_labels", "offset", "all_teacher_image",
                "all_teacher_text"}
    for fn in (clip_loss, supcon_loss, siglip_loss, debiased_clip_loss, hard_negative_clip_loss, mochi_loss,
               distill_loss):
        params = inspect.signature(fn).parameters
        assert params["gathered"].kind is inspect.Parameter.KEYWORD_ONLY, fn.__name__
        assert not separate & set(params), fn.__name__


# ---------------------------------------------------------------------- supervised contrastive


_LABELS = torch.tensor([0, 1, 0, 2, -1, 1, 0, 3, -1, 2, 5, 5, 7, 0, -1, 4, 4, 4, 9, 1])


@pytest.mark.parametrize("chunk", [None, 6])
def test_supcon_matches_float64_reference(chunk):
    img, txt = _features(20, 8, torch.float64, seed=10)
    s = torch.tensor(12.0, dtype=torch.float64)
    got = supcon_loss(img, txt, _LABELS, s, chunk)
    torch.testing.assert_close(got, ref_supcon(img, txt, _LABELS, 12.0), rtol=1e-12, atol=1e-12)  # float64


def test_supcon_tiled_matches_dense_grads(tiles):
    img, txt = _features(20, 8, torch.float32, seed=11)
    s = torch.tensor(30.0)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    dense = supcon_loss(a[0], a[1], _LABELS, a[2])
    tiled = supcon_loss(b[0], b[1], _LABELS, b[2], chunk_size=7)
    floor = 30.0 * 2**-23  # float32 rounding of logits of size <= s, as in the clip test
    torch.testing.assert_close(tiled, dense, rtol=1e-5, atol=floor)
    for gd, gt in zip(_grads(dense, a), _grads(tiled, b)):
        torch.testing.assert_close(gt, gd, rtol=1e-5, atol=floor)


def test_supcon_with_distinct_labels_equals_clip():
    img, txt = _features(33, 16, torch.float32, seed=12)
    s = torch.tensor(20.0)
    distinct = torch.randperm(33, generator=torch.Generator().manual_seed(0)) * 3
    for labels in (distinct, None, torch.full((33,), -1)):
        # Dense: the same float32 log-softmax values; only the order of the 33-term mean differs (~1 ulp each).
        torch.testing.assert_close(supcon_loss(img, txt, labels, s), clip_loss(img, txt, s), rtol=1e-6, atol=0)
        # Tiled: the positive logit comes from a row-wise dot product instead of the matmul; float32 rounding.
        torch.testing.assert_close(supcon_loss(img, txt, labels, s, 8), clip_loss(img, txt, s, 8), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 4])
def test_supcon_local_rows_split_reproduces_global_batch(chunk):
    img, txt = _features(20, 8, torch.float64, seed=13)
    s = torch.tensor(9.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    ref = supcon_loss(a[0], a[1], _LABELS, a[2])
    parts = [
        supcon_loss(b[0][r * 5:(r + 1) * 5], b[1][r * 5:(r + 1) * 5], _LABELS[r * 5:(r + 1) * 5], b[2], chunk,
                    gathered=Gathered(b[0], b[1], all_labels=_LABELS, offset=r * 5))
        for r in range(4)
    ]
    split = torch.stack(parts).mean()
    torch.testing.assert_close(split, ref, rtol=1e-12, atol=1e-12)  # float64, summation order only
    for ga, gb in zip(_grads(ref, a), _grads(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)


def test_supcon_rejects_bad_labels():
    img, txt = _features(4, 3)
    with pytest.raises(LossInputError, match="labels"):
        supcon_loss(img, txt, torch.zeros(3, dtype=torch.long), torch.tensor(1.0))
    with pytest.raises(LossInputError, match="labels"):
        supcon_loss(img, txt, torch.zeros(4), torch.tensor(1.0))


# ---------------------------------------------------------------------- SigLIP


@pytest.mark.parametrize("n,d,scale,bias", [(1, 4, 1.0, 0.0), (9, 16, 10.0, -10.0), (40, 8, 100.0, -3.0)])
def test_siglip_matches_open_clip_and_float64_formula(n, d, scale, bias):
    img, txt = _features(n, d, torch.float64, seed=n)
    s = torch.tensor(scale, dtype=torch.float64)
    b = torch.tensor(bias, dtype=torch.float64)
    a1, a2 = _leaves(img, txt, s, b), _leaves(img, txt, s, b)
    ours = siglip_loss(*a1)
    theirs = SigLipLoss()(*a2)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)  # float64 both
    for g1, g2 in zip(_grads(ours, a1), _grads(theirs, a2)):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    logits = scale * img @ txt.T + bias
    ref = -sum(
        math.log(1 / (1 + math.exp(-(1 if i == j else -1) * logits[i, j].item()))) for i in range(n) for j in range(n)
    ) / n
    assert abs(ours.item() - ref) <= 1e-10 * max(1.0, abs(ref))  # float64 vs Python floats


def test_siglip_local_rows_split_reproduces_global_batch():
    img, txt = _features(12, 8, torch.float64, seed=14)
    s, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s, bias), _leaves(img, txt, s, bias)
    ref = siglip_loss(*a)
    split = torch.stack([
        siglip_loss(b[0][r * 4:(r + 1) * 4], b[1][r * 4:(r + 1) * 4], b[2], b[3],
                    gathered=Gathered(None, b[1], offset=r * 4))
        for r in range(3)
    ]).mean()
    torch.testing.assert_close(split, ref, rtol=1e-12, atol=1e-12)  # float64, summation order only
    for ga, gb in zip(_grads(ref, a), _grads(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale,bias_value", [(10.0, -10.0), (100.0, -3.0)])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_tiled_siglip_equals_dense_in_value_and_gradients(chunk, scale, bias_value, tiles):
    img, txt = _features(13, 8, torch.float64, seed=21)
    s, bias = torch.tensor(scale, dtype=torch.float64), torch.tensor(bias_value, dtype=torch.float64)
    a, b = _leaves(img, txt, s, bias), _leaves(img, txt, s, bias)
    dense = siglip_loss(*a)
    tiled = siglip_loss(*b, chunk_size=chunk)
    torch.testing.assert_close(tiled, dense, rtol=1e-12, atol=1e-12)  # float64: summation order only
    for gt, gd in zip(_grads(tiled, b), _grads(dense, a)):
        torch.testing.assert_close(gt, gd, rtol=1e-10, atol=1e-12)
    # Local rows against gathered columns: each row's positive may fall in any column tile.
    for r, (lo, hi) in enumerate(((0, 5), (5, 9), (9, 13))):
        a, b = _leaves(img[lo:hi], txt, s, bias), _leaves(img[lo:hi], txt, s, bias)
        dense = siglip_loss(a[0], a[1][lo:hi], a[2], a[3], gathered=Gathered(None, a[1], offset=lo))
        tiled = siglip_loss(b[0], b[1][lo:hi], b[2], b[3], gathered=Gathered(None, b[1], offset=lo), chunk_size=chunk)
        torch.testing.assert_close(tiled, dense, rtol=1e-12, atol=1e-12)
        for gt, gd in zip(_grads(tiled, b), _grads(dense, a)):
            torch.testing.assert_close(gt, gd, rtol=1e-10, atol=1e-12)


def test_tiled_siglip_memory_stays_one_tile():
    """Saved activations: the dense loss keeps (n, n) logits for backward, the tiled one only (views of) its
    inputs, never a tile of logits."""
    n, d = 2048, 16
    img, txt = _features(n, d, torch.float32, seed=3)
    s, bias = torch.tensor(10.0), torch.tensor(-10.0)

    def largest_saved(**kw):
        leaves = _leaves(img, txt, s, bias)
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            siglip_loss(*leaves, **kw)
        return max(sizes)

    assert largest_saved() >= n * n  # the logits
    assert largest_saved(chunk_size=256) <= n * d  # at most the (n, d) features


# ---------------------------------------------------------------------- debiased / hard-negative


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
    img, txt = _features(13, 8, torch.float64, seed=15, correlated=False)
    got = hard_negative_clip_loss(img, txt, torch.tensor(5.0, dtype=torch.float64), tau_plus, beta, chunk)
    ref = ref_reweighted(img, txt, 5.0, tau_plus, beta)
    assert abs(got.item() - ref) <= 1e-10 * abs(ref)  # float64 log-space vs Python floats in linear space
    if beta == 0:
        deb = debiased_clip_loss(img, txt, torch.tensor(5.0, dtype=torch.float64), tau_plus, chunk)
        assert torch.equal(deb, got)


def test_debiased_floor_is_reached_and_matches_formula():
    # tau_plus = 0.9 with tight clusters makes the debiased estimate negative: the floor N e^{-s} applies.
    img, txt = _features(6, 4, torch.float64, seed=16)
    got = debiased_clip_loss(img, txt, torch.tensor(3.0, dtype=torch.float64), 0.9)
    assert abs(got.item() - ref_reweighted(img, txt, 3.0, 0.9, 0.0)) <= 1e-10


def test_debiased_and_hard_negative_reduce_to_clip():
    img, txt = _features(30, 16, torch.float32, seed=17)
    s = torch.tensor(14.0)
    a, b, c = _leaves(img, txt, s), _leaves(img, txt, s), _leaves(img, txt, s)
    clip = clip_loss(*a)
    deb = debiased_clip_loss(*b, tau_plus=0.0)
    hn = hard_negative_clip_loss(*c, tau_plus=0.0, beta=0.0)
    # float32: log-space formula vs cross-entropy, logits up to 14 rounded to ~1e-6.
    torch.testing.assert_close(deb, clip, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hn, clip, rtol=1e-6, atol=1e-6)
    for g1, g2, g3 in zip(_grads(clip, a), _grads(deb, b), _grads(hn, c)):
        torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g3, g1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tau_plus,beta", [(0.1, 0.0), (0.1, 1.0)])
def test_hard_negative_tiled_matches_dense(tau_plus, beta, tiles):
    img, txt = _features(40, 8, torch.float64, seed=18, correlated=False)
    s = torch.tensor(10.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    dense = hard_negative_clip_loss(*a, tau_plus=tau_plus, beta=beta)
    tiled = hard_negative_clip_loss(*b, tau_plus=tau_plus, beta=beta, chunk_size=7)
    # float64; only the order of the additions differs (the tiled path masks the positive inside each tile).
    torch.testing.assert_close(tiled, dense, rtol=1e-10, atol=1e-12)
    for ga, gb in zip(_grads(dense, a), _grads(tiled, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-8, atol=1e-10)


def test_hard_negative_local_rows_split_reproduces_global_batch():
    img, txt = _features(12, 8, torch.float64, seed=19, correlated=False)
    s = torch.tensor(8.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    ref = hard_negative_clip_loss(*a, tau_plus=0.1, beta=0.5)
    split = torch.stack([
        hard_negative_clip_loss(b[0][r * 6:(r + 1) * 6], b[1][r * 6:(r + 1) * 6], b[2], 0.1, 0.5, 4,
                                gathered=Gathered(b[0], b[1], offset=r * 6))
        for r in range(2)
    ]).mean()
    torch.testing.assert_close(split, ref, rtol=1e-10, atol=1e-12)  # float64
    for ga, gb in zip(_grads(ref, a), _grads(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------- MoCHi


def ref_mochi_direction(q, k, queue, s, n_hard, n_mix, n_query_mix, mix_max, gen):
    """Kalantidis et al. (2020) for one direction, per query in float64; draws in the documented order."""
    m = k.shape[0]
    cand = k if queue is None else torch.cat([k, queue])
    n_cand = cand.shape[0]
    hard_k = min(n_hard, n_cand - 1)
    pairs = torch.randint(0, hard_k, (m, n_mix, 2), generator=gen)
    alpha = torch.rand(m, n_mix, 1, generator=gen).double()
    picks = torch.randint(0, hard_k, (m, n_query_mix), generator=gen)
    beta = (torch.rand(m, n_query_mix, 1, generator=gen) * mix_max).double()
    total = 0.0
    for i in range(m):
        negatives = [j for j in range(n_cand) if j != i]
        sims = torch.stack([cand[j] @ q[i] for j in negatives])
        hard = [negatives[o] for o in torch.argsort(sims, descending=True)[:hard_k].tolist()]
        synthetic = []
        for t in range(n_mix):
            mix = alpha[i, t] * cand[hard[pairs[i, t, 0]]] + (1 - alpha[i, t]) * cand[hard[pairs[i, t, 1]]]
            synthetic.append(mix / mix.norm())
        for t in range(n_query_mix):
            mix = beta[i, t] * q[i] + (1 - beta[i, t]) * cand[hard[picks[i, t]]]
            synthetic.append(mix / mix.norm())
        keys = torch.cat([cand] + ([torch.stack(synthetic).detach()] if synthetic else []))
        logits = s * keys @ q[i]
        total = total + torch.logsumexp(logits, 0) - logits[i]
    return total / m


@pytest.mark.parametrize("with_queue", [False, True])
def test_mochi_matches_float64_reference(with_queue):
    img, txt = _features(10, 8, torch.float64, seed=20, correlated=False)
    iq, tq = _features(7, 8, torch.float64, seed=21) if with_queue else (None, None)
    s = torch.tensor(7.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    got = mochi_loss(a[0], a[1], a[2], 5, 4, 3, 0.5, torch.Generator().manual_seed(3), iq, tq)
    gen = torch.Generator().manual_seed(3)
    ref = (ref_mochi_direction(b[0], b[1], tq, b[2], 5, 4, 3, 0.5, gen)
           + ref_mochi_direction(b[1], b[0], iq, b[2], 5, 4, 3, 0.5, gen)) / 2
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)  # float64 both
    # The reference detaches the synthetic features too, so matching gradients shows none flows through them.
    for ga, gb in zip(_grads(got, a), _grads(ref, b)):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("with_queue,synth", [(False, (4, 3)), (True, (4, 3)), (True, (0, 0)), (False, (0, 2))])
def test_chunked_mochi_equals_dense(chunk, with_queue, synth, tiles):
    img, txt = _features(10, 8, torch.float64, seed=27, correlated=False)
    iq, tq = _features(7, 8, torch.float64, seed=28) if with_queue else (None, None)
    s = torch.tensor(7.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    dense = mochi_loss(*a, 5, *synth, 0.5, torch.Generator().manual_seed(3), iq, tq)
    chunked = mochi_loss(*b, 5, *synth, 0.5, torch.Generator().manual_seed(3), iq, tq, chunk_size=chunk)
    torch.testing.assert_close(chunked, dense, rtol=1e-12, atol=1e-12)  # float64: summation order only
    for gc, gd in zip(_grads(chunked, b), _grads(dense, a)):
        torch.testing.assert_close(gc, gd, rtol=1e-10, atol=1e-12)
    # Local rows against gathered columns (the distributed layout), chunked, still equal the global batch.
    c = _leaves(img, txt, s)
    parts = [mochi_loss(c[0][sl], c[1][sl], c[2], 5, *synth, 0.5, torch.Generator().manual_seed(3), iq, tq,
                        gathered=Gathered(c[0], c[1], offset=sl.start), chunk_size=chunk)
             for sl in (slice(0, 5), slice(5, 10))]
    torch.testing.assert_close(torch.stack(parts).mean(), dense, rtol=1e-12, atol=1e-12)


def test_chunked_mochi_keeps_no_logit_matrix_for_backward():
    n, q_len, d = 1024, 2048, 16
    img, txt = _features(n, d, torch.float32, seed=29)
    iq, tq = _features(q_len, d, torch.float32, seed=30)
    s = torch.tensor(10.0)

    def largest_saved(**kw):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            mochi_loss(*_leaves(img, txt, s), 8, 4, 3, 0.5, torch.Generator().manual_seed(0), iq, tq, **kw)
        return max(sizes)

    assert largest_saved() >= n * (n + q_len)  # the dense (n, M + Q) logits
    # No (n, M + Q) logits and no (n, s + s', D) synthetic features: at most the (M + Q, D) keys and queue.
    assert largest_saved(chunk_size=128) <= (n + q_len) * d


def test_mochi_without_synthesis_is_infonce():
    img, txt = _features(16, 8, torch.float32, seed=22)
    s = torch.tensor(20.0)
    g = torch.Generator().manual_seed(0)
    plain = mochi_loss(img, txt, s, 4, 0, 0, 0.5, g)
    torch.testing.assert_close(plain, clip_loss(img, txt, s), rtol=1e-6, atol=1e-6)  # float32, same CE
    iq, tq = _features(5, 8, torch.float32, seed=23)
    queued = mochi_loss(img, txt, s, 4, 0, 0, 0.5, g, iq, tq)
    expected = (infonce_rows(img, torch.cat([txt, tq]), s).mean()
                + infonce_rows(txt, torch.cat([img, iq]), s).mean()) / 2
    torch.testing.assert_close(queued, expected, rtol=1e-6, atol=1e-6)  # float32, same CE


def test_mochi_hard_negatives_raise_the_loss():
    img, txt = _features(64, 16, torch.float32, seed=24)
    s = torch.tensor(20.0)
    plain = clip_loss(img, txt, s)
    harder = mochi_loss(img, txt, s, 8, 16, 8, 0.5, torch.Generator().manual_seed(0))
    assert harder.item() > plain.item() + 1e-3  # extra negatives, some near the query, can only add mass


def test_mochi_local_rows_split_reproduces_global_batch():
    img, txt = _features(12, 8, torch.float64, seed=25, correlated=False)
    iq, tq = _features(5, 8, torch.float64, seed=26)
    s = torch.tensor(6.0, dtype=torch.float64)
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    ref = mochi_loss(*a, 4, 3, 2, 0.5, torch.Generator().manual_seed(5), iq, tq)
    parts = []
    for r in range(3):  # every rank seeds its generator identically
        sl = slice(r * 4, (r + 1) * 4)
        parts.append(mochi_loss(b[0][sl], b[1][sl], b[2], 4, 3, 2, 0.5, torch.Generator().manual_seed(5), iq, tq,
                                gathered=Gathered(b[0], b[1], offset=r * 4)))
    split = torch.stack(parts).mean()
    torch.testing.assert_close(split, ref, rtol=1e-12, atol=1e-12)  # float64
    for ga, gb in zip(_grads(ref, a), _grads(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)


def test_feature_queue_fifo_and_state_dict():
    q = FeatureQueue(5)
    assert q.get() is None and len(q) == 0
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    q.enqueue(x[:3])
    assert torch.equal(q.get(), x[:3])
    q.enqueue(x[3:])  # 6 items into 5 slots: the oldest is overwritten
    assert len(q) == 5 and sorted(q.get()[:, 0].tolist()) == [2.0, 4.0, 6.0, 8.0, 10.0]
    fresh = FeatureQueue(5)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh.get(), q.get()) and int(fresh.ptr) == int(q.ptr)
    q.enqueue(x[:2])
    fresh.enqueue(x[:2])
    assert torch.equal(fresh.get(), q.get())
    with pytest.raises(LossInputError, match="width"):
        q.enqueue(torch.zeros(1, 3))


def test_objective_state_dict_resumes_mochi_exactly():
    cfg = LossConfig(clip=1.0, mochi=MochiConfig(weight=0.5, n_hard=4, s=3, s_prime=2, queue_size=16))
    batches = [_features(8, 6, torch.float32, seed=30 + i) for i in range(4)]
    s = torch.tensor(10.0)
    run = objective_from_config(cfg)
    run.reseed(7)
    losses = [run(*b, s)[1]["loss/mochi"] for b in batches]
    half = objective_from_config(cfg)
    half.reseed(7)
    for b in batches[:2]:
        half(*b, s)
    state = half.state_dict()
    assert "image_queue.features" in state and "text_queue.features" in state and len(half.text_queue) == 16
    resumed = objective_from_config(cfg)
    resumed.load_state_dict(state)
    after = [resumed(*b, s)[1]["loss/mochi"] for b in batches[2:]]
    assert after == losses[2:]  # queue and generator both restored: bit-identical continuation
    assert losses[2] != objective_from_config(cfg)(*batches[2], s)[1]["loss/mochi"]  # the queue mattered


def test_objective_eval_mode_does_not_enqueue():
    cfg = LossConfig(mochi=MochiConfig(weight=1.0, n_hard=2, s=1, s_prime=1, queue_size=8))
    obj = objective_from_config(cfg).eval()
    obj(*_features(4, 3), torch.tensor(5.0))
    assert len(obj.image_queue) == 0


def test_objective_all_terms():
    cfg = LossConfig(clip=1.0, supcon=0.5, siglip=0.25, align=0.1, uniform=0.2, debiased=0.3, tau_plus=0.1,
                     hard_negative=0.4, hn_beta=0.5, chunk_size=5,
                     mochi=MochiConfig(weight=0.7, n_hard=4, s=2, s_prime=2, queue_size=0))
    img, txt = _features(12, 8, torch.float64, seed=40)
    s, b = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-5.0, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, -1, 2, 2, 2, 3, -1, 4, 5, 1])
    obj = objective_from_config(cfg)
    obj.reseed(1)
    total, terms = obj(img, txt, s, b, labels)
    expected = {
        "clip": clip_loss(img, txt, s),
        "supcon": supcon_loss(img, txt, labels, s),
        "siglip": siglip_loss(img, txt, s, b),
        "align": align_loss(img, txt),
        "uniform": (uniform_loss(img) + uniform_loss(txt)) / 2,
        "debiased": debiased_clip_loss(img, txt, s, 0.1),
        "hard_negative": hard_negative_clip_loss(img, txt, s, 0.1, 0.5),
        "mochi": mochi_loss(img, txt, s, 4, 2, 2, 0.5, torch.Generator().manual_seed(1)),
    }
    weights = {"clip": 1.0, "supcon": 0.5, "siglip": 0.25, "align": 0.1, "uniform": 0.2, "debiased": 0.3,
               "hard_negative": 0.4, "mochi": 0.7}
    for name, value in expected.items():
        assert terms[f"loss/{name}"] == pytest.approx(value.item(), rel=1e-10), name  # float64, tiled vs dense
    torch.testing.assert_close(total, sum(weights[k] * v for k, v in expected.items()), rtol=1e-10, atol=0)
    assert terms["loss"] == pytest.approx(total.item(), rel=1e-12)


def test_objective_terms_are_one_table_read_through_the_config_keys():
    """The objective's terms are one table (a row per term: name, needed inputs, computation), the one home of the
    term list; training reads each weight through its config key and a term's own section (``loss.mochi``) as the
    objective's keywords."""
    from mmcl.config import term_keys
    from mmcl.losses.objective import _TABLE

    assert tuple(row.name for row in _TABLE) == losses.TERMS == tuple(term_keys())
    assert term_keys()["mochi"] == "loss.mochi.weight"
    obj = objective_from_config(LossConfig(clip=0.0, mochi=MochiConfig(weight=0.5, n_hard=7, s=3, s_prime=2,
                                                                       mix_max=0.25, queue_size=12)))
    assert obj.weights["mochi"] == 0.5 and obj.active_terms() == ["mochi"]
    assert (obj.n_hard, obj.s, obj.s_prime, obj.mix_max, obj.image_queue.size) == (7, 3, 2, 0.25, 12)


def test_objective_input_errors_and_config_checks():
    """The objective rejects inputs it cannot take (LossInputError); loss settings are checked by the config's
    validation, every problem at once."""
    from mmcl.config import TrainConfig, validate

    with pytest.raises(LossInputError, match="logit bias"):
        objective_from_config(LossConfig(clip=0.0, siglip=1.0))(*_features(4, 3), torch.tensor(1.0))
    with pytest.raises(LossInputError, match="unknown loss terms"):
        losses.ContrastiveObjective({"clip": 1.0, "clap": 1.0})
    problems = validate(TrainConfig(loss=LossConfig(clip=0.0, siglip=1.0, debiased=1.0, tau_plus=1.0)))
    assert any("logit bias" in p for p in problems) and any("tau_plus" in p for p in problems)
    assert any("no loss term" in p for p in validate(TrainConfig(loss=LossConfig(clip=0.0))))
    problems = validate(TrainConfig(loss=LossConfig(mochi=MochiConfig(weight=1.0, n_hard=0)), ))
    assert any("loss.mochi needs" in p for p in problems)
    with pytest.raises(ConfigError, match="tau_plus.*hn_beta|hn_beta.*tau_plus"):
        from mmcl.config import load_config

        load_config(None, ["loss.hard_negative=1.0", "loss.tau_plus=1.5", "loss.hn_beta=-1"])


def test_objective_chunk_size_reaches_every_tiled_term():
    """loss.chunk_size tiles clip, siglip and MoCHi inside the objective without changing the numbers."""
    img, txt = _features(24, 8, torch.float64, seed=31, correlated=False)
    s, b = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-5.0, dtype=torch.float64)
    kw = dict(clip=1.0, siglip=0.5, mochi=MochiConfig(weight=0.5, n_hard=4, s=3, s_prime=2, queue_size=0))
    dense, tiled = objective_from_config(LossConfig(**kw)), objective_from_config(LossConfig(chunk_size=5, **kw))
    dense.reseed(0)
    tiled.reseed(0)
    (a_loss, a_terms), (c_loss, c_terms) = dense(img, txt, s, b), tiled(img, txt, s, b)
    torch.testing.assert_close(c_loss, a_loss, rtol=1e-12, atol=1e-12)
    for name in ("clip", "siglip", "mochi"):
        torch.testing.assert_close(c_terms[f"loss/{name}"], a_terms[f"loss/{name}"], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- regimes of a trained model, half precision


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
    a, b = _leaves(img, txt, s), _leaves(img, txt, s)
    dense = hard_negative_clip_loss(*a, tau_plus=tau_plus, beta=beta)
    tiled = hard_negative_clip_loss(*b, tau_plus=tau_plus, beta=beta, chunk_size=16)
    assert dense.item() > 0.1  # the twins keep it away from zero, so a relative comparison means something
    # float64: summation order only; the definition of "done" for this regime is 1e-9.
    torch.testing.assert_close(tiled, dense, rtol=1e-9, atol=1e-9)
    for ga, gb in zip(_grads(dense, a), _grads(tiled, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-9, atol=1e-9)
    ref = ref_reweighted(img, txt, 100.0, tau_plus, beta)
    assert abs(dense.item() - ref) <= 1e-9 * max(1.0, abs(ref))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 64])
def test_siglip_half_precision_is_finite_and_close_to_float64(dtype, chunk):
    img, txt = _features(256, 32, dtype, seed=51)
    s, bias = torch.tensor(100.0, dtype=dtype), torch.tensor(-10.0, dtype=dtype)
    got = siglip_loss(img, txt, s, bias, chunk_size=chunk)
    assert got.dtype == torch.float32 and torch.isfinite(got)
    # Reference on the same (rounded) inputs in float64: what is left is float32 accumulation, ~1e-6 relative.
    ref = siglip_loss(img.double(), txt.double(), s.double(), bias.double())
    assert abs(got.item() - ref.item()) <= 1e-5 * abs(ref.item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_losses_build_logits_in_float32_for_half_inputs(dtype):
    img, txt = _features(64, 32, dtype, seed=52)
    s = torch.tensor(100.0, dtype=dtype)
    labels = torch.tensor([0, 1, 2, -1] * 16)
    f64 = dict(image_features=img.double(), text_features=txt.double(), logit_scale=s.double())
    half = dict(image_features=img, text_features=txt, logit_scale=s)
    cases = [
        (clip_loss, {}),
        (supcon_loss, {"labels": labels}),
        (hard_negative_clip_loss, {"tau_plus": 0.1, "beta": 1.0}),
        (debiased_clip_loss, {"tau_plus": 0.1}),
    ]
    for fn, kw in cases:
        for chunk in (None, 16):
            got = fn(**half, **kw, chunk_size=chunk)
            ref = fn(**f64, **kw)
            assert got.dtype == torch.float32
            # Same rounded inputs: float32 logits of size <= 100 carry ~100 * 2^-24 each.
            assert abs(got.item() - ref.item()) <= 2e-5 * max(1.0, abs(ref.item())), (fn.__name__, chunk)
    got = mochi_loss(img, txt, s, 8, 4, 2, 0.5, torch.Generator().manual_seed(0))
    ref = mochi_loss(img.double(), txt.double(), s.double(), 8, 4, 2, 0.5, torch.Generator().manual_seed(0))
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 2e-5 * max(1.0, abs(ref.item()))
    for fn in (uniform_loss, lambda x: align_loss(x, txt)):
        got, ref = fn(img), fn(img.double()) if fn is uniform_loss else align_loss(img.double(), txt.double())
        assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))


def _mochi_cfg(chunk):
    return LossConfig(clip=0.0, chunk_size=chunk,
                      mochi=MochiConfig(weight=1.0, n_hard=8, s=4, s_prime=2, mix_max=0.5, queue_size=12))


@pytest.mark.parametrize("chunk", [None, 5])
def test_objective_with_queue_backward_after_enqueue(chunk):
    """forward (which enqueues the batch) then backward: the queue tensor the loss used must be left intact, and
    the gradient equals that of the loss against a copy of the queue taken before the step."""
    obj = objective_from_config(_mochi_cfg(chunk)).train()
    s = torch.tensor(10.0)
    for step in range(3):  # the queue fills (8 of 12), then wraps around
        img, txt = _leaves(*_features(8, 6, torch.float32, seed=60 + step), s)[:2]
        iq, tq = (None if q is None else q.clone() for q in (obj.image_queue.get(), obj.text_queue.get()))
        state = obj.generator.get_state()
        total, _ = obj(img, txt, s)
        total.backward()
        a = _leaves(img, txt)
        ref = mochi_loss(a[0], a[1], s, 8, 4, 2, 0.5, torch.Generator().set_state(state), iq, tq, chunk_size=chunk)
        ref.backward()
        torch.testing.assert_close(total, ref, rtol=0, atol=0)
        torch.testing.assert_close(img.grad, a[0].grad, rtol=0, atol=0)
        torch.testing.assert_close(txt.grad, a[1].grad, rtol=0, atol=0)
    assert len(obj.image_queue) == 12


@pytest.mark.parametrize("chunk", [None, 4])
def test_train_step_with_mochi_queue_backpropagates(chunk):
    from accelerate import Accelerator

    from mmcl import models
    from mmcl.config import load_config
    from mmcl.training.step import backward, forward_loss

    torch.manual_seed(0)
    model_cfg = load_config(None, ["model.vision_cfg={layers: 1, width: 32, head_width: 16}",
                                   "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]).model
    model, *_ = models.build(model_cfg)
    acc = Accelerator(cpu=True)
    obj = objective_from_config(_mochi_cfg(chunk)).train()
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        batch = {"image": torch.randn(6, 3, 64, 64, generator=g), "text": torch.randint(1, 1000, (6, 32), generator=g),
                 "label": torch.full((6,), -1, dtype=torch.long)}
        model.zero_grad()
        loss, terms, cache = forward_loss(model, obj, [batch], acc)
        # raised "modified by an inplace operation" once the queue held a batch
        backward(acc, model, loss, [batch], cache)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(gr).all() for gr in grads) and math.isfinite(terms["loss/mochi"])
    assert len(obj.text_queue) == 12


@pytest.mark.parametrize("noise", [0.5, 0.05])  # aligned pairs (cosine ~0.9) and near-duplicates (~0.999)
def test_tiled_float32_as_accurate_as_dense_when_the_positive_dominates(noise, tiles):
    """At scale 100 every row's positive dominates: the loss and its gradients are ~e^-50. The tiled path must
    form lse - positive and softmax_ii - 1 from the same rounded logit (it subtracted a separately computed
    positive, leaving one float32 ulp of a logit of 90, ~1e-6 in the loss and ~1e-8 in the gradients)."""
    g = torch.Generator().manual_seed(70)
    img = F.normalize(torch.randn(256, 64, generator=g, dtype=torch.float64), dim=1)
    txt = F.normalize(img + noise * torch.randn(256, 64, generator=g, dtype=torch.float64) / 8, dim=1)
    s = torch.tensor(100.0, dtype=torch.float64)
    ref = _leaves(img, txt, s)
    ref_loss = clip_loss(*ref)
    ref_grads = _grads(ref_loss, ref)
    errors = {}
    for chunk in (None, 64):
        x = _leaves(img.float(), txt.float(), s.float())
        loss = clip_loss(*x, chunk_size=chunk)
        errors[chunk] = [abs(loss.item() - ref_loss.item())] + [
            (gr.double() - rg).abs().max().item() for gr, rg in zip(_grads(loss, x), ref_grads)]
    # Within 10x of the dense float32 path's own error (which is ~1e-16 for the value here), plus 1e-20.
    for tiled_err, dense_err in zip(errors[64], errors[None]):
        assert tiled_err <= 10 * dense_err + 1e-20, (errors[64], errors[None])


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
        img, txt = _features(64, 16, torch.float64, seed=4)
        a, b = _leaves(img, txt), _leaves(img, txt)
        ours = clip_loss(*a, torch.tensor(scale, dtype=torch.float64))
        logits = scale * b[0] @ b[1].T
        target = torch.arange(64)
        ref = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
        for go, gr in zip(_grads(ours, a), _grads(ref, b)):
            torch.testing.assert_close(go, gr, rtol=1e-10, atol=1e-14)


def test_dense_clip_loss_forms_no_subnormal_gradient_at_scale_100():
    """At scale 100 with aligned pairs most softmax entries are float32 subnormals (x86 runs ~100x slower on
    them: a dense fwd+bwd at N = 2048 took 27 s instead of 0.3 s). F.cross_entropy's logit gradient is full
    of them; the dense InfoNCE's holds none and still equals float64 to float32 precision (a term below 1e-27
    of its row's coefficient may be raised to that, as the tiles do)."""
    from mmcl.losses.clip import DenseInfoNCE

    img, txt = _features(256, 64, torch.float64, seed=5, correlated=False)
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


def test_supcon_positive_mean_logits_gradcheck():
    """The tiled SupCon's positive term (class means rebuilt in backward): gradcheck with repeated, single and
    unlabelled (-1) classes, rows at an offset into a longer key set, and values against the autograd form."""
    from mmcl.losses.clip import _positive_logits
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
    ref = _positive_logits(q, _positive_means(k, q_labels, k_labels, 2), s, 0)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_dense_logsumexp_gradchecks_and_forms_no_subnormal():
    """DenseLogSumExp (dense SupCon, debiased, hard-negative, logsumexp_rows): gradcheck over rows and columns,
    and at scale 100 with aligned pairs a dense SupCon backward whose logit gradient holds no subnormal and
    equals float64's."""
    from mmcl.losses.clip import DenseLogSumExp

    x = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    for dim in (0, 1):
        assert torch.autograd.gradcheck(lambda x: DenseLogSumExp.apply(x, dim), (x,))
    img, txt = _features(128, 32, torch.float64, seed=6, correlated=False)
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


def test_the_losses_import_torch_and_nothing_else_of_mmcl():
    """Layering: every module of mmcl/losses imports only the standard library, torch and its own package."""
    import ast
    import sys
    from pathlib import Path

    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    for path in sorted((Path(losses.__file__).parent).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:  # from .x import ...: inside mmcl.losses
                    continue
                assert node.level == 0, f"{path.name} imports from outside mmcl.losses: {ast.unparse(node)}"
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


@pytest.mark.parametrize("s,s_prime", [(3, 2), (0, 2), (3, 0)])
def test_mochi_synthetic_logits_gradcheck_and_match_explicit_mixes(s, s_prime):
    """MoCHi's synthetic logits from dot products and norms (no mixed features formed): values and query and
    scale gradients equal to normalising the explicit mixes and taking s * q . u with u detached. (No
    gradcheck: the values read q . h from the ranking's dot products, fixed inputs of the function.)"""
    from mmcl.losses.mochi import SyntheticLogits

    g = torch.Generator().manual_seed(11)
    n, c, d, k = 4, 9, 5, 4
    q = F.normalize(torch.randn(n, d, dtype=torch.float64, generator=g), dim=1).requires_grad_(True)
    cand = F.normalize(torch.randn(c, d, dtype=torch.float64, generator=g), dim=1)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    hard = torch.stack([torch.randperm(c, generator=g)[:k] for _ in range(n)])
    hard_sims = (q.detach() @ cand.T).gather(1, hard)
    draws = (torch.randint(0, k, (n, s, 2), generator=g), torch.rand(n, s, 1, generator=g, dtype=torch.float64),
             torch.randint(0, k, (n, s_prime), generator=g),
             0.5 * torch.rand(n, s_prime, 1, generator=g, dtype=torch.float64))
    fn = lambda q, scale: SyntheticLogits.apply(q, scale, cand, hard, hard_sims, draws, 3)  # noqa: E731
    pairs, a, picks, b = draws
    qd = q.detach()
    first, second = cand[hard.gather(1, pairs[..., 0])], cand[hard.gather(1, pairs[..., 1])]
    mixes = [F.normalize(a * first + (1 - a) * second, dim=-1),
             F.normalize(b * qd[:, None] + (1 - b) * cand[hard.gather(1, picks)], dim=-1)]
    ref = scale * torch.einsum("nd,nkd->nk", q, torch.cat(mixes, dim=1))
    ours = fn(q, scale)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(ours.shape, dtype=torch.float64, generator=g)
    ours_grads = torch.autograd.grad((ours * w).sum(), (q, scale))
    for go, gr in zip(ours_grads, torch.autograd.grad((ref * w).sum(), (q, scale))):
        torch.testing.assert_close(go, gr, rtol=1e-10, atol=1e-12)


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


def test_feature_queue_reads_nothing_from_the_device_and_restores_its_position(monkeypatch):
    """The MoCHi queue keeps its write position on the host (no `.item()`/`int()` of a buffer per training step)
    and takes it back from a loaded state dict: the queue continues where the saved one would have."""
    from mmcl.losses import FeatureQueue

    torch.manual_seed(0)
    batches = [torch.randn(3, 4) for _ in range(5)]
    q, reads = FeatureQueue(7), []
    for name in ("item", "__int__", "__index__", "tolist", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k))
    for x in batches[:3]:
        q.enqueue(x)
        q.get()
    monkeypatch.undo()
    assert reads == [] and len(q) == 7
    restored = FeatureQueue(7)
    restored.load_state_dict(q.state_dict())
    assert len(restored) == 7 and int(restored.ptr) == 2
    for x in batches[3:]:
        q.enqueue(x)
        restored.enqueue(x)
    assert torch.equal(q.get(), restored.get())
    # the oldest rows were overwritten in order: batch 3 went to rows 2..4, batch 4 to rows 5, 6 and 0
    assert torch.equal(restored.get()[2:5], batches[3]) and torch.equal(restored.get()[5:7], batches[4][:2])
