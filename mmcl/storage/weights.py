"""Weights apart from building: saving and loading model directories, reading checkpoints, ``init_from`` and
``model.pretrained`` (published weights by open_clip tag, hub name, local path or open_clip_train run).

A saved model directory is open_clip's local-dir layout (``open_clip_config.json`` + ``open_clip_model.safetensors``),
so open_clip, CLIP_benchmark and `mmcl.load` all read the same files. With a Hugging Face text tower the directory
also holds that tower's ``config.json`` and tokenizer files, so it loads after the source checkpoint is gone. The
config records the weights' size and SHA-256, checked on every load.

Weights are read from files (.pt/.pth/.bin/.safetensors), open_clip local dirs, mmcl runs (their newest verified
training checkpoint, through `mmcl.storage.checkpoints`), mmcl exports and transformers CLIP directories (keys mapped by
`mmcl.storage.hf_clip`). Towers are built by `mmcl.models`; directories are written through `mmcl.storage.fsutil.atomic_dir`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import checkpoints, hf_clip
from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from .fsutil import atomic_dir, file_sha256, files_under, inside, os_error_text, output_dir
from .layout import RunLayout
from ..models import towers
from ..models.towers import (build_tokenizer, build_transforms, create, hf_custom_code_error, is_local_dir,
                             preprocess_config)

# The model directory's files (open_clip's local-dir layout), read by open_clip, CLIP_benchmark and `mmcl.load`.
CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
HF_CONFIG_FILE = "config.json"  # a Hugging Face tower's own config, kept beside the weights
# A Hugging Face tokenizer saved beside the weights (named where the towers read it).
TOKENIZER_CONFIG_FILE = towers.TOKENIZER_CONFIG_FILE

# Weight files of a local directory, most preferred first (open_clip's names, then transformers').
DIR_WEIGHT_FILES = (WEIGHTS_FILE, "open_clip_pytorch_model.safetensors",
                    "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth",
                    "model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")

def state_dict_for_safetensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's state on the CPU, contiguous, each tensor in storage of its own: safetensors refuses tensors
    that share storage (the tied embeddings of some Hugging Face towers), so the repeats are cloned."""
    seen, out = {}, {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        out[key] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen[ptr] = key
    return out


# Names of the files a saved model or an export may hold besides the config and weights: a Hugging Face text
# tower's config and tokenizer files. Used to tell mmcl's files from the user's in a directory written before
# mmcl recorded the list of its files, and to copy a tower's tokenizer files from one directory to another.
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "special_tokens", "merges", "spiece", "sentencepiece",
                           "added_tokens")


