"""Terms scored sample by sample from the model's own outputs: a sample's loss reads only that sample (its caption's
tokens, its views' patches), so it is never gathered, and the global batch's value is the sum of the samples' losses
over the sum of what they count (a caption's tokens), as one process holding the whole batch computes it.

A sample term is a row of the objective's table (`mmcl.losses.objective.TABLE`) with ``outputs``: the keys of the
model's forward dict it reads (``logits`` and ``labels`` for the captioning term). Its ``per_sample(objective,
outputs)`` gives a `SampleLosses` of this rank's rows; the objective's `ContrastiveObjective.sample_losses` makes
them after each forward, and the term's value is `sample_mean` of them.

Why sums and counts rather than a mean per rank: a caption's token count varies, so a rank's mean of token losses
is not its share of the batch's mean; with the counts summed over ranks (one all-reduce on the device, no host
read), each rank's loss ``W * sum(sums_r) / sum_r' sum(counts_r')`` averages over ranks (DDP) to exactly the
global batch's mean: two processes equal one, and micro-batches (GradCache) equal the whole batch, since the sums
are held as leaves whose gradient each micro-batch's re-run takes back (`mmcl.training.step`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor


class SampleLosses(NamedTuple):
    """This rank's samples' losses for one sample term: ``sums`` (n,) each sample's loss summed over its items
    (float32, with gradient), ``counts`` (n,) how many items each sum holds (no gradient; 0 for a sample the term
    skips). The term's value over a batch is ``sums.sum() / counts.sum()``."""

    sums: Tensor
    counts: Tensor

    def rows(self, start: int, stop: int) -> "SampleLosses":
        return SampleLosses(self.sums[start:stop], self.counts[start:stop])


def joined(parts) -> SampleLosses:
    """The micro-batches' `SampleLosses` concatenated in order."""
    parts = list(parts)
    return SampleLosses(torch.cat([p.sums for p in parts]), torch.cat([p.counts for p in parts]))


def sample_mean(x: SampleLosses, world_size: int = 1) -> Tensor:
    """This rank's 0-dim loss for a sample term: ``world_size * sum(sums) / (global sum of counts)``, whose mean over
    ranks is the global batch's ``sum(sums) / sum(counts)`` (see the module docstring). The counts are summed over
    the ranks with one all-reduce when ``world_size > 1``; a batch that counts nothing gives 0."""
    count = x.counts.detach().to(torch.float32).sum()
    if world_size > 1:
        count = count.clone()
        dist.all_reduce(count)
    return x.sums.float().sum() * world_size / count.clamp_min(1.0)
