"""Weight-space interpolation of two models of one architecture: WiSE-FT (Wortsman et al. 2022).

Fine-tuning a zero-shot model on one distribution costs robustness on others; the weights
``(1 - alpha) * initial + alpha * fine-tuned`` recover much of it at a small cost in the fine-tuning task. Both
models must have the same architecture: the same parameter and buffer names and shapes, and the same model-config
values where both configs set a key. Each alpha is written as a model directory (`weights.save_model_dir`) that
`mmcl.load`, open_clip (``local-dir:``) and every mmcl command read, with the fine-tuned model's config,
preprocessing and tokenizer (the ones the interpolated weights are used with).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import models
from ..config import load_config
from ..errors import ConfigError
from . import pretrained, weights
from .fsutil import inside
from .layout import RunLayout
from .manifest import OutputManifest

# Model-config keys that name where a tower came from or how it was initialised, not what it is.
_NOT_ARCHITECTURE = {"init_logit_scale", "init_logit_bias", "text_cfg.hf_model_name", "text_cfg.hf_tokenizer_name",
                     "text_cfg.hf_model_pretrained", "preprocess_cfg"}


def alpha_dir_name(alpha: float) -> str:
    """The folder of one alpha's model: ``alpha_0.5``, ``alpha_0``, ``alpha_1``."""
    return f"alpha_{float(alpha):g}"


