"""FLIP patch dropout (Li et al. 2023) with masks that are a function of the run's seed and step.

`SeededPatchDropout` takes the place of open_clip's ``PatchDropout`` in a ViT image tower (after the positional
embedding, before the pre-norm): in training it keeps a random ``1 - prob`` of each image's patch tokens (the class
token always), so the transformer runs on fewer tokens; in evaluation mode it passes everything through.

open_clip draws its masks from the global RNG. mmcl draws them from a generator seeded by ``(seed, step,
micro-batch)`` instead, so that

- a run resumed after a kill draws the masks an uninterrupted run draws (nothing else, e.g. a data-loader start,
  can shift them);
- 2 processes equal 1 process: the noise is drawn for the global micro-batch and each process takes its rows
  (rank r of W, local batch n: rows ``r*n .. (r+1)*n``, the rows a single process with the global batch gives
  those samples);
- accumulation's two passes over a micro-batch (features without autograd, then again with it) see the same masks:
  the k-th forward of a step is micro-batch ``k mod accum_steps``.

The loop calls `begin_step(modules, step, masked)` before each optimiser step; ``train.unmasked_steps`` turns the
masking off for the last steps (FLIP's unmasked tuning phase).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio) spreading (seed, step, micro) over the seed space


def mask_seed(seed: int, step: int, micro: int) -> int:
    """The generator seed of micro-batch `micro` of optimiser step `step` (a 63-bit integer)."""
    x = (int(seed) & 0xFFFFFFFF) * _MIX + (int(step) + 1) * (_MIX >> 7) + int(micro) * 0x2545F4914F6CDD1D
    return x & 0x7FFFFFFFFFFFFFFF


class SeededPatchDropout(nn.Module):
    """Keeps ``max(1, int(P * (1 - prob)))`` of the P patch tokens per image in training (the first token, the
    class token, always). No parameters; the state dict of the tower is unchanged."""

    def __init__(self, prob: float, seed: int = 0, rank: int = 0, world_size: int = 1, accum_steps: int = 1):
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch dropout must be in [0, 1), got {prob}")
        self.prob, self.seed, self.rank, self.world_size, self.accum_steps = prob, seed, rank, world_size, accum_steps
        self.step, self.calls, self.masked = 0, 0, True

    def begin_step(self, step: int, masked: bool = True) -> None:
        self.step, self.calls, self.masked = step, 0, masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.masked or self.prob == 0.0:
            return x
        micro = self.calls % self.accum_steps
        self.calls += 1
        first, patches = x[:, :1], x[:, 1:]
        n, p = patches.shape[0], patches.shape[1]
        keep = max(1, int(p * (1.0 - self.prob)))
        gen = torch.Generator().manual_seed(mask_seed(self.seed, self.step, micro))
        noise = torch.rand(n * self.world_size, p, generator=gen)[self.rank * n:(self.rank + 1) * n]
        # The kept patches stay in their spatial order (the positional embedding is already added; order only
        # matters for reading the masks).
        idx = noise.topk(keep, dim=1).indices.sort(dim=1).values.to(x.device)
        kept = patches.gather(1, idx.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
        return torch.cat([first, kept], dim=1)

    def extra_repr(self) -> str:
        return f"prob={self.prob}"


def begin_step(modules: Iterable[SeededPatchDropout], step: int, masked: bool) -> None:
    """Before optimiser step `step` (0-based): masks for this step, or none when not `masked`."""
    for m in modules:
        m.begin_step(step, masked)
