"""MoCHi: synthetic hard negatives mixed from a feature queue (`mochi_loss`, `FeatureQueue`)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .clip import DenseInfoNCE, dense_logits, positive_logits
from .errors import LossInputError
from .inputs import Gathered, check_chunk, check_pair, gathered_columns
from .precision import float32_math
from .tiling import TiledLogSumExp, acc_dtype, as_scale, upcast


def _to_device(draws: Tensor, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Random draws made on the CPU (the generator's draws are the same on every device), moved to `like`'s device
    without the host waiting: from pinned memory, non-blocking, where the device is a GPU."""
    if like.device.type == "cuda":
        draws = draws.pin_memory()
    return draws.to(like.device, dtype, non_blocking=True)


def _mochi_rows(queries, keys, queue, logit_scale, offset, n_hard, s, s_prime, mix_max, generator,
                chunk_size=None):
    """Per-row InfoNCE over [positive, real negatives, synthetic hard negatives] for one direction.

    With `chunk_size` the (n, M + Q) logits are never formed: one tiled pass (`TiledLogSumExp` with ``topk``) gives
    the log-sum-exp over real negatives and queue and ranks the hardest negatives from the same tiles, and it is
    combined with the synthetic negatives' log-sum-exp; the same value and gradients as the dense form.
    """
    n, m = queries.shape[0], keys.shape[0]
    acc = acc_dtype(queries.dtype)  # hard-negative ranking, synthetic features and logits in float32 at least
    n_queue = 0 if queue is None else queue.shape[0]
    k = min(n_hard, m - 1 + n_queue)
    rows = torch.arange(n, device=queries.device)
    # Draws are made for all M queries of the global batch and sliced at this rank's offset, so every rank
    # (sharing one seed) synthesises exactly what a single process holding the global batch would.
    pairs = _to_device(torch.randint(0, max(k, 1), (m, s, 2), generator=generator)[offset:offset + n], queries)
    alpha = _to_device(torch.rand(m, s, 1, generator=generator)[offset:offset + n], queries, acc)
    picks = _to_device(torch.randint(0, max(k, 1), (m, s_prime), generator=generator)[offset:offset + n], queries)
    beta = _to_device((torch.rand(m, s_prime, 1, generator=generator) * mix_max)[offset:offset + n], queries, acc)
    if queue is not None and n_queue > 0:
        queue = queue.detach().to(acc)
    else:
        queue = None

    synthetic = k > 0 and s + s_prime > 0
    draws = (pairs, alpha, picks, beta)
    block = n if chunk_size is None else chunk_size
    real = keys.to(acc) if queue is None else torch.cat([keys.to(acc), queue])  # negatives: batch, then queue
    if chunk_size is not None:
        # One pass over the tiles gives the log-sum-exp over real negatives and queue and, from the same logits,
        # the hardest negatives: the (n, M + Q) products are computed once here and once in backward.
        out = TiledLogSumExp.apply(queries, real, logit_scale, chunk_size, False, None, None, None, False,
                                   k if synthetic else 0, offset)
        lse, hard, hard_logits = out if synthetic else (out, None, None)
        if synthetic:
            synthetic_logits = SyntheticLogits.apply(queries.to(acc), logit_scale, real.detach(), hard,
                                                     hard_logits / logit_scale.detach(), draws, block)
            lse = torch.logaddexp(lse, torch.logsumexp(synthetic_logits.to(lse.dtype), dim=1))
        return lse - positive_logits(queries, keys, logit_scale, offset)

    synthetic_logits = None
    if synthetic:
        with torch.no_grad():
            q = queries.detach().to(acc)
            candidates = real.detach()  # (M+Q, D)
            sims = q @ candidates.T
            sims[rows, rows + offset] = -math.inf  # the positive is not a negative
            top = sims.topk(k, dim=1)  # hardest first: candidate ids and q . h
            del sims
        synthetic_logits = SyntheticLogits.apply(queries.to(acc), logit_scale, candidates, top.indices, top.values,
                                                 draws, block)

    parts = [dense_logits(queries, keys, logit_scale)]  # (n, M)
    if queue is not None:
        parts.append(dense_logits(queries, queue, logit_scale))  # (n, Q)
    if synthetic_logits is not None:
        parts.append(synthetic_logits)
    # cross-entropy at the positive column, with a backward that forms no subnormal at scale 100
    return DenseInfoNCE.apply(torch.cat(parts, dim=1), offset, False)


