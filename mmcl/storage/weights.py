"""Weights apart from building: saving and loading model directories, reading checkpoints, ``init_from``.

A saved model directory is open_clip's local-dir layout (``open_clip_config.json`` + ``open_clip_model.safetensors``),
so open_clip, CLIP_benchmark and `mmcl.load` all read the same files. With a Hugging Face text tower the directory
also holds that tower's ``config.json`` and tokenizer files, so it loads after the source checkpoint is gone. The
config records the weights' size and SHA-256, checked on every load.

Weights are read from files (.pt/.pth/.bin/.safetensors), open_clip local dirs, mmcl runs (their newest verified
training checkpoint, through `mmcl.storage.checkpoints`), mmcl exports and transformers CLIP directories (keys mapped by
`mmcl.storage.hf_clip`). Which model a path names is `mmcl.storage.locate`'s to say; ``model.pretrained`` (published
weights by open_clip tag or hub name) is `mmcl.storage.pretrained`, whose names stay reachable from this module too.
Towers are built by `mmcl.models`; directories are written through `mmcl.storage.fsutil.atomic_dir`.

open_clip's ``load_checkpoint`` and ``create_model("local-dir:...")`` load the same layout; mmcl reads it itself for
what they do not do: the size and SHA-256 check, a Hugging Face text tower rebuilt from the directory's own
``config.json`` (no download, no remote code), training checkpoints and runs as sources, and every damaged or
misfitting file as one `CheckpointError` line naming the file. open_clip's own layout fixes (custom-text keys,
resized position grids) are called, not copied (`_adapt_to_model`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from open_clip.model import convert_to_custom_text_state_dict, resize_pos_embed, resize_text_pos_embed
from open_clip.transformer import QuickGELU
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer

from ..config import ModelConfig, load_config
from ..data.limits import read_regular_text
from ..errors import CheckpointError, ConfigError, file_problem, preview
from ..models import towers
from ..models.resize import LONG_CLIP_KEEP, stretch_text_positions
from ..models.towers import (
    build_tokenizer,
    build_transforms,
    create,
    hf_custom_code_error,
    is_local_dir,
    preprocess_config,
    resolve_model_config,
)
from . import checkpoints, hf_clip
from .fsutil import atomic_dir, file_sha256, files_under, inside, os_error_text, output_dir
from .layout import RunLayout
from .locate import (
    CONFIG_FILE,
    damaged,
    find_model_dir,
    locate,
    located,
    open_clip_train_arch,
    read_json_file,
    read_model_meta,
)

# The model directory's files (open_clip's local-dir layout), read by open_clip, CLIP_benchmark and `mmcl.load`;
# its config file (`CONFIG_FILE`) is named in `mmcl.storage.locate`, which finds model directories by it.
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
        meta = json.loads(read_regular_text(listing))
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


def weights_record(weights: Path) -> Dict[str, Any]:
    """Size and SHA-256 of a weights file, kept in the config file beside it so that damage is found at load."""
    return {"file": weights.name, "size": weights.stat().st_size, "sha256": file_sha256(weights)}


def recorded_weights(meta: Any) -> Optional[Dict[str, Any]]:
    """The weights record (``file``, ``size``, ``sha256``; `weights_record`) that a parsed model config holds in
    its ``mmcl`` section, or None for a config written without one."""
    mmcl_meta = meta.get("mmcl") if isinstance(meta, dict) else None
    record = mmcl_meta.get("weights") if isinstance(mmcl_meta, dict) else None
    return record if isinstance(record, dict) else None


def _check_weights_record(weights: Path, meta: Dict[str, Any]) -> None:
    """Compare the weights file with the size and SHA-256 recorded when it was written (models saved without a
    record are loaded unchecked)."""
    record = recorded_weights(meta)
    if record is None or record.get("file") != weights.name:
        return
    size = weights.stat().st_size
    if record.get("size") is not None and size != record["size"]:
        cut = "truncated" if size < record["size"] else "longer than written"
        raise damaged(weights, f"{size} bytes, {record['size']} were written: {cut}")
    if record.get("sha256") and weights_record(weights)["sha256"] != record["sha256"]:
        raise damaged(weights, "its SHA-256 differs from the one recorded when it was written")


def _fit_state(model: nn.Module, state: Dict[str, torch.Tensor], weights: Path, config: Path) -> None:
    """Load `state` strictly; a mismatch is a `CheckpointError` naming missing, unexpected and misshapen keys."""
    own = model.state_dict()
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    shapes = sorted(k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({preview(missing, 3)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({preview(unexpected, 3)})")
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
    found = located(path)
    if found.is_file():
        return _load_open_clip_train(found, found.parent.parent / "params.txt")
    if checkpoints.is_checkpoint(found):
        return _load_checkpoint(found)
    model_dir, config = found, found / CONFIG_FILE
    meta = read_model_meta(config)
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
    _check_size_declared(model_cfg, weights, config)
    model, pp = _build(model_cfg, meta.get("preprocess_cfg"), config)
    _fit_state(model, _read_weight_file(weights), weights, config)
    model.eval()
    return model, model_cfg, pp


def _check_size_declared(model_cfg: Dict[str, Any], weights: Path, config: Path) -> None:
    """CheckpointError when the model `config` describes has more parameters than `weights` can hold at 2 bytes each
    (half precision, the least a weights file stores): counted on a model built on the meta device, which allocates
    nothing, before the real model is built (a few lines of config can ask for billions of parameters)."""
    cfg = copy.deepcopy(model_cfg)
    if cfg.get("text_cfg", {}).get("hf_model_name"):
        cfg["text_cfg"]["hf_model_pretrained"] = False
    try:
        with torch.device("meta"):
            count = sum(p.numel() for p in create(cfg).parameters())
    except Exception:  # noqa: BLE001 - a config that cannot be built is reported by `_build`, in its words
        return
    size = weights.stat().st_size
    if count * 2 > size:
        raise CheckpointError(f"{config} describes a model of {count:,} parameters, at least {count * 2:,} bytes of "
                              f"weights, but {weights.name} holds {size:,} bytes: the config does not belong to these "
                              f"weights (nothing was built)")


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
        meta = read_model_meta(config)
        model_cfg, pp = copy.deepcopy(meta.get("model_cfg", meta)), meta.get("preprocess_cfg")
    else:
        model_cfg, pp, config = _run_architecture(ckpt)
    model, pp = _build(model_cfg, pp, config)
    _fit_state(model, state, ckpt / checkpoints.MODEL_WEIGHTS, config)
    model.eval()
    return model, model_cfg, pp


def _run_architecture(ckpt: Path) -> Tuple[Dict[str, Any], Dict[str, Any], Path]:
    """(model_cfg, preprocess_cfg, config.yaml) of the run whose checkpoint `ckpt` is, from its ``config.yaml``."""

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

    arch, tag_pp = open_clip_train_arch(params)
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

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for bad headers
            raise damaged(path, f"not a readable safetensors file: {str(err).splitlines()[0]}") from None
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
    .safetensors); whatever `locate` resolves (an open_clip local-dir, an mmcl export, an mmcl run: its ``model/``,
    else its newest intact training checkpoint; a training checkpoint, as `checkpoints.model_of_checkpoint` reads
    it); a transformers CLIP directory (``config.json`` with model_type clip).
    """
    path = Path(path).expanduser()
    problem = file_problem(path, folder_ok=True)
    if problem is not None:
        raise CheckpointError(f"init_from path {problem}: {path}")
    if path.is_file():
        state, what = _read_weight_file(path), f"{path.suffix.lstrip('.')} file"
    elif (found := locate(path)) is not None and found.is_file():  # open_clip_train's epoch_N.pt
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
            if key != "visual.positional_embedding" and state[key].shape[0] < own[key].shape[0]:
                # A longer context (model.context_length): Long-CLIP's stretch, the first positions as trained.
                state[key] = stretch_text_positions(state[key], own[key].shape[0])
                notes.append(f"stretched {label} {before} -> {tuple(state[key].shape)} (the first "
                             f"{min(LONG_CLIP_KEEP, before[0] - 2)} as trained, the rest interpolated: Long-CLIP)")
                continue
            resize(state, model)
            notes.append(f"resized {label} {before} -> {tuple(state[key].shape)}")
    return state, notes


def _hf_activation_note(path: Path, model: nn.Module) -> Optional[str]:

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
                              f"(got e.g. {preview(sorted(state), 3)}; expected e.g. {preview(sorted(own), 3)})")
    model.load_state_dict(matched, strict=False)
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    parts = [f"{label} ({what}): loaded {len(matched)}/{len(own)} tensors"]
    parts.append(f"missing {len(missing)}" + (f": {preview(missing, 6)}" if missing else ""))
    parts.append(f"unexpected {len(unexpected)}" + (f": {preview(unexpected, 6)}" if unexpected else ""))
    parts += notes
    note = _hf_activation_note(Path(path), model)
    if note:
        parts.append(note)
    return "; ".join(parts)

