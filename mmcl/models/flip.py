"""FLIP patch dropout (Li et al. 2023) with masks that are a function of the run's seed and step.

`SeededPatchDropout` takes the place of open_clip's ``PatchDropout`` in a ViT image tower (after the positional
embedding, before the pre-norm): in training it keeps a random ``1 - prob`` of each image's patch tokens (the class
token always), so the transformer runs on fewer tokens; in evaluation mode it passes everything through.

open_clip draws its masks from the global RNG. mmcl derives them from ``(seed, step, micro-batch)`` instead, so that

- a run resumed after a kill draws the masks an uninterrupted run draws (nothing else, e.g. a data-loader start,
  can shift them);
- 2 processes equal 1 process: each image's noise is keyed by its row in the global micro-batch (rank r of W,
  local batch n: rows ``r*n .. (r+1)*n``, the rows a single process with the global batch gives those samples);
- accumulation's two passes over a micro-batch (features without autograd, then again with it) see the same masks:
  the k-th forward of a step is micro-batch ``k mod accum_steps``.

The loop calls `begin_step(modules, step, masked, prob)` before each optimiser step; ``train.unmasked_steps`` turns
the masking off for the last steps (FLIP's unmasked tuning phase) and ``train.phases`` sets each phase's rate.

The noise is a counter-based hash of (seed, global row, patch) computed by tensor ops on the images' device
(`patch_keys`), not a draw from a host generator: no generator is built per step, nothing is copied from the host
in the forward, the masks are the same on every device, and a compiled tower traces the draw into its graph
(the step's seeds are a buffer, so a new step changes data, not the graph).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio) spreading (seed, step, micro) over the seed space


def mask_seed(seed: int, step: int, micro: int) -> int:
    """The generator seed of micro-batch `micro` of optimiser step `step` (a 63-bit integer)."""
    x = (int(seed) & 0xFFFFFFFF) * _MIX + (int(step) + 1) * (_MIX >> 7) + int(micro) * 0x2545F4914F6CDD1D
    return x & 0x7FFFFFFFFFFFFFFF


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 `x` in [0, 2**32) without int64 overflow (``c`` split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xor-shift / multiply rounds) of int64 `x` in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def patch_keys(seeds: torch.Tensor, rows: torch.Tensor, patches: int) -> torch.Tensor:
    """(len(rows), patches) int64 random keys, distinct within a row: a hash of the seed (`seeds`: int64 (2,), its
    low and high 32 bits), the global row and the patch index, in the low 32 bits of a 48-bit key whose high part
    is the patch index (so that equal hashes cannot tie). Pure integer arithmetic: the same keys on every device."""
    lo, hi = seeds[0], seeds[1]
    row_key = _mix32(_mix32((rows & _M32) ^ lo) ^ hi)  # (n,)
    cols = torch.arange(patches, device=rows.device, dtype=torch.int64)
    h = _mix32(row_key[:, None] ^ _mul32(cols + 1, 0x9E3779B9)[None, :])
    h = _mix32(h ^ lo)
    return (h << 16) | cols[None, :]


class SeededPatchDropout(nn.Module):
    """Keeps ``max(1, int(P * (1 - prob)))`` of the P patch tokens per image in training (the first token, the
    class token, always): those with the largest keys (`patch_keys`). No parameters and no saved buffer; the state
    dict of the tower is unchanged."""

    def __init__(self, prob: float, seed: int = 0, rank: int = 0, world_size: int = 1, accum_steps: int = 1):
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch dropout must be in [0, 1), got {prob}")
        self.prob, self.seed, self.rank, self.world_size, self.accum_steps = prob, seed, rank, world_size, accum_steps
        # Row k: micro-batch k's seed (low, high 32 bits) from the next forward on; the forward rotates the rows,
        # so the k-th forward of a step uses micro-batch k mod accum_steps without a host-side counter.
        self.register_buffer("seeds", torch.zeros(accum_steps, 2, dtype=torch.int64), persistent=False)
        self.step, self.masked = 0, True
        self.begin_step(0)

    def begin_step(self, step: int, masked: bool = True, prob: Optional[float] = None) -> None:
        """Masks for optimiser step `step`, none when not `masked`; `prob`, when given, is the rate from this step on
        (a phase's, `mmcl.training.phases`)."""
        if prob is not None:
            if not 0.0 <= prob < 1.0:
                raise ValueError(f"patch dropout must be in [0, 1), got {prob}")
            self.prob = float(prob)
        self.step, self.masked = step, masked
        seeds = [mask_seed(self.seed, step, micro) for micro in range(self.accum_steps)]
        host = torch.tensor([[s & _M32, s >> 32] for s in seeds], dtype=torch.int64)
        if self.seeds.is_cuda:
            host = host.pin_memory()  # copied while the device works on, not waited for
        self.seeds.copy_(host, non_blocking=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.masked or self.prob == 0.0:
            return x
        first, patches = x[:, :1], x[:, 1:]
        n, p = patches.shape[0], patches.shape[1]
        keep = max(1, int(p * (1.0 - self.prob)))
        # The rows of this process in the global micro-batch (rank r of W, local batch n: rows r*n .. (r+1)*n).
        rows = torch.arange(self.rank * n, (self.rank + 1) * n, device=x.device, dtype=torch.int64)
        keys = patch_keys(self.seeds[0], rows, p)
        if self.accum_steps > 1:
            self.seeds.copy_(self.seeds.roll(-1, dims=0))
        # The kept patches stay in their spatial order (the positional embedding is already added; order only
        # matters for reading the masks).
        idx = keys.topk(keep, dim=1).indices.sort(dim=1).values
        kept = patches.gather(1, idx.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
        return torch.cat([first, kept], dim=1)

    def extra_repr(self) -> str:
        return f"prob={self.prob}"


def begin_step(modules: Iterable[SeededPatchDropout], step: int, masked: bool, prob: Optional[float] = None) -> None:
    """Before optimiser step `step` (0-based): masks for this step, or none when not `masked`; at rate `prob` when
    given (the step's phase's), else at each module's own."""
    for m in modules:
        m.begin_step(step, masked, prob)
