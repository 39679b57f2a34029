"""Alignment and uniformity (Wang & Isola 2020) against float64 transcriptions of their formulas."""

import math

import torch
import torch.nn.functional as F

from mmcl.losses import align_loss, uniform_loss

from helpers import pair_features


def test_align_and_uniform_match_float64_formulas():
    x, y = pair_features(17, 5, torch.float64, seed=7)
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
