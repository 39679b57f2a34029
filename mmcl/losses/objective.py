"""`ContrastiveObjective`: the weighted sum of loss terms used in training, and `build_objective`."""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import ConfigError, DataError
from .tiling import _acc_dtype, _as_scale
from .clip import _check_pair, clip_loss
from .supcon import _check_labels, supcon_loss
from .siglip import siglip_loss
from .reweighted import debiased_clip_loss, hard_negative_clip_loss
from .mochi import FeatureQueue, mochi_loss
from .geometry import _uniform_log_partial, align_loss, uniform_loss
from .distributed import _distributed, gather_features

# Logged metrics only need a sample of the batch; pairwise uniformity is quadratic in it.
_METRIC_MAX_ITEMS = 4096


class ContrastiveObjective(nn.Module):
    """Weighted sum of the configured terms; holds the MoCHi queues and generator.

    ``forward(image_features, text_features, logit_scale, logit_bias=None, labels=None)`` returns
    ``(total_loss, terms)``. ``total_loss`` is this rank's 0-dim loss to backpropagate: when
    ``torch.distributed`` is initialised with several ranks, features are gathered with gradient and each
    rank's rows are scored against the global columns, so after DDP averages parameter gradients they equal
    a single process's on the global batch (see the module docstring). ``terms`` holds floats, averaged over
    ranks so they describe the global batch: ``loss`` (weighted total), ``loss/<name>`` for every active
    term, and the metrics ``align``, ``uniform_image``, ``uniform_text`` (no gradient; each rank's first
    4096 items, then averaged over ranks).

    ``labels`` (B,) integer, -1 for "no label", feed the supervised term; without labels every pair is its
    own class. In training mode, each call appends the global batch to the MoCHi queues after the loss.
    ``state_dict`` holds the queues and the generator state.
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weights: Dict[str, float] = {
            name: float(getattr(cfg, name))
            for name in ("clip", "supcon", "siglip", "align", "uniform", "debiased", "hard_negative")
        }
        self.weights["mochi"] = float(cfg.mochi.weight)
        problems = [f"loss.{name} must be >= 0 (got {w})" for name, w in self.weights.items() if w < 0]
        if not any(w > 0 for w in self.weights.values()):
            problems.append("no loss term is active (got all weights 0, expected at least one > 0)")
        if cfg.chunk_size is not None and cfg.chunk_size <= 0:
            problems.append(f"loss.chunk_size must be a positive integer or null (got {cfg.chunk_size})")
        if (self.weights["debiased"] > 0 or self.weights["hard_negative"] > 0) and not 0 <= cfg.tau_plus < 1:
            problems.append(f"loss.tau_plus must be in [0, 1) (got {cfg.tau_plus})")
        if self.weights["hard_negative"] > 0 and cfg.hn_beta < 0:
            problems.append(f"loss.hn_beta must be >= 0 (got {cfg.hn_beta})")
        m = cfg.mochi
        if self.weights["mochi"] > 0 and (m.n_hard < 1 or m.s < 0 or m.s_prime < 0 or not 0 < m.mix_max <= 1):
            problems.append(
                f"loss.mochi needs n_hard >= 1, s >= 0, s_prime >= 0, 0 < mix_max <= 1 (got n_hard={m.n_hard}, "
                f"s={m.s}, s_prime={m.s_prime}, mix_max={m.mix_max})"
            )
        if m.queue_size < 0:
            problems.append(f"loss.mochi.queue_size must be >= 0 (got {m.queue_size})")
        if problems:
            raise ConfigError("; ".join(problems))
        size = m.queue_size if self.weights["mochi"] > 0 else 0
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

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        logit_bias: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        with_metrics: bool = True,
    ):
        """Weighted loss and the logged numbers. ``with_metrics`` adds the align/uniform metrics, which cost a
        pairwise pass over the batch; a trainer may leave them out on steps it does not log (pass the same value
        on every rank, since the logged numbers are reduced together)."""
        _check_pair(image_features, text_features)
        cfg, w = self.cfg, self.weights
        logit_scale = _as_scale(logit_scale, image_features)
        if labels is not None:
            labels = _check_labels(labels.to(image_features.device), image_features.shape[0], image_features.device)
        distributed = _distributed()
        if distributed:
            all_img, all_txt, all_labels, offset = gather_features(image_features, text_features, labels)
            cols = dict(all_image_features=all_img, all_text_features=all_txt, offset=offset)
        else:
            all_img, all_txt, all_labels, offset = image_features, text_features, labels, 0
            cols = {}
        chunk = cfg.chunk_size

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
                raise ConfigError(
                    "loss.siglip > 0 needs a model with a logit bias (got none; set model.init_logit_bias, e.g. -10)"
                )
            values["siglip"] = siglip_loss(
                image_features, text_features, logit_scale, logit_bias,
                **({"all_text_features": all_txt, "offset": offset} if distributed else {}),
                chunk_size=cfg.chunk_size,
            )
        if w["debiased"] > 0:
            values["debiased"] = debiased_clip_loss(
                image_features, text_features, logit_scale, cfg.tau_plus, chunk, **cols
            )
        if w["hard_negative"] > 0:
            values["hard_negative"] = hard_negative_clip_loss(
                image_features, text_features, logit_scale, cfg.tau_plus, cfg.hn_beta, chunk, **cols
            )
        if w["mochi"] > 0:
            m = cfg.mochi
            values["mochi"] = mochi_loss(
                image_features, text_features, logit_scale, m.n_hard, m.s, m.s_prime, m.mix_max, self.generator,
                self.image_queue.get(), self.text_queue.get(), **cols, chunk_size=chunk,
            )
        if w["align"] > 0:
            values["align"] = align_loss(image_features, text_features, cfg.align_alpha)
        if w["uniform"] > 0:
            values["uniform"] = (
                self._uniform(image_features, all_img, offset, distributed)
                + self._uniform(text_features, all_txt, offset, distributed)
            ) / 2

        total = sum(w[name] * value for name, value in values.items())
        with torch.no_grad():
            # float64 keeps the logged numbers exact for float64 inputs; MPS has no float64.
            log_dtype = torch.float32 if image_features.device.type == "mps" else torch.float64
            logged = {f"loss/{name}": value.detach().to(log_dtype) for name, value in values.items()}
            if with_metrics:
                logged.update(self._metrics(image_features, text_features))
            names = list(logged)
            stacked = torch.stack([logged[k].reshape(()).to(log_dtype) for k in names])
            if distributed:
                dist.all_reduce(stacked)
                stacked /= dist.get_world_size()
            numbers = stacked.tolist()
        terms = dict(zip(names, numbers))
        terms["loss"] = sum(w[name] * terms[f"loss/{name}"] for name in values)
        if self.training and w["mochi"] > 0:
            self.image_queue.enqueue(all_img)
            self.text_queue.enqueue(all_txt)
        return total, terms

    def _uniform(self, x: Tensor, all_x: Tensor, offset: int, distributed: bool) -> Tensor:
        t = self.cfg.uniform_t
        if not distributed:
            return uniform_loss(x, t)
        # Global uniformity is log(Z / P) with Z = sum_r Z_r summed over ranks' rows. Each rank returns the
        # global value plus a zero-valued term whose gradient is W * dZ_r / Z, so that DDP's average over
        # ranks gives d log Z exactly.
        world = dist.get_world_size()
        n_all = all_x.shape[0]
        if n_all < 2:
            raise DataError(f"uniform_loss needs at least 2 items (got {n_all})")
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
