"""Which model a path names, and what its folder records about it: the one resolver of a model path (`locate`),
open_clip_train's run folders (``params.txt`` and ``checkpoints/epoch_N.pt``), and the reading of a model's config
file. `mmcl.storage.weights` loads what is found here; `mmcl.storage.pretrained` resolves ``model.pretrained``
through it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from open_clip import get_pretrained_cfg

from ..data.limits import read_regular_text
from ..errors import CheckpointError, file_problem
from . import checkpoints
from .fsutil import os_error_text
from .layout import RunLayout

# The file that marks a model directory (open_clip's local-dir layout): read by open_clip, CLIP_benchmark and
# `mmcl.load`.
CONFIG_FILE = "open_clip_config.json"
# What an open_clip tag says about the images its weights were trained on.
TAG_PREPROCESS = ("mean", "std", "interpolation", "resize_mode")
_OPEN_CLIP_CHECKPOINTS = "checkpoints"  # in open_clip_train's run folder (logs/NAME), not mmcl's


def locate(path: Path) -> Optional[Path]:
    """The one resolver of a model path, for every command's ``--model``, ``model.init_from``, ``model.pretrained``,
    ``distill.teacher`` and ``mmcl interpolate --from/--to``. In this order: the ``epoch_N.pt`` file of an
    open_clip_train run, checkpoint or ``checkpoints/`` folder; a training checkpoint folder (``checkpoints/step-N``,
    checked when it is read: `checkpoints.model_of_checkpoint`); the folder holding ``open_clip_config.json`` (`path`,
    its ``model/`` or its ``open_clip/``: a model directory, an export, a run folder); a run folder's newest
    checkpoint whose weights are intact. None when `path` is none of these."""
    train_ckpt = open_clip_train_checkpoint(path)
    if train_ckpt is not None:
        return train_ckpt[0]
    if checkpoints.is_checkpoint(path):
        return path
    for candidate in (path, RunLayout(path).model, path / "open_clip"):
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    return checkpoints.newest_run_weights(path) if path.is_dir() else None


def located(path) -> Path:
    """`locate(path)`; a path that does not exist or holds no model is one `CheckpointError` line."""
    path = Path(path).expanduser()
    problem = file_problem(path, folder_ok=True)  # "not found", "is not a regular file (a FIFO)"...
    if problem is not None:
        raise CheckpointError(f"model path {problem}: {path}")
    found = locate(path)
    if found is None:
        raise CheckpointError(f"no model in {path} (expected {CONFIG_FILE} there or in {RunLayout(path).model}, or a "
                              f"complete training checkpoint; train or export one first)")
    return found


def find_model_dir(path) -> Path:
    """The folder holding the model that `path` names (`locate`): a model directory or export, a training
    checkpoint, or open_clip_train's ``checkpoints/`` folder."""
    found = located(path)
    return found.parent if found.is_file() else found


# ---------------------------------------------------------------------------------------- open_clip_train
def _newest_open_clip_train(ckpt_dir: Path) -> Optional[Path]:
    """The newest ``epoch_N.pt`` (else ``epoch_latest.pt``) of an open_clip_train ``checkpoints/`` folder."""
    numbered = []
    for f in ckpt_dir.glob("epoch_*.pt"):
        stem = f.stem[len("epoch_"):]
        if stem.isdigit():
            numbered.append((int(stem), f))
    if numbered:
        return max(numbered)[1]
    latest = ckpt_dir / "epoch_latest.pt"
    return latest if latest.is_file() else None


def open_clip_train_checkpoint(path) -> Optional[Tuple[Path, Path]]:
    """(checkpoint file, params.txt) when `path` is an open_clip_train checkpoint
    (``logs/NAME/checkpoints/epoch_N.pt``), its ``checkpoints/`` folder or its run folder ``logs/NAME`` (the newest
    checkpoint); else None."""
    path = Path(path).expanduser()
    if path.is_dir() and (path / "params.txt").is_file() and (path / _OPEN_CLIP_CHECKPOINTS).is_dir():
        path = path / _OPEN_CLIP_CHECKPOINTS
    if path.is_dir() and (path.parent / "params.txt").is_file():
        path = _newest_open_clip_train(path) or path
    if path.is_file() and path.suffix == ".pt" and (path.parent.parent / "params.txt").is_file():
        return path, path.parent.parent / "params.txt"
    return None


def read_params_txt(params: Path) -> Dict[str, str]:
    """open_clip_train's ``params.txt`` (one ``name: value`` line per argument) as a dict of strings."""
    try:
        lines = params.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as err:
        raise CheckpointError(f"cannot read {params} ({os_error_text(err)})") from None
    return dict((k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines) if k.strip())


def open_clip_train_arch(params: Path) -> Tuple[str, Dict[str, Any]]:
    """The architecture (``--model``) of an open_clip_train run and the preprocessing of the tag it started from."""

    args = read_params_txt(params)
    arch = args.get("model", "")
    if not arch or arch == "None":
        raise CheckpointError(f"{params} names no model (expected a 'model: NAME' line, as open_clip_train writes)")
    tag_cfg = get_pretrained_cfg(arch, args.get("pretrained", "")) if args.get("pretrained") else {}
    return arch, {k: tag_cfg[k] for k in TAG_PREPROCESS if k in tag_cfg}


# ------------------------------------------------------------------------------------------- config files
def damaged(path: Path, what: str) -> CheckpointError:
    """The error for a model file that is there but not as mmcl or open_clip wrote it."""
    return CheckpointError(f"{path} is damaged ({what}); save, export or copy the model again")


def read_json_file(path: Path, error: Callable[[str], Exception] = CheckpointError) -> Any:
    """A JSON file's content; a truncated, non-UTF-8 or unreadable file raises `error` naming it and the cause."""
    try:
        return json.loads(read_regular_text(path))
    except json.JSONDecodeError as err:
        raise error(f"{path} is damaged (not valid JSON: {err.msg} at line {err.lineno} column {err.colno})"
                    ) from None
    except UnicodeDecodeError:
        raise error(f"{path} is damaged (not UTF-8 text)") from None
    except OSError as err:
        raise error(f"cannot read {path} ({os_error_text(err)})") from None


def read_model_meta(config: Path) -> Dict[str, Any]:
    """The parsed ``open_clip_config.json`` of a model directory (or ``model_config.json`` of a training
    checkpoint), checked for the fields loading needs."""
    meta = read_json_file(config)
    if not isinstance(meta, dict):
        raise damaged(config, f"expected a JSON object, got {type(meta).__name__}")
    model_cfg = meta.get("model_cfg", meta)
    problems = [] if isinstance(model_cfg, dict) else [f"model_cfg is a {type(model_cfg).__name__}"]
    if not problems:
        problems += [f"no {key}" for key in ("embed_dim", "vision_cfg", "text_cfg") if key not in model_cfg]
        problems += [f"{key} is not an object" for key in ("vision_cfg", "text_cfg")
                     if key in model_cfg and not isinstance(model_cfg[key], dict)]
    pp = meta.get("preprocess_cfg")
    if pp is not None and not isinstance(pp, dict):
        problems.append(f"preprocess_cfg is a {type(pp).__name__}")
    if problems:
        raise damaged(config, f"expected an open_clip model config: {', '.join(problems)}")
    return meta
