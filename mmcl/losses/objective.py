"""`ContrastiveObjective`: the weighted sum of loss terms used in training, built from numbers (term weights and
the terms' parameters), not from the config tree; the caller gathers the global batch (`gather_batch`)."""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._precision import float32_math
from .errors import LossInputError
from .tiling import _acc_dtype, _as_scale
from .clip import _check_pair, clip_loss
from .supcon import _check_labels, supcon_loss
from .siglip import siglip_loss
from .reweighted import debiased_clip_loss, hard_negative_clip_loss
from .mochi import FeatureQueue, mochi_loss
from .geometry import _uniform_log_partial, align_loss, uniform_loss
from .distributed import Gathered
from .distill import TeacherFeatures, distill_loss

# Logged metrics only need a sample of the batch; pairwise uniformity is quadratic in it.
_METRIC_MAX_ITEMS = 4096
TERMS = ("clip", "supcon", "siglip", "align", "uniform", "debiased", "hard_negative", "mochi", "distill")


class ContrastiveObjective(nn.Module):
    """Weighted sum of loss terms; holds the MoCHi queues and generator.

    Args:
        weights: term name -> weight, names from `TERMS` (absent terms weigh 0); the terms with a positive weight
            are computed.
        chunk_size: None (dense) or the tile size of the tiled terms.
        tau_plus, hn_beta: the debiased / hard-negative terms' class prior and concentration.
        align_alpha, uniform_t: the align / uniform terms' (and metrics') exponent and temperature.
        n_hard, s, s_prime, mix_max: MoCHi's hardest negatives and synthetic negatives (see `mochi_loss`).
        queue_size: MoCHi's queue of past features (used only with a positive ``mochi`` weight).

    ``forward(image_features, text_features, logit_scale, logit_bias=None, labels=None, with_metrics=True,
    gathered=None, teacher=None)`` returns ``(total_loss, terms)``. With ``gathered`` (`gather_batch` of this rank's features
    and labels, several ranks) each rank's rows are scored against the global columns and ``total_loss`` is this
    rank's 0-dim loss to backpropagate: after DDP averages parameter gradients they equal a single process's on
    the global batch (see the package docstring). ``terms`` holds floats, averaged over ranks so they describe
    the global batch: ``loss`` (weighted total), ``loss/<name>`` for every active term, and the metrics
    ``align``, ``uniform_image``, ``uniform_text`` (no gradient; each rank's first 4096 items, then averaged
    over ranks). With ``with_metrics=False`` (a trainer's steps that are not logged) there are no metrics, and
    ``loss`` and ``loss/<name>`` stay 0-dim tensors of this rank's rows: no collective and no host read. The scale is used as given: the limit on it is the model's (its parameter is clamped).

    ``teacher`` (a `TeacherFeatures` of this rank's pairs) feeds the ``distill`` term (`distill_loss`); with
    ``gathered`` its features must have been gathered too (``gather_batch(..., teacher=...)``).

    ``labels`` (B,) integer, -1 for "no label", feed the supervised term; without labels every pair is its
    own class. In training mode, each call appends the global batch to the MoCHi queues after the loss.
    ``state_dict`` holds the queues and the generator state.
    """

    def __init__(self, weights: Mapping[str, float], *, chunk_size: Optional[int] = None, tau_plus: float = 0.1,
                 hn_beta: float = 1.0, align_alpha: float = 2.0, uniform_t: float = 2.0, n_hard: int = 64,
                 s: int = 32, s_prime: int = 16, mix_max: float = 0.5, queue_size: int = 0):
        super().__init__()
        unknown = sorted(set(weights) - set(TERMS))
        if unknown:
            raise LossInputError(f"unknown loss terms {unknown} (expected some of {', '.join(TERMS)})")
        self.weights: Dict[str, float] = {name: float(weights.get(name, 0.0)) for name in TERMS}
        self.chunk_size = chunk_size
        self.tau_plus, self.hn_beta = tau_plus, hn_beta
        self.align_alpha, self.uniform_t = align_alpha, uniform_t
        self.n_hard, self.s, self.s_prime, self.mix_max = n_hard, s, s_prime, mix_max
        size = queue_size if self.weights["mochi"] > 0 else 0
        self.image_queue = FeatureQueue(size)
        self.text_queue = FeatureQueue(size)
        self.generator = torch.Generator()
        self.generator.manual_seed(0)

    def reseed(self, seed: int) -> None:
        """Seed the generator that draws MoCHi's mixing indices and coefficients (same seed on every rank)."""
        self.generator.manual_seed(int(seed))

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state) -> None:
        self.generator.set_state(state["generator"])

    def active_terms(self):
        """Names of the terms with a positive weight."""
        return [name for name, w in self.weights.items() if w > 0]

    @float32_math
    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        logit_bias: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        with_metrics: bool = True,
        gathered: Optional[Gathered] = None,
        teacher: Optional[TeacherFeatures] = None,
    ):
        """Weighted loss and the logged numbers. ``with_metrics`` adds the align/uniform metrics, which cost a
        pairwise pass over the batch; a trainer may leave them out on steps it does not log (pass the same value
        on every rank, since the logged numbers are reduced together). ``gathered``: see the class docstring."""
        _check_pair(image_features, text_features)
        w = self.weights
        logit_scale = _as_scale(logit_scale, image_features)
        if labels is not None:
            labels = _check_labels(labels.to(image_features.device), image_features.shape[0], image_features.device)
        distributed = gathered is not None
        if distributed:
            all_img, all_txt, all_labels = gathered.all_image_features, gathered.all_text_features, gathered.all_labels
            offset = gathered.offset
            if all_img.shape[0] != image_features.shape[0] * gathered.world_size:
                raise LossInputError(f"gathered features hold {all_img.shape[0]} rows, expected "
                                     f"{gathered.world_size} ranks x {image_features.shape[0]}")
            cols = dict(all_image_features=all_img, all_text_features=all_txt, offset=offset)
        else:
            all_img, all_txt, all_labels, offset = image_features, text_features, labels, 0
            cols = {}
        chunk = self.chunk_size

        values: Dict[str, Tensor] = {}
        if w["clip"] > 0:
            values["clip"] = clip_loss(image_features, text_features, logit_scale, chunk, **cols)
        if w["supcon"] > 0:
            values["supcon"] = supcon_loss(
                image_features, text_features, labels, logit_scale, chunk, **cols,
                **({"all_labels": all_labels} if distributed else {}),
            )
        if w["siglip"] > 0:
            if logit_bias is None:
                raise LossInputError("the siglip term needs a logit bias (got none)")
            values["siglip"] = siglip_loss(
                image_features, text_features, logit_scale, logit_bias,
                **({"all_text_features": all_txt, "offset": offset} if distributed else {}),
                chunk_size=chunk,
            )
        if w["debiased"] > 0:
            values["debiased"] = debiased_clip_loss(
                image_features, text_features, logit_scale, self.tau_plus, chunk, **cols
            )
        if w["hard_negative"] > 0:
            values["hard_negative"] = hard_negative_clip_loss(
                image_features, text_features, logit_scale, self.tau_plus, self.hn_beta, chunk, **cols
            )
        if w["mochi"] > 0:
            values["mochi"] = mochi_loss(
                image_features, text_features, logit_scale, self.n_hard, self.s, self.s_prime, self.mix_max,
                self.generator,
                self.image_queue.get(), self.text_queue.get(), **cols, chunk_size=chunk,
            )
        if w["distill"] > 0:
            if teacher is None:
                raise LossInputError("the distill term needs the teacher's features (got none)")
            extra = {}
            if distributed:
                if gathered.all_teacher_image is None:
                    raise LossInputError("the distill term needs the teacher's features gathered over ranks "
                                         "(gather_batch(..., teacher=...))")
                extra = dict(cols, all_teacher_image=gathered.all_teacher_image,
                             all_teacher_text=gathered.all_teacher_text)
            values["distill"] = distill_loss(image_features, text_features, logit_scale, teacher.image,
                                             teacher.text, teacher.scale, chunk, **extra)
        if w["align"] > 0:
            values["align"] = align_loss(image_features, text_features, self.align_alpha)
        if w["uniform"] > 0:
            values["uniform"] = (
                self._uniform(image_features, all_img, offset, gathered)
                + self._uniform(text_features, all_txt, offset, gathered)
            ) / 2

        total = sum(w[name] * value for name, value in values.items())
        with torch.no_grad():
            # float64 keeps the logged numbers exact for float64 inputs; MPS has no float64.
            log_dtype = torch.float32 if image_features.device.type == "mps" else torch.float64
            logged = {f"loss/{name}": value.detach().to(log_dtype) for name, value in values.items()}
            if with_metrics:
                logged.update(self._metrics(image_features, text_features))
            if with_metrics:
                names = list(logged)
                stacked = torch.stack([logged[k].reshape(()).to(log_dtype) for k in names])
                if distributed:
                    dist.all_reduce(stacked)
                    stacked /= gathered.world_size
                terms = dict(zip(names, stacked.tolist()))
            else:  # no collective and no host read: a trainer's ordinary step never waits on these
                terms = {k: v.reshape(()) for k, v in logged.items()}
        terms["loss"] = sum(w[name] * terms[f"loss/{name}"] for name in values)
        if self.training and w["mochi"] > 0:
            self.image_queue.enqueue(all_img)
            self.text_queue.enqueue(all_txt)
        return total, terms

    def _uniform(self, x: Tensor, all_x: Tensor, offset: int, gathered: Optional[Gathered]) -> Tensor:
        t = self.uniform_t
        if gathered is None:
            return uniform_loss(x, t)
        # Global uniformity is log(Z / P) with Z = sum_r Z_r summed over ranks' rows. Each rank returns the
        # global value plus a zero-valued term whose gradient is W * dZ_r / Z, so that DDP's average over
        # ranks gives d log Z exactly.
        world = gathered.world_size
        n_all = all_x.shape[0]
        if n_all < 2:
            raise LossInputError(f"uniform_loss needs at least 2 items (got {n_all})")
        log_part = _uniform_log_partial(x, all_x, offset, t)  # log Z_r, 0-dim
        parts = [torch.zeros(1, dtype=log_part.dtype, device=log_part.device) for _ in range(world)]
        dist.all_gather(parts, log_part.detach().reshape(1))
        log_total = torch.logsumexp(torch.cat(parts), dim=0)
        value = log_total - math.log(n_all * (n_all - 1))
        return value + world * (torch.exp(log_part - log_total) - torch.exp(log_part.detach() - log_total))

    @torch.no_grad()
    def _metrics(self, image_features: Tensor, text_features: Tensor) -> Dict[str, Tensor]:
        acc = _acc_dtype(image_features.dtype)
        img = image_features[:_METRIC_MAX_ITEMS].detach().to(acc)
        txt = text_features[:_METRIC_MAX_ITEMS].detach().to(acc)
        out = {"align": align_loss(img, txt, self.align_alpha)}
        if img.shape[0] >= 2:
            out["uniform_image"] = uniform_loss(img, self.uniform_t)
            out["uniform_text"] = uniform_loss(txt, self.uniform_t)
        else:
            nan = torch.full((), math.nan, device=img.device)
            out["uniform_image"] = out["uniform_text"] = nan
        return out