class SyntheticLogits(torch.autograd.Function):
    """Logits (n, s + s') of the queries against their MoCHi synthetic negatives (Kalantidis et al. 2020), without
    forming the synthetic features.

    ``s`` mixes ``u = (a h_i + (1 - a) h_j) / |a h_i + (1 - a) h_j|`` of two hard negatives and ``s'`` mixes
    ``u = (b q + (1 - b) h_k) / |...|`` with the (detached) query. Since u is a combination of two known vectors,
    ``q . u`` is a combination of dot products the ranking already holds (q . h, |q|^2) over a norm that needs
    only |h|^2 and, for two hard negatives, h_i . h_j; and the gradient ``s u`` (u carries none) is a weighted sum
    of candidate rows, one `embedding_bag`. So neither pass builds the (n, s + s', D) mixes (at N = 4096 their
    gathers, products and normalisation were ~3/4 of the loss's time, twice with the tiled path's recompute).

    Args (apply): queries (n, D), logit_scale 0-dim, candidates (C, D) detached, hard (n, k) candidate ids,
    hard_sims (n, k) q . candidate, draws = (pairs (n, s, 2), a (n, s, 1), picks (n, s'), b (n, s', 1)),
    block int (rows per gather of h_i . h_j).
    """

    @staticmethod
    @float32_math
    def forward(ctx, queries, logit_scale, candidates, hard, hard_sims, draws, block: int):
        pairs, alpha, picks, beta = draws
        q = queries.detach()
        cand_sq = candidates.pow(2).sum(dim=1)  # (C,)
        ids, weights, dots = [], [], []  # per mix: candidate ids (n, m, 2 or 1), their weights, q . u
        q_weight = None
        if pairs.shape[1] > 0:
            a = alpha[..., 0]
            first, second = hard.gather(1, pairs[..., 0]), hard.gather(1, pairs[..., 1])  # (n, s)
            cross = torch.cat([  # h_i . h_j, gathered in row blocks
                torch.linalg.vecdot(candidates[first[i0:i0 + block]], candidates[second[i0:i0 + block]])
                for i0 in range(0, q.shape[0], block)])
            sq = a * a * cand_sq[first] + (1 - a) ** 2 * cand_sq[second] + 2 * a * (1 - a) * cross
            norm = sq.clamp_min(0).sqrt().clamp_min(1e-12)  # F.normalize's floor
            w1, w2 = a / norm, (1 - a) / norm
            ids.append(torch.stack([first, second], dim=2))
            weights.append(torch.stack([w1, w2], dim=2))
            dots.append(w1 * hard_sims.gather(1, pairs[..., 0]) + w2 * hard_sims.gather(1, pairs[..., 1]))
        if picks.shape[1] > 0:
            b = beta[..., 0]
            picked = hard.gather(1, picks)  # (n, s')
            qh = hard_sims.gather(1, picks)
            qq = q.pow(2).sum(dim=1, keepdim=True)
            sq = b * b * qq + (1 - b) ** 2 * cand_sq[picked] + 2 * b * (1 - b) * qh
            norm = sq.clamp_min(0).sqrt().clamp_min(1e-12)
            q_weight, wp = b / norm, (1 - b) / norm
            ids.append(picked[..., None])
            weights.append(wp[..., None])
            dots.append(q_weight * qq + wp * qh)
        dots = torch.cat(dots, dim=1)  # (n, s + s')
        ctx.n_mix = pairs.shape[1]
        ctx.save_for_backward(q, logit_scale, candidates, *[torch.cat([x.flatten(1) for x in group], dim=1)
                                                             for group in (ids, weights)], dots,
                              q_weight if q_weight is not None else dots.new_zeros(0))
        return logit_scale * dots

    @staticmethod
    @torch.autograd.function.once_differentiable
    @float32_math
    def backward(ctx, grad):
        q, logit_scale, candidates, ids, weights, dots, q_weight = ctx.saved_tensors
        g = grad * logit_scale  # d logit / d(q . u) = s; d(q . u) / dq = u
        # expand each mix's gradient over its candidate ids (2 for a pair mix, 1 for a query mix)
        parts = [g[:, :ctx.n_mix].repeat_interleave(2, dim=1)] if ctx.n_mix else []
        if g.shape[1] > ctx.n_mix:
            parts.append(g[:, ctx.n_mix:])
        per_id = torch.cat(parts, dim=1)
        grad_q = torch.nn.functional.embedding_bag(ids, candidates, per_sample_weights=per_id * weights, mode="sum")
        if q_weight.numel():
            grad_q += (g[:, ctx.n_mix:] * q_weight).sum(dim=1, keepdim=True) * q
        return grad_q, (grad * dots).sum().reshape(logit_scale.shape), None, None, None, None, None


