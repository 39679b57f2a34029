"""``model.pretrained``: published weights by open_clip tag or hub name, a local file or directory, or an
open_clip_train run, resolved to files on this machine and loaded through `mmcl.storage.weights.init_from`.

A source that carries its architecture (``hf-hub:``, a model directory, an open_clip_train run) builds that
architecture; an open_clip tag and a bare weights file build model.name's.

What open_clip's and huggingface_hub's public functions do, mmcl calls: the tag table (`is_pretrained_cfg`,
`get_pretrained_cfg`, the tag listings), the downloads into the Hugging Face cache (``download_pretrained`` for a
tag, ``download_pretrained_from_hf`` for a hub repo: safetensors first, as ``open_clip.create_model`` loads them)
and, with ``HF_HUB_OFFLINE=1``, the check that the files are already there (the same two functions, which then
read the cache and never the network), so the files checked are the files loaded. What mmcl keeps of its own:

* the check before a run starts (`pretrained_problem`), so that a tag or hub name that cannot be resolved is one
  ``mmcl: error:`` line before anything is built or written, instead of open_clip's ``RuntimeError`` mid-build;
* the names of the files looked for in that line (`_weight_alternatives`): open_clip's download raises naming only
  the last file it tried, and its order (the safetensors alternative first) is spelled only in its private
  ``open_clip.pretrained._get_safe_alternatives``, pinned by tests/test_dependency_names.py;
* model directories, mmcl runs and exports, training checkpoints and open_clip_train runs as sources
  (`mmcl.storage.locate`), which open_clip's ``pretrained=`` does not read;
* loading through `init_from` rather than ``open_clip.load_checkpoint``: the report of missing and unexpected keys,
  the checks of a damaged file, and an architecture taken from the source while model.* overrides still apply.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from huggingface_hub import constants
from open_clip import (
    download_pretrained,
    get_pretrained_cfg,
    is_pretrained_cfg,
    list_pretrained_models_by_tag,
    list_pretrained_tags_by_model,
)
from open_clip.constants import HF_WEIGHTS_NAME
from open_clip.pretrained import _get_safe_alternatives, download_pretrained_from_hf
from open_clip.transformer import QuickGELU

from .. import models
from ..config import ModelConfig
from ..errors import CheckpointError, preview
from . import checkpoints
from .locate import CONFIG_FILE, TAG_PREPROCESS, locate, open_clip_train_arch, read_json_file, read_model_meta
from .weights import init_from

HUB_PREFIX = "hf-hub:"
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

    return str(constants.HF_HUB_CACHE)


def _hf_offline() -> bool:

    return bool(constants.HF_HUB_OFFLINE)


def _in_cache(fetch: Callable[[], str]) -> bool:
    """Whether open_clip's download `fetch` finds its file in the Hugging Face cache. Called with HF_HUB_OFFLINE=1
    only: huggingface_hub then reads the cache and never the network, so nothing is downloaded."""
    try:
        fetch()
    except Exception:  # noqa: BLE001 - open_clip turns huggingface_hub's miss into FileNotFoundError; any failure
        return False  # to find the file is a miss
    return True


def _weight_alternatives(filename: Optional[str]) -> Tuple[str, ...]:
    """The files open_clip's ``download_pretrained_from_hf`` tries for `filename`, in its order (safetensors first):
    named in the error line when none is in the cache."""

    filename = filename or HF_WEIGHTS_NAME
    return tuple(_get_safe_alternatives(filename)) + (filename,)


def _tag_repo(tag_cfg: Dict[str, Any]) -> Tuple[str, Optional[str]]:
    """(hub repo, weights file or None for open_clip's default) of an open_clip tag's config, split as
    ``download_pretrained`` splits it; ('', None) for a tag published by URL only (open_clip downloads those into
    ~/.cache/clip)."""
    repo, filename = os.path.split(tag_cfg.get("hf_hub") or "")
    return repo, filename or None


def _not_cached(what: str, repo: str, files: Tuple[str, ...]) -> str:
    return (f"{what}: {' or '.join(files)} of {repo} is not in the Hugging Face cache {_hf_cache_dir()} and "
            f"HF_HUB_OFFLINE=1 forbids downloading it (run once with network access, or point HF_HUB_CACHE at a "
            f"cache that holds it)")


def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~", "local-dir:")) or os.sep in name or "/" in name
            or name.endswith(_WEIGHT_SUFFIXES))


def _local(name: str) -> Path:
    return Path(name[len("local-dir:"):] if name.startswith("local-dir:") else name).expanduser()


def _hub_problem(name: str) -> Optional[str]:
    """Why ``hf-hub:ORG/NAME`` cannot be resolved: a malformed name, or, offline, a file missing from the cache."""

    repo = name[len(HUB_PREFIX):]
    if repo.count("/") != 1 or not all(repo.split("/")):
        return f"{name} is not a hub name (expected hf-hub:ORG/NAME, e.g. hf-hub:timm/ViT-B-16-SigLIP)"
    if _hf_offline() and not _in_cache(lambda: download_pretrained_from_hf(repo, filename=CONFIG_FILE)):
        return _not_cached(name, repo, (CONFIG_FILE,))
    if _hf_offline() and not _in_cache(lambda: download_pretrained_from_hf(repo)):
        return _not_cached(name, repo, _weight_alternatives(None))
    return None


def pretrained_problem(name: str, arch: str) -> Optional[str]:
    """Why `model.pretrained=name` (for architecture `arch`) cannot be resolved on this machine, without
    downloading anything; None when it can (or may be downloaded)."""

    if name.startswith(HUB_PREFIX):
        return _hub_problem(name)
    local = _local(name)
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
        hint = f" ('{name}' is published for {preview(others, 6)})" if others else ""
        return (f"open_clip publishes no weights for model.name={arch}{hint}; set model.name to one that has "
                f"them, or give hf-hub:ORG/NAME, a file or a directory")
    tag_cfg = get_pretrained_cfg(arch, name)
    repo, filename = _tag_repo(tag_cfg)
    if repo and _hf_offline() and not _in_cache(lambda: download_pretrained(tag_cfg)):
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


def _resolve_local(name: str, local: Path, arch: str) -> Pretrained:
    """A local file or directory as `model.pretrained` (`locate`): an open_clip_train run, a source that records its
    architecture, or weights for model.name's."""
    found = locate(local)
    brought = pretrained_architecture(name)
    if found is not None and found.is_file():
        _, pp = open_clip_train_arch(found.parent.parent / "params.txt")
        return Pretrained(found, brought, pp, f"{local}: open_clip_train checkpoint {found.name}, architecture "
                                              f"{brought} from {found.parent.parent / 'params.txt'}")
    if brought is not None:
        config = found / checkpoints.MODEL_CONFIG if checkpoints.is_checkpoint(found) else found / CONFIG_FILE
        return Pretrained(found, brought, dict(read_model_meta(config).get("preprocess_cfg") or {}),
                          f"{local}: architecture and preprocessing from its {config.name}")
    return Pretrained(local, None, {}, f"{local}: weights for model.name={arch}")


def resolve_pretrained(name: str, arch: str) -> Pretrained:
    """Resolve `model.pretrained` to local files, downloading them through open_clip's own functions (into the
    Hugging Face cache; with HF_HUB_OFFLINE=1 only the cache is read). Raises `CheckpointError` in one line."""

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
    local = _local(name)
    if local.exists():
        return _resolve_local(name, local, arch)
    arch = arch.replace("/", "-")
    tag_cfg = get_pretrained_cfg(arch, name)
    repo = _tag_repo(tag_cfg)[0] or tag_cfg.get("url", "")
    file = _download(f"the weights of {arch} '{name}'", repo, lambda: download_pretrained(tag_cfg))
    return Pretrained(file, None, {k: tag_cfg[k] for k in TAG_PREPROCESS if k in tag_cfg},
                      f"open_clip tag {arch} '{name}' ({repo}: {file}), preprocessing of the tag",
                      quick_gelu=bool(tag_cfg.get("quick_gelu")))


def pretrained_architecture(name: str) -> Optional[str]:
    """The architecture `model.pretrained=name` brings, spelled as a ``model.name``, without downloading anything:
    ``hf-hub:ORG/NAME`` itself, ``local-dir:DIR`` for a model directory, export or run folder (`locate`), the
    ``model_config.json`` of a training checkpoint that records one, an open_clip_train run's ``--model``. None for
    an open_clip tag, a weights file or anything else: those are loaded into model.name's architecture."""
    if name.startswith(HUB_PREFIX):
        return name
    local = _local(name)
    found = locate(local) if local.exists() else None
    if found is None:
        return None
    if found.is_file():
        return open_clip_train_arch(found.parent.parent / "params.txt")[0]
    if checkpoints.is_checkpoint(found):
        config = found / checkpoints.MODEL_CONFIG
        return str(config.resolve()) if config.is_file() else None
    return f"local-dir:{found.resolve()}"


def record_pretrained_architecture(model: ModelConfig) -> ModelConfig:
    """The ``model`` section with ``name`` set to the architecture ``model.pretrained`` brings
    (`pretrained_architecture`), where it brings one: that architecture is the one built, so it is the one the run
    folder's config.yaml records, and a resumed run spelled as the first one is the same run."""
    brought = pretrained_architecture(model.pretrained) if model.pretrained else None
    if brought is None or brought == model.name:
        return model
    return dataclasses.replace(model, name=brought)


def build_pretrained(cfg: ModelConfig):
    """The model `cfg.pretrained` names, with its weights loaded: ``(model, model_cfg, preprocess_cfg, tokenizer,
    report)``. The architecture is the source's own (hf-hub:, a model directory, an open_clip_train run) or
    model.name's (a tag, a bare weights file); model.* overrides apply on top, as without pretrained."""


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
