"""Exponential moving average of the trainable weights (``train.ema_decay``).

After each applied optimiser step, ``ema = decay * ema + (1 - decay) * w`` for every parameter that requires a
gradient; the average starts from the weights the run starts with and is kept in float32 whatever the weights'
dtype. Locked parameters have no average (they do not change), and neither do buffers.

timm's ``ModelEmaV3`` keeps a deep copy of the whole module (locked towers and buffers included) and swaps nothing
in; mmcl follows its update rule (one fused ``lerp`` over all tensors) but keeps only the trainable tensors, by
parameter name, so that a locked tower costs no memory and the state is a plain dict, saved in the main process's
rank state of each checkpoint (loaded as plain data on resume). The in-loop evaluation, ``model/`` and exports see
the average through `swapped_in`, which puts it into the model's own parameters and gives the trained weights back
afterwards (bit for bit).
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