def write_text_tower_files(model: nn.Module, text_cfg: Dict[str, Any], dest: Path, copy_from: Sequence[Path] = (),
                           config: bool = True) -> None:
    """A Hugging Face text tower's ``config.json`` (from the live model, unless `config` is False) and tokenizer
    files, written into `dest`: the tokenizer files of the first folder of `copy_from` that holds any are copied
    as they are (a saved model or an export being exported again), else the tokenizer that ``hf_tokenizer_name``
    (or ``hf_model_name``) names is loaded with transformers (a local folder or the Hugging Face cache) and saved."""
    from transformers import AutoTokenizer

    if config:
        model.text.config.to_json_file(str(dest / HF_CONFIG_FILE))
    for folder in copy_from:
        names = [n for n in os.listdir(folder) if n.startswith(TOKENIZER_FILE_PREFIXES)]
        if names:
            for name in names:  # regular files of that folder only: a link there is refused, never followed
                shutil.copy2(inside(folder, name), dest / name)
            return
    source = text_cfg.get("hf_tokenizer_name") or text_cfg["hf_model_name"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except ValueError as err:
        raise (hf_custom_code_error(err, source) or err) from None
    except OSError as err:
        detail = str(err).splitlines()[0]
        if copy_from:
            raise CheckpointError(f"cannot find the text tower's tokenizer files (got '{source}', not in "
                                  f"{copy_from[0]} nor in the local Hugging Face cache: {detail})") from None
        raise CheckpointError(f"cannot save the text tower's tokenizer: '{source}' is not readable ({detail})"
                              ) from None
    tokenizer.save_pretrained(str(dest))


def is_model_file_name(name: str) -> bool:
    """Whether a file of this name is one a model directory written by mmcl holds."""
    return name in (CONFIG_FILE, WEIGHTS_FILE, HF_CONFIG_FILE) or name.startswith(TOKENIZER_FILE_PREFIXES)


def previous_files(out_dir: Path, listing_file: str, default: Callable[[str], bool]) -> List[str]:
    """The files mmcl wrote in `out_dir` before: the ``files`` list of the JSON `listing_file` there (its
    ``mmcl`` section or top level), else the top-level files whose name `default` accepts."""
    listing = out_dir / listing_file
    try:
        meta = json.loads(listing.read_text(encoding="utf-8"))
        files = (meta.get("mmcl") or {}).get("files") or meta.get("files")
        if isinstance(files, list) and all(isinstance(f, str) for f in files):
            return list(files) + [listing_file]
    except (OSError, ValueError, AttributeError):
        pass  # no listing (an older or damaged directory): go by the names mmcl writes
    if not out_dir.is_dir():
        return []
    return [n for n in os.listdir(out_dir) if (out_dir / n).is_file() and default(n)]


def write_config_with_record(out: Path, meta: Dict[str, Any], config_name: str = CONFIG_FILE,
                             weights_name: str = WEIGHTS_FILE) -> None:
    """Write the config JSON into the directory `out` with, in its ``mmcl`` section, the size and SHA-256 of the
    weights file (checked by `load_model_dir`) and the list of the files mmcl wrote there (so that a later write
    replaces only those and keeps the user's)."""
    meta = dict(meta)
    extra = dict(meta.get("mmcl") or {})
    extra["weights"] = weights_record(out / weights_name)
    extra["files"] = sorted(files_under(out) | {config_name})
    meta["mmcl"] = extra
    (out / config_name).write_text(json.dumps(meta, indent=2) + "\n")


def save_model_dir(model: nn.Module, model_cfg: Dict[str, Any], preprocess_cfg: Dict[str, Any], out_dir,
                   extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write open_clip's local-dir layout atomically: a temp dir beside `out_dir`, then a rename.

    With a Hugging Face text tower, its ``config.json`` and tokenizer files are written too, and when the tower
    came from a local directory the saved ``hf_model_name`` points at `out_dir` itself, so neither mmcl nor
    open_clip (``local-dir:``) needs the original directory. A hub name is kept as it is. The config records the
    weights' size and SHA-256 and the files written; files the user added to an earlier `out_dir` are kept.
    Raises `CheckpointError` when the directory cannot be written (read-only, disk full), naming the cause.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out_dir = output_dir(out_dir)
    model_cfg = copy.deepcopy(model_cfg)
    text_cfg = model_cfg.get("text_cfg", {})
    meta_extra = dict(extra or {})
    try:
        with atomic_dir(out_dir, previous_files(out_dir, CONFIG_FILE, is_model_file_name)) as tmp:
            save_file(state_dict_for_safetensors(model), str(tmp / WEIGHTS_FILE))
            if text_cfg.get("hf_model_name"):
                write_text_tower_files(model, text_cfg, tmp)
                text_cfg.pop("hf_model_pretrained", None)
                meta_extra.setdefault("text_source", text_cfg["hf_model_name"])
                if is_local_dir(text_cfg["hf_model_name"]):
                    text_cfg["hf_model_name"] = text_cfg["hf_tokenizer_name"] = str(out_dir.resolve())
            meta = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
            if meta_extra:
                meta["mmcl"] = meta_extra
            write_config_with_record(tmp, meta)
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"cannot save the model to {out_dir}: {os_error_text(err)}") from None
    return out_dir


def _locate(path: Path) -> Optional[Path]:
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


def _located(path) -> Path:
    """`_locate(path)`; a path that does not exist or holds no model is one `CheckpointError` line."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"model path not found: {path}")
    found = _locate(path)
    if found is None:
        raise CheckpointError(f"no model in {path} (expected {CONFIG_FILE} there or in {RunLayout(path).model}, or a "
                              f"complete training checkpoint; train or export one first)")
    return found


def find_model_dir(path) -> Path:
    """The folder holding the model that `path` names (`_locate`): a model directory or export, a training
    checkpoint, or open_clip_train's ``checkpoints/`` folder."""
    found = _located(path)
    return found.parent if found.is_file() else found


def weights_record(weights: Path) -> Dict[str, Any]:
    """Size and SHA-256 of a weights file, kept in the config file beside it so that damage is found at load."""
    return {"file": weights.name, "size": weights.stat().st_size, "sha256": file_sha256(weights)}


def recorded_weights(meta: Any) -> Optional[Dict[str, Any]]:
    """The weights record (``file``, ``size``, ``sha256``; `weights_record`) that a parsed model config holds in
    its ``mmcl`` section, or None for a config written without one."""
    mmcl_meta = meta.get("mmcl") if isinstance(meta, dict) else None
    record = mmcl_meta.get("weights") if isinstance(mmcl_meta, dict) else None
    return record if isinstance(record, dict) else None


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path} is damaged ({what}); save, export or copy the model again")


