"""Shared autograd machinery of the tiled losses: `TiledLogSumExp`, the tile helpers and the dtype helpers."""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .errors import LossInputError
from .precision import float32_math

# Tiles of the logit matrix span chunk_size rows and enough columns to hold about `tile_elements(device)` logits.
# On a CPU, about 2^22 (16 MiB in float32): few, large elementwise kernels (each a thread barrier) whose tiles stay
# near the caches, so time and memory stay linear in the batch.
_TILE_ELEMENTS = 1 << 22
# On a GPU every op of a tile is a kernel launch, and the CPU's tile would mean ~2,000 tiles per pass at 32k rows
# per GPU x 8 GPUs: the tiles are as large as the memory allows, between these bounds.
_CUDA_MIN_TILE_ELEMENTS, _CUDA_MAX_TILE_ELEMENTS = 1 << 24, 1 << 28


def cuda_tile_elements(total_memory: int) -> int:
    """Logits per tile on a GPU with `total_memory` bytes: the largest power of two up to 1/256 of it (a pass holds
    at most four float32 tiles, so at most 1/16 of the memory), within [2^24, 2^28]: 2^28 (1 GiB tiles) on an
    80 GB GPU, 2^26 on a 24 GB one."""
    budget = max(1, total_memory // 256)
    return max(_CUDA_MIN_TILE_ELEMENTS, min(_CUDA_MAX_TILE_ELEMENTS, 1 << (budget.bit_length() - 1)))


@functools.lru_cache(maxsize=None)
def _cuda_tile_elements(index: int) -> int:
    return cuda_tile_elements(torch.cuda.get_device_properties(index).total_memory)


def tile_elements(device: torch.device) -> int:
    """Logits per tile of the tiled losses on `device`: cache-sized on a CPU (`_TILE_ELEMENTS`), memory-sized on a
    GPU (`cuda_tile_elements`, from the device's total memory, read once: no synchronisation). ``chunk_size``
    still sets the rows of a tile; this sets how many columns join them."""
    if device.type == "cuda":
        return _cuda_tile_elements(device.index if device.index is not None else torch.cuda.current_device())
    return _TILE_ELEMENTS


def tile_width(chunk_size: int, n_cols: int, device: torch.device, live_tiles: int = 1) -> int:
    """Columns per tile: about `tile_elements(device)` logits in all, shared by the `live_tiles` tiles a pass holds
    at once beyond the two every pass holds (the logits and one exp)."""
    return min(n_cols, max(chunk_size, tile_elements(device) // (chunk_size * live_tiles)))


# ----------------------------------------------------------------------------------------------------------
# Tiled log-sum-exp over the logits s * Q K^T
# ----------------------------------------------------------------------------------------------------------


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision features still build their logits and accumulate their sums in float32.
    return torch.promote_types(dtype, torch.float32)


def finite_or_zero(x: Tensor) -> Tensor:
    # A maximum over an empty set (every entry masked so far) is -inf; shifting by it would give inf - inf.
    return torch.where(x == -math.inf, torch.zeros((), dtype=x.dtype, device=x.device), x)


def exp_(x: Tensor) -> Tensor:
    """exp of a tile in place, with arguments below log(smallest normal float) + 24 raised to that first.

    Such terms (e^-63 in float32) are far below one ulp of any sum they join (every sum here holds a term equal
    to 1), but as subnormals (also after the backward's multiplication by a gradient >= e^-24) they cost ~100x
    per element on x86, in the exp and in the matmuls: at scale 100 with aligned pairs nearly every negative
    sits ~90 below its row's positive, and one N = 2048 fwd+bwd took 39 s instead of well under one."""
    return x.clamp_(min=math.log(torch.finfo(x.dtype).tiny) + 24).exp_()


def _logit_tile(qs: Tensor, k: Tensor, mask_shift: Optional[int], keep: Optional[Tensor] = None,
                bias: Optional[Tensor] = None) -> Tensor:
    """L = qs @ k.T (+ `bias`, one value per column: 0 or -inf) for one tile, with the entries j = i + mask_shift
    set to -inf when mask_shift is not None (their values first written to `keep`, indexed by the tile's row, when
    given)."""
    logits = qs @ k.T
    if bias is not None:
        logits.add_(bias)
    if mask_shift is not None:
        diag, lo, hi = tile_positives(logits, mask_shift)
        if keep is not None:
            keep[lo:hi] = diag
        diag.fill_(-math.inf)
    return logits


def coefficient_unit(coefficients, like: Tensor) -> Tensor:
    """The largest |coefficient| of a backward (1 when all are 0): gradient tiles are formed relative to it."""
    unit, seen = torch.ones((), dtype=like.dtype, device=like.device), None
    for c in coefficients:
        if c.numel():
            top = c.abs().amax()
            unit = top if seen is None else torch.maximum(unit, top)
            seen = True
    return torch.where(unit > 0, unit, torch.ones_like(unit))


def coefficient_floor(coef: Tensor, unit: Tensor, width: int) -> Tuple[Tensor, Tensor]:
    """(coef / unit, floor of the exp argument) for softmax-times-coefficient products with no subnormal.

    Subnormal floats cost ~100x per element on x86, in the elementwise ops and in the matmuls they feed. Where
    the incoming gradients span many orders of magnitude (MoCHi at scale 100: synthetic negatives dominate most
    rows and leave coefficients of 1e-17 on their real ones), products ``exp(x) * coef`` fill the tiles with
    them and the backward runs ~3x slower; at scale 100 with aligned pairs the softmax entries alone sit in
    that range (a dense fwd+bwd at N = 2048 took 27 s instead of 0.3 s). So the products are formed relative
    to the largest coefficient (`unit`, multiplied back afterwards), and each row's (column's) exp argument is
    floored where ``exp(x) * |coef| / unit`` would fall below tiny * e^24, as the forward floors at that. A
    raised term adds at most e^floor to a softmax entry, so the floor may go up to ``log(eps / width)``: below
    eps of that row's own gradient. A row whose coefficient is too small even for that (under ~1e-19 of the
    largest at 16384 columns, in float32) is left out: all of it is below float32's resolution of any sum of
    gradients it joins.
    """
    finfo = torch.finfo(coef.dtype)
    coef = coef / unit
    floor = (math.log(finfo.tiny) + 24) - torch.log(coef.abs().clamp_min(finfo.tiny))
    cap = math.log(finfo.eps / max(width, 1))
    return coef.masked_fill(floor > cap, 0), floor.clamp_(max=cap)


def _scaled_exp(x: Tensor, g: float, last: bool) -> Tensor:
    """exp(g * x) (`exp_`), in x's own storage when `last` (the caller reads x no more), else in a new tensor."""
    if g != 1.0:
        return exp_(x.mul_(g) if last else torch.mul(x, g))
    return exp_(x if last else x.clone())


def _online_sums(sums: Tensor, run_max: Tensor, tile: Tensor, gammas: Tuple[float, ...], dim: int,
                 reuse_tile: bool) -> Tensor:
    """One tile's step of the online log-sum-exp along `dim` of the tile (1: its rows, 0: its columns): each
    ``sums[gi]``, the sum of exp(g * (L - run_max)) so far, is rescaled to the new maximum and the tile's terms
    are added, in place. Returns the new maximum. With `reuse_tile` the tile's storage holds the shifted logits
    and the last gamma's exp afterwards (the caller reads it no more)."""
    new_max = torch.maximum(run_max, tile.amax(dim=dim))
    shift = finite_or_zero(new_max)
    d = tile.sub_(shift.unsqueeze(dim)) if reuse_tile else torch.sub(tile, shift.unsqueeze(dim))
    for gi, g in enumerate(gammas):
        e = _scaled_exp(d, g, gi == len(gammas) - 1)
        sums[gi] = sums[gi] * torch.exp(g * (run_max - shift)) + e.sum(dim=dim)
    return new_max


def _merge_topk(best: Optional[Tuple[Tensor, Tensor]], tile: Tensor, j0: int, topk: int,
                skip: Optional[int]) -> Tuple[Tensor, Tensor]:
    """(values, column indices) of each row's `topk` largest logits: those in `best` (None before a row block's
    first tile) and this tile's, whose first column is `j0`; the tile's entries j = i + `skip` are left out
    (set to -inf in the tile) when `skip` is not None."""
    if skip is not None:
        tile_positives(tile, skip)[0].fill_(-math.inf)
    tile_top = tile.topk(min(topk, tile.shape[1]), dim=1)
    if best is None:
        return tile_top.values, tile_top.indices
    vals = torch.cat([best[0], tile_top.values], dim=1)
    idx = torch.cat([best[1], tile_top.indices + j0], dim=1)
    merged = vals.topk(min(topk, vals.shape[1]), dim=1)
    return merged.values, idx.gather(1, merged.indices)


class TiledLogSumExp(torch.autograd.Function):
    """Row (and optionally column) log-sum-exp of ``L = s * queries @ keys.T`` without materialising L.

    Tiles are ``chunk_size`` rows by ``max(chunk_size, E / (chunk_size * G))`` columns (at most M; G gammas; E
    logits per tile from `tile_elements`: 2^22 on a CPU, up to 2^28 on a GPU), so memory is bounded by two tiles
    plus the (n + M) x D inputs and gradients, whatever the batch size or logit scale.

    Forward keeps a running maximum and a sum rescaled to it for every row (within a row block) and for every
    column (across row blocks), the online softmax of flash attention in both directions: per tile one
    matmul, the tile's row and column maxima, and exp(L - row max) and exp(L - column max). Every sum is thus
    taken relative to its own largest term, which is exactly 1, so nothing underflows that could matter
    whatever the scale and the alignment of the features (a shift shared by all rows underflows whole rows
    of weakly aligned features at logit scale 100).

    Backward recomputes each tile once and forms ``G = g_row * exp(L - lse_row) + g_col * exp(L - lse_col)``
    (the softmax in each direction, each at most 1: no overflow, and a term underflows only when it is below
    the smallest float relative to its own sum).

    ``positive_offset`` set: the outputs are per-row InfoNCE losses ``lse_i - L[i, offset + i]`` (and for
    columns ``col_lse_j - L[j, j]``, which needs offset 0 and n == M); folding the positive logit in here keeps
    its gradient in the same buffers instead of two more (n, D) tensors.
    ``mask_offset`` set: the entries ``L[i, mask_offset + i]`` are left out of every sum (set to -inf inside
    each tile), which gives the log-sum-exp over negatives only without subtracting the positive afterwards
    (that subtraction cancels completely once the positive dominates its row). Columns need offset 0, n == M.
    ``gammas`` set (a tuple of positive floats, without ``positive_offset``): the log-sum-exps of ``gamma * L``
    for every gamma from the same tiles, one matmul per tile for all of them (the hard-negative loss needs
    gamma = 1 + beta and beta); the outputs are then (G, n) [and (G, M)], and tiles are narrower so that the
    extra exp per gamma stays within the same memory.
    ``topk`` > 0 (rows only): two more outputs, the (n, topk) column indices and values of each row's largest
    logits, leaving out ``L[i, topk_skip + i]`` when ``topk_skip`` is set, read from the same tiles (MoCHi ranks its
    hard negatives this way instead of with one more pass over the keys); not differentiable.
    ``return_masked`` (with ``mask_offset``): one more output, the (n,) logits ``L[i, mask_offset + i]`` left out
    of the sums, read from the tiles and differentiable through the same gradient buffers (a separate
    ``s * q_i . k_i`` would add two more (n, D) gradients to the peak).
    ``col_bias`` set ((M,), 0 or -inf, no gradient): added to every column of L, so that the columns at -inf
    (padding, `mmcl.losses.pad_pairs`) never enter a sum; rows only (the column sums of such a column are empty).

    Args (apply): queries (n, D), keys (M, D), logit_scale 0-dim, chunk_size int, with_cols bool,
    positive_offset int or None, mask_offset int or None, gammas tuple or None, return_masked bool, topk int,
    topk_skip int or None, col_bias (M,) or None. Returns
    (n,) [and (M,)] [and the (n,) masked logits]; float32 for half inputs, else the input dtype.
    """

    @staticmethod
    @float32_math
    def forward(ctx, queries, keys, logit_scale, chunk_size: int, with_cols: bool, positive_offset=None,
                mask_offset=None, gammas=None, return_masked=False, topk=0, topk_skip=None, col_bias=None):
        acc = acc_dtype(queries.dtype)
        q32, k32, scale = queries.to(acc), keys.to(acc), logit_scale.to(acc)
        n, m = q32.shape[0], k32.shape[0]
        bias = None if col_bias is None else col_bias.to(acc)
        assert bias is None or not with_cols, "col_bias reads rows only"
        for off in (positive_offset, mask_offset):
            assert off is None or not with_cols or (off == 0 and n == m), "square batch expected"
        multi = gammas is not None
        gammas = (1.0,) if gammas is None else tuple(float(g) for g in gammas)
        assert all(g > 0 for g in gammas) and (positive_offset is None or not multi), "bad gammas"
        assert not return_masked or mask_offset is not None, "return_masked needs mask_offset"
        assert not topk or not with_cols, "topk reads rows only"
        top_idx = torch.zeros(n, topk, dtype=torch.long, device=q32.device)
        top_val = torch.zeros(n, topk, dtype=acc, device=q32.device)
        n_g = len(gammas)
        minus_inf = torch.full((), -math.inf, dtype=acc, device=q32.device)
        row_lse = torch.empty(n_g, n, dtype=acc, device=q32.device)
        row_out = torch.empty(n if positive_offset is not None else 0, dtype=acc, device=q32.device)
        m_cols = m if with_cols else 0
        col_max = minus_inf.expand(m_cols).clone()  # of L; the maximum of gamma * L is gamma times it
        col_sum = torch.zeros(n_g, m_cols, dtype=acc, device=q32.device)
        width = tile_width(chunk_size, m, q32.device, n_g)
        masked = torch.zeros(n if return_masked else 0, dtype=acc, device=q32.device)
        # The positive logits L[i, offset + i], read from the tiles themselves: lse_i - L_ii is then formed from
        # the same rounded number on both sides, exactly 0 + log(sum) when the positive is the row's maximum.
        positive = torch.zeros(n if positive_offset is not None else 0, dtype=acc, device=q32.device)
        for i0 in range(0, n, chunk_size):
            qs = q32[i0:i0 + chunk_size] * scale  # (c, D): the scale folded into the smaller operand
            r_max = minus_inf.expand(qs.shape[0]).clone()
            r_sum = torch.zeros(n_g, qs.shape[0], dtype=acc, device=q32.device)
            best = None  # the row block's largest logits so far (topk)
            for j0 in range(0, m, width):
                j1 = min(m, j0 + width)
                logits = _logit_tile(qs, k32[j0:j1], None if mask_offset is None else mask_offset + i0 - j0,
                                     masked[i0:i0 + chunk_size] if return_masked else None,
                                     None if bias is None else bias[j0:j1])
                if positive_offset is not None:
                    diag, lo, hi = tile_positives(logits, positive_offset + i0 - j0)
                    positive[i0 + lo:i0 + hi] = diag
                r_max = _online_sums(r_sum, r_max, logits, gammas, dim=1, reuse_tile=False)
                if topk:  # logits is not read again
                    best = _merge_topk(best, logits, j0, topk, None if topk_skip is None else topk_skip + i0 - j0)
                if with_cols:
                    col_max[j0:j1] = _online_sums(col_sum[:, j0:j1], col_max[j0:j1], logits, gammas, dim=0,
                                                  reuse_tile=True)
                del logits
            if topk:
                top_val[i0:i0 + chunk_size], top_idx[i0:i0 + chunk_size] = best
            for gi, g in enumerate(gammas):
                row_lse[gi, i0:i0 + chunk_size] = g * r_max + torch.log(r_sum[gi])
                if positive_offset is not None:  # (max - positive) + log(sum): no cancellation of two large terms
                    row_out[i0:i0 + chunk_size] = (r_max - positive[i0:i0 + chunk_size]) + torch.log(r_sum[gi])
        col_lse = torch.stack([g * col_max for g in gammas]) + torch.log(col_sum)
        ctx.chunk_size, ctx.with_cols, ctx.gammas, ctx.multi = chunk_size, with_cols, gammas, multi
        ctx.positive_offset, ctx.mask_offset, ctx.return_masked = positive_offset, mask_offset, return_masked
        ctx.save_for_backward(queries, keys, logit_scale, row_lse, col_lse, bias)
        if positive_offset is not None:
            row_lse = row_out
            col_lse = (col_max - positive) + torch.log(col_sum[0]) if with_cols else None
        elif not multi:
            row_lse, col_lse = row_lse[0], col_lse[0]
        outputs = (row_lse, col_lse) if with_cols else (row_lse,)
        if return_masked:
            outputs += (masked,)
        if topk:
            ctx.mark_non_differentiable(top_idx, top_val)
            outputs += (top_idx, top_val)
        return outputs if len(outputs) > 1 else row_lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    @float32_math
    def backward(ctx, *grad_outputs: Optional[Tensor]):
        grad_row = grad_outputs[0]
        grad_col = grad_outputs[1] if ctx.with_cols else None
        grad_masked = grad_outputs[2 if ctx.with_cols else 1] if ctx.return_masked else None
        queries, keys, logit_scale, row_lse, col_lse, bias = ctx.saved_tensors
        c, mask_offset, gammas = ctx.chunk_size, ctx.mask_offset, ctx.gammas
        acc = acc_dtype(queries.dtype)
        q32, k32, scale = queries.to(acc), keys.to(acc), logit_scale.to(acc)
        n, m = q32.shape[0], k32.shape[0]
        grad_q = torch.zeros_like(q32)  # sum_j G_ij k_j
        grad_k = torch.zeros_like(k32)  # sum_i G_ij q_i
        # One term per (gamma, direction) with a gradient: d lse_gamma / dL = gamma * softmax(gamma L), formed as
        # exp(gamma L - lse) times gamma * g. (Folding log(gamma g) into the shift would save a pass but round
        # the shift at the size of lse: a relative error of ~1e-5 on every softmax entry at scale 100, and
        # softmax_ii - 1 would no longer vanish where the positive dominates.)
        grads = [(is_row, grad.to(acc).reshape(len(gammas), -1), lse)
                 for is_row, grad, lse in ((True, grad_row, row_lse), (False, grad_col if ctx.with_cols else None,
                                                                         col_lse)) if grad is not None]
        # Gradient tiles without subnormal products: see `coefficient_floor`.
        coefs = [grad[gi] * g for _, grad, _ in grads for gi, g in enumerate(gammas)]
        if grad_masked is not None:
            coefs.append(grad_masked.to(acc))
        unit = coefficient_unit(coefs, q32)
        terms = []  # (gamma, is_row, lse, coefficient / unit, floor of the exp argument)
        diag = torch.zeros(n if ctx.positive_offset is not None else 0, dtype=acc, device=q32.device)
        for is_row, grad, lse in grads:
            for gi, g in enumerate(gammas):
                coef, floor = coefficient_floor(grad[gi] * g, unit, m if is_row else n)
                terms.append((g, is_row, finite_or_zero(lse[gi]), coef, floor))
                if ctx.positive_offset is not None and gi == 0:
                    diag += coef  # d(-L[i, off+i]) / dL = -1 at the positive, from rows and from columns
        width = tile_width(c, m, q32.device, len(gammas))
        if grad_masked is not None:
            grad_masked = grad_masked.to(acc) / unit
        if terms or grad_masked is not None:
            for i0 in range(0, n, c):
                q_raw = q32[i0:i0 + c]
                qs = q_raw * scale
                for j0 in range(0, m, width):
                    j1 = min(m, j0 + width)
                    k = k32[j0:j1]
                    logits = _logit_tile(qs, k, None if mask_offset is None else mask_offset + i0 - j0, None,
                                         None if bias is None else bias[j0:j1])
                    g_tile = torch.zeros_like(logits) if not terms else None
                    for t, (g, is_row, lse, coef, floor) in enumerate(terms):
                        sh = lse[i0:i0 + c, None] if is_row else lse[None, j0:j1]
                        if t < len(terms) - 1:
                            x = torch.add(-sh, logits, alpha=g)  # g * L - lse in one pass, L kept
                        else:
                            x = (logits if g == 1.0 else logits.mul_(g)).sub_(sh)
                        x = torch.maximum(x, floor[i0:i0 + c, None] if is_row else floor[None, j0:j1], out=x)
                        x.exp_().mul_(coef[i0:i0 + c, None] if is_row else coef[None, j0:j1])
                        g_tile = x if g_tile is None else g_tile.add_(x)
                    if ctx.positive_offset is not None:
                        # The -1 of the positive inside the tile, so that softmax_ii - 1 is formed before the
                        # matmul (exactly 0 when the positive dominates) instead of cancelling after it.
                        pos, lo, hi = tile_positives(g_tile, ctx.positive_offset + i0 - j0)
                        pos.sub_(diag[i0 + lo:i0 + hi])
                    if grad_masked is not None:  # d L[i, mask_offset + i] at the entries left out of the sums
                        pos, lo, hi = tile_positives(g_tile, mask_offset + i0 - j0)
                        pos.add_(grad_masked[i0 + lo:i0 + hi])
                    grad_q[i0:i0 + c].addmm_(g_tile, k)
                    grad_k[j0:j1].addmm_(g_tile.T, q_raw)
                    del logits, g_tile
        # dL/ds = sum_ij G_ij q_i.k_j = sum_i q_i . (G K)_i, which reuses the unscaled query gradient.
        grad_scale = torch.dot(q32.reshape(-1), grad_q.reshape(-1)) * unit
        return (
            grad_q.mul_(scale * unit).to(queries.dtype),
            grad_k.mul_(scale * unit).to(keys.dtype),
            grad_scale.to(logit_scale.dtype).reshape(logit_scale.shape),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def as_scale(logit_scale, like: Tensor) -> Tensor:
    # In float32 at least, like the features after `upcast`.
    if not torch.is_tensor(logit_scale):
        return torch.full((), float(logit_scale), dtype=acc_dtype(like.dtype), device=like.device)
    if logit_scale.numel() != 1:
        raise LossInputError(f"logit_scale must be a scalar (got shape {tuple(logit_scale.shape)}, expected ())")
    return logit_scale.reshape(()).to(acc_dtype(logit_scale.dtype))


def upcast(*features: Optional[Tensor]):
    """Half-precision features as float32 (others unchanged): logits, log-sum-exps and every sum are then
    float32, and the gradients of a feature's several uses (as a row and as a column, in the positive) add up
    in float32 behind the one cast, rounded to the input dtype once."""
    return tuple(None if x is None else x.to(acc_dtype(x.dtype)) for x in features)




def tile_positives(tile: Tensor, shift: int) -> Tuple[Tensor, int, int]:
    """The entries j = i + shift of a 2-D tile as a writable view (its `diagonal`), and the range [lo, hi) of the
    tile's rows they sit in. The range is known from the shapes alone: no mask, no data-dependent op, no host
    sync (a boolean mask would cost a device-to-host read per tile on a GPU)."""
    n_rows, n_cols = tile.shape
    lo, hi = max(0, -shift), max(max(0, -shift), min(n_rows, n_cols - shift))
    return tile.diagonal(shift), lo, hi