@float32_math
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
    gathered: Optional[Gathered] = None,
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
        gathered: as in `clip_loss`.
        chunk_size: None for the dense (n, M + Q) logits; an int ranks and sums them in blocks of that many rows
            (memory linear in M + Q; the synthetic negatives are still n x (s + s') x D).
    Returns:
        0-dim tensor.
    """
    check_pair(image_features, text_features)
    check_chunk(chunk_size)
    if n_hard < 1 or s < 0 or s_prime < 0:
        raise LossInputError(
            f"MoCHi needs n_hard >= 1 and s, s_prime >= 0 (got n_hard={n_hard}, s={s}, s_prime={s_prime})"
        )
    if not 0 < mix_max <= 1:
        raise LossInputError(f"MoCHi mix_max must be in (0, 1] (got {mix_max}; the paper uses 0.5)")
    logit_scale = as_scale(logit_scale, image_features)
    image_features, text_features = upcast(image_features, text_features)
    all_img, all_txt, offset, _ = gathered_columns(image_features, text_features, gathered)
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
        # Host copies of ptr and count, so that a training step reads nothing back from the device.
        self._ptr, self._count = 0, 0

    def __len__(self) -> int:
        return self._count

    @torch.no_grad()
    def enqueue(self, x: Tensor) -> None:
        """Append (B, D) features, overwriting the oldest once full."""
        if self.size == 0:
            return
        if self.features.shape != (self.size, x.shape[1]):
            if self._count > 0:
                raise LossInputError(f"queue holds width {self.features.shape[1]} features, got {x.shape[1]}")
            self.features = torch.zeros(self.size, x.shape[1], dtype=torch.float32, device=x.device)
        x = x.detach()[-self.size:].to(self.features)
        idx = (self._ptr + torch.arange(x.shape[0], device=x.device)) % self.size
        # A new buffer, not a write into the old one: the tensor `get` returned for this step's loss is still
        # in the autograd graph (the queries' gradient needs it), and an in-place write would invalidate the
        # backward that follows. The copy costs one pass over the queue per step.
        self.features = self.features.index_copy(0, idx, x)
        self._ptr, self._count = (self._ptr + x.shape[0]) % self.size, min(self._count + x.shape[0], self.size)
        self.ptr.fill_(self._ptr)
        self.count.fill_(self._count)

    def get(self) -> Optional[Tensor]:
        """The stored (count, D) float32 features, or None when empty."""
        return self.features[:self._count] if self._count > 0 else None

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
        self._ptr, self._count = int(self.ptr), int(self.count)


# ----------------------------------------------------------------------------------------------------------
# Alignment and uniformity (Wang & Isola 2020)
# ----------------------------------------------------------------------------------------------------------