def read_json_file(path: Path, error: Callable[[str], Exception] = CheckpointError) -> Any:
    """A JSON file's content; a truncated, non-UTF-8 or unreadable file raises `error` naming it and the cause."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise error(f"{path} is damaged (not valid JSON: {err.msg} at line {err.lineno} column {err.colno})"
                    ) from None
    except UnicodeDecodeError:
        raise error(f"{path} is damaged (not UTF-8 text)") from None
    except OSError as err:
        raise error(f"cannot read {path} ({os_error_text(err)})") from None


def _read_model_meta(config: Path) -> Dict[str, Any]:
    """The parsed ``open_clip_config.json`` of a model directory (or ``model_config.json`` of a training
    checkpoint), checked for the fields loading needs."""
    meta = read_json_file(config)
    if not isinstance(meta, dict):
        raise _damaged(config, f"expected a JSON object, got {type(meta).__name__}")
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
        raise _damaged(config, f"expected an open_clip model config: {', '.join(problems)}")
    return meta


def _check_weights_record(weights: Path, meta: Dict[str, Any]) -> None:
    """Compare the weights file with the size and SHA-256 recorded when it was written (models saved without a
    record are loaded unchecked)."""
    record = recorded_weights(meta)
    if record is None or record.get("file") != weights.name:
        return
    size = weights.stat().st_size
    if record.get("size") is not None and size != record["size"]:
        cut = "truncated" if size < record["size"] else "longer than written"
        raise _damaged(weights, f"{size} bytes, {record['size']} were written: {cut}")
    if record.get("sha256") and weights_record(weights)["sha256"] != record["sha256"]:
        raise _damaged(weights, "its SHA-256 differs from the one recorded when it was written")


def _fit_state(model: nn.Module, state: Dict[str, torch.Tensor], weights: Path, config: Path) -> None:
    """Load `state` strictly; a mismatch is a `CheckpointError` naming missing, unexpected and misshapen keys."""
    own = model.state_dict()
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    shapes = sorted(k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({_preview(missing, 3)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({_preview(unexpected, 3)})")
        if shapes:
            k = shapes[0]
            parts.append(f"{len(shapes)} of another shape (e.g. {k}: {tuple(state[k].shape)} in the file, "
                         f"{tuple(own[k].shape)} by the config)")
        raise CheckpointError(f"weights in {weights} do not fit {config.name}: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


def load_model_dir(path) -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    """Load a saved model directory: (model in eval mode, model_cfg, preprocess_cfg).

    A Hugging Face text tower is rebuilt from the ``config.json`` saved in the directory (no download, no
    reference to where it first came from); the returned model_cfg then names the directory as its source.
    A missing, truncated or altered file (config, weights; checked against the size and SHA-256 recorded when
    mmcl wrote them) and weights that do not fit the config are `CheckpointError` naming the file and the cause.
    """
    found = _located(path)
    if found.is_file():
        return _load_open_clip_train(found, found.parent.parent / "params.txt")
    if checkpoints.is_checkpoint(found):
        return _load_checkpoint(found)
    model_dir, config = found, found / CONFIG_FILE
    meta = _read_model_meta(config)
    model_cfg = copy.deepcopy(meta.get("model_cfg", meta))
    text_cfg = model_cfg.get("text_cfg", {})
    if text_cfg.get("hf_model_name"):
        if (model_dir / HF_CONFIG_FILE).is_file():
            text_cfg["hf_model_name"] = str(model_dir.resolve())
            if (model_dir / TOKENIZER_CONFIG_FILE).is_file():
                text_cfg["hf_tokenizer_name"] = str(model_dir.resolve())
        text_cfg.pop("hf_model_pretrained", None)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{model_dir} has {CONFIG_FILE} but no {WEIGHTS_FILE} (an incomplete copy?)")
    _check_weights_record(weights, meta)
    model, pp = _build(model_cfg, meta.get("preprocess_cfg"), config)
    _fit_state(model, _read_weight_file(weights), weights, config)
    model.eval()
    return model, model_cfg, pp


def _build(model_cfg: Dict[str, Any], pp: Optional[Dict[str, Any]], config: Path) -> Tuple[nn.Module, Dict[str, Any]]:
    """(the model `model_cfg` describes, with a Hugging Face text tower's weights left to the caller's file;
    `pp` or the architecture's preprocessing); `CheckpointError` naming `config` when it cannot be built."""
    cfg_for_create = copy.deepcopy(model_cfg)
    if cfg_for_create.get("text_cfg", {}).get("hf_model_name"):
        cfg_for_create["text_cfg"]["hf_model_pretrained"] = False  # weights come from our file
    try:
        return create(cfg_for_create), pp or preprocess_config(model_cfg)
    except (ConfigError, TypeError, ValueError, KeyError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"cannot build the model {config} describes: {detail}") from None


def _load_checkpoint(ckpt: Path) -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    """A training checkpoint as a model: the weights `checkpoints.model_of_checkpoint` gives (the weight average
    when the run keeps one, as its ``model/`` would hold at that step), the architecture and preprocessing its
    ``model_config.json`` records, or for a checkpoint written before checkpoints recorded them, those of the run's
    ``config.yaml`` two levels up (``RUN/checkpoints/step-N``)."""
    state, meta = checkpoints.model_of_checkpoint(ckpt)
    config = ckpt / checkpoints.MODEL_CONFIG
    if meta is not None:
        meta = _read_model_meta(config)
        model_cfg, pp = copy.deepcopy(meta.get("model_cfg", meta)), meta.get("preprocess_cfg")
    else:
        model_cfg, pp, config = _run_architecture(ckpt)
    model, pp = _build(model_cfg, pp, config)
    _fit_state(model, state, ckpt / checkpoints.MODEL_WEIGHTS, config)
    model.eval()
    return model, model_cfg, pp


def _run_architecture(ckpt: Path) -> Tuple[Dict[str, Any], Dict[str, Any], Path]:
    """(model_cfg, preprocess_cfg, config.yaml) of the run whose checkpoint `ckpt` is, from its ``config.yaml``."""
    from ..config import load_config
    from ..models.towers import resolve_model_config

    config = RunLayout(ckpt.parent.parent).config
    if ckpt.parent.name != checkpoints.CHECKPOINTS_DIR or not config.is_file():
        raise CheckpointError(f"checkpoint {ckpt} does not record its architecture (no {checkpoints.MODEL_CONFIG}) "
                              f"and has no run's config.yaml two levels up: use it inside its run folder, or the "
                              f"run's model/")
    try:
        model_cfg = resolve_model_config(load_config(str(config)).model)
    except ConfigError as err:
        raise CheckpointError(f"cannot tell the architecture of checkpoint {ckpt} from {config}: {err}") from None
    pp = preprocess_config(model_cfg)
    model_cfg.pop("preprocess_cfg", None)
    return model_cfg, pp, config


def _load_open_clip_train(ckpt: Path, params: Path) -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    """An open_clip_train checkpoint as a model: the architecture its ``params.txt`` names (``--model``), the
    preprocessing of the tag it started from (``--pretrained``), the weights of ``state_dict`` loaded strictly."""
    from ..models.towers import resolve_model_config

    arch, tag_pp = _open_clip_train_arch(params)
    try:
        model_cfg = resolve_model_config(ModelConfig(name=arch))
        model = create(model_cfg)
    except (ConfigError, TypeError, ValueError, KeyError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"cannot build the model {params} names ({arch}): {detail}") from None
    pp = {**preprocess_config(model_cfg), **{k: list(v) if isinstance(v, tuple) else v for k, v in tag_pp.items()}}
    state, _ = read_checkpoint(ckpt)
    state, _ = _adapt_to_model(state, model)
    _fit_state(model, state, ckpt, params)
    model.eval()
    return model, model_cfg, pp


def load(path):
    """``model, preprocess, tokenizer = mmcl.load(path)`` for a run dir, its ``model/``, or an export.

    ``model.encode_image(images (B,3,H,W) float)`` / ``model.encode_text(tokens (B,L) long)`` give (B, D)
    features (pass ``normalize=True`` for unit vectors); ``model.logit_scale`` is log s.
    """
    model, model_cfg, pp = load_model_dir(path)
    _, eval_tf = build_transforms(pp)
    tokenizer = build_tokenizer(model_cfg, source_dir=str(find_model_dir(path)))
    return model, eval_tf, tokenizer


# ------------------------------------------------------------------------------------------------ init_from
def _read_weight_file(path: Path) -> Dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for bad headers
            raise _damaged(path, f"not a readable safetensors file: {str(err).splitlines()[0]}") from None
    try:
        obj = checkpoints.load_plain(path)  # a pickled object is refused by name (CheckpointError)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file's errors come in many types
        raise CheckpointError(f"cannot read {path} as a weights-only torch checkpoint: "
                              f"{str(err).splitlines()[0]}") from None
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "module"):  # open_clip_train, and other trainers' wrappers
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} holds no state dict (expected a dict of tensors, or one under 'state_dict')")
    return obj


