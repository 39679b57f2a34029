"""The captioning term (CoCa, Yu et al. 2022; the decoder of SigLIP 2's LocCa): a decoder reads the image's tokens and
predicts its caption token by token (teacher forcing); the loss is the cross-entropy of the next token, averaged over
the batch's caption tokens (padding left out), as open_clip's ``CoCaLoss`` computes its caption part.

It is a sample term (`mmcl.losses.sample_terms`): each caption's summed token losses and its token count, so the
batch's mean over tokens is exact over micro-batches and processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import LossInputError
from .sample_terms import SampleLosses


def caption_losses(logits: Tensor, labels: Tensor, pad_id: int = 0) -> SampleLosses:
    """Each caption's summed next-token cross-entropy and its token count.

    Args:
        logits: (n, L, V) the decoder's scores of each position's next token (any float dtype; computed in float32).
        labels: (n, L) long, the tokens to predict; ``pad_id`` marks padding, which counts nothing.
        pad_id: the tokenizer's padding token (open_clip's tokenizers: 0).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise LossInputError(f"caption logits (n, L, V) and labels (n, L) expected, got {tuple(logits.shape)} and "
                             f"{tuple(labels.shape)}")
    labels = labels.to(logits.device).long()
    tokens = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=pad_id, reduction="none")
    keep = labels != pad_id
    return SampleLosses(tokens.sum(dim=1), keep.sum(dim=1).to(torch.float32))
