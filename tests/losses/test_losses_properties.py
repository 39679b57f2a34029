"""Property-based tests of the losses: hypothesis searches batch sizes, widths, tile shapes that split rows and
columns unevenly, logit scales in [1, 100], feature alignments, labels and dtypes for a case where

- a tiled path differs from its dense specification (float64, values and gradients),
- a dense path differs from an independent float64 transcription of the paper's definition written here,
- half-precision inputs give a non-finite result, or one that differs from the float32 computation on the same
  (rounded) inputs, which is what "computed in float32 whatever the features' dtype" promises.

The searches are derandomized (a fixed sequence of examples), so CI runs the same cases every time; a failure
prints the smallest example hypothesis found.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmcl import losses
from mmcl.losses import (
    Gathered,
    align_loss,
    clip_loss,
    hard_negative_clip_loss,
    logsumexp_rows,
    mochi_loss,
    siglip_loss,
    supcon_loss,
    uniform_loss,
)

from helpers import ref_clip, ref_supcon

# derandomize: the same examples on every run (and no example database written next to the code).
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
ALIGNMENTS = ("random", "correlated", "duplicate", "dominant")


def make_features(n, d, alignment, seed):
    """Unit (image, text) pairs in float64. correlated: cosine ~0.7 per pair; duplicate: ~0.999;
    dominant: ~0.97 with every other pair far away (the positive dominates its row at scale 100)."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, d, generator=g, dtype=torch.float64)
    noise = torch.randn(n, d, generator=g, dtype=torch.float64) / max(d, 1) ** 0.5
    txt = {"random": noise, "correlated": img / d ** 0.5 + noise, "duplicate": img / d ** 0.5 + 0.03 * noise,
           "dominant": img / d ** 0.5 + 0.25 * noise}[alignment]
    return F.normalize(img, dim=1), F.normalize(txt, dim=1)


