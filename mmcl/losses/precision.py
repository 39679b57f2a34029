"""`float32_math`: every loss computes in float32 (or float64), with autocast off, whatever context calls it.

Training calls the objective inside ``accelerator.autocast()``. Left to autocast, the losses' matmuls would run in
bf16 or fp16: bf16 logits at scale 100 are off by ~0.4, gradients by a few percent (dL/ds by ~14 % at scale 50),
the tiles' float32 buffers would be written from bf16 products (an index-put dtype error), and an autograd
Function could compute its forward in one precision and its recomputing backward in another. The decorator is the
one place that fixes the precision: it turns autocast off for the inputs' device type and casts half-precision
floating tensors among the arguments (also inside tuples, lists and named tuples) to float32, each distinct tensor
once (so a tensor passed twice stays one tensor, and its gradients add up in float32 behind a single cast). Every
public entry point, the objective and every autograd Function's forward and backward wear it; backward needs it
too because autograd runs it under the autocast state of the ``backward()`` caller.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_HALF = (torch.float16, torch.bfloat16)
# The device types with autocast, asked once here: a compiled step then reads a constant. (torch 2.11's dynamo
# cannot trace the builtin behind `torch.amp.is_autocast_available` and broke the compiled loss's graph there, on
# an H100.) Another device type is asked when it is met, outside compilation.
_AUTOCAST_TYPES = frozenset(t for t in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")
                            if torch.amp.is_autocast_available(t))


def _has_autocast(device_type: str) -> bool:
    if device_type in _AUTOCAST_TYPES:
        return True
    return device_type != "meta" and not torch.compiler.is_compiling() and torch.amp.is_autocast_available(device_type)


def _cast(x: Any, seen: Dict[int, torch.Tensor]) -> Any:
    if torch.is_tensor(x):
        if x.dtype not in _HALF:
            return x
        if id(x) not in seen:
            seen[id(x)] = x.float()
        return seen[id(x)]
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple (TeacherFeatures, Gathered)
        return type(x)(*(_cast(v, seen) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, seen) for v in x)
    return x


def _device_type(args, kwargs) -> Optional[str]:
    for x in (*args, *kwargs.values()):
        if torch.is_tensor(x):
            return x.device.type
        if isinstance(x, (tuple, list)):
            found = _device_type(x, {})
            if found is not None:
                return found
    return None


def float32_math(fn: F) -> F:
    """Run `fn` with autocast disabled for its tensors' device type and half-precision tensor arguments as
    float32 (float32 and float64 tensors, integer tensors and other arguments pass unchanged)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        seen: Dict[int, torch.Tensor] = {}
        args = tuple(_cast(a, seen) for a in args)
        kwargs = {k: _cast(v, seen) for k, v in kwargs.items()}
        device_type = _device_type(args, kwargs)
        # Autocast of one device type changes only the ops on that device's tensors; a device type without
        # autocast (meta) has nothing to turn off.
        if device_type is None or not _has_autocast(device_type):
            return fn(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class _ScaledProducts(torch.autograd.Function):
    """``scale * a @ b.T`` whose backward also runs in float32 with autocast off.

    Autograd's own backward of a matmul calls a matmul, and it runs under the autocast state of the
    ``backward()`` caller: a loss called and differentiated inside ``autocast()`` would get bf16 gradients from
    float32 logits. Elementwise ops and reductions keep their input dtype under autocast, so the matmuls that
    build logits and distances are the only built-in ops of the losses that need this.
    """

    @staticmethod
    @float32_math
    def forward(ctx, a, b, scale):
        products = a @ b.T
        ctx.save_for_backward(a, b, scale, products if scale.requires_grad else None)
        return products * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    @float32_math
    def backward(ctx, grad):
        a, b, scale, products = ctx.saved_tensors
        grad_scaled = grad * scale
        grad_a = grad_scaled @ b if ctx.needs_input_grad[0] else None
        grad_b = grad_scaled.T @ a if ctx.needs_input_grad[1] else None
        grad_s = (grad * products).sum().reshape(scale.shape) if ctx.needs_input_grad[2] else None
        return grad_a, grad_b, grad_s


def scaled_products(a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scale * a @ b.T`` (``a @ b.T`` without a scale) in float32 at least, forward and backward, under any
    autocast (`_ScaledProducts`). Args: a (n, D), b (M, D), scale 0-dim or None. Returns (n, M)."""
    if scale is None:
        scale = torch.ones((), dtype=a.dtype, device=a.device)
    return _ScaledProducts.apply(a, b, scale)