def read_checkpoint(path) -> Tuple[Dict[str, torch.Tensor], str]:
    """Weights from any supported source, in open_clip key layout; returns (state_dict, description).

    Sources: a file (.pt/.pth/.bin torch checkpoint, open_clip_train's ``{'state_dict': ...}`` included, or
    .safetensors); whatever `_locate` resolves (an open_clip local-dir, an mmcl export, an mmcl run: its ``model/``,
    else its newest intact training checkpoint; a training checkpoint, as `checkpoints.model_of_checkpoint` reads
    it); a transformers CLIP directory (``config.json`` with model_type clip).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"init_from path not found: {path}")
    if path.is_file():
        state, what = _read_weight_file(path), f"{path.suffix.lstrip('.')} file"
    elif (found := _locate(path)) is not None and found.is_file():  # open_clip_train's epoch_N.pt
        state, what = _read_weight_file(found), f"open_clip_train checkpoint {found.name}"
    elif found is not None and checkpoints.is_checkpoint(found):
        state, what = checkpoints.model_of_checkpoint(found)[0], f"mmcl training checkpoint {found.name}"
    else:
        weights_dir, what = found, "open_clip/mmcl model dir"
        hf_config = path / HF_CONFIG_FILE
        if weights_dir is None and hf_config.is_file():
            hf_meta = read_json_file(hf_config)
            model_type = hf_meta.get("model_type") if isinstance(hf_meta, dict) else None
            if model_type != "clip":
                raise CheckpointError(f"{path} is a Hugging Face '{model_type}' model, not CLIP (expected "
                                      f"model_type 'clip', or an open_clip/mmcl model directory)")
            weights_dir, what = path, "transformers CLIP dir"
        if weights_dir is None:
            raise CheckpointError(f"no weights found in {path} (expected {CONFIG_FILE}, a model/ subdirectory, "
                                  f"a complete training checkpoint, or a transformers CLIP config.json)")
        files = [weights_dir / name for name in DIR_WEIGHT_FILES if (weights_dir / name).is_file()]
        if not files:
            raise CheckpointError(f"{weights_dir} has no weights file (expected one of {', '.join(DIR_WEIGHT_FILES)})")
        state = _read_weight_file(files[0])
        what = f"{what}, {files[0].name}"
    for prefix in ("module.", "_orig_mod."):  # DDP and torch.compile wrappers
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    if any(k.startswith(("vision_model.", "text_model.")) for k in state):
        state, what = hf_clip.from_hf(state), f"{what}, transformers CLIP layout mapped to open_clip"
    return state, what


def _adapt_to_model(state: Dict[str, torch.Tensor], model: nn.Module) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """open_clip's layout fixes: CLIP -> CustomTextCLIP text keys, scalar vs 1-d scale, resized position grids."""
    from open_clip.model import convert_to_custom_text_state_dict, resize_pos_embed, resize_text_pos_embed

    notes = []
    state = dict(state)
    if "positional_embedding" in state and not hasattr(model, "positional_embedding"):
        state = convert_to_custom_text_state_dict(state)
    for key in ("logit_scale", "logit_bias"):
        target = getattr(model, key, None)
        if key in state and target is not None and state[key].numel() == target.numel():
            state[key] = state[key].reshape(target.shape)
    own = model.state_dict()
    for key, label, resize in (("visual.positional_embedding", "image position grid", resize_pos_embed),
                               ("positional_embedding", "text positions", resize_text_pos_embed),
                               ("text.positional_embedding", "text positions", resize_text_pos_embed)):
        if key in state and key in own and state[key].shape != own[key].shape \
                and state[key].shape[-1] == own[key].shape[-1]:
            before = tuple(state[key].shape)
            resize(state, model)
            notes.append(f"resized {label} {before} -> {tuple(state[key].shape)}")
    return state, notes


