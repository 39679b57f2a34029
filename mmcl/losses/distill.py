"""Knowledge distillation between CLIP models (`distill_loss`): the KL divergence from a teacher's image->text
and text->image softmax distributions over the batch to the student's, dense or tiled."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .clip import DenseLogSumExp, dense_logits
from .errors import LossInputError
from .inputs import Gathered, check_chunk, check_pair, gathered_columns
from .precision import float32_math
from .tiling import TiledLogSumExp, as_scale, exp_, tile_elements, upcast


class TeacherFeatures(NamedTuple):
    """A teacher's view of this rank's batch: L2-normalised features (B, Dt) of the images and of the captions,
    and its logit scale (0-dim). They carry no gradient; Dt need not be the student's width."""

    image: Tensor
    text: Tensor
    scale: Tensor


def _teacher_probs_(logits: Tensor, lse: Tensor) -> Tensor:
    """softmax rows of a teacher tile, in place: exp(logits - lse), with the terms a float32 sum cannot see
    (below e^-63 of the row's total) set to ~0 without forming subnormals (`tiling.exp_`)."""
    return exp_(logits.sub_(lse[:, None]))


class _TeacherWeightedProducts(torch.autograd.Function):
    """``sum_i sum_j p_t(i, j) * s * q_i . k_j`` (a 0-dim tensor), with the teacher's probabilities p_t given by
    their row-weighted products with the keys and queries: ``kbar = P_t K`` (n, D) and ``qbar = P_t^T Q`` (M, D).

    Gradients: ``s * kbar`` for the queries, ``s * qbar`` for the keys, ``sum_i q_i . kbar_i`` for the scale.
    """

    @staticmethod
    @float32_math
    def forward(ctx, queries, keys, logit_scale, kbar, qbar):
        ctx.save_for_backward(queries, logit_scale, kbar, qbar)
        return logit_scale * torch.linalg.vecdot(queries, kbar).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    @float32_math
    def backward(ctx, grad):
        queries, logit_scale, kbar, qbar = ctx.saved_tensors
        g = grad * logit_scale
        grad_scale = grad * torch.linalg.vecdot(queries, kbar).sum()
        return g * kbar, g * qbar, grad_scale.reshape(logit_scale.shape), None, None


