"""`ContrastiveObjective`: the weighted sum of loss terms used in training, built from numbers (term weights and
the terms' parameters), not from the config tree; the caller gathers the global batch (`gather_batch`).

The terms are one table, `_TABLE`, with a row per term: ``Term(name, needs, compute)``.
- ``name`` is the term's name everywhere: its weight's config key is ``loss.<name>`` (``loss.<name>.weight`` for
  a term with its own section of parameters, as ``loss.mochi``; `mmcl.config.term_keys` derives the keys from
  `TERMS`), its logged loss is ``loss/<name>``, and its key in the ``weights`` of `ContrastiveObjective`.
- ``needs`` names the optional inputs of the forward (fields of `TermInputs`: ``logit_bias``, ``labels``,
  ``teacher``) the term cannot do without; a missing one is a `LossInputError` naming the term.
- ``compute(objective, inputs)`` returns the term's 0-dim loss over this rank's rows, from the `TermInputs` and
  the objective's parameters (``objective.chunk_size``, ``objective.tau_plus``, ...).
A new term is its loss function (its own module) and one row; a parameter of it is a keyword of the constructor,
and `mmcl.training.step.objective_from_config` passes each field of a term's config section (other than its
weight) as the keyword of the same name. The objective computes the rows with a positive weight, in table order.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._inputs import Gathered, _check_labels, _check_pair
from ._precision import float32_math
from .clip import clip_loss
from .distill import TeacherFeatures, distill_loss
from .errors import LossInputError
from .geometry import _uniform_log_partial, align_loss, uniform_loss
from .global_contrastive import GlobalEstimates
from .mochi import FeatureQueue, mochi_loss
from .reweighted import debiased_clip_loss, hard_negative_clip_loss
from .siglip import siglip_loss
from .supcon import supcon_loss
from .tiling import _acc_dtype, _as_scale
from .variable_pairs import VARIABLE_PAIR_TERMS, PairMask, masked_geometry, pair_mask

# Logged metrics only need a sample of the batch; pairwise uniformity is quadratic in it.
_METRIC_MAX_ITEMS = 4096


class TermInputs(NamedTuple):
    """What the forward passes to every term: this rank's rows and the optional inputs, as checked."""

    image: Tensor  # (n, D) this rank's image features
    text: Tensor  # (n, D)
    logit_scale: Tensor  # 0-dim, float32 at least
    logit_bias: Optional[Tensor]  # 0-dim, SigLIP's
    labels: Optional[Tensor]  # (n,) long, -1 for "no label"
    gathered: Optional[Gathered]  # the global batch's columns; None in one process
    teacher: Optional[TeacherFeatures]  # the teacher's features of this rank's pairs
    sample_ids: Optional[Tensor] = None  # (n,) long, the stable ids of this rank's pairs (the global term's keys)
    valid: Optional[Tensor] = None  # (n,) bool, the real rows of a padded batch (`VARIABLE_PAIR_TERMS` only)

    def columns(self) -> Tuple[Tensor, Tensor, int]:
        """(all_image, all_text, offset): the global batch's columns and this rank's first row among them."""
        if self.gathered is None:
            return self.image, self.text, 0
        return self.gathered.all_image_features, self.gathered.all_text_features, self.gathered.offset


class Term(NamedTuple):
    """One row of the objective's table (see the module docstring)."""

    name: str
    needs: Tuple[str, ...]
    compute: Callable[["ContrastiveObjective", TermInputs], Tensor]


# What each optional input is called in the error of a term that needs it and did not get it.
_NEEDS = {"logit_bias": "a logit bias", "labels": "labels", "teacher": "the teacher's features"}


def _uniform_term(obj: "ContrastiveObjective", x: TermInputs) -> Tensor:
    all_img, all_txt, offset = x.columns()
    return (obj._uniform(x.image, all_img, offset, x.gathered) + obj._uniform(x.text, all_txt, offset, x.gathered)) / 2


def _mochi_term(obj: "ContrastiveObjective", x: TermInputs) -> Tensor:
    return mochi_loss(x.image, x.text, x.logit_scale, obj.n_hard, obj.s, obj.s_prime, obj.mix_max, obj.generator,
                      obj.image_queue.get(), obj.text_queue.get(), gathered=x.gathered, chunk_size=obj.chunk_size)


