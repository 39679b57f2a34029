"""Float32 math for every loss (mmcl/losses/precision.py): half inputs computed in float32 with autocast off, each
tensor cast once, and `scaled_products` float32 forward and backward under any autocast, against float64."""

from typing import NamedTuple

import torch

from mmcl.losses.precision import float32_math, scaled_products

from helpers import pair_features


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_half_arguments_arrive_as_float32_once_and_the_rest_unchanged():
    seen = {}

    @float32_math
    def look(x, y, pair, items, other, n=None):
        seen.update(x=x, y=y, pair=pair, items=items, other=other, n=n)
        return x @ x.T

    half = torch.randn(3, 4, dtype=torch.bfloat16)
    f16 = torch.randn(3, 4, dtype=torch.float16)
    f64, ints = torch.randn(3, 4, dtype=torch.float64), torch.arange(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = look(half, half, Pair(f16, f64), [ints, half], "text", n=f16)
    assert out.dtype == torch.float32  # autocast is off inside: the matmul stays in float32
    assert seen["x"].dtype == torch.float32 and seen["x"] is seen["y"] is seen["items"][1]  # one cast per tensor
    assert torch.equal(seen["x"], half.float())
    assert isinstance(seen["pair"], Pair) and seen["pair"].a.dtype == torch.float32 and seen["pair"].b is f64
    assert seen["items"][0] is ints and seen["other"] == "text" and seen["n"] is seen["pair"].a
    assert look.__name__ == "look"


def test_scaled_products_equal_the_float64_products_and_gradients():
    a, b = pair_features(6, 8, seed=1)
    a, b = a.clone().requires_grad_(), b[:5].clone().requires_grad_()
    s = torch.tensor(12.5, requires_grad=True)
    out = scaled_products(a, b, s)
    a64, b64, s64 = (t.detach().double().requires_grad_() for t in (a, b, s))
    ref = s64 * a64 @ b64.T
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)
    weights = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    (out * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    for got, want in ((a.grad, a64.grad), (b.grad, b64.grad), (s.grad, s64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scaled_products(a, b).double(), a64 @ b64.T, rtol=1e-6, atol=1e-6)


def test_scaled_products_forward_and_backward_stay_float32_under_autocast():
    a, b = pair_features(4, 8, seed=3)
    results = []
    for autocast in (False, True):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        s = torch.tensor(30.0, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = scaled_products(x, y, s)
            out.logsumexp(dim=1).sum().backward()
        assert out.dtype == x.grad.dtype == y.grad.dtype == s.grad.dtype == torch.float32
        results.append((out.detach(), x.grad, y.grad, s.grad))
    for off, on in zip(*results):
        assert torch.equal(off, on)