def _hf_activation_note(path: Path, model: nn.Module) -> Optional[str]:
    from open_clip.transformer import QuickGELU

    cfg_file = path / HF_CONFIG_FILE if path.is_dir() else None
    if cfg_file is None or not cfg_file.is_file():
        return None
    hf_meta = read_json_file(cfg_file)
    vision = (hf_meta.get("vision_config") if isinstance(hf_meta, dict) else None) or {}
    quick = vision.get("hidden_act") == "quick_gelu"
    has_quick = any(isinstance(m, QuickGELU) for m in model.modules())
    if quick != has_quick:
        want = "a -quickgelu architecture" if quick else "an architecture without quick_gelu"
        return f"WARNING: the checkpoint uses {vision.get('hidden_act')}, the model does not match (pick {want})"
    return None


def _preview(keys: List[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f", ... (+{len(keys) - n})" if len(keys) > n else "")


def init_from(model: nn.Module, path, label: Optional[str] = None) -> str:
    """Load pretrained weights into `model` in place; returns a one-paragraph report.

    `path`: an open_clip checkpoint (.pt/.pth/.bin/.safetensors, or an open_clip_train ``epoch_N.pt``), an open_clip
    local-dir, an mmcl run directory or export, or a transformers CLIP directory. Keys the model lacks are
    reported as unexpected, model keys the checkpoint lacks keep their current values and are reported as
    missing. A tensor whose shape differs from the model's raises `CheckpointError` (position grids are resized
    as open_clip does). `label` names the source in the report and errors (default ``init_from PATH``).
    """
    label = label or f"init_from {path}"
    state, what = read_checkpoint(path)
    state, notes = _adapt_to_model(state, model)
    own = model.state_dict()
    mismatched = [k for k in state if k in own and state[k].shape != own[k].shape]
    if mismatched:
        k = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise CheckpointError(f"{label}: {k} has shape {tuple(state[k].shape)} in the checkpoint, "
                              f"expected {tuple(own[k].shape)} by the model{more}; check model.name and the "
                              f"model.* overrides")
    matched = {k: v for k, v in state.items() if k in own}
    if not matched:
        raise CheckpointError(f"{label}: none of its {len(state)} tensors matches a model key "
                              f"(got e.g. {_preview(sorted(state), 3)}; expected e.g. {_preview(sorted(own), 3)})")
    model.load_state_dict(matched, strict=False)
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    parts = [f"{label} ({what}): loaded {len(matched)}/{len(own)} tensors"]
    parts.append(f"missing {len(missing)}" + (f": {_preview(missing)}" if missing else ""))
    parts.append(f"unexpected {len(unexpected)}" + (f": {_preview(unexpected)}" if unexpected else ""))
    parts += notes
    note = _hf_activation_note(Path(path), model)
    if note:
        parts.append(note)
    return "; ".join(parts)


# ----------------------------------------------------------------------------------------------- pretrained
# `model.pretrained` is the name-based front door: it resolves to files on this machine (downloading them through
# open_clip and huggingface_hub into the usual caches when allowed), which then go through the same loader as
# `model.init_from`. A source that carries its architecture (hf-hub:, a model directory, an open_clip_train run)
# builds that architecture; an open_clip tag and a bare weights file build model.name's.
HUB_PREFIX = "hf-hub:"
_TAG_PREPROCESS = ("mean", "std", "interpolation", "resize_mode")  # what an open_clip tag says about its images
_WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")


@dataclasses.dataclass
class Pretrained:
    """`model.pretrained` resolved: the weights to load, the architecture and preprocessing they come with."""

    weights: Path  # a file or directory that `read_checkpoint` reads
    arch: Optional[str]  # the model name to build (``local-dir:DIR`` for a directory's config); None: model.name
    preprocess: Dict[str, Any]  # preprocessing the weights were trained with, over the architecture's defaults
    what: str  # where the architecture and weights came from, for the run's log
    quick_gelu: Optional[bool] = None  # an open_clip tag's activation (its weights were trained with QuickGELU)


def _hf_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _hf_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_cached(repo: str, filenames: Tuple[str, ...]) -> Optional[str]:
    """The cached path of the first of `filenames` in `repo` that is in the Hugging Face cache, else None."""
    from huggingface_hub import try_to_load_from_cache

    for name in filenames:
        found = try_to_load_from_cache(repo, name)
        if isinstance(found, str):
            return found
    return None


def _weight_alternatives(filename: Optional[str]) -> Tuple[str, ...]:
    """The files open_clip's ``download_pretrained_from_hf`` tries for `filename`, in its order (safetensors first)."""
    from open_clip.constants import HF_WEIGHTS_NAME
    from open_clip.pretrained import _get_safe_alternatives  # the order open_clip's download follows

    filename = filename or HF_WEIGHTS_NAME
    return tuple(_get_safe_alternatives(filename)) + (filename,)


def _tag_repo(arch: str, tag: str) -> Tuple[str, Optional[str]]:
    """(hub repo, weights file or None for open_clip's default) of an open_clip tag; ('', None) for a tag
    published by URL only (open_clip downloads those into ~/.cache/clip)."""
    from open_clip.pretrained import get_pretrained_cfg

    repo, filename = os.path.split(get_pretrained_cfg(arch, tag).get("hf_hub") or "")
    return repo, filename or None


def _not_cached(what: str, repo: str, files: Tuple[str, ...]) -> str:
    return (f"{what}: {' or '.join(files)} of {repo} is not in the Hugging Face cache {_hf_cache_dir()} and "
            f"HF_HUB_OFFLINE=1 forbids downloading it (run once with network access, or point HF_HUB_CACHE at a "
            f"cache that holds it)")


def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~", "local-dir:")) or os.sep in name or "/" in name
            or name.endswith(_WEIGHT_SUFFIXES))


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


