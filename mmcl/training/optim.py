"""The optimiser's parameter groups: weight decay split, per-tower learning-rate multipliers, layer-wise decay.

Each trainable parameter gets a learning-rate scale

    scale = tower_mult * layer_decay ** (last_id - layer_id)

(``optim.image_lr_mult`` / ``optim.text_lr_mult`` and ``optim.image_layer_decay`` / ``optim.text_layer_decay``;
BEiT's layer-wise decay, Bao et al. 2021, as open_clip's fine-tuning recipes use it). Within a tower of L blocks
the layer id is 0 for the embeddings (patch/token embedding, class and positional embeddings, the pre-norm),
i + 1 for block i, and ``last_id = L + 1`` for what follows the blocks (final norm, pooling, projection): the head
learns at the tower's rate and each block below it at ``layer_decay`` times the one above. The logit scale and
bias belong to neither tower (scale 1).

Parameters with the same scale and weight decay share one group, so the defaults give the two groups of the plain
weight-decay split (decayed matrices, then gains, biases and the logit scale/bias without decay). The scheduler
sets ``lr = scheduled_lr * group["lr_scale"]`` on every group (`set_lr`).

The optimiser is ``optim.name``: ``adamw`` (the default) is torch's AdamW, fused where the device has the kernel;
any other name is one of timm's (``timm.optim.create_optimizer_v2``, ``timm.optim.list_optimizers()`` lists them:
lamb, lion, adafactor, muon, adamuon, sgd, ...), built over the same groups (handed to timm as a list of groups,
which it does not regroup), with ``optim.kwargs`` as its further keyword arguments and its own defaults otherwise
(`build_optimizer`). The Muon family updates 2-d parameters by Newton-Schulz orthogonalisation and the rest by its
AdamW fallback; mmcl sends the 2-d embedding tables and the head's matrices to the fallback too (`muon_fallback`).

The schedule is a function, not a scheduler object: before each optimiser step the loop sets
``lr_at(step, cfg, total_steps)`` on every group, with the step the run's progress counts (saved in every
checkpoint). A ``torch.optim.lr_scheduler.LambdaLR`` handed to accelerate (``prepare`` wraps it in its
``AcceleratedScheduler``, whose state each checkpoint then saves) would give the same rates on a fixed number of
processes, and neither reads a device value (both set Python floats). It is not used because of resuming: accelerate
steps a prepared scheduler once per process at each optimiser step (``split_batches=False``, mmcl's setting), so its
saved ``last_epoch`` counts optimiser steps times the process count of the run that saved it, and a run resumed on
another number of processes would continue from a position that no longer matches its own step (nor its total
steps, which depend on the processes) unless mmcl converted that state. `lr_at` has no state: the rate after a
resume, on any number of processes, is the rate for the resumed step by construction, and a checkpoint holds one
file fewer to load. The per-group scale stays one multiplication in `set_lr` (a LambdaLR would keep it as each
group's ``initial_lr``).
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from timm.optim import Muon, create_optimizer_v2, get_optimizer_class
from torch import nn

try:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
except ImportError:
    _get_fused_kernels_supported_devices = None

from ..config import OptimConfig
from ..errors import ConfigError
from ..storage.fsutil import atomic_write_text
from ..storage.layout import RunLayout

# Block containers of open_clip (resblocks), Hugging Face encoders (layer), timm (blocks) and GPT-style (h, layers).
_BLOCK = re.compile(r"(?:^|\.)(?:resblocks|layer|layers|blocks|h)\.(\d+)\.")
# What comes before the blocks: embeddings of patches, tokens, classes and positions, a conv stem, the pre-norm.
_EMBEDDING = re.compile(r"embed|conv1|ln_pre|cls_token|class_token|stem|norm_pre")


def tower_of(name: str) -> Optional[str]:
    """``image`` for the image tower's parameters, ``text`` for the text tower's, None for the logit scale/bias."""
    if name.startswith("visual."):
        return "image"
    if name.split(".")[0] in ("logit_scale", "logit_bias"):
        return None
    return "text"


def depth_of(model: nn.Module, tower: str) -> int:
    """The number of blocks of `tower` (locked ones included: the depth is the architecture's)."""
    ids = [int(m.group(1)) for n, _ in model.named_parameters() if tower_of(n) == tower
           for m in [_BLOCK.search(n)] if m]
    return max(ids) + 1 if ids else 0


def layer_id(name: str, depth: int) -> int:
    """0 for the embeddings, i + 1 for block i, depth + 1 for the rest (final norm, projection, head)."""
    m = _BLOCK.search(name)
    if m:
        return int(m.group(1)) + 1
    local = name.split(".", 1)[1] if name.startswith("visual.") else name
    return 0 if _EMBEDDING.search(local) else depth + 1


def no_weight_decay(name: str, p: torch.Tensor, pattern: Optional[str] = None) -> bool:
    """Gains, biases, other 1-d parameters and the logit scale/bias are not decayed, nor parameters whose names
    match `pattern` (``optim.no_decay_pattern``, searched anywhere in the name)."""
    return (p.ndim < 2 or "logit_scale" in name or "logit_bias" in name or name.endswith(".bias")
            or (pattern is not None and re.search(pattern, name) is not None))


def lr_scales(model: nn.Module, cfg) -> Dict[str, Tuple[float, Optional[str], int]]:
    """``name -> (lr scale, tower, layer id)`` for every trainable parameter; `cfg` is the OptimConfig."""
    depth = {t: depth_of(model, t) for t in ("image", "text")}
    mult = {"image": cfg.image_lr_mult, "text": cfg.text_lr_mult}
    decay = {"image": cfg.image_layer_decay, "text": cfg.text_layer_decay}
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        tower = tower_of(name)
        if tower is None:
            out[name] = (1.0, None, 0)
            continue
        lid = layer_id(name, depth[tower])
        out[name] = (mult[tower] * decay[tower] ** (depth[tower] + 1 - lid), tower, lid)
    return out


def param_groups(model: nn.Module, cfg) -> List[Dict[str, Any]]:
    """AdamW groups, one per (lr scale, weight decay); each holds ``params``, ``weight_decay``, ``lr_scale`` and
    ``names`` (the parameters' names, for the description; `optimizer_groups` drops them)."""
    scales = lr_scales(model, cfg)
    groups: "OrderedDict[Tuple[float, bool], Dict[str, Any]]" = OrderedDict()
    order: List[float] = []  # scales in order of first appearance; within a scale the decayed group comes first
    for name, p in model.named_parameters():
        if name not in scales:
            continue  # locked towers get no optimiser state
        scale = scales[name][0]
        if scale not in order:
            order.append(scale)
        plain = no_weight_decay(name, p, cfg.no_decay_pattern)
        g = groups.setdefault((scale, plain), {"params": [], "names": [], "lr_scale": scale,
                                               "weight_decay": 0.0 if plain else cfg.weight_decay})
        g["params"].append(p)
        g["names"].append(name)
    return [groups[k] for k in sorted(groups, key=lambda k: (order.index(k[0]), k[1]))]


def optimizer_groups(groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """`groups` as the optimiser takes them (without the names)."""
    return [{k: v for k, v in g.items() if k != "names"} for g in groups]


def schedule_change(optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int, total_steps: int) -> str:
    """After a resume at `step`, before the next step sets its rate: "" when the learning-rate schedule is the one
    the checkpoint was trained with, else what changed (train.steps or epochs raised, optim.lr or the schedule
    edited), from the rate the checkpoint's last step took (still in the optimiser) to the one the next step takes."""
    scales = [g for g in optimizer.param_groups if g.get("lr_scale", 1.0) > 0]
    if step == 0 or step >= total_steps or not scales:
        return ""
    before = scales[0]["lr"] / scales[0].get("lr_scale", 1.0)
    if math.isclose(before, lr_at(step - 1, cfg, total_steps), rel_tol=1e-6, abs_tol=1e-12):
        return ""
    return (f"; the learning-rate schedule changed: step {step} took lr {before:.4g}, step {step + 1} takes "
            f"{lr_at(step, cfg, total_steps):.4g} (optim.schedule {cfg.schedule} over {total_steps} steps)")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The scheduled learning rate `lr`, scaled by each group's ``lr_scale``."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def describe(model: nn.Module, groups: List[Dict[str, Any]], cfg) -> List[Dict[str, Any]]:
    """One JSON-able record per group: peak learning rate, scale, weight decay, sizes, towers and layers, names."""
    scales = lr_scales(model, cfg)
    out = []
    for i, g in enumerate(groups):
        where: Dict[str, List[int]] = {}
        for n in g["names"]:
            _, tower, lid = scales[n]
            where.setdefault(tower or "logit", []).append(lid)
        out.append({"group": i, "lr": cfg.lr * g["lr_scale"], "lr_scale": g["lr_scale"],
                    "weight_decay": g["weight_decay"], "tensors": len(g["params"]),
                    "parameters": sum(p.numel() for p in g["params"]),
                    "layers": {t: sorted(set(ids)) for t, ids in where.items()}, "names": g["names"]})
    return out


def log_groups(described: List[Dict[str, Any]], log) -> None:
    """One line per group (from `describe`)."""
    log(f"{len(described)} parameter groups (lr at its peak):")
    for d in described:
        layers = "; ".join("logit scale/bias" if t == "logit" else f"{t} {_ranges(ids)}"
                           for t, ids in d["layers"].items())
        log(f"  group {d['group']}: lr {d['lr']:.3g} (x{d['lr_scale']:.4g}), weight decay {d['weight_decay']:g}, "
            f"{d['tensors']} tensors, {d['parameters']:,} parameters: {layers}")


def write_groups(described: List[Dict[str, Any]], out_dir: Path) -> None:
    """``out_dir/param_groups.json`` (replaced atomically)."""

    atomic_write_text(RunLayout(out_dir).param_groups, json.dumps(described, indent=1) + "\n")


def _ranges(ids: List[int]) -> str:
    if len(ids) == 1:
        return f"layer {ids[0]}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"layers {ids[0]}-{ids[-1]}"
    return "layers " + ",".join(map(str, ids))


def _fused_problem(groups: List[Dict[str, Any]], device: Optional[torch.device]) -> Optional[str]:
    """Why the fused AdamW cannot update these parameters on `device` (where they will train: accelerate moves
    them there after the optimiser is built), or None. torch checks this only at the first step, where it would
    end the run."""
    if _get_fused_kernels_supported_devices is None:  # an older torch, which checks when the optimiser is built
        return None
    supported = _get_fused_kernels_supported_devices()
    params = [p for g in groups for p in g["params"]]
    kind = torch.device(device).type if device is not None else params[0].device.type
    if kind not in supported:
        return f"no fused kernel for {kind} (only {', '.join(d for d in supported if d)})"
    odd = sorted({str(p.dtype) for p in params if not torch.is_floating_point(p)})
    if odd:
        return f"parameters of dtype {', '.join(odd)}"
    return None


ADAMW = "adamw"  # optim.name of torch's (fused) AdamW; every other name is timm's


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, groups=None,
                    device: Optional[torch.device] = None) -> torch.optim.Optimizer:
    """The optimiser ``optim.name`` over `groups` (`mmcl.param_groups(model, cfg)` when not given), for parameters
    that will train on `device` (default: where they are now).

    ``adamw`` is torch's AdamW with ``optim.beta1``/``beta2``/``eps``. The fused kernel is the default; where the device
    or dtype has none, the per-tensor AdamW runs instead, with the reason kept as its ``fused_unavailable`` for the one
    line `host_check_line` gives at the start: that optimiser cannot take ``found_inf``, so the finite-loss decision
    moves to the host (`mmcl.training.step.FiniteChecks`). Any other name is timm's (`timm_optimizer`), which takes the
    host path too.
    """
    named = groups if groups is not None else param_groups(model, cfg)
    groups = optimizer_groups(named)
    if not any(g["params"] for g in groups):
        raise ConfigError("no trainable parameters: both towers are locked")
    if cfg.name != ADAMW:
        return timm_optimizer(model, cfg, groups)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **extra_kwargs(cfg))
    problem = _fused_problem(groups, device)
    if problem is None:
        try:
            # The fused kernel updates all tensors in one pass: about 4x faster than the default per-tensor loop on
            # CPU for the tiny model (BENCHMARKS.md, Training); same update rule.
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError) as err:  # a torch that checks the device here
            problem = (str(err).splitlines() or [type(err).__name__])[0]
    optimizer = torch.optim.AdamW(groups, **kwargs)
    optimizer.fused_unavailable = problem
    return optimizer


