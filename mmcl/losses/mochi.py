"""MoCHi: synthetic hard negatives mixed from a feature queue (`mochi_loss`, `FeatureQueue`)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import LossInputError
from .tiling import _acc_dtype, _as_scale, _check_chunk, _upcast
from .clip import DenseInfoNCE, _check_pair, _columns, _dense_logits, _positive_logits, logsumexp_rows


def _mochi_rows(queries, keys, queue, logit_scale, offset, n_hard, s, s_prime, mix_max, generator,
                chunk_size=None):
    """Per-row InfoNCE over [positive, real negatives, synthetic hard negatives] for one direction.

    With `chunk_size` the (n, M + Q) logits are never formed: the hardest negatives are ranked in row blocks
    without autograd, the log-sum-exp over real negatives and queue is tiled (`logsumexp_rows`), and it is
    combined with the synthetic negatives' log-sum-exp; the same value and gradients as the dense form.
    """
    n, m = queries.shape[0], keys.shape[0]
    acc = _acc_dtype(queries.dtype)  # hard-negative ranking, synthetic features and logits in float32 at least
    n_queue = 0 if queue is None else queue.shape[0]
    k = min(n_hard, m - 1 + n_queue)
    rows = torch.arange(n, device=queries.device)
    # Draws are made for all M queries of the global batch and sliced at this rank's offset, so every rank
    # (sharing one seed) synthesises exactly what a single process holding the global batch would.
    pairs = torch.randint(0, max(k, 1), (m, s, 2), generator=generator)[offset:offset + n].to(queries.device)
    alpha = torch.rand(m, s, 1, generator=generator)[offset:offset + n].to(queries.device, acc)
    picks = torch.randint(0, max(k, 1), (m, s_prime), generator=generator)[offset:offset + n].to(queries.device)
    beta = (torch.rand(m, s_prime, 1, generator=generator) * mix_max)[offset:offset + n].to(
        queries.device, acc
    )
    if queue is not None and n_queue > 0:
        queue = queue.detach().to(acc)
    else:
        queue = None

    synthetic_logits = None
    if k > 0 and s + s_prime > 0:
        with torch.no_grad():
            q = queries.detach().to(acc)
            candidates = keys.detach().to(acc)
            candidates = candidates if queue is None else torch.cat([candidates, queue])  # (M+Q, D)
            block = n if chunk_size is None else chunk_size
            hard = []
            for i0 in range(0, n, block):
                here = rows[i0:i0 + block]
                sims = q[i0:i0 + block] @ candidates.T
                sims[here - i0, here + offset] = -math.inf  # the positive is not a negative
                hard.append(sims.topk(k, dim=1).indices)  # hardest first
            hard = torch.cat(hard)  # (n, k)
        draws = (pairs, alpha, picks, beta)
        if chunk_size is None:
            synthetic_logits = _synthetic_logits(queries, candidates, hard, draws, logit_scale)
        else:
            # Each block's synthetic features (c, s + s', D) are rebuilt in backward instead of kept.
            from torch.utils.checkpoint import checkpoint

            synthetic_logits = torch.cat([
                checkpoint(_synthetic_logits, queries[i0:i0 + chunk_size], candidates, hard[i0:i0 + chunk_size],
                           tuple(d[i0:i0 + chunk_size] for d in draws), logit_scale, use_reentrant=False)
                for i0 in range(0, n, chunk_size)])

    if chunk_size is not None:
        real = keys if queue is None else torch.cat([keys.to(acc), queue])
        lse = logsumexp_rows(queries, real, logit_scale, chunk_size)
        if synthetic_logits is not None:
            lse = torch.logaddexp(lse, torch.logsumexp(synthetic_logits.to(lse.dtype), dim=1))
        return lse - _positive_logits(queries, keys, logit_scale, offset)

    parts = [_dense_logits(queries, keys, logit_scale)]  # (n, M)
    if queue is not None:
        parts.append(_dense_logits(queries, queue, logit_scale))  # (n, Q)
    if synthetic_logits is not None:
        parts.append(synthetic_logits)
    # cross-entropy at the positive column, with a backward that forms no subnormal at scale 100
    return DenseInfoNCE.apply(torch.cat(parts, dim=1), offset, False)


def _synthetic_logits(queries: Tensor, candidates: Tensor, hard: Tensor, draws, logit_scale: Tensor) -> Tensor:
    """Logits (n, s + s') of the queries against their MoCHi synthetic negatives (Kalantidis et al. 2020).

    ``s`` mixes ``a h_i + (1 - a) h_j`` of two hard negatives and ``s'`` mixes ``b q + (1 - b) h_k`` with the
    query, each normalised; `hard` (n, k) indexes `candidates`, `draws` = (pairs (n, s, 2), a (n, s, 1),
    picks (n, s'), b (n, s', 1)). The synthetic features carry no gradient; their logits still push the query
    away from them.
    """
    pairs, alpha, picks, beta = draws
    acc = _acc_dtype(queries.dtype)
    with torch.no_grad():
        q = queries.detach().to(acc)
        synthetic = []
        if pairs.shape[1] > 0:
            first = candidates[hard.gather(1, pairs[..., 0])]  # (n, s, D)
            second = candidates[hard.gather(1, pairs[..., 1])]
            synthetic.append(F.normalize(alpha * first + (1 - alpha) * second, dim=-1))
        if picks.shape[1] > 0:
            negative = candidates[hard.gather(1, picks)]  # (n, s', D)
            synthetic.append(F.normalize(beta * q[:, None, :] + (1 - beta) * negative, dim=-1))
        synthetic = torch.cat(synthetic, dim=1)  # (n, s + s', D)
    return logit_scale.to(acc) * torch.einsum("nd,nkd->nk", queries.to(acc), synthetic)


def mochi_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    n_hard: int,
    s: int,
    s_prime: int,
    mix_max: float,
    generator: torch.Generator,
    image_queue: Optional[Tensor] = None,
    text_queue: Optional[Tensor] = None,
    *,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """InfoNCE with MoCHi synthetic hard negatives (Kalantidis et al. 2020), both directions averaged.

    For each query (image->text against all texts and ``text_queue``; text->image against all images and
    ``image_queue``), its negatives are ranked by similarity and the ``n_hard`` hardest kept; ``s`` synthetic
    negatives are normalised mixes ``a h_i + (1 - a) h_j`` of two random hard ones (a ~ U(0, 1)) and
    ``s_prime`` harder ones are normalised mixes ``b q + (1 - b) h_k`` with the query (b ~ U(0, mix_max)).
    Synthetic features are detached. Random draws come from ``generator`` on the CPU, in this order for
    image->text then text->image: pair indices (M, s, 2), a (M, s, 1), indices (M, s'), b (M, s', 1), where
    M is the global batch size; rank-local rows use the slice at ``offset``.

    Args:
        image_features, text_features: (n, D) float, L2-normalised.  logit_scale: 0-dim tensor s.
        n_hard, s, s_prime: counts (n_hard >= 1, s, s_prime >= 0).  mix_max: in (0, 1].
        generator: CPU torch.Generator.  image_queue, text_queue: (Q, D) past features or None.
        all_image_features, all_text_features, offset: as in `clip_loss`.
        chunk_size: None for the dense (n, M + Q) logits; an int ranks and sums them in blocks of that many rows
            (memory linear in M + Q; the synthetic negatives are still n x (s + s') x D).
    Returns:
        0-dim tensor.
    """
    _check_pair(image_features, text_features)
    _check_chunk(chunk_size)
    if n_hard < 1 or s < 0 or s_prime < 0:
        raise LossInputError(
            f"MoCHi needs n_hard >= 1 and s, s_prime >= 0 (got n_hard={n_hard}, s={s}, s_prime={s_prime})"
        )
    if not 0 < mix_max <= 1:
        raise LossInputError(f"MoCHi mix_max must be in (0, 1] (got {mix_max}; the paper uses 0.5)")
    logit_scale = _as_scale(logit_scale, image_features)
    image_features, text_features, all_image_features, all_text_features = _upcast(
        image_features, text_features, all_image_features, all_text_features
    )
    all_img, all_txt, offset, _ = _columns(image_features, text_features, all_image_features, all_text_features, offset)
    i2t = _mochi_rows(image_features, all_txt, text_queue, logit_scale, offset, n_hard, s, s_prime, mix_max, generator,
                      chunk_size)
    t2i = _mochi_rows(text_features, all_img, image_queue, logit_scale, offset, n_hard, s, s_prime, mix_max, generator,
                      chunk_size)
    return (i2t.mean() + t2i.mean()) / 2


class FeatureQueue(nn.Module):
    """First-in-first-out store of past (detached) features, kept in buffers so checkpoints carry it.

    The feature width is taken from the first `enqueue` (or from a loaded state dict), so the queue can be
    built from the loss config alone.
    """

    def __init__(self, size: int):
        super().__init__()
        if size < 0:
            raise LossInputError(f"queue size must be >= 0 (got {size})")
        self.size = int(size)
        self.register_buffer("features", torch.zeros(0, 0))  # (size, D) float32 once used
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def __len__(self) -> int:
        return int(self.count)

    @torch.no_grad()
    def enqueue(self, x: Tensor) -> None:
        """Append (B, D) features, overwriting the oldest once full."""
        if self.size == 0:
            return
        if self.features.shape != (self.size, x.shape[1]):
            if int(self.count) > 0:
                raise LossInputError(f"queue holds width {self.features.shape[1]} features, got {x.shape[1]}")
            self.features = torch.zeros(self.size, x.shape[1], dtype=torch.float32, device=x.device)
        x = x.detach()[-self.size:].to(self.features)
        idx = (int(self.ptr) + torch.arange(x.shape[0], device=x.device)) % self.size
        # A new buffer, not a write into the old one: the tensor `get` returned for this step's loss is still
        # in the autograd graph (the queries' gradient needs it), and an in-place write would invalidate the
        # backward that follows. The copy costs one pass over the queue per step.
        self.features = self.features.index_copy(0, idx, x)
        self.ptr.fill_((int(self.ptr) + x.shape[0]) % self.size)
        self.count.fill_(min(int(self.count) + x.shape[0], self.size))

    def get(self) -> Optional[Tensor]:
        """The stored (count, D) float32 features, or None when empty."""
        count = int(self.count)
        return self.features[:count] if count > 0 else None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + "features")
        if saved is not None and saved.shape != self.features.shape:
            if saved.dim() != 2 or saved.shape[0] not in (0, self.size):
                raise LossInputError(
                    f"saved queue has shape {tuple(saved.shape)}, expected ({self.size}, D) "
                    "(loss.mochi.queue_size changed?)"
                )
            self.features = torch.zeros(saved.shape, dtype=torch.float32, device=self.features.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Alignment and uniformity (Wang & Isola 2020)
# ----------------------------------------------------------------------------------------------------------