@st.composite
def problems(draw, min_n=1, max_n=160):
    n = draw(st.integers(min_n, max_n))
    d = draw(st.sampled_from([1, 2, 3, 8, 17, 32]))
    # At most ~12 row blocks and ~8 column tiles, so one example stays in the tens of milliseconds.
    chunk = draw(st.integers(max(1, n // 12), n + 3))
    width = draw(st.integers(max(chunk, n // 8, 1), max(chunk, n // 8, 1) + n))
    return dict(
        n=n, d=d, chunk=chunk,
        tile_elements=chunk * width,  # tiles of chunk x width logits (width < n splits the columns)
        scale=draw(st.floats(1.0, 100.0)),
        alignment=draw(st.sampled_from(ALIGNMENTS)),
        seed=draw(st.integers(0, 2**16)),
    )


@contextlib.contextmanager
def tile_elements(value):
    old = losses.tiling._TILE_ELEMENTS
    losses.tiling._TILE_ELEMENTS = value
    try:
        yield
    finally:
        losses.tiling._TILE_ELEMENTS = old


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def value_and_grads(fn, *inputs):
    xs = leaves(*inputs)
    out = fn(*xs)
    # Inputs a loss does not read (the scale of align_loss) get a zero gradient.
    return out.detach(), torch.autograd.grad(out, xs, allow_unused=True, materialize_grads=True)


def assert_same(got, ref, rtol, atol, what):
    (v1, g1), (v2, g2) = got, ref
    torch.testing.assert_close(v1, v2, rtol=rtol, atol=atol, msg=lambda m: f"{what} value: {m}")
    for i, (a, b) in enumerate(zip(g1, g2)):
        # Gradients are compared relative to the largest entry of the reference (a softmax gradient spans many
        # orders of magnitude; the small entries carry absolute, not relative, rounding).
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * max(1.0, b.abs().max().item()),
                                   msg=lambda m: f"{what} gradient {i}: {m}")


def draw_labels(draw_kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    if draw_kind == "none":
        return None
    if draw_kind == "all_equal":
        return torch.zeros(n, dtype=torch.long)
    if draw_kind == "repeats":
        return torch.randint(0, max(1, n // 3), (n,), generator=g)
    return torch.randint(-1, 3, (n,), generator=g)  # "unlabelled": many -1 among few classes


# ---------------------------------------------------------------------- float64 transcriptions of the definitions
# (clip's and supcon's are in helpers.py, shared with test_clip.py and test_supcon.py)


def ref_siglip(img, txt, s, b):
    """Zhai et al. 2023: -1/n sum_ij log sigmoid(z_ij (s x_i.y_j + b)), z = 1 on the diagonal, else -1."""
    n = img.shape[0]
    z = 2 * torch.eye(n, dtype=img.dtype) - 1
    return -F.logsigmoid(z * (s * img @ txt.T + b)).sum() / n


def ref_hard_negative(img, txt, s, tau_plus, beta):
    """Robinson et al. 2021 (HCL) in linear space, float64: N = n - 1 negatives, importance weights e^{beta L}
    normalised by their mean, Ng = max((sum_j w_j e^{L_j} - tau+ N e^p) / (1 - tau+), N e^{-s}). The published
    code clamps at N e^{-1/t} the same way; mmcl detaches the floor (a safeguard, not a target). The scale and
    beta are kept where e^{(1+beta) s} fits in float64."""
    n = img.shape[0]
    off = ~torch.eye(n, dtype=torch.bool)
    out = 0
    for q, k in ((img, txt), (txt, img)):
        logits = s * q @ k.T
        pos = logits.diagonal().exp()
        e = logits.exp() * off
        w = (beta * logits).exp() * off
        reweighted = (n - 1) * (w * e).sum(1) / w.sum(1)
        floor = (n - 1) * math.exp(-float(s.detach()))
        ng = ((reweighted - tau_plus * (n - 1) * pos) / (1 - tau_plus)).clamp(min=floor)
        out = out + (-torch.log(pos / (pos + ng))).mean() / 2
    return out


def ref_uniform(x, t):
    """Wang & Isola 2020: log of the mean over distinct pairs of exp(-t ||x_i - x_j||^2)."""
    n = x.shape[0]
    sq = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)
    i, j = torch.triu_indices(n, n, offset=1)
    return torch.log(torch.exp(-t * sq[i, j]).mean())


def ref_align(x, y, alpha):
    return (x - y).norm(dim=1).pow(alpha).mean()


# ---------------------------------------------------------------------- tiled == dense, float64


@settings(max_examples=40, **SETTINGS)
@given(p=problems(), cols=st.booleans(), split=st.integers(0, 3))
def test_tiled_logsumexp_and_clip_equal_dense(p, cols, split):
    img, txt = make_features(p["n"], p["d"], p["alignment"], p["seed"])
    s = torch.tensor(p["scale"], dtype=torch.float64)
    with tile_elements(p["tile_elements"]):
        dense = value_and_grads(lambda q, k, s: sum(x.sum() for x in logsumexp_rows(q, k, s, None, True)), img,
                                txt, s)
        tiled = value_and_grads(lambda q, k, s: sum(x.sum() for x in logsumexp_rows(q, k, s, p["chunk"], True)),
                                img, txt, s)
        assert_same(tiled, dense, 1e-10, 1e-10, "lse rows+cols")
        # Local rows [o, o + r) of a gathered batch (a rank's share), as the distributed path calls it.
        o = min(split, p["n"] - 1)
        r = max(1, (p["n"] - o) // 2)

        def local(chunk):
            return lambda a, b, s: clip_loss(a[o:o + r], b[o:o + r], s, chunk, gathered=Gathered(a, b, offset=o))

        fns = [lambda chunk: (lambda a, b, s: clip_loss(a, b, s, chunk))] + ([local] if not cols else [])
        for make in fns:
            assert_same(value_and_grads(make(p["chunk"]), img, txt, s), value_and_grads(make(None), img, txt, s),
                        1e-10, 1e-10, "clip")


@settings(max_examples=30, **SETTINGS)
@given(p=problems(), labels=st.sampled_from(["none", "all_equal", "repeats", "unlabelled"]))
def test_tiled_supcon_equals_dense(p, labels):
    img, txt = make_features(p["n"], p["d"], p["alignment"], p["seed"])
    y = draw_labels(labels, p["n"], p["seed"])
    s = torch.tensor(p["scale"], dtype=torch.float64)
    with tile_elements(p["tile_elements"]):
        tiled = value_and_grads(lambda a, b, s: supcon_loss(a, b, y, s, p["chunk"]), img, txt, s)
    dense = value_and_grads(lambda a, b, s: supcon_loss(a, b, y, s), img, txt, s)
    assert_same(tiled, dense, 1e-10, 1e-10, "supcon")


@settings(max_examples=30, **SETTINGS)
@given(p=problems(), bias=st.floats(-20.0, 5.0))
def test_tiled_siglip_equals_dense(p, bias):
    img, txt = make_features(p["n"], p["d"], p["alignment"], p["seed"])
    s, b = torch.tensor(p["scale"], dtype=torch.float64), torch.tensor(bias, dtype=torch.float64)
    with tile_elements(p["tile_elements"]):
        tiled = value_and_grads(lambda x, y, s, b: siglip_loss(x, y, s, b, chunk_size=p["chunk"]), img, txt, s, b)
    dense = value_and_grads(lambda x, y, s, b: siglip_loss(x, y, s, b), img, txt, s, b)
    assert_same(tiled, dense, 1e-10, 1e-10, "siglip")


@settings(max_examples=40, **SETTINGS)
@given(p=problems(min_n=2), tau_plus=st.sampled_from([0.0, 0.05, 0.1, 0.5]),
       beta=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_tiled_hard_negative_equals_dense(p, tau_plus, beta):
    img, txt = make_features(p["n"], p["d"], p["alignment"], p["seed"])
    s = torch.tensor(p["scale"], dtype=torch.float64)
    with tile_elements(p["tile_elements"]):
        tiled = value_and_grads(lambda a, b, s: hard_negative_clip_loss(a, b, s, tau_plus, beta, p["chunk"]),
                                img, txt, s)
    dense = value_and_grads(lambda a, b, s: hard_negative_clip_loss(a, b, s, tau_plus, beta), img, txt, s)
    assert_same(tiled, dense, 1e-9, 1e-9, "hard negative")


@settings(max_examples=20, **SETTINGS)
@given(p=problems(min_n=2, max_n=60), queue=st.integers(0, 40), n_hard=st.integers(1, 12),
       mixes=st.tuples(st.integers(0, 4), st.integers(0, 4)))
def test_tiled_mochi_equals_dense(p, queue, n_hard, mixes):
    img, txt = make_features(p["n"], p["d"], p["alignment"], p["seed"])
    iq, tq = make_features(queue, p["d"], "random", p["seed"] + 1) if queue else (None, None)
    s = torch.tensor(p["scale"], dtype=torch.float64)

    def loss(chunk):
        return lambda a, b, s: mochi_loss(a, b, s, n_hard, mixes[0], mixes[1], 0.5,
                                          torch.Generator().manual_seed(p["seed"]), iq, tq, chunk_size=chunk)

    with tile_elements(p["tile_elements"]):
        tiled = value_and_grads(loss(p["chunk"]), img, txt, s)
    assert_same(tiled, value_and_grads(loss(None), img, txt, s), 1e-10, 1e-10, "mochi")


# ---------------------------------------------------------------------- dense == float64 definition


@settings(max_examples=40, **SETTINGS)
@given(p=problems(max_n=80), labels=st.sampled_from(["none", "all_equal", "repeats", "unlabelled"]),
       bias=st.floats(-20.0, 5.0), tau_plus=st.sampled_from([0.0, 0.1, 0.5]), beta=st.sampled_from([0.0, 1.0, 3.0]))
def test_dense_losses_equal_float64_definitions(p, labels, bias, tau_plus, beta):
    img, txt = make_features(p["n"], p["d"], p["alignment"], p["seed"])
    y = draw_labels(labels, p["n"], p["seed"])
    s = torch.tensor(p["scale"], dtype=torch.float64)
    b = torch.tensor(bias, dtype=torch.float64)
    cases = [
        ("clip", lambda x, t, s: clip_loss(x, t, s), lambda x, t, s: ref_clip(x, t, s)),
        ("supcon", lambda x, t, s: supcon_loss(x, t, y, s), lambda x, t, s: ref_supcon(x, t, y, s)),
        ("siglip", lambda x, t, s: siglip_loss(x, t, s, b), lambda x, t, s: ref_siglip(x, t, s, b)),
        ("align", lambda x, t, s: align_loss(x, t), lambda x, t, s: ref_align(x, t, 2.0)),
    ]
    if p["n"] >= 2:
        cases.append(("uniform", lambda x, t, s: uniform_loss(x, 2.0), lambda x, t, s: ref_uniform(x, 2.0)))
        cases.append(("hard negative", lambda x, t, s: hard_negative_clip_loss(x, t, s, tau_plus, beta),
                      lambda x, t, s: ref_hard_negative(x, t, s, tau_plus, beta)))
    for name, ours, ref in cases:
        got, want = value_and_grads(ours, img, txt, s), value_and_grads(ref, img, txt, s)
        if name == "hard negative":
            # The transcription works in linear space: e^{(1+beta) L} and the subtraction of tau+ N e^p lose up
            # to ~1e-12 relative to the largest term; the loss and its gradient keep that much.
            assert_same(got, want, 1e-8, 1e-9, name)
        elif name == "uniform":
            # Our kernel expands ||a - b||^2 = |a|^2 + |b|^2 - 2 a.b: absolute error ~1e-15 per distance.
            assert_same(got, want, 1e-9, 1e-11, name)
        else:
            assert_same(got, want, 1e-10, 1e-10, name)


# ---------------------------------------------------------------------- half precision


@settings(max_examples=15, **SETTINGS)
@given(p=problems(min_n=2, max_n=64), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       tiled=st.booleans(), labels=st.sampled_from(["none", "repeats", "unlabelled"]))
def test_half_inputs_compute_in_float32(p, dtype, tiled, labels):
    """Half features (and scale) give exactly the float32 computation on the same rounded values, finite, in
    float32; and that stays within float32 rounding of float64 on those values."""
    img, txt = make_features(p["n"], p["d"], p["alignment"], p["seed"])
    img, txt = img.to(dtype), txt.to(dtype)
    s = torch.tensor(p["scale"], dtype=dtype)
    bias = torch.tensor(-10.0, dtype=dtype)
    y = draw_labels(labels, p["n"], p["seed"])
    chunk = p["chunk"] if tiled else None
    gen = lambda: torch.Generator().manual_seed(p["seed"])  # noqa: E731
    cases = {
        "clip": lambda a, b, s: clip_loss(a, b, s, chunk),
        "supcon": lambda a, b, s: supcon_loss(a, b, y, s, chunk),
        "siglip": lambda a, b, s: siglip_loss(a, b, s, bias.to(a.dtype), chunk_size=chunk),
        "debiased": lambda a, b, s: hard_negative_clip_loss(a, b, s, 0.1, 0.0, chunk),
        "hard negative": lambda a, b, s: hard_negative_clip_loss(a, b, s, 0.1, 1.0, chunk),
        "mochi": lambda a, b, s: mochi_loss(a, b, s, 4, 2, 2, 0.5, gen(), chunk_size=chunk),
        "uniform": lambda a, b, s: uniform_loss(a, 2.0) + uniform_loss(b, 2.0),
        "align": lambda a, b, s: align_loss(a, b),
    }
    with tile_elements(p["tile_elements"]):
        for name, fn in cases.items():
            half_value, half_grads = value_and_grads(fn, img, txt, s)
            f32_value, f32_grads = value_and_grads(fn, img.float(), txt.float(), s.float())
            assert half_value.dtype == torch.float32, name
            assert torch.isfinite(half_value) and all(torch.isfinite(g).all() for g in half_grads), name
            assert torch.equal(half_value, f32_value), (name, half_value.item(), f32_value.item())
            for h, f in zip(half_grads, f32_grads):
                assert torch.equal(h, f.to(h.dtype)), name  # the float32 gradient, rounded once at the end
            if name in ("clip", "supcon", "siglip", "uniform", "align"):
                ref = fn(img.double(), txt.double(), s.double())
                # float32 logits of size <= 100: ~1e-5 absolute each; sums over up to 64^2 pairs stay ~1e-5
                # relative (rounding errors of both signs).
                assert abs(half_value.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item())), (name, ref.item())
