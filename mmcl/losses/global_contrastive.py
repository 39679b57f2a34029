"""Global contrastive loss for small batches (SogCLR, Yuan et al. 2022; FastCLIP, Wei et al. 2024).

InfoNCE at batch B estimates each anchor's softmax normaliser from B - 1 negatives, and the gradient of the log of
that estimate is biased: small batches train worse than large ones. The global contrastive loss keeps, for every
sample i of the data set and each direction, a moving estimate u_i of the mean over negatives

    g_i = 1/(M - 1) * sum_{j != i} exp(L_ij - L_ii),        L = s * I @ T.T,

updated from the batch's estimate with rate gamma, ``u_i <- (1 - gamma) * u_i + gamma * g_i(batch)``, and follows
the gradient of ``log(eps + g_i)`` with the batch's ``grad g_i`` divided by ``eps + u_i`` instead of by the batch
estimate. Over the run the estimates average many batches' negatives, so the gradient approaches that of the
full-data-set objective ``mean_i log(eps + g_i(all negatives))`` at any batch size.

Scale and eps. The per-row loss ``log(eps + g_i)`` equals InfoNCE minus ``log(M - 1)`` when ``eps = 1 / (M - 1)``
(the default): the positive weighs in the normaliser as in InfoNCE, and with gamma = 1 (the estimate is the
batch's) value and gradients are exactly CLIP's, so the learning rate, the learned temperature and the other terms'
weights keep their meaning next to ``loss.clip``. ``eps = 1 / (N - 1)`` for a data set of N samples weighs the
positive as full-data-set InfoNCE does; eps -> 0 is the papers' objective, whose temperature gradient never
vanishes (the learned scale then climbs to its clamp; the papers fix or separately regularise tau). The papers'
objective is ``tau * log(...)``: libauc's bimodal loss has gradients (M - 1) * tau times these at eps = 0. The
temperature is learned as in CLIP: the gradient of the logits reaches ``s`` through ``L = s * I @ T.T``.

Numerics. The estimates live in log space (``log u``, -inf for a sample never seen, whose first estimate is its
batch's); exp(L_ij - L_ii) spans e^{+-200} at scale 100, out of float32's range, and the log-sum-exp over the
negatives comes from the same masked tiles as the debiased loss (the positive left out of the sum, never
subtracted from it). The coefficient ``g_i(batch) / (eps + u_i)`` is at most 1 / gamma.

Distributed. Each rank scores its own rows against the gathered columns and updates the estimates of its own
rows; `GlobalEstimates` gathers the updates so that every rank holds the same table (2 processes = 1).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .errors import LossInputError
from .inputs import Gathered, check_chunk, check_pair, gathered_columns
from .precision import float32_math
from .reweighted import negative_lse
from .tiling import as_scale, upcast

GAMMA_SCHEDULES = ("constant", "cosine")


def gamma_at(step: int, gamma: float, schedule: str = "constant", decay_steps: int = 0) -> float:
    """The inner rate of the moving estimates at update `step` (0-based).

    ``constant``: `gamma` throughout (a sample's first estimate is its batch's whatever the rate). ``cosine``
    (FastCLIP): from 1 down to `gamma` along a half cosine over `decay_steps` updates, then `gamma`: early
    estimates follow the quickly changing features, later ones average over more batches.
    """
    if schedule == "constant" or decay_steps <= 0 or step >= decay_steps:
        return float(gamma)
    if schedule != "cosine":
        raise LossInputError(f"unknown gamma schedule {schedule!r} (expected one of {', '.join(GAMMA_SCHEDULES)})")
    return float(gamma + (1 - gamma) * 0.5 * (1 + math.cos(math.pi * step / decay_steps)))


def _updated(log_u: Tensor, log_g: Tensor, gamma: float) -> Tensor:
    """``log((1 - gamma) * u + gamma * g)`` from logs; a row never seen (log u = -inf) takes its batch's estimate."""
    if gamma >= 1.0:
        return log_g
    mixed = torch.logaddexp(log_u + math.log1p(-gamma), log_g + math.log(gamma))
    return torch.where(torch.isneginf(log_u), log_g, mixed)


