"""SILC's local-to-global self-distillation (Naeem et al. 2023; SigLIP 2's second stage, Tschannen et al. 2025), in
DINO's form (Caron et al. 2021): a projection head maps an image embedding to scores over K prototypes; the teacher
(an EMA of the student, `mmcl.models.siglip2`) scores the whole image, and its scores, centred by a running mean
and sharpened by a low temperature, are the target distribution of the student's scores of each local crop:

    p_t = softmax((t - c) / tau_t)      (no gradient)        log p_s = log_softmax(s / tau_s)
    loss of a sample = sum over its teacher views g and student crops l of  -sum_k p_t[g, k] log p_s[l, k]

averaged over the batch's (view, crop) pairs. The centring (``c``, a running mean of the teacher's scores over the
batch) and the teacher's low temperature are what keep the two from collapsing: centring alone pushes towards the
uniform distribution, sharpening alone towards one prototype (DINO, section 5.3).

It is a sample term (`mmcl.losses.sample_terms`): a sample's loss reads only its own crops and views. The centre is
the one quantity that reads the batch; `next_center` moves it by the global batch's mean (its sums all-reduced by
the caller), so two processes equal one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .errors import LossInputError
from .sample_terms import SampleLosses


def teacher_targets(teacher_logits: Tensor, center: Tensor, temperature: float) -> Tensor:
    """The teacher's target distributions ``softmax((t - c) / tau_t)`` over the last dimension, in float32 and
    without gradient. `teacher_logits` (..., K), `center` (K,)."""
    with torch.no_grad():
        return F.softmax((teacher_logits.detach().float() - center.float()) / float(temperature), dim=-1)


def cross_entropy_sums(student_logits: Tensor, targets: Tensor, student_temp: float) -> Tensor:
    """(n,): each sample's summed cross-entropy ``-sum_k p_t[g, k] log_softmax(s[l] / tau_s)_k`` over all pairs of
    its `targets` (n, G, K) and `student_logits` (n, L, K) rows, computed in float32."""
    if student_logits.dim() != 3 or targets.dim() != 3 or student_logits.shape[0] != targets.shape[0] \
            or student_logits.shape[2] != targets.shape[2]:
        raise LossInputError(f"student scores (n, L, K) and teacher targets (n, G, K) expected, got "
                             f"{tuple(student_logits.shape)} and {tuple(targets.shape)}")
    log_p = F.log_softmax(student_logits.float() / float(student_temp), dim=-1)
    # sum over g, l of -<p_t[g], log p_s[l]> = -<sum_g p_t[g], sum_l log p_s[l]>: no (n, G, L) intermediate
    return -(targets.float().sum(dim=1) * log_p.sum(dim=1)).sum(dim=1)


def self_distill_losses(student_logits: Tensor, targets: Tensor, student_temp: float = 0.1) -> SampleLosses:
    """Each sample's summed local-to-global cross-entropy and its count of (teacher view, student crop) pairs.

    Args:
        student_logits: (n, L, K) the student head's scores of each sample's L local crops (any float dtype).
        targets: (n, G, K) the teacher's distributions (`teacher_targets`) of each sample's G global views.
        student_temp: tau_s (SILC, DINO: 0.1).
    """
    sums = cross_entropy_sums(student_logits, targets, student_temp)
    pairs = float(student_logits.shape[1] * targets.shape[1])
    return SampleLosses(sums, torch.full_like(sums.detach(), pairs))


def next_center(center: Tensor, batch_sum: Tensor, batch_count: Tensor, momentum: float,
                world_size: int = 1, weight: Tensor = None) -> Tensor:
    """The centre after a step: ``m c + (1 - m) mean``, the mean of the teacher's scores over the global batch
    (`batch_sum` (K,) and `batch_count` () of this process's rows, all-reduced together when ``world_size > 1``:
    one collective, no host read). `weight` (0-dim, optional) scales the move: 0 leaves the centre (a skipped
    step). Float32; returns a new tensor."""
    stats = torch.cat([batch_sum.detach().float().reshape(-1), batch_count.detach().float().reshape(1)])
    if world_size > 1:
        dist.all_reduce(stats)
    mean = stats[:-1] / stats[-1].clamp_min(1.0)
    rate = torch.full((), 1.0 - float(momentum), dtype=torch.float32, device=center.device)
    if weight is not None:
        rate = rate * weight.to(rate.device, torch.float32)
    return center.float() + rate * (mean - center.float())