def _distill_term(obj: "ContrastiveObjective", x: TermInputs) -> Tensor:
    t = x.teacher
    return distill_loss(x.image, x.text, x.logit_scale, t.image, t.text, t.scale, obj.chunk_size, gathered=x.gathered)


_TABLE: Tuple[Term, ...] = (
    Term("clip", (), lambda o, x: clip_loss(x.image, x.text, x.logit_scale, o.chunk_size, gathered=x.gathered,
                                            valid=x.valid)),
    Term("supcon", (), lambda o, x: supcon_loss(x.image, x.text, x.labels, x.logit_scale, o.chunk_size,
                                                gathered=x.gathered)),
    Term("siglip", ("logit_bias",), lambda o, x: siglip_loss(x.image, x.text, x.logit_scale, x.logit_bias,
                                                             gathered=x.gathered, chunk_size=o.chunk_size,
                                                             valid=x.valid)),
    Term("align", (), lambda o, x: align_loss(x.image, x.text, o.align_alpha)),
    Term("uniform", (), _uniform_term),
    Term("debiased", (), lambda o, x: debiased_clip_loss(x.image, x.text, x.logit_scale, o.tau_plus, o.chunk_size,
                                                         gathered=x.gathered)),
    Term("hard_negative", (), lambda o, x: hard_negative_clip_loss(x.image, x.text, x.logit_scale, o.tau_plus,
                                                                   o.hn_beta, o.chunk_size, gathered=x.gathered)),
    Term("mochi", (), _mochi_term),
    Term("distill", ("teacher",), _distill_term),
    Term("global_contrastive", (), lambda o, x: o.global_estimates(  # sample ids: needed in training mode only
        x.image, x.text, x.logit_scale, x.sample_ids, x.gathered, o.chunk_size)),
)
TERMS = tuple(term.name for term in _TABLE)


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
        gamma, gamma_schedule, gamma_decay_steps, eps, table_size: the global contrastive term's moving estimates
            (`GlobalEstimates`; kept only with a positive ``global_contrastive`` weight).

    ``forward(image_features, text_features, logit_scale, logit_bias=None, labels=None, with_metrics=True,
    gathered=None, teacher=None)`` returns ``(total_loss, terms)``. With ``gathered`` (`gather_batch` of this rank's
    features and labels, several ranks) each rank's rows are scored against the global columns and ``total_loss`` is
    this rank's 0-dim loss to backpropagate: after DDP averages parameter gradients they equal a single process's on the
    global batch (see the package docstring). ``terms`` holds floats, averaged over ranks so they describe the global
    batch: ``loss`` (weighted total), ``loss/<name>`` for every active term, and the metrics ``align``,
    ``uniform_image``, ``uniform_text`` (no gradient; each rank's first 4096 items, then averaged over ranks). With
    ``with_metrics=False`` (a trainer's steps that are not logged) there are no metrics, and ``loss`` and
    ``loss/<name>`` stay 0-dim tensors of this rank's rows: no collective and no host read. The scale is used as given:
    the limit on it is the model's (its parameter is clamped).

    ``teacher`` (a `TeacherFeatures` of this rank's pairs) feeds the ``distill`` term (`distill_loss`); with
    ``gathered`` its features must have been gathered too (``gather_batch(..., teacher=...)``).

    ``labels`` (B,) integer, -1 for "no label", feed the supervised term; without labels every pair is its
    own class. In training mode, each call appends the global batch to the MoCHi queues after the loss.
    ``sample_ids`` (n,) long, the stable ids of this rank's pairs, key the global contrastive term's estimates,
    which each call in training mode updates.

    ``valid`` (n,) bool marks the real rows of a padded batch (`pad_pairs`: a variable number of pairs per process;
    with ``gathered``, ``gather_batch(..., valid=valid)``): the terms then score the real pairs alone, exactly as
    one process holding only them, and the metrics read the real rows only. Only the terms of
    `VARIABLE_PAIR_TERMS` take it; another term with a positive weight is a `LossInputError`.

    ``state_dict`` holds the queues, the estimates and the generator state.
    """

    def __init__(self, weights: Mapping[str, float], *, chunk_size: Optional[int] = None, tau_plus: float = 0.1,
                 hn_beta: float = 1.0, align_alpha: float = 2.0, uniform_t: float = 2.0, n_hard: int = 64,
                 s: int = 32, s_prime: int = 16, mix_max: float = 0.5, queue_size: int = 0, gamma: float = 0.9,
                 gamma_schedule: str = "constant", gamma_decay_steps: int = 0, eps: Optional[float] = None,
                 table_size: int = 2 ** 20):
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
        # The global contrastive term's per-sample estimates (buffers: saved with the objective's state)
        self.global_estimates = (GlobalEstimates(table_size, gamma, gamma_schedule, gamma_decay_steps, eps)
                                 if self.weights["global_contrastive"] > 0 else None)

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
        sample_ids: Optional[Tensor] = None,
        valid: Optional[Tensor] = None,
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
        mask = self._check_batch(image_features, gathered, valid)
        inputs = TermInputs(image_features, text_features, logit_scale, logit_bias, labels, gathered, teacher,
                            sample_ids, valid)
        values: Dict[str, Tensor] = {}
        for term in _TABLE:
            if w[term.name] <= 0:
                continue
            for need in term.needs:
                if getattr(inputs, need) is None:
                    raise LossInputError(f"the {term.name} term needs {_NEEDS[need]} (got none)")
            values[term.name] = term.compute(self, inputs)

        total = sum(w[name] * value for name, value in values.items())
        with torch.no_grad():
            # float64 keeps the logged numbers exact for float64 inputs; MPS has no float64.
            log_dtype = torch.float32 if image_features.device.type == "mps" else torch.float64
            logged = {f"loss/{name}": value.detach().to(log_dtype) for name, value in values.items()}
            if with_metrics:
                logged.update(self._metrics(image_features, text_features, mask))
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
            all_img, all_txt, _ = inputs.columns()
            self.image_queue.enqueue(all_img)
            self.text_queue.enqueue(all_txt)
        return total, terms

    def _check_batch(self, image: Tensor, gathered: Optional[Gathered], valid: Optional[Tensor]):
        """The gathered rows' count, and with `valid` the terms and the `PairMask` (returned; None without)."""
        n = image.shape[0]
        if gathered is not None and gathered.all_image_features.shape[0] != n * gathered.world_size:
            raise LossInputError(f"gathered features hold {gathered.all_image_features.shape[0]} rows, expected "
                                 f"{gathered.world_size} ranks x {n}")
        if valid is None:
            return None
        for name in self.active_terms():
            if name not in VARIABLE_PAIR_TERMS:
                raise LossInputError(f"the {name} term does not take a variable number of pairs per process "
                                     "(NaFlex); use loss.clip or loss.siglip")
        m = n if gathered is None else gathered.all_image_features.shape[0]
        return pair_mask(valid, n, image.device, gathered, m)

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
    def _metrics(self, image_features: Tensor, text_features: Tensor,
                 mask: Optional[PairMask] = None) -> Dict[str, Tensor]:
        acc = _acc_dtype(image_features.dtype)
        img = image_features[:_METRIC_MAX_ITEMS].detach().to(acc)
        txt = text_features[:_METRIC_MAX_ITEMS].detach().to(acc)
        if mask is not None:  # real rows only, weighted so that the mean over ranks describes the global batch
            mask = PairMask(mask.rows[:_METRIC_MAX_ITEMS], mask.cols, mask.world)
            return masked_geometry(img, txt, mask, self.align_alpha, self.uniform_t)
        out = {"align": align_loss(img, txt, self.align_alpha)}
        if img.shape[0] >= 2:
            out["uniform_image"] = uniform_loss(img, self.uniform_t)
            out["uniform_text"] = uniform_loss(txt, self.uniform_t)
        else:
            nan = torch.full((), math.nan, device=img.device)
            out["uniform_image"] = out["uniform_text"] = nan
        return out