def _rows(d: Tensor, log_u: Tensor, gamma: float, log_eps: float, n_neg: int) -> Tuple[Tensor, Tensor]:
    """Per-row losses and new estimates from ``d_i = log sum_{j != i} exp(L_ij - L_ii)`` (differentiable).

    The value is ``log(eps + u_i)`` with the updated estimate; its gradient is ``g_i / (eps + u_i) * grad d_i``
    (= ``grad g_i / (eps + u_i)``), with the coefficient detached.
    """
    log_g = d.detach() - math.log(n_neg)
    new = _updated(log_u.to(d.dtype), log_g, gamma)
    log_denominator = torch.logaddexp(new, torch.full_like(new, log_eps))
    coefficient = torch.exp(log_g - log_denominator)
    return log_denominator + coefficient * (d - d.detach()), new


@float32_math
def global_contrastive_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    log_u_image: Tensor,
    log_u_text: Tensor,
    gamma: float,
    eps: Optional[float] = None,
    chunk_size: Optional[int] = None,
    *,
    gathered: Optional[Gathered] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Symmetric global contrastive loss of this rank's rows (see the module docstring).

    Args:
        image_features, text_features: (n, D) float, L2-normalised; row i of each is a pair.
        logit_scale: 0-dim tensor s (already exponentiated).
        log_u_image, log_u_text: (n,) the current log estimates of the rows' image->text and text->image
            normalisers (-inf: not seen yet); not modified.
        gamma: the inner rate in (0, 1] (`gamma_at`).
        eps: the constant inside the log (>= 0); None: 1 / (M - 1) for M pairs in the global batch, where the
            loss is InfoNCE with the batch's normaliser replaced by the moving estimate.
        chunk_size: None is the dense computation; an int the tiled one (same values and gradients).
        gathered: the global batch's columns and this rank's first row in it (`gather_batch`); None when this
            process holds the whole batch.
    Returns:
        (loss, new_log_u_image, new_log_u_text): the 0-dim mean over rows and both directions of
        ``log(eps + u_i)`` carrying the estimator's gradient, and the (n,) updated log estimates (float32 at
        least, no gradient).
    """
    check_pair(image_features, text_features)
    check_chunk(chunk_size)
    if not 0.0 < gamma <= 1.0:
        raise LossInputError(f"gamma must be in (0, 1] (got {gamma})")
    if eps is not None and not eps >= 0.0:
        raise LossInputError(f"eps must be >= 0 (got {eps})")
    n = image_features.shape[0]
    for name, log_u in (("log_u_image", log_u_image), ("log_u_text", log_u_text)):
        if log_u.shape != (n,):
            raise LossInputError(f"{name} must have shape ({n},) (got {tuple(log_u.shape)})")
    logit_scale = as_scale(logit_scale, image_features)
    image_features, text_features = upcast(image_features, text_features)
    all_img, all_txt, offset, single = gathered_columns(image_features, text_features, gathered)
    m = all_img.shape[0]
    if m < 2:
        raise LossInputError(f"the global contrastive loss needs at least 2 pairs in the global batch (got {m})")
    (p_i2t, p_t2i), [(lse_i2t, lse_t2i)] = negative_lse(
        image_features, text_features, all_img, all_txt, logit_scale, (1.0,), offset, chunk_size, single
    )
    if eps is None:
        eps = 1.0 / (m - 1)
    log_eps = math.log(eps) if eps > 0 else -math.inf
    image_rows, new_image = _rows(lse_i2t - p_i2t, log_u_image, gamma, log_eps, m - 1)
    text_rows, new_text = _rows(lse_t2i - p_t2i, log_u_text, gamma, log_eps, m - 1)
    return (image_rows.mean() + text_rows.mean()) / 2, new_image, new_text


def _all_gather(x: Tensor) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


class GlobalEstimates(nn.Module):
    """The per-sample estimates of the global contrastive term, with its update counter (for the gamma schedule).

    A sample's id (a 63-bit hash of its shard and key, `mmcl.data.pipeline.sample_id`) picks slot
    ``id % table_size`` of two float32 tables (log u for image->text and text->image): 8 bytes per slot, 8 MiB for
    the default 2^20 slots. Samples whose ids share a slot share an estimate: with N samples in T slots a fraction
    of about ``1 - exp(-N / T)`` of them does, so T of a few times the data set keeps that small.
    The tables are buffers and the counter extra state: they travel in the objective's state dict, hence in
    checkpoints, and every rank holds the same copy (each rank's updates are gathered). ``dtype`` is the tables'
    (float32; float64 for references). A step reads nothing on the host.

    ``forward(image_features, text_features, logit_scale, sample_ids, gathered=None, chunk_size=None)`` returns
    the term's 0-dim loss; in training mode it also writes the rows' new estimates and counts one update. Out of
    training mode (an evaluation loss) nothing is written and the estimates are the batch's own (gamma = 1);
    there ``sample_ids`` may be None.
    """

    def __init__(self, table_size: int = 1 << 20, gamma: float = 0.9, schedule: str = "constant",
                 decay_steps: int = 0, eps: Optional[float] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if table_size < 1:
            raise LossInputError(f"table_size must be >= 1 (got {table_size})")
        if schedule not in GAMMA_SCHEDULES:
            raise LossInputError(f"unknown gamma schedule {schedule!r} (expected one of {', '.join(GAMMA_SCHEDULES)})")
        if not 0.0 < gamma <= 1.0:
            raise LossInputError(f"gamma must be in (0, 1] (got {gamma})")
        self.table_size, self.gamma, self.schedule, self.decay_steps, self.eps = (
            int(table_size), float(gamma), schedule, int(decay_steps), None if eps is None else float(eps))
        self.register_buffer("log_u_image", torch.full((self.table_size,), -math.inf, dtype=dtype))
        self.register_buffer("log_u_text", torch.full((self.table_size,), -math.inf, dtype=dtype))
        self.updates = 0  # updates so far, for the gamma schedule: a host number (no device read), in extra state

    def get_extra_state(self):
        return {"updates": self.updates}

    def set_extra_state(self, state) -> None:
        self.updates = int(state["updates"])

    def current_gamma(self) -> float:
        """The rate the next update uses."""
        return gamma_at(self.updates, self.gamma, self.schedule, self.decay_steps)

    # Run eagerly inside a compiled objective (``train.compile``): gamma changes every step (a float dynamo would
    # specialise on) and the update counter is a host number, so a compiled frame would be compiled again per step.
    @torch.compiler.disable
    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                sample_ids: Optional[Tensor], gathered: Optional[Gathered] = None,
                chunk_size: Optional[int] = None) -> Tensor:
        training = self.training
        n = image_features.shape[0]
        if sample_ids is None and training:
            raise LossInputError("the global contrastive term needs the batch's sample ids (got none)")
        if sample_ids is None:  # an evaluation loss of held-out data: the batch's own estimates
            unseen = torch.full((n,), -math.inf, dtype=self.log_u_image.dtype, device=image_features.device)
            return global_contrastive_loss(image_features, text_features, logit_scale, unseen, unseen, 1.0,
                                           self.eps, chunk_size, gathered=gathered)[0]
        if sample_ids.shape != (n,):
            raise LossInputError(f"sample ids must have shape ({n},) (got {tuple(sample_ids.shape)})")
        slots = torch.remainder(sample_ids.to(self.log_u_image.device, torch.long), self.table_size)
        gamma = self.current_gamma() if training else 1.0
        loss, new_image, new_text = global_contrastive_loss(
            image_features, text_features, logit_scale,
            self.log_u_image[slots].to(image_features.device), self.log_u_text[slots].to(image_features.device),
            gamma, self.eps, chunk_size, gathered=gathered)
        if training:
            self._write(slots, new_image, new_text, gathered is not None)
        return loss

    @torch.no_grad()
    def _write(self, slots: Tensor, new_image: Tensor, new_text: Tensor, distributed: bool) -> None:
        device = self.log_u_image.device
        values = torch.stack([new_image, new_text], dim=1).to(device, self.log_u_image.dtype)
        if distributed:  # every rank applies every rank's rows, in the global batch's order
            slots = _all_gather(slots.to(new_image.device)).to(device)
            values = _all_gather(values.to(new_image.device)).to(device)
        # Rows sharing a slot (a repeated sample, or a collision) each read the old estimate, and the last row's
        # update is kept: every row of a run of equal slots (a stable sort keeps the rows' order within it)
        # writes the value of the run's last row, so the result does not depend on the order in which index_put
        # applies them. Shape-static ops only: no host sync.
        slots, order = torch.sort(slots, stable=True)
        m = slots.shape[0]
        positions = torch.arange(m, device=device)
        run_end = torch.ones(m, dtype=torch.bool, device=device)
        run_end[:-1] = slots[:-1] != slots[1:]
        ends = torch.where(run_end, positions, torch.full_like(positions, m))
        last = torch.flip(torch.cummin(torch.flip(ends, [0]), 0).values, [0])  # the end of each row's run
        values = values[order][last]
        self.log_u_image[slots] = values[:, 0]
        self.log_u_text[slots] = values[:, 1]
        self.updates += 1