def _flat(cfg: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    for key in sorted(cfg):
        value, name = cfg[key], f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flat(value, name + ".")
        else:
            yield name, list(value) if isinstance(value, tuple) else value


def architecture_difference(init_cfg: Dict[str, Any], finetuned_cfg: Dict[str, Any],
                            init_state: Dict[str, torch.Tensor], finetuned_state: Dict[str, torch.Tensor]
                            ) -> Optional[str]:
    """The first difference that makes two models different architectures, as ``key: what`` (None when none):
    a model-config value both configs set differently, else a weight one model lacks or has in another shape."""
    a, b = dict(_flat(init_cfg)), dict(_flat(finetuned_cfg))
    for key in sorted(a.keys() & b.keys()):
        if key not in _NOT_ARCHITECTURE and a[key] != b[key]:
            return f"{key} is {a[key]!r} in --from and {b[key]!r} in --to"
    for key in sorted(init_state.keys() | finetuned_state.keys()):
        if key not in init_state or key not in finetuned_state:
            return f"{key} is a weight of --{'to' if key not in init_state else 'from'} only"
        x, y = init_state[key], finetuned_state[key]
        if x.shape != y.shape:
            return f"{key} has shape {tuple(x.shape)} in --from and {tuple(y.shape)} in --to"
    return None


def interpolate_state(init: Dict[str, torch.Tensor], finetuned: Dict[str, torch.Tensor], alpha: float
                      ) -> Dict[str, torch.Tensor]:
    """``(1 - alpha) * init + alpha * finetuned`` per floating-point tensor, computed in float32 (or wider) and
    stored in the fine-tuned tensor's dtype; integer buffers are the fine-tuned model's. Written as the two
    products' sum, alpha 0 and 1 give back the two models exactly."""
    out = {}
    for key, y in finetuned.items():
        x = init[key]
        if not y.is_floating_point():
            out[key] = y.clone()
            continue
        wide = torch.promote_types(y.dtype, torch.float32)
        mixed = (1.0 - alpha) * x.to(wide) + alpha * y.to(wide)
        out[key] = mixed.to(y.dtype)
    return out


def write_interpolations(init_path, finetuned_path, alphas: Sequence[float], out_dir
                         ) -> Tuple[List[Tuple[float, Path]], OutputManifest]:
    """Write one model per alpha under ``out_dir/alpha_<a>/`` (`alpha_dir_name`) from two model folders (anything
    `mmcl.load` reads; `init_path` None: the start of the run `finetuned_path`, `start_weights`); returns
    ([(alpha, folder)], the output folder's manifest). `ConfigError`, one line, for an alpha outside [0, 1] or two
    architectures; nothing is written then."""
    check_alphas(alphas)
    if init_path is None:  # the weights the run in `finetuned_path` started from
        init_model, init_cfg, init_path = start_weights(finetuned_path)
    else:
        init_model, init_cfg, _ = weights.load_model_dir(init_path)
    init_state = {k: v.detach().clone() for k, v in init_model.state_dict().items()}
    del init_model
    model, cfg, pp = weights.load_model_dir(finetuned_path)
    return write_alphas(init_state, init_cfg, model, cfg, pp, alphas, out_dir,
                        {"from": str(init_path), "to": str(finetuned_path)})


def start_weights(run_dir) -> Tuple[torch.nn.Module, Dict[str, Any], str]:
    """The weights a training run started from, rebuilt from its ``config.yaml`` as training built them
    (``model.pretrained`` or ``model.init_from``, read from the same files, the same seed for anything they do not
    cover): ``(model, model_cfg, what)``. `ConfigError` when `run_dir` is no run folder or the run started from
    random weights (then ``--from`` must name the start)."""

    config = RunLayout(run_dir).config
    if not config.is_file():
        raise ConfigError(f"--from is needed: {run_dir} is not an mmcl run folder (no config.yaml), so the weights "
                          f"it started from are unknown")
    cfg = load_config(str(config))
    start = cfg.model.pretrained or cfg.model.init_from
    if not start:
        raise ConfigError(f"--from is needed: the run in {run_dir} started from random weights (neither "
                          f"model.pretrained nor model.init_from is set in its config.yaml)")
    torch.manual_seed(cfg.train.seed)
    if cfg.model.pretrained:
        model, model_cfg, *_ = pretrained.build_pretrained(cfg.model)
    else:
        model, model_cfg, *_ = models.build(cfg.model)
        weights.init_from(model, cfg.model.init_from)
    return model, model_cfg, run_start(cfg.model)


def run_start(model_cfg) -> str:
    """What a run's first weights were, as its config names them (wise_ft.json's "from")."""
    if model_cfg.pretrained:
        return f"model.pretrained={model_cfg.pretrained}"
    if model_cfg.init_from:
        return f"model.init_from={model_cfg.init_from}"
    return "random initial weights"


def check_alphas(alphas: Sequence[float]) -> None:
    bad = [a for a in alphas if not 0.0 <= float(a) <= 1.0]
    if not alphas or bad:
        raise ConfigError(f"--alpha takes one or more values in [0, 1] (got {list(alphas)})")


def write_alphas(init_state: Dict[str, torch.Tensor], init_cfg: Dict[str, Any], model: torch.nn.Module,
                 cfg: Dict[str, Any], pp: Dict[str, Any], alphas: Sequence[float], out_dir,
                 record: Dict[str, Any]) -> Tuple[List[Tuple[float, Path]], OutputManifest]:
    """`write_interpolations` from the initial weights `init_state` (of a model with config `init_cfg`) and the
    fine-tuned `model` (config `cfg`, preprocessing `pp`; its weights are replaced in turn by each alpha's, so pass
    one that may change). `record` goes into each model's config beside its alpha."""
    check_alphas(alphas)
    finetuned_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    difference = architecture_difference(init_cfg, cfg, init_state, finetuned_state)
    if difference:
        raise ConfigError(f"--from {record.get('from')} and --to {record.get('to')} are not the same "
                          f"architecture: {difference}")
    out_dir = Path(out_dir)
    manifest = OutputManifest.claim(out_dir, "interpolate")
    manifest.data.update(record)  # where the two ends came from, also in wise_ft.json
    written = []
    for alpha in dict.fromkeys(float(a) for a in alphas):  # in the order given, once each
        model.load_state_dict(interpolate_state(init_state, finetuned_state, alpha))
        folder = inside(out_dir, alpha_dir_name(alpha))  # a link there is refused, never written through
        weights.save_model_dir(model, cfg, pp, folder, extra={"wise_ft": {"alpha": alpha, **record}})
        # The model folder's config lists the files it wrote (files a user added there stay the user's).
        listed = (weights.read_json_file(folder / weights.CONFIG_FILE).get("mmcl") or {}).get("files") or []
        manifest.files |= {f"{folder.name}/{name}" for name in listed}
        manifest.save()
        written.append((alpha, folder))
    model.load_state_dict(finetuned_state)
    return written, manifest
