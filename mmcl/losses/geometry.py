"""Alignment and uniformity of the embedding (`align_loss`, `uniform_loss`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import LossInputError
from .precision import float32_math, scaled_products
from .tiling import acc_dtype


@float32_math
def align_loss(x: Tensor, y: Tensor, alpha: float = 2.0) -> Tensor:
    """Alignment ``mean_i ||x_i - y_i||_2^alpha`` over positive pairs.

    Args: x, y: (B, D) float, row i of each a positive pair.  alpha: exponent > 0.
    Returns: 0-dim tensor.
    """
    if x.shape != y.shape:
        raise LossInputError(f"align_loss needs equal shapes (got {tuple(x.shape)} and {tuple(y.shape)})")
    acc = acc_dtype(x.dtype)
    x, y = x.to(acc), y.to(acc)  # half-precision differences of near-equal features lose most of their bits
    if alpha == 2:
        # The squared norm avoids the sqrt, whose gradient is undefined at x_i == y_i.
        return (x - y).pow(2).sum(dim=1).mean()
    return (x - y).norm(p=2, dim=1).pow(alpha).mean()


def sq_dists(a: Tensor, b: Tensor) -> Tensor:
    # |a|^2 + |b|^2 - 2 a.b: one matmul and a smooth gradient everywhere (cdist's is undefined at 0). Built
    # in float32 at least: in bf16 the three terms of size ~1 cancel to distances with an error of ~1e-2.
    acc = acc_dtype(a.dtype)
    a, b = a.to(acc), b.to(acc)
    d = a.pow(2).sum(1, keepdim=True) + b.pow(2).sum(1)[None, :] - 2 * scaled_products(a, b)
    return d.clamp_min(0)


@float32_math
def uniform_loss(x: Tensor, t: float = 2.0) -> Tensor:
    """Uniformity ``log mean_{i<j} exp(-t ||x_i - x_j||^2)`` over distinct pairs of one batch.

    Args: x: (B, D) float with B >= 2.  t: temperature > 0.
    Returns: 0-dim tensor (computed as a log-sum-exp, so it is finite for any spread).
    """
    b = x.shape[0]
    if b < 2:
        raise LossInputError(f"uniform_loss needs at least 2 items (got {b})")
    x = x.to(acc_dtype(x.dtype))  # one cast, so both uses of x add their gradients in float32
    i, j = torch.triu_indices(b, b, offset=1, device=x.device)
    d = sq_dists(x, x)[i, j]
    return torch.logsumexp(-t * d, dim=0) - math.log(d.numel())


def uniform_log_partial(x: Tensor, all_x: Tensor, offset: int, t: float) -> Tensor:
    """``log sum_{i local, j != offset+i} exp(-t ||x_i - all_x_j||^2)`` (ordered pairs), a 0-dim tensor."""
    d = sq_dists(x, all_x)
    rows = torch.arange(x.shape[0], device=x.device)
    d = d.index_put((rows, rows + offset), torch.full((), math.inf, dtype=d.dtype, device=d.device))
    return torch.logsumexp((-t * d).flatten(), dim=0)


# ----------------------------------------------------------------------------------------------------------
# Gathering across ranks
# ----------------------------------------------------------------------------------------------------------