_OPEN_CLIP_CHECKPOINTS = "checkpoints"  # in open_clip_train's run folder (logs/NAME), not mmcl's


def open_clip_train_checkpoint(path) -> Optional[Tuple[Path, Path]]:
    """(checkpoint file, params.txt) when `path` is an open_clip_train checkpoint (``logs/NAME/checkpoints/epoch_N.pt``),
    its ``checkpoints/`` folder or its run folder ``logs/NAME`` (the newest checkpoint); else None."""
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


def _open_clip_train_arch(params: Path) -> Tuple[str, Dict[str, Any]]:
    """The architecture (``--model``) of an open_clip_train run and the preprocessing of the tag it started from."""
    from open_clip.pretrained import get_pretrained_cfg

    args = read_params_txt(params)
    arch = args.get("model", "")
    if not arch or arch == "None":
        raise CheckpointError(f"{params} names no model (expected a 'model: NAME' line, as open_clip_train writes)")
    tag_cfg = get_pretrained_cfg(arch, args.get("pretrained", "")) if args.get("pretrained") else {}
    return arch, {k: tag_cfg[k] for k in _TAG_PREPROCESS if k in tag_cfg}


def pretrained_problem(name: str, arch: str) -> Optional[str]:
    """Why `model.pretrained=name` (for architecture `arch`) cannot be resolved on this machine, without
    downloading anything; None when it can (or may be downloaded)."""
    from open_clip.pretrained import is_pretrained_cfg, list_pretrained_models_by_tag, list_pretrained_tags_by_model

    if name.startswith(HUB_PREFIX):
        repo = name[len(HUB_PREFIX):]
        if repo.count("/") != 1 or not all(repo.split("/")):
            return f"{name} is not a hub name (expected hf-hub:ORG/NAME, e.g. hf-hub:timm/ViT-B-16-SigLIP)"
        if _hf_offline() and _hub_cached(repo, (CONFIG_FILE,)) is None:
            return _not_cached(name, repo, (CONFIG_FILE,))
        if _hf_offline() and _hub_cached(repo, _weight_alternatives(None)) is None:
            return _not_cached(name, repo, _weight_alternatives(None))
        return None
    local = Path(name[len("local-dir:"):] if name.startswith("local-dir:") else name).expanduser()
    if local.exists():
        return None
    if _looks_like_path(name):
        return f"{os.path.abspath(local)} does not exist (expected an open_clip tag, hf-hub:ORG/NAME, or a file or " \
               f"directory of weights)"
    arch = arch.replace("/", "-")  # as open_clip names architectures
    if not is_pretrained_cfg(arch, name):
        tags = list_pretrained_tags_by_model(arch)
        if tags:
            return f"'{name}' is not a published tag of {arch}; open_clip knows: {', '.join(tags)}"
        others = list_pretrained_models_by_tag(name)
        hint = f" ('{name}' is published for {_preview(others, 6)})" if others else ""
        return (f"open_clip publishes no weights for model.name={arch}{hint}; set model.name to one that has "
                f"them, or give hf-hub:ORG/NAME, a file or a directory")
    repo, filename = _tag_repo(arch, name)
    if repo and _hf_offline() and _hub_cached(repo, _weight_alternatives(filename)) is None:
        return _not_cached(f"{arch} '{name}'", repo, _weight_alternatives(filename))
    return None


