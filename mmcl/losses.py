"""Contrastive objectives for image-text pretraining.

Every loss is a pure function of L2-normalised features ``(B, D)`` and the already-exponentiated logit
scale ``s`` (a 0-dim tensor that carries gradient to the learned temperature ``t = log s``).

Distributed layout. The functions never read rank or world size. To train on a global batch split over
ranks, a caller gathers the features of all ranks (`gather_features`, which keeps the gradient and sums it
back in backward) and passes them as ``all_image_features`` / ``all_text_features`` together with
``offset``, the global index of this rank's first row. The local features are then the rows (queries), the
gathered ones the columns (keys), and the positive of local row ``i`` is global column ``offset + i``.
Each rank's loss is the mean over its own rows, so the mean over ranks equals the global-batch loss; with
the summing all-gather backward each rank holds ``W`` times the global gradient of its own features and
DDP's averaging of parameter gradients turns that into exactly the global-batch gradient.

Memory. ``chunk_size`` switches the softmax losses to a tiled computation (`TiledLogSumExp`): blocks of
``chunk_size x chunk_size`` logits are formed, reduced into running log-sum-exps and dropped; backward
recomputes each block once. Extra memory is O((n + M) * D + chunk_size**2) instead of O(n * M), with the
same value and gradients as the dense computation, which stays in this module as the specification.

`ContrastiveObjective` (built by `build_objective` from `mmcl.config.LossConfig`) combines the weighted
terms, gathers across ranks when ``torch.distributed`` is initialised, and holds the only state: the MoCHi
feature queues and the random generator used to synthesise negatives.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import ConfigError, DataError

__all__ = [
    "TiledLogSumExp",
    "logsumexp_rows",
    "infonce_rows",
    "clip_loss",
    "supcon_loss",
    "siglip_loss",
    "debiased_clip_loss",
    "hard_negative_clip_loss",
    "mochi_loss",
    "align_loss",
    "uniform_loss",
    "gather_features",
    "FeatureQueue",
    "ContrastiveObjective",
    "build_objective",
]

# Logged metrics only need a sample of the batch; pairwise uniformity is quadratic in it.
_METRIC_MAX_ITEMS = 4096


# ----------------------------------------------------------------------------------------------------------
# Tiled log-sum-exp over the logits s * Q K^T
# ----------------------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision features still accumulate their log-sum-exps in float32.
    return torch.promote_types(dtype, torch.float32)


class TiledLogSumExp(torch.autograd.Function):
    """Row (and optionally column) log-sum-exp of ``L = s * queries @ keys.T`` without materialising L.

    Forward visits ``chunk x chunk`` blocks once, keeping an online (max, sum) pair per row and per column.
    Backward recomputes each block once and applies ``g_row * softmax_row + g_col * softmax_col`` to it,
    since d lse_row_i / d L_ij = softmax_row_ij and d lse_col_j / d L_ij = softmax_col_ij.
    """

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, logit_scale: Tensor, chunk_size: int, with_cols: bool):
        n, m = queries.shape[0], keys.shape[0]
        acc = _acc_dtype(queries.dtype)
        scale = logit_scale.to(queries.dtype)
        row_lse = torch.empty(n, dtype=acc, device=queries.device)
        col_max = torch.full((m,), -math.inf, dtype=acc, device=queries.device)
        col_sum = torch.zeros(m, dtype=acc, device=queries.device)
        for i0 in range(0, n, chunk_size):
            q = queries[i0:i0 + chunk_size] * scale  # (c, D), the scale folded into the smaller operand
            r_max = torch.full((q.shape[0],), -math.inf, dtype=acc, device=queries.device)
            r_sum = torch.zeros(q.shape[0], dtype=acc, device=queries.device)
            for j0 in range(0, m, chunk_size):
                logits = (q @ keys[j0:j0 + chunk_size].T).to(acc)  # (c, c')
                new_max = torch.maximum(r_max, logits.amax(dim=1))
                r_sum = r_sum * torch.exp(r_max - new_max) + torch.exp(logits - new_max[:, None]).sum(dim=1)
                r_max = new_max
                if with_cols:
                    cm, cs = col_max[j0:j0 + chunk_size], col_sum[j0:j0 + chunk_size]
                    new_cmax = torch.maximum(cm, logits.amax(dim=0))
                    cs.mul_(torch.exp(cm - new_cmax)).add_(torch.exp(logits - new_cmax[None, :]).sum(dim=0))
                    cm.copy_(new_cmax)
            row_lse[i0:i0 + chunk_size] = r_max + torch.log(r_sum)
        col_lse = col_max + torch.log(col_sum) if with_cols else None
        ctx.chunk_size = chunk_size
        ctx.with_cols = with_cols
        ctx.save_for_backward(queries, keys, logit_scale, row_lse, col_lse if with_cols else row_lse)
        if with_cols:
            return row_lse, col_lse
        return row_lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_row: Optional[Tensor], grad_col: Optional[Tensor] = None):
        queries, keys, logit_scale, row_lse, col_lse = ctx.saved_tensors
        c, with_cols = ctx.chunk_size, ctx.with_cols
        acc = _acc_dtype(queries.dtype)
        scale = logit_scale.to(queries.dtype)
        if grad_row is None:
            grad_row = torch.zeros_like(row_lse)
        use_cols = with_cols and grad_col is not None
        grad_q = torch.zeros(queries.shape, dtype=acc, device=queries.device)  # sum_j G_ij k_j
        grad_k = torch.zeros(keys.shape, dtype=acc, device=keys.device)  # sum_i G_ij q_i
        for i0 in range(0, queries.shape[0], c):
            q_raw = queries[i0:i0 + c]
            q = q_raw * scale
            lse_r, g_r = row_lse[i0:i0 + c, None], grad_row[i0:i0 + c, None]
            q_raw_acc = q_raw.to(acc)
            for j0 in range(0, keys.shape[0], c):
                k = keys[j0:j0 + c]
                logits = (q @ k.T).to(acc)
                if use_cols:
                    grad_logits = torch.exp(logits - col_lse[None, j0:j0 + c]).mul_(grad_col[None, j0:j0 + c])
                    grad_logits.add_(torch.exp(logits.sub_(lse_r)).mul_(g_r))
                else:
                    grad_logits = torch.exp(logits.sub_(lse_r)).mul_(g_r)
                grad_q[i0:i0 + c].addmm_(grad_logits, k.to(acc))
                grad_k[j0:j0 + c].addmm_(grad_logits.T, q_raw_acc)
        # dL/ds = sum_ij G_ij q_i.k_j = sum_i q_i . (G K)_i, which reuses the unscaled query gradient.
        grad_scale = (queries.to(acc) * grad_q).sum()
        scale_acc = logit_scale.to(acc)
        return (
            (grad_q * scale_acc).to(queries.dtype),
            (grad_k * scale_acc).to(keys.dtype),
            grad_scale.to(logit_scale.dtype).reshape(logit_scale.shape),
            None,
            None,
        )


def _check_chunk(chunk_size: Optional[int]) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise ConfigError(f"chunk_size must be a positive integer or None (got {chunk_size!r})")


def _as_scale(logit_scale, like: Tensor) -> Tensor:
    if not torch.is_tensor(logit_scale):
        return torch.tensor(float(logit_scale), dtype=like.dtype, device=like.device)
    if logit_scale.numel() != 1:
        raise ConfigError(f"logit_scale must be a scalar (got shape {tuple(logit_scale.shape)}, expected ())")
    return logit_scale.reshape(())


def logsumexp_rows(
    queries: Tensor, keys: Tensor, logit_scale: Tensor, chunk_size: Optional[int] = None, with_cols: bool = False
):
    """Log-sum-exp over the rows (and columns) of ``L = logit_scale * queries @ keys.T``.

    Args:
        queries: (n, D) float.  keys: (M, D) float, same dtype.  logit_scale: 0-dim tensor.
        chunk_size: None computes L densely; an int uses `TiledLogSumExp` with blocks of that size.
        with_cols: also return the column log-sum-exp.
    Returns:
        row_lse (n,) (float32 for half inputs), and col_lse (M,) when ``with_cols``.
    """
    _check_chunk(chunk_size)
    logit_scale = _as_scale(logit_scale, queries)
    if chunk_size is None:
        logits = logit_scale * (queries @ keys.T)
        logits = logits.to(_acc_dtype(logits.dtype))
        if with_cols:
            return torch.logsumexp(logits, dim=1), torch.logsumexp(logits, dim=0)
        return torch.logsumexp(logits, dim=1)
    return TiledLogSumExp.apply(queries, keys, logit_scale, chunk_size, with_cols)


# ----------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------


def _check_pair(image_features: Tensor, text_features: Tensor) -> None:
    if image_features.dim() != 2 or text_features.dim() != 2:
        raise DataError(
            f"features must be 2-D (B, D) (got image {tuple(image_features.shape)}, "
            f"text {tuple(text_features.shape)})"
        )
    if image_features.shape != text_features.shape:
        raise DataError(
            f"image and text features must have the same shape (got {tuple(image_features.shape)} and "
            f"{tuple(text_features.shape)}, expected equal (B, D))"
        )
    if image_features.shape[0] == 0:
        raise DataError("empty batch (got 0 pairs, expected at least 1)")


def _columns(image_features, text_features, all_image_features, all_text_features, offset):
    """Resolve the key sets; returns (all_image, all_text, offset, single) with single=True for one process."""
    if (all_image_features is None) != (all_text_features is None):
        raise ConfigError("pass both all_image_features and all_text_features, or neither")
    if all_image_features is None:
        if offset != 0:
            raise ConfigError(f"offset needs gathered features (got offset={offset} without all_*_features)")
        return image_features, text_features, 0, True
    n, m = image_features.shape[0], all_image_features.shape[0]
    if all_image_features.shape != all_text_features.shape or all_image_features.shape[1] != image_features.shape[1]:
        raise DataError(
            f"gathered features must be (M, {image_features.shape[1]}) for both modalities (got "
            f"{tuple(all_image_features.shape)} and {tuple(all_text_features.shape)})"
        )
    if not 0 <= offset <= m - n:
        raise ConfigError(f"offset must be in [0, {m - n}] for {n} local rows of {m} (got {offset})")
    single = offset == 0 and all_image_features is image_features and all_text_features is text_features
    return all_image_features, all_text_features, offset, single


def _positive_logits(queries: Tensor, keys: Tensor, logit_scale: Tensor, offset: int) -> Tensor:
    positives = keys[offset:offset + queries.shape[0]]
    return logit_scale * (queries * positives).sum(dim=1)  # (n,)


# ----------------------------------------------------------------------------------------------------------
# InfoNCE (CLIP)
# ----------------------------------------------------------------------------------------------------------


def infonce_rows(
    queries: Tensor, keys: Tensor, logit_scale: Tensor, offset: int = 0, chunk_size: Optional[int] = None
) -> Tensor:
    """Per-row InfoNCE: ``-log softmax(s * queries @ keys.T)[i, offset + i]``.

    Args:
        queries: (n, D) float, this rank's rows.  keys: (M, D) float, all columns (M >= offset + n).
        logit_scale: 0-dim tensor s.  offset: global column of the positive of row 0.
        chunk_size: None for the dense computation, an int for the tiled one.
    Returns:
        (n,) per-row losses (float32 for half inputs).
    """
    _check_chunk(chunk_size)
    logit_scale = _as_scale(logit_scale, queries)
    n = queries.shape[0]
    if chunk_size is None:
        logits = logit_scale * (queries @ keys.T)
        target = torch.arange(offset, offset + n, device=queries.device)
        return F.cross_entropy(logits.to(_acc_dtype(logits.dtype)), target, reduction="none")
    lse = TiledLogSumExp.apply(queries, keys, logit_scale, chunk_size, False)
    return lse - _positive_logits(queries, keys, logit_scale, offset)


def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    chunk_size: Optional[int] = None,
    *,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
) -> Tensor:
    """Symmetric InfoNCE of CLIP (Radford et al. 2021): mean of image->text and text->image cross-entropies.

    Args:
        image_features, text_features: (n, D) float, L2-normalised, row i of each is a pair.
        logit_scale: 0-dim tensor s (already exponentiated); logits are ``s * image @ text.T``.
        chunk_size: None is the dense reference; an int computes it in ``chunk x chunk`` blocks with the same
            value and gradients and O((n + M) * D) extra memory.
        all_image_features, all_text_features: (M, D) gathered features of the whole global batch (columns);
            None when this process holds the whole batch.
        offset: global index of local row 0 within the gathered features.
    Returns:
        0-dim tensor, the mean over the local rows of both directions.
    """
    _check_pair(image_features, text_features)
    _check_chunk(chunk_size)
    logit_scale = _as_scale(logit_scale, image_features)
    all_img, all_txt, offset, single = _columns(
        image_features, text_features, all_image_features, all_text_features, offset
    )
    if single and chunk_size is None:
        logits = logit_scale * (image_features @ text_features.T)
        logits = logits.to(_acc_dtype(logits.dtype))
        target = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    if single:
        # One pass over the blocks gives both directions: the text->image rows are the image->text columns.
        row_lse, col_lse = TiledLogSumExp.apply(image_features, text_features, logit_scale, chunk_size, True)
        positive = _positive_logits(image_features, text_features, logit_scale, 0)
        return (row_lse.mean() + col_lse.mean()) / 2 - positive.mean()
    image_to_text = infonce_rows(image_features, all_txt, logit_scale, offset, chunk_size)
    text_to_image = infonce_rows(text_features, all_img, logit_scale, offset, chunk_size)
    return (image_to_text.mean() + text_to_image.mean()) / 2


# ----------------------------------------------------------------------------------------------------------
# Alignment and uniformity (Wang & Isola 2020)
# ----------------------------------------------------------------------------------------------------------


def align_loss(x: Tensor, y: Tensor, alpha: float = 2.0) -> Tensor:
    """Alignment ``mean_i ||x_i - y_i||_2^alpha`` over positive pairs.

    Args: x, y: (B, D) float, row i of each a positive pair.  alpha: exponent > 0.
    Returns: 0-dim tensor.
    """
    if x.shape != y.shape:
        raise DataError(f"align_loss needs equal shapes (got {tuple(x.shape)} and {tuple(y.shape)})")
    if alpha == 2:
        # The squared norm avoids the sqrt, whose gradient is undefined at x_i == y_i.
        return (x - y).pow(2).sum(dim=1).mean()
    return (x - y).norm(p=2, dim=1).pow(alpha).mean()


def _sq_dists(a: Tensor, b: Tensor) -> Tensor:
    # |a|^2 + |b|^2 - 2 a.b: one matmul and a smooth gradient everywhere (cdist's is undefined at 0).
    d = a.pow(2).sum(1, keepdim=True) + b.pow(2).sum(1)[None, :] - 2 * (a @ b.T)
    return d.clamp_min(0)


def uniform_loss(x: Tensor, t: float = 2.0) -> Tensor:
    """Uniformity ``log mean_{i<j} exp(-t ||x_i - x_j||^2)`` over distinct pairs of one batch.

    Args: x: (B, D) float with B >= 2.  t: temperature > 0.
    Returns: 0-dim tensor (computed as a log-sum-exp, so it is finite for any spread).
    """
    b = x.shape[0]
    if b < 2:
        raise DataError(f"uniform_loss needs at least 2 items (got {b})")
    i, j = torch.triu_indices(b, b, offset=1, device=x.device)
    d = _sq_dists(x, x)[i, j]
    return torch.logsumexp(-t * d, dim=0) - math.log(d.numel())


def _uniform_log_partial(x: Tensor, all_x: Tensor, offset: int, t: float) -> Tensor:
    """``log sum_{i local, j != offset+i} exp(-t ||x_i - all_x_j||^2)`` (ordered pairs), a 0-dim tensor."""
    d = _sq_dists(x, all_x)
    rows = torch.arange(x.shape[0], device=x.device)
    d = d.index_put((rows, rows + offset), torch.tensor(math.inf, dtype=d.dtype, device=d.device))
    return torch.logsumexp((-t * d).flatten(), dim=0)


# ----------------------------------------------------------------------------------------------------------
# Gathering across ranks
# ----------------------------------------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_features(
    image_features: Tensor, text_features: Tensor, labels: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Optional[Tensor], int]:
    """All-gather features over the default process group, keeping the gradient.

    Backward sums the gradients of every rank's copy into the owner's features
    (`torch.distributed.nn.functional.all_gather`), which is what the local-rows / global-columns losses need.

    Args:
        image_features, text_features: (n, D) this rank's features; n must be equal on all ranks.
        labels: optional (n,) long; gathered without gradient.
    Returns:
        (all_image (W*n, D), all_text (W*n, D), all_labels (W*n,) or None, offset = rank * n).
        Without an initialised process group of more than one rank, the inputs unchanged and offset 0.
    """
    if not _distributed():
        return image_features, text_features, labels, 0
    from torch.distributed.nn.functional import all_gather

    world, rank = dist.get_world_size(), dist.get_rank()
    n = image_features.shape[0]
    sizes = [torch.zeros(1, dtype=torch.long, device=image_features.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([n], dtype=torch.long, device=image_features.device))
    sizes = [int(s.item()) for s in sizes]
    if len(set(sizes)) != 1:
        raise DataError(
            f"every rank must hold the same number of pairs (got per-rank batch sizes {sizes}; "
            "drop the last partial batch)"
        )
    all_image = torch.cat(all_gather(image_features.contiguous()), dim=0)
    all_text = torch.cat(all_gather(text_features.contiguous()), dim=0)
    all_labels = None
    if labels is not None:
        gathered = [torch.empty_like(labels) for _ in range(world)]
        dist.all_gather(gathered, labels.contiguous())
        all_labels = torch.cat(gathered, dim=0)
    return all_image, all_text, all_labels, rank * n


# ----------------------------------------------------------------------------------------------------------
# The combined objective
# ----------------------------------------------------------------------------------------------------------


class ContrastiveObjective(nn.Module):
    """Weighted sum of the configured terms; holds the MoCHi queues and generator.

    ``forward(image_features, text_features, logit_scale, logit_bias=None, labels=None)`` returns
    ``(total_loss, terms)``: ``total_loss`` is this rank's 0-dim loss to backpropagate (see the module
    docstring for why its DDP-averaged gradient is the global-batch gradient); ``terms`` holds floats:
    ``loss`` (the weighted total), ``loss/<name>`` for every active term, and the metrics ``align``,
    ``uniform_image``, ``uniform_text``, all averaged over ranks so they describe the global batch.
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weights: Dict[str, float] = {
            name: float(getattr(cfg, name))
            for name in ("clip", "supcon", "siglip", "align", "uniform", "debiased", "hard_negative")
        }
        self.weights["mochi"] = float(cfg.mochi.weight)
        self.generator = torch.Generator()
        self.generator.manual_seed(0)

    def reseed(self, seed: int) -> None:
        """Seed the generator that draws MoCHi's mixing indices and coefficients (same seed on every rank)."""
        self.generator.manual_seed(int(seed))

    def active_terms(self):
        return [name for name, w in self.weights.items() if w > 0]

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        logit_bias: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
    ):
        _check_pair(image_features, text_features)
        cfg = self.cfg
        logit_scale = _as_scale(logit_scale, image_features).clamp(max=cfg.max_logit_scale)
        distributed = _distributed()
        if distributed:
            all_img, all_txt, all_labels, offset = gather_features(image_features, text_features, labels)
            cols = dict(all_image_features=all_img, all_text_features=all_txt, offset=offset)
        else:
            all_img, all_txt, all_labels, offset = image_features, text_features, labels, 0
            cols = {}
        chunk = cfg.chunk_size

        values: Dict[str, Tensor] = {}
        if self.weights["clip"] > 0:
            values["clip"] = clip_loss(image_features, text_features, logit_scale, chunk, **cols)
        if self.weights["align"] > 0:
            values["align"] = align_loss(image_features, text_features, cfg.align_alpha)

        total = sum(self.weights[name] * value for name, value in values.items())
        with torch.no_grad():
            logged = {f"loss/{name}": value.detach().float() for name, value in values.items()}
            logged.update(self._metrics(image_features, text_features))
            names = list(logged)
            stacked = torch.stack([logged[k].reshape(()) for k in names])
            if distributed:
                dist.all_reduce(stacked)
                stacked /= dist.get_world_size()
            numbers = stacked.tolist()
        terms = dict(zip(names, numbers))
        terms["loss"] = sum(self.weights[name] * terms[f"loss/{name}"] for name in values)
        return total, terms

    @torch.no_grad()
    def _metrics(self, image_features: Tensor, text_features: Tensor) -> Dict[str, Tensor]:
        img = image_features[:_METRIC_MAX_ITEMS].detach().float()
        txt = text_features[:_METRIC_MAX_ITEMS].detach().float()
        out = {"align": align_loss(img, txt, self.cfg.align_alpha)}
        if img.shape[0] >= 2:
            out["uniform_image"] = uniform_loss(img, self.cfg.uniform_t)
            out["uniform_text"] = uniform_loss(txt, self.cfg.uniform_t)
        else:
            nan = torch.tensor(math.nan, device=img.device)
            out["uniform_image"] = out["uniform_text"] = nan
        return out


def build_objective(cfg) -> ContrastiveObjective:
    """Build the training objective from a `mmcl.config.LossConfig`."""
    return ContrastiveObjective(cfg)