def _teacher_pass(queries, keys, t_queries, t_keys, t_scale, chunk_size):
    """For one direction, without gradient: the teacher's row log-sum-exp ``lse_t`` (n,), ``sum_j p_t T`` per row
    (n,), ``kbar = P_t K`` (n, D) and ``qbar = P_t^T Q`` (M, D), where K, Q are the student's keys and queries.

    The teacher's logits are formed once, in stripes of whole rows holding at most `chunk_size` rows and about
    as many logits as a `TiledLogSumExp` tile (at least one row), so memory stays linear in n + M."""
    n, m = queries.shape[0], keys.shape[0]
    rows_per = max(1, min(chunk_size, tile_elements(queries.device) // max(m, 1)))
    ts = t_queries * t_scale
    lse = torch.empty(n, dtype=queries.dtype, device=queries.device)
    expected_t = torch.empty(n, dtype=queries.dtype, device=queries.device)
    kbar = torch.empty_like(queries)
    qbar = torch.zeros(keys.shape, dtype=queries.dtype, device=queries.device)
    for r0 in range(0, n, rows_per):
        rows = slice(r0, r0 + rows_per)
        logits = ts[rows] @ t_keys.T  # (rows, M)
        lse[rows] = torch.logsumexp(logits, dim=1)
        p = _teacher_probs_(logits.clone(), lse[rows])
        expected_t[rows] = torch.linalg.vecdot(p, logits)
        kbar[rows] = p @ keys
        qbar.addmm_(p.T, queries[rows])
    return lse, expected_t, kbar, qbar


def _kl_rows_sum(queries, keys, logit_scale, t_queries, t_keys, t_scale, chunk_size):
    """Sum over the n rows of KL(p_teacher || p_student) for the queries against the keys (one direction)."""
    if chunk_size is None:
        student = dense_logits(queries, keys, logit_scale)  # (n, M) float32 at least
        with torch.no_grad():
            teacher = dense_logits(t_queries, t_keys, t_scale)
            lse_t = torch.logsumexp(teacher, dim=1)
            p = _teacher_probs_(teacher.clone(), lse_t)
            expected_t = (p * teacher).sum(dim=1)
        lse_s = DenseLogSumExp.apply(student, 1)
        cross = (p * student).sum()
    else:
        with torch.no_grad():
            lse_t, expected_t, kbar, qbar = _teacher_pass(queries.detach(), keys.detach(), t_queries, t_keys,
                                                          t_scale, chunk_size)
        lse_s = TiledLogSumExp.apply(queries, keys, logit_scale, chunk_size, False)
        cross = _TeacherWeightedProducts.apply(queries, keys, logit_scale, kbar, qbar)
    # KL_i = sum_j p_t (T_ij - S_ij) - lse_t(i) + lse_s(i)
    return (expected_t - lse_t).sum() + lse_s.sum() - cross


@float32_math
def distill_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    teacher_image: Tensor,
    teacher_text: Tensor,
    teacher_scale: Tensor,
    chunk_size: Optional[int] = None,
    *,
    gathered: Optional[Gathered] = None,
) -> Tensor:
    """KL divergence from the teacher's to the student's contrastive distributions, both directions averaged.

    For image i, p(i -> .) is the softmax over the batch's captions of scale * cosine, computed by each model
    with its own features and its own scale; likewise p(t -> .) for caption t over the images. The loss is
    ``(mean_i KL(p_teacher(i -> .) || p_student(i -> .)) + mean_t KL(p_teacher(t -> .) || p_student(t -> .))) / 2``,
    zero exactly when the student's distributions are the teacher's. The teacher's inputs carry no gradient; the
    student's features and scale get exact ones (with respect to the student's logits, (p_student - p_teacher) /
    B per row).

    Args:
        image_features, text_features: (n, D) the student's, L2-normalised.  logit_scale: 0-dim, the student's.
        teacher_image, teacher_text: (n, Dt) the teacher's, L2-normalised.  teacher_scale: 0-dim.
        chunk_size: None for the dense (n, M) logits; an int computes the same value and gradients in tiles of
            that many rows (memory linear in n + M, `TiledLogSumExp`).
        gathered: the global batch gathered over ranks (as in `clip_loss`), with the teacher's columns
            (``all_teacher_image``, ``all_teacher_text``, without gradient); this rank's rows against the global
            columns.
    Returns:
        0-dim tensor (float32 for half-precision inputs).
    """
    check_pair(image_features, text_features)
    check_pair(teacher_image, teacher_text)
    check_chunk(chunk_size)
    if teacher_image.shape[0] != image_features.shape[0]:
        raise LossInputError(f"the teacher's features hold {teacher_image.shape[0]} rows, the student's "
                             f"{image_features.shape[0]} (expected one teacher row per pair)")
    if gathered is not None and (gathered.all_teacher_image is None or gathered.all_teacher_text is None):
        raise LossInputError("the distill term needs the teacher's features gathered over ranks with the student's "
                             "(gather_batch(..., teacher=...))")
    logit_scale = as_scale(logit_scale, image_features)
    t_scale = as_scale(teacher_scale, teacher_image).detach()
    image_features, text_features = upcast(image_features, text_features)
    all_teacher = (None, None) if gathered is None else (gathered.all_teacher_image, gathered.all_teacher_text)
    t_img, t_txt, all_t_img, all_t_txt = (None if x is None else x.detach().to(image_features.dtype)
                                          for x in (teacher_image, teacher_text, *all_teacher))
    t_scale = t_scale.to(image_features.dtype)
    all_img, all_txt, offset, single = gathered_columns(image_features, text_features, gathered)
    if single:
        all_t_img, all_t_txt = t_img, t_txt
    elif all_t_img.shape[0] != all_img.shape[0] or all_t_txt.shape != all_t_img.shape:
        raise LossInputError(f"gathered teacher features must be ({all_img.shape[0]}, Dt) for both modalities (got "
                             f"{tuple(all_t_img.shape)} and {tuple(all_t_txt.shape)})")
    n = image_features.shape[0]
    i2t = _kl_rows_sum(image_features, all_txt, logit_scale, t_img, all_t_txt, t_scale, chunk_size)
    t2i = _kl_rows_sum(text_features, all_img, logit_scale, t_txt, all_t_img, t_scale, chunk_size)
    return (i2t + t2i) / (2 * n)