def _download(what: str, repo: str, fetch: Callable[[], str]) -> Path:
    """`fetch()` (open_clip's download into the Hugging Face cache); a failure is one line naming what and where."""
    try:
        return Path(fetch())
    except Exception as err:  # noqa: BLE001 - huggingface_hub and open_clip raise many types
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"model.pretrained: cannot get {what} of {repo} into the Hugging Face cache "
                              f"{_hf_cache_dir()} ({detail[:300]})") from None


def resolve_pretrained(name: str, arch: str) -> Pretrained:
    """Resolve `model.pretrained` to local files, downloading them through open_clip's own functions (into the
    Hugging Face cache; with HF_HUB_OFFLINE=1 only the cache is read). Raises `CheckpointError` in one line."""
    from open_clip.pretrained import download_pretrained, download_pretrained_from_hf, get_pretrained_cfg

    problem = pretrained_problem(name, arch)
    if problem:
        raise CheckpointError(f"model.pretrained: {problem}")
    if name.startswith(HUB_PREFIX):
        repo = name[len(HUB_PREFIX):]
        config = _download(CONFIG_FILE, repo, lambda: download_pretrained_from_hf(repo, filename=CONFIG_FILE))
        file = _download("the weights", repo, lambda: download_pretrained_from_hf(repo))
        meta = read_json_file(config)
        pp = meta.get("preprocess_cfg") if isinstance(meta, dict) else None
        return Pretrained(file, f"local-dir:{config.parent}", dict(pp or {}),
                          f"{name}: architecture and preprocessing from its {CONFIG_FILE}, weights {file}")
    local = Path(name[len("local-dir:"):] if name.startswith("local-dir:") else name).expanduser()
    if local.exists():
        found = _locate(local)
        brought = pretrained_architecture(name)
        if found is not None and found.is_file():
            _, pp = _open_clip_train_arch(found.parent.parent / "params.txt")
            return Pretrained(found, brought, pp, f"{local}: open_clip_train checkpoint {found.name}, architecture "
                                                  f"{brought} from {found.parent.parent / 'params.txt'}")
        if brought is not None:
            config = found / checkpoints.MODEL_CONFIG if checkpoints.is_checkpoint(found) else found / CONFIG_FILE
            return Pretrained(found, brought, dict(_read_model_meta(config).get("preprocess_cfg") or {}),
                              f"{local}: architecture and preprocessing from its {config.name}")
        return Pretrained(local, None, {}, f"{local}: weights for model.name={arch}")
    arch = arch.replace("/", "-")
    tag_cfg = get_pretrained_cfg(arch, name)
    repo = _tag_repo(arch, name)[0] or tag_cfg.get("url", "")
    file = _download(f"the weights of {arch} '{name}'", repo, lambda: download_pretrained(tag_cfg))
    return Pretrained(file, None, {k: tag_cfg[k] for k in _TAG_PREPROCESS if k in tag_cfg},
                      f"open_clip tag {arch} '{name}' ({repo}: {file}), preprocessing of the tag",
                      quick_gelu=bool(tag_cfg.get("quick_gelu")))


