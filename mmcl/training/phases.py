"""Token-reduction phases (``train.phases``; CLIPA, Li et al. 2023): most steps at a low image resolution, on short
captions and with patch dropout, then a short phase at full size, in one run that resumes exactly.

A phase is a function of the step alone:

- the data workers make each batch at its step's phase (process batch ``b`` is step ``b // accum_steps``, counted
  by the stream from its saved position), so the early phase decodes and resizes small images in the workers, which
  is part of what makes it cheap, and a resumed or re-batched stream makes the batches an uninterrupted one makes;
- the model keeps its parameters at full size and derives each phase's position embeddings from them in the forward
  (`mmcl.models.resize`): nothing in the optimiser, DDP, FSDP, the EMA or a checkpoint changes shape at a phase
  change, which is what makes resume, 2 processes = 1 and accumulation hold across it with no code of their own;
- patch dropout takes the phase's rate through the masking modules' step hook (`mmcl.models.flip.begin_step`).

The model saved at the end is at the last phase's size (`final_model`): the model itself when that phase keeps the
model's sizes (CLIPA's recipe ends at full size), else a model built at that size with the resized embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..config import TrainSection, phase_lengths
from ..errors import ConfigError
from ..models import build_tokenizer
from ..models import resize as model_phases


@dataclasses.dataclass(frozen=True)
class Phase:
    """A phase resolved against the model: steps [start, start + steps), at image_size px (square), captions of
    context_length tokens, and patch_dropout (None: the model's ``model.patch_dropout``)."""

    start: int
    steps: int
    image_size: int
    context_length: Optional[int]
    patch_dropout: Optional[float]

    def describe(self, model_size: int, model_length: Optional[int]) -> str:
        parts = [f"{self.image_size} px" + (" (full)" if self.image_size == model_size else "")]
        if self.context_length is not None:
            parts.append(f"{self.context_length} tokens" + (" (full)" if self.context_length == model_length
                                                          else ""))
        if self.patch_dropout is not None:
            parts.append(f"patch dropout {self.patch_dropout:g}")
        span = f"step {self.start + 1}" if self.steps == 1 else f"steps {self.start + 1}-{self.start + self.steps}"
        return f"{span}: " + ", ".join(parts)


def plan(train: TrainSection, model: nn.Module, model_cfg: Dict[str, Any], total: int) -> List[Phase]:
    """The run's phases resolved against its `total` steps (`mmcl.config.phase_lengths`) and the model (none
    without ``train.phases``); makes the image tower follow its input's size when a phase trains at another one.
    Raises ConfigError for lengths that do not make the run and sizes the model cannot take."""
    if not train.phases:
        return []
    size, patch, length = model_phases.full_sizes(model_cfg)
    out, start, problems = [], 0, []
    for i, (p, steps) in enumerate(zip(train.phases, phase_lengths(train.phases, total))):
        image_size = size if p.image_size is None else int(p.image_size)
        if p.image_size is not None and (size is None or patch is None):
            problems.append(f"train.phases[{i}].image_size needs a ViT image tower with a patch size (this model "
                            f"has none): leave image_size out")
        elif p.image_size is not None and image_size % patch:
            problems.append(f"train.phases[{i}].image_size={image_size} is not a multiple of the patch size "
                            f"{patch}")
        if p.context_length is not None and length is not None and p.context_length > length:
            problems.append(f"train.phases[{i}].context_length={p.context_length} exceeds the model's context "
                            f"length {length} (its text position embedding has {length} rows)")
        out.append(Phase(start, steps, image_size, p.context_length, p.patch_dropout))
        start += steps
    last = out[-1]
    if train.wise_ft and (last.image_size != size or last.context_length not in (None, length)):
        problems.append("train.wise_ft interpolates the initial and the final weights, which need the same sizes: "
                        "end train.phases with a phase at the model's own image_size and context_length")
    if problems:
        raise ConfigError("; ".join(problems))
    if any(p.image_size != size for p in out):
        model_phases.follow_input_size(model)
    return out


def uses_patch_dropout(train: TrainSection) -> bool:
    """Whether some phase drops patches (the masking modules are then needed even at model.patch_dropout=0)."""
    return any(p.patch_dropout for p in train.phases)


def phase_at(phases: Sequence[Phase], step: int) -> Optional[Phase]:
    """The phase of optimiser step `step` (0-based); the last one past the end; None without phases."""
    current = None
    for p in phases:
        if p.start > step:
            break
        current = p
    return current


def patch_dropout_at(phases: Sequence[Phase], step: int, default: float) -> Optional[float]:
    """The patch-dropout rate of step `step`: its phase's, else `default` (model.patch_dropout); None without
    phases (the masking modules keep their own rate)."""
    p = phase_at(phases, step)
    if p is None:
        return None
    return default if p.patch_dropout is None else float(p.patch_dropout)


def input_sizes(phases: Sequence[Phase], model_size: Optional[int],
                accum_steps: int) -> List[Tuple[int, Optional[int], Optional[int]]]:
    """The input sizes of the phases as the data stream takes them (`mmcl.data.InputSizes`): (first process batch,
    image size or None for the model's own, context length or None)."""
    return [(p.start * accum_steps, None if p.image_size == model_size else p.image_size, p.context_length)
            for p in phases]




def final_model(phases: Sequence[Phase], model: nn.Module, model_cfg: Dict[str, Any], pp_cfg: Dict[str, Any],
                tokenizer: Any) -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any], Any]:
    """(model, model config, preprocess config, tokenizer) at the last phase's size: those given when that phase
    keeps the model's sizes."""
    if not phases:
        return model, model_cfg, pp_cfg, tokenizer
    last = phases[-1]
    resized, cfg = model_phases.at_size(model, model_cfg, last.image_size, last.context_length)
    if resized is model:
        return model, model_cfg, pp_cfg, tokenizer
    return resized, cfg, dict(pp_cfg, size=last.image_size), build_tokenizer(cfg)
