"""TIPS' masked prediction (Maninis et al. 2025; SigLIP 2's second stage), in iBOT's form (Zhou et al. 2022): the
student sees the image with a share of its patch embeddings replaced by a learned mask token, and its patch head's
scores at the masked positions must match the teacher's (an EMA of the student, which sees the image unmasked) at the
same positions, as distributions over K prototypes: the teacher's centred and sharpened (`teacher_targets`), the
student's at temperature tau_s, cross-entropy between them:

    loss of a sample = sum over its masked patches m of  -sum_k p_t[m, k] log_softmax(s[m] / tau_s)_k

averaged over the batch's masked patches. A sample term (`mmcl.losses.sample_terms`): each sample's sum and its
number of masked patches; the patch centre is moved by `mmcl.losses.self_distill.next_center` like SILC's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import LossInputError
from .sample_terms import SampleLosses


def masked_losses(student_logits: Tensor, targets: Tensor, student_temp: float = 0.1) -> SampleLosses:
    """Each sample's summed cross-entropy over its masked patches and their number.

    Args:
        student_logits: (n, M, K) the student patch head's scores at each sample's M masked positions.
        targets: (n, M, K) the teacher's distributions at the same positions (`teacher_targets`).
        student_temp: tau_s (iBOT: 0.1).
    """
    if student_logits.shape != targets.shape or student_logits.dim() != 3:
        raise LossInputError(f"masked student scores and teacher targets of one shape (n, M, K) expected, got "
                             f"{tuple(student_logits.shape)} and {tuple(targets.shape)}")
    m = student_logits.shape[1]
    log_p = F.log_softmax(student_logits.float() / float(student_temp), dim=-1)
    sums = -(targets.float() * log_p).sum(dim=(1, 2))  # (n,): over the masked positions and the prototypes
    return SampleLosses(sums, torch.full_like(sums.detach(), float(m)))