def pretrained_architecture(name: str) -> Optional[str]:
    """The architecture `model.pretrained=name` brings, spelled as a ``model.name``, without downloading anything:
    ``hf-hub:ORG/NAME`` itself, ``local-dir:DIR`` for a model directory, export or run folder (`_locate`), the
    ``model_config.json`` of a training checkpoint that records one, an open_clip_train run's ``--model``. None for
    an open_clip tag, a weights file or anything else: those are loaded into model.name's architecture."""
    if name.startswith(HUB_PREFIX):
        return name
    local = Path(name[len("local-dir:"):] if name.startswith("local-dir:") else name).expanduser()
    found = _locate(local) if local.exists() else None
    if found is None:
        return None
    if found.is_file():
        return _open_clip_train_arch(found.parent.parent / "params.txt")[0]
    if checkpoints.is_checkpoint(found):
        config = found / checkpoints.MODEL_CONFIG
        return str(config.resolve()) if config.is_file() else None
    return f"local-dir:{found.resolve()}"


def record_pretrained_architecture(cfg):
    """The training config `cfg` with ``model.name`` set to the architecture ``model.pretrained`` brings
    (`pretrained_architecture`), where it brings one: that architecture is the one built, so it is the one the run
    folder's config.yaml records, and a resumed run spelled as the first one is the same run."""
    brought = pretrained_architecture(cfg.model.pretrained) if cfg.model.pretrained else None
    if brought is None or brought == cfg.model.name:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=brought))


def build_pretrained(cfg: ModelConfig):
    """The model `cfg.pretrained` names, with its weights loaded: ``(model, model_cfg, preprocess_cfg, tokenizer,
    report)``. The architecture is the source's own (hf-hub:, a model directory, an open_clip_train run) or
    model.name's (a tag, a bare weights file); model.* overrides apply on top, as without pretrained."""
    from open_clip.transformer import QuickGELU

    from .. import models

    source = resolve_pretrained(cfg.pretrained, cfg.name)
    section = cfg
    if source.arch:
        section = dataclasses.replace(cfg, name=source.arch)
        if models.resolve_model_config(section)["text_cfg"].get("hf_model_name"):
            # The source holds the Hugging Face text tower's weights too: build it from its config alone, as
            # open_clip does for pretrained weights, rather than downloading weights that are then replaced.
            section = dataclasses.replace(section, text_cfg={**section.text_cfg, "hf_model_pretrained": False})
    model, model_cfg, pp, _, _, tokenizer = models.build(section)
    # The image size stays the model's (model.image_size may change it); the rest is what the weights saw.
    pp = {**pp, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in source.preprocess.items() if k != "size"}}
    report = f"{init_from(model, source.weights, label=f'model.pretrained={cfg.pretrained}')}; {source.what}"
    has_quick = any(isinstance(m, QuickGELU) for m in model.modules())
    if source.quick_gelu is not None and source.quick_gelu != has_quick:
        want = f"{cfg.name}-quickgelu" if source.quick_gelu else cfg.name.replace("-quickgelu", "")
        report += (f"; WARNING: these weights were trained {'with' if source.quick_gelu else 'without'} QuickGELU "
                   f"and the model {'lacks' if source.quick_gelu else 'has'} it (use model.name={want})")
    return model, model_cfg, pp, tokenizer, report
