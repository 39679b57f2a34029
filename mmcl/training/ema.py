"""Exponential moving average of the trainable weights (``train.ema_decay``).

After each applied optimiser step, ``ema = decay * ema + (1 - decay) * w`` for every parameter that requires a
gradient; the average starts from the weights the run starts with and is kept in float32 whatever the weights'
dtype. Locked parameters have no average (they do not change), and neither do buffers. The average is a plain dict
of tensors by parameter name, saved in the main process's rank state of each checkpoint (loaded as plain data on
resume). The in-loop evaluation, ``model/`` and exports see the average through `swapped_in`, which puts it into
the model's own parameters and gives the trained weights back afterwards (bit for bit).

Why not timm's ``timm.utils.ModelEmaV3`` (installed with open_clip): measured by bench/bench_ema.py on the tiny ViT
of configs/tiny.yaml (7.8 M parameters, float32, 2 CPU cores shared with other work, the ways taking turns update
by update, fastest of 30). A plain update costs the same: one multi-tensor lerp each, 20 ms for both, no host sync.
What a run needs and timm's does not do:

* skipping on the device. A step whose loss is not finite is skipped by the optimiser on a device-side flag, never
  read on the host (`mmcl.training.step`); ``update(model, skipped=flag)`` weighs the step by that flag with three
  multi-tensor ops and no host sync (69 ms on that CPU). ``ModelEmaV3.update`` takes a Python decay: skipping with
  it means reading the flag every step (1 host sync per step), and setting its decay to a device tensor (which
  timm does not document) also gives 1 host sync per update;
* locked towers. ``ModelEmaV3`` averages a deep copy of the whole module, locked parameters included: with
  ``model.lock_image=true``, 29.7 MiB against 26.5 MiB on the tiny model, and on configs/vit-b-32.yaml 577 MiB
  against the 242 MiB of its 63.4 M trainable parameters, with the update's work in proportion.

Both resume exactly (``load_state_dict(state_dict())`` then the same update gives bitwise the same average); timm's
state is a whole module's state dict, mmcl's the trainable tensors only. So mmcl keeps `WeightEMA`, with timm's
update rule (its one fused ``lerp``) on the path without a flag.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn


def _trainable(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class WeightEMA:
    """The float32 average of `model`'s trainable parameters. `model` is the unwrapped module (not DDP's)."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = float(decay)
        self.updates = 0
        self.names = [n for n, _ in _trainable(model)]
        with torch.no_grad():
            self.shadow: Dict[str, torch.Tensor] = {
                n: p.detach().to(torch.float32, copy=True) for n, p in _trainable(model)}

    @torch.no_grad()
    def update(self, model: nn.Module, skipped: Optional[torch.Tensor] = None) -> None:
        """Move the average towards `model`'s current weights (call after each optimiser step). `skipped`: a
        device-side flag, non-zero where the optimiser skipped this step (a non-finite loss decided without a
        host sync); the average then stays as it is, without the flag being read."""
        params = dict(model.named_parameters())
        current = [params[n].float() for n in self.names]  # under no_grad: no per-tensor detach needed
        shadows = [self.shadow[n] for n in self.names]
        if skipped is None:
            torch._foreach_lerp_(shadows, current, 1.0 - self.decay)
        else:
            # The step's weight as a 0-dim device tensor (0 on a skipped step): three multi-tensor kernels over all
            # the averages, not one small kernel per tensor (a foreach lerp with a tensor weight would take its
            # per-tensor path).
            weight = (skipped.to(shadows[0].device) == 0).to(torch.float32) * (1.0 - self.decay)
            delta = torch._foreach_sub(current, shadows)
            torch._foreach_mul_(delta, weight)
            torch._foreach_add_(shadows, delta)
        self.updates += 1

    def drop(self, prefix: str) -> None:
        """Forget the averages of the parameters whose names start with `prefix` (training-only parts taken off the
        model before it is saved)."""
        self.names = [n for n in self.names if not n.startswith(prefix)]
        self.shadow = {n: self.shadow[n] for n in self.names}

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[nn.Module]:
        """`model` with the averaged weights in place of its trainable ones, restored on exit (also on error)."""
        params = dict(model.named_parameters())
        kept = {}
        with torch.no_grad():
            for n in self.names:
                p = params[n]
                kept[n] = p.detach().clone()
                p.copy_(self.shadow[n].to(p.dtype))
        try:
            yield model
        finally:
            with torch.no_grad():
                for n in self.names:
                    params[n].copy_(kept[n])

    # Saved in rank 0's rank state (`Run.rank_state`); every process loads it from there on resume
    def state_dict(self) -> Dict[str, object]:
        return {"decay": self.decay, "updates": self.updates, "shadow": {n: t.cpu() for n, t in self.shadow.items()}}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        shadow = state["shadow"]
        if sorted(shadow) != sorted(self.names):
            missing = sorted(set(self.names) - set(shadow))
            extra = sorted(set(shadow) - set(self.names))
            raise ValueError(f"the checkpoint's EMA holds other parameters (missing {missing[:3]}, extra {extra[:3]}):"
                             f" were the towers locked differently?")
        with torch.no_grad():
            for n in self.names:
                self.shadow[n].copy_(shadow[n])
        self.updates = int(state["updates"])


def swapped_in(ema, model: nn.Module):
    """`ema.swapped_in(model)`, or `model` unchanged when there is no EMA (``ema`` is None)."""
    return contextlib.nullcontext(model) if ema is None else ema.swapped_in(model)
