"""What mmcl does differently when accelerate shards the model with FSDP2 (``distributed_type: FSDP``,
``fsdp_version: 2``; `launch/fsdp.yaml`).

- open_clip keeps the temperature (and SigLIP's bias) as 0-dim parameters, which ``fully_shard`` rejects ("doesn't
  support scalar parameters"). Before the optimiser is built they become 1-element vectors
  (`vector_scalars`); the model computes the same numbers. Saved models are rebuilt from the model config
  (`full_model`), so model/ and exports keep open_clip's 0-dim parameters.
- Sharded parameters are DTensors: the model/ directory, the periodic and final evaluations and the EMA need the
  full weights. `full_model` gathers them one parameter at a time into a plain replica in the main process's CPU
  memory (a collective every process joins), which is what gets saved; `for_evaluation` puts it on the device in
  the training's compute precision (bf16 under bf16), so an evaluation never holds a full float32 copy of the
  model beside the shards, gradients and optimiser state on the device.
- Under mixed precision (bf16, fp16), accelerate's own policy casts every parameter to the compute dtype and
  reduces the gradients in it. mmcl's (`shard_with_precision`): the transformer blocks, nearly all the weights,
  gather their parameters in the compute dtype (half the traffic) but reduce gradients in float32; the rest of
  the model (embeddings, projections, final norms, the learned temperature and SigLIP's bias) stays float32 for
  compute and reduction, with autocast choosing the matmul precision as under DDP. A bf16 temperature would move
  the scale in steps of 1.6 % to 3 % (bf16 keeps 8 significant bits of log(scale)), and bf16 gradient sums lose
  the small contributions of many ranks.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from accelerate.utils.other import get_module_children_bottom_up
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .. import models
from ..config import is_main_process
from ..errors import ConfigError

# accelerate's mixed_precision names and the compute dtype each gives the transformer blocks under FSDP2
_COMPUTE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


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


def shard_with_precision(accelerator, model: nn.Module) -> List[str]:
    """Under bf16/fp16: shard the modules accelerate's auto-wrap policy picks (the transformer blocks) now, with
    parameters gathered in the compute dtype and gradients reduced in float32, and make accelerate's own policy,
    which `accelerator.prepare` then applies to the rest of the model, float32 throughout. Returns the sharded
    modules' names (empty in float32, where nothing changes).

    Called before the optimiser is built (it holds the sharded parameters, which `prepare` maps as its own).
    """

    compute = _COMPUTE_DTYPE.get(str(accelerator.mixed_precision))
    plugin = accelerator.state.fsdp_plugin
    if compute is None or plugin is None:
        return []
    if plugin.activation_checkpointing or plugin.cpu_ram_efficient_loading:
        raise ConfigError("fsdp_activation_checkpointing and fsdp_cpu_ram_efficient_loading are not supported under "
                          "mixed precision (mmcl shards the transformer blocks itself); set them to false in the "
                          "launch file (model.grad_checkpointing=true checkpoints the blocks)")

    plugin.set_auto_wrap_policy(model)  # as accelerate's prepare does; a second call there changes nothing
    picks = fsdp2_prepare_auto_wrap_policy(plugin, model)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    common = {"reshard_after_forward": plugin.reshard_after_forward, "offload_policy": plugin.cpu_offload,
              "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None}
    blocks = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    names = {id(m): n for n, m in model.named_modules()}
    sharded = []
    if picks is not None:
        for module in get_module_children_bottom_up(model)[:-1]:  # children before parents, as FSDP2 requires
            if picks(module):
                fully_shard(module, mp_policy=blocks, **common)
                sharded.append(names[id(module)])
    # The rest, root included (accelerate shards it in `prepare`): float32 parameters and reduction. Its auto-wrap
    # has nothing left to pick (and would no longer find the blocks by class name: sharded, their class is FSDP's).
    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    plugin.auto_wrap_policy = None
    return sharded


def full_model(accelerator, model: nn.Module, model_cfg: Dict[str, Any]) -> Optional[nn.Module]:
    """The full, unsharded weights of an FSDP-prepared `model` in a plain float32 replica in the main process's
    CPU memory (None on the others). Every process must call it (the weights are gathered parameter by
    parameter, each moved to the CPU before the next: torch's full state dict with CPU offload)."""

    state = accelerator.get_state_dict(model)  # full state dict, gathered to the main process's CPU memory
    if not is_main_process():
        return None
    replica = models.create(model_cfg)
    own = replica.state_dict()
    fitted = {k: (v.reshape(own[k].shape) if k in own and v.numel() == own[k].numel() else v)
              for k, v in state.items()}
    replica.load_state_dict(fitted, strict=True)
    return replica


def for_evaluation(accelerator, replica: nn.Module) -> nn.Module:
    """`replica` (from `full_model`) on the device for an evaluation: in the compute dtype under mixed precision
    (the precision its transformer blocks trained in; half the memory of float32), else as it is."""
    compute = _COMPUTE_DTYPE.get(str(accelerator.mixed_precision))
    return replica.to(accelerator.device, dtype=compute) if compute is not None else replica.to(accelerator.device)


def full(tensor):
    """A parameter's full value: a DTensor's gathered (a collective: every process must call it), else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
