"""What mmcl does differently when accelerate shards the model with FSDP2 (``distributed_type: FSDP``,
``fsdp_version: 2``; `launch/fsdp.yaml`).

- open_clip keeps the temperature (and SigLIP's bias) as 0-dim parameters, which ``fully_shard`` rejects ("doesn't
  support scalar parameters"). Before the optimiser is built they become 1-element vectors
  (`vector_scalars`); the model computes the same numbers. Saved models are rebuilt from the model config
  (`full_model`), so model/ and exports keep open_clip's 0-dim parameters.
- Sharded parameters are DTensors: the model/ directory, the periodic and final evaluations and the EMA need the
  full weights. `full_model` gathers them (a collective every process joins) into a plain replica on the main
  process, which is what gets saved and evaluated.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn


def in_effect(accelerator) -> bool:
    """Whether accelerate shards the model (FSDP)."""
    return str(getattr(accelerator, "distributed_type", "")).rsplit(".", 1)[-1] == "FSDP"


def vector_scalars(model: nn.Module) -> list:
    """Replace the model's own 0-dim parameters by 1-element vectors (same value, same name); returns the names."""
    names = []
    for name, param in list(model.named_parameters(recurse=False)):
        if param.dim() == 0:
            setattr(model, name, nn.Parameter(param.detach().reshape(1).clone(), requires_grad=param.requires_grad))
            names.append(name)
    return names


def full_model(accelerator, model: nn.Module, model_cfg: Dict[str, Any]) -> Optional[nn.Module]:
    """The full, unsharded weights of an FSDP-prepared `model` in a plain replica on the main process (None on the
    others). Every process must call it (the weights are gathered)."""
    from . import models

    state = accelerator.get_state_dict(model)  # full state dict, gathered to the main process
    if not accelerator.is_main_process:
        return None
    replica = models.create(model_cfg)
    own = replica.state_dict()
    fitted = {k: (v.reshape(own[k].shape) if k in own and v.numel() == own[k].numel() else v)
              for k, v in state.items()}
    replica.load_state_dict(fitted, strict=True)
    return replica.to(accelerator.device)


def full(tensor):
    """A parameter's full value: a DTensor's gathered (a collective: every process must call it), else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