def extra_kwargs(cfg: OptimConfig) -> Dict[str, Any]:
    """``optim.kwargs`` as the optimiser's keyword arguments: a list (as YAML gives ``betas: [0.9, 0.99]``) becomes
    a tuple. `mmcl.config.checks` has checked the names against the optimiser's constructor."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in (cfg.kwargs or {}).items()}


def timm_optimizer(model: nn.Module, cfg: OptimConfig, groups: List[Dict[str, Any]]) -> torch.optim.Optimizer:
    """timm's optimiser ``optim.name`` over mmcl's `groups` (as `optimizer_groups` gives them): each keeps its
    ``weight_decay`` and ``lr_scale``; for the Muon family each group is split in two (`muon_fallback_groups`).

    The learning rate is ``optim.lr`` (`set_lr` sets each group's before every step). AdamW's ``optim.beta1``,
    ``beta2`` and ``eps`` are not passed: the same names mean other things here (Lion's betas interpolate its
    momentum, Adafactor's eps is 1e-30 under a squared gradient, Muon's eps guards its Newton-Schulz normalisation
    and its AdamW fallback), so the optimiser's own defaults hold unless ``optim.kwargs`` sets them. timm's factory
    adds its own defaults (momentum 0.9 where the optimiser takes one, Nesterov for ``sgd``). The name is kept as
    the optimiser's ``timm_name`` for `host_check_line`."""

    if issubclass(get_optimizer_class(cfg.name, bind_defaults=False), Muon):
        groups = muon_fallback_groups(groups, muon_fallback(model, cfg))
    optimizer = create_optimizer_v2(groups, opt=cfg.name, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                    **extra_kwargs(cfg))
    optimizer.timm_name = cfg.name
    return optimizer


def muon_fallback(model: nn.Module, cfg: OptimConfig) -> List[torch.Tensor]:
    """The 2-d parameters a Muon-family optimiser should leave to its AdamW fallback although their shape would
    take Newton-Schulz: those of a tower's embeddings (layer 0: the token embedding and the positional embeddings;
    the patch-embedding conv is 4-d and stays with Muon) and of its head (after the last block: the projections to
    the shared embedding), as the Muon authors keep embeddings and output heads on AdamW. timm's own rule sends
    every parameter of fewer than 2 non-unit dimensions (gains, biases, the class embedding, the logit scale) there
    already, and a 2-d one only for its shape (a side under 4, an aspect ratio over 128: the token embedding of a
    narrow tower but not of a wide one)."""
    depth = {t: depth_of(model, t) for t in ("image", "text")}
    params = dict(model.named_parameters())
    return [params[n] for n, (_, tower, lid) in lr_scales(model, cfg).items()
            if tower is not None and params[n].ndim == 2 and lid in (0, depth[tower] + 1)]


def muon_fallback_groups(groups: List[Dict[str, Any]], fallback: List[torch.Tensor]) -> List[Dict[str, Any]]:
    """Each group split in two where it holds parameters of `fallback`: the rest, then those (``use_fallback``:
    timm's Muon updates them with AdamW), both keeping the group's other entries; empty parts are left out."""
    marked = {id(p) for p in fallback}
    out = []
    for g in groups:
        for flag in (False, True):
            part = [p for p in g["params"] if (id(p) in marked) == flag]
            if part:
                out.append({**g, "params": part, **({"use_fallback": True} if flag else {})})
    return out


def takes_found_inf(optimizer) -> bool:
    """Whether `optimizer` (or the one accelerate's wrapper holds) is torch's fused AdamW, whose step reads a
    ``found_inf`` tensor set on the optimiser and leaves the parameters, moments and step count as they were where
    it is 1: the way `torch.amp.GradScaler` skips a step without a host read. torch documents no public name for
    that contract (it marks such optimisers with ``_step_supports_amp_scaling``): tests/test_dependency_names.py
    checks it, and pyproject bounds torch's major version."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return isinstance(inner, torch.optim.AdamW) and bool(inner.defaults.get("fused"))


def host_check_line(optimizer, scaler) -> Optional[str]:
    """The one line saying that the finite-loss decision of each step runs on the host, and why; None where it
    stays on the device (`mmcl.training.step.FiniteChecks.on_device`: an optimiser that takes ``found_inf``
    (`takes_found_inf`), and no loss scaler, which sets ``found_inf`` itself)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    name = type(inner).__name__
    given = getattr(inner, "timm_name", None)  # timm's name where it is not the class's (adamuon: Muon)
    if given is not None and given != name.lower():
        name = f"{name}, timm's {given}"
    if scaler is not None:
        why = "fp16's loss scaler sets found_inf itself"
    elif getattr(inner, "fused_unavailable", None):
        why = f"the fused AdamW is not available here ({inner.fused_unavailable}), the per-tensor one runs"
    elif not takes_found_inf(inner):
        why = f"the optimiser ({name}) cannot take found_inf"
    else:
        return None
    return f"a step with a non-finite loss is detected on the host (one device sync per step): {why}"


def cooldown_steps(cfg: OptimConfig, total_steps: int) -> int:
    """The length of the final decay of ``const-cooldown`` / ``wsd``: ``optim.cooldown_steps``, or
    ``optim.cooldown_fraction`` of the run (rounded)."""
    if cfg.cooldown_steps is not None:
        return cfg.cooldown_steps
    return int(round(cfg.cooldown_fraction * total_steps))


def check_schedule(cfg: OptimConfig, total_steps: int) -> None:
    """Raise `ConfigError` where the warmup and the cooldown do not fit in the run's `total_steps` (known only at
    the start of a run: it depends on the processes and, for train.epochs, on the data)."""
    if cfg.schedule in ("const-cooldown", "wsd"):
        cool = cooldown_steps(cfg, total_steps)
        if cool < 1:
            raise ConfigError(f"optim.schedule={cfg.schedule} needs a cooldown: set optim.cooldown_steps >= 1 or "
                              f"optim.cooldown_fraction > 0 (got {cool} steps of {total_steps})")
        if cfg.warmup_steps + cool > total_steps:
            raise ConfigError(f"optim.warmup_steps ({cfg.warmup_steps}) + the cooldown ({cool} steps) exceed the "
                              f"run's {total_steps} steps: shorten them or lengthen the run")


def cooldown_factor(progress: float, shape: str, power: float = 1.0) -> float:
    """The share of the peak rate left at `progress` in [0, 1] of the cooldown (1 at its start, 0 at its end)."""
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return (1.0 - progress) ** power


def warmup_line(cfg: OptimConfig, total_steps: int) -> Optional[str]:
    """The line for a warm-up longer than the run (``optim.warmup_steps`` over `total_steps`): the rate never
    reaches its peak, and the last step's rate against the peak says by how much. None when the warm-up ends in
    the run."""
    if cfg.warmup_steps <= total_steps or cfg.lr <= 0:  # optim.lr=0 (a run that only evaluates): no peak to reach
        return None
    last = lr_at(total_steps - 1, cfg, total_steps)
    return (f"warning: optim.warmup_steps={cfg.warmup_steps} is longer than the run's {total_steps} steps: the whole "
            f"run is warm-up, its last step at lr {last:.3g} of the peak optim.lr={cfg.lr:g} "
            f"({100 * last / cfg.lr:.2g} %); set optim.warmup_steps below {total_steps}")


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimiser step `step` (0-based): linear warmup (open_clip's, reaching the peak on the
    warmup's last step), then the schedule:

    * ``cosine`` / ``linear``: from the peak to ``min_lr`` over the rest of the run;
    * ``constant``: the peak;
    * ``const-cooldown`` / ``wsd``: the peak, then over the last `cooldown_steps` steps down to ``min_lr`` as
      ``optim.cooldown_shape`` (open_clip's const_lr_cooldown; transformers' get_wsd_schedule past its warmup).
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule in ("const-cooldown", "wsd"):
        cool = cooldown_steps(cfg, total_steps)
        start = total_steps - cool
        if step < start or cool <= 0:
            return cfg.lr
        progress = min(1.0, (step - start) / cool)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * cooldown_factor(progress, cfg.cooldown_shape,
                                                                    cfg.cooldown_power)
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - progress)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
