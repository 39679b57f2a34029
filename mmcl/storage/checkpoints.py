"""Training checkpoints on disk: layout, save, verify, and the choice of the one to resume from.

Layout: ``checkpoints/step-NNNNNNNN/`` holds accelerate's state (the model's weights in ``model.safetensors``), one
``rank_state_<i>.pt`` per process, the model's architecture and preprocessing (``model_config.json``, as a model
directory's ``open_clip_config.json`` records them) and a ``COMPLETE`` marker written last. The marker records the
progress (step, samples) and the size and SHA-256 of every file, so a truncated or altered file is found before loading,
not halfway through. A checkpoint that fails this check is renamed ``damaged-step-NNNNNNNN`` (never deleted: it is
evidence, and the new name keeps it out of ``keep_checkpoints`` rotation and out of the way of a new save of the same
step).

Imports no training code: `newest_run_weights` is what loading a run directory (``mmcl.storage.weights``) uses, so the
layout and the COMPLETE check are known here only.

Nothing in a checkpoint runs code when it is loaded: a run folder may come from someone else, and its COMPLETE
marker proves nothing then (whoever wrote the files wrote the marker). Every pickled file is read with
``weights_only=True`` (`load_plain`): tensors and plain containers load, anything else is one `CheckpointError`
naming the file. The run's progress and weight average live in the rank states, not in objects handed to
accelerate's ``register_for_checkpointing`` (accelerate unpickles those ``custom_checkpoint_<i>.pkl`` files with
``weights_only=False``); `load_accelerate_state` keeps accelerate away from such files, which older checkpoints
hold, and `legacy_custom_states` reads them as plain data instead.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from safetensors.torch import load_file

from ..config import is_main_process
from ..errors import CheckpointError, ConfigError, StorageError
from ..models.clip_classes import without_heads
from ..models.lora import merge_state
from .fsutil import file_sha256, inside, make_folder, open_dir_inside, write_text_at
from .layout import CHECKPOINTS_DIR, CKPT_PREFIX, COMPLETE, DAMAGED_PREFIX, LATEST

MODEL_WEIGHTS = "model.safetensors"  # accelerate's name for the model's weights in its saved state
MODEL_CONFIG = "model_config.json"  # {"model_cfg", "preprocess_cfg"}: what the checkpoint's weights are of
_STEP_NAME = re.compile(rf"^(\.tmp-|{DAMAGED_PREFIX})?{CKPT_PREFIX}\d+(-\d+)?$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# What accelerate names the state of objects given to `register_for_checkpointing`. mmcl registers none; a
# checkpoint holding such files (an earlier layout) has the progress at index 0 and, with train.ema_decay, the
# weight average at 1, which resuming reads (`legacy_custom_states`).
_CUSTOM_STATE = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
LEGACY_PROGRESS, LEGACY_EMA = 0, 1


def rank_state_file(ckpt: Path, rank: int) -> Path:
    """The file holding process `rank`'s own state (data position, loss state; progress; rank 0: the EMA)."""
    return ckpt / f"rank_state_{rank}.pt"


# ----------------------------------------------------------------------------------------------- loading
def load_plain(path: Path, map_location: Any = "cpu") -> Any:
    """`torch.load` of `path` as tensors and plain containers only (``weights_only=True``), mapped to
    `map_location` (never to the device the file names, which may be another process's GPU or absent here).

    Raises CheckpointError naming the file when it holds anything else (a class, a function: loading it the
    way ``weights_only=False`` does would run what it names). Other read errors (a truncated file) propagate
    unchanged, for the caller's damaged-checkpoint handling.
    """

    try:
        return torch.load(str(path), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message spans paragraphs around the one line that names what was refused ("Unsupported
        # operand 110" for bytes that are no pickle, "... unsupported GLOBAL posix.system ..." for a callable).
        lines = [ln.strip() for ln in str(err).splitlines() if "nsupported" in ln]
        what = lines[0].rstrip(".") if lines else "not a torch file"
        if "GLOBAL" not in what:  # bytes that are not a pickle at all: damaged or another format
            raise CheckpointError(f"cannot read {path}: it is not a file of tensors ({what})") from None
        raise CheckpointError(f"refusing {path}: it does not load as plain tensors and containers ({what}); "
                              f"mmcl never runs code a file names") from None


def legacy_custom_states(ckpt: Path) -> Dict[int, Any]:
    """{index: state} of the ``custom_checkpoint_<index>.pkl`` files in `ckpt` (checkpoints written when mmcl
    registered its progress and EMA with accelerate), each read by `load_plain`; {} when there are none."""
    out = {}
    for name in sorted(os.listdir(ckpt)):
        m = _CUSTOM_STATE.match(name)
        if m:
            out[int(m.group(1))] = load_plain(ckpt / name, "cpu")
    return out


def load_accelerate_state(accelerator, ckpt: Path) -> None:
    """``accelerator.load_state(ckpt)`` (weights, optimiser, scaler, RNG: all read by accelerate with
    ``weights_only=True``) without letting accelerate see a ``custom_checkpoint_<i>.pkl``, which it would
    unpickle with ``weights_only=False``: when `ckpt` holds one, accelerate reads a temporary view of `ckpt`
    (symbolic links to every other entry) instead. The checkpoint itself is not changed."""
    names = os.listdir(ckpt)
    if not any(_CUSTOM_STATE.match(n) for n in names):
        accelerator.load_state(str(ckpt))
        return
    with tempfile.TemporaryDirectory(prefix="mmcl-checkpoint-view-") as view:
        for name in names:
            if not _CUSTOM_STATE.match(name):
                os.symlink(Path(ckpt).resolve() / name, Path(view) / name)
        accelerator.load_state(view)


# ----------------------------------------------------------------------------------------------- reading
def read_marker(ckpt: Path) -> Dict[str, Any]:
    """The parsed COMPLETE marker of `ckpt`; ValueError when it is missing keys or is not JSON."""
    try:
        marker = json.loads((ckpt / COMPLETE).read_text())
        int(marker["step"])
    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"its {COMPLETE} marker is unreadable ({type(err).__name__})") from None
    if not isinstance(marker, dict):
        raise ValueError(f"its {COMPLETE} marker is unreadable")
    return marker


def _step_of_name(d: Path) -> int:
    try:
        return int(d.name[len(CKPT_PREFIX):])
    except ValueError:
        return -1


def _marked(ckpt_dir: Path) -> List[Tuple[int, Path, Optional[Dict[str, Any]]]]:
    """(step, dir, marker or None when unreadable) of every ``step-*`` dir that has a COMPLETE file."""
    found = []
    if ckpt_dir.is_dir():
        for d in ckpt_dir.iterdir():
            if d.name.startswith(CKPT_PREFIX) and d.is_dir() and (d / COMPLETE).is_file():
                try:
                    marker = read_marker(d)
                    found.append((int(marker["step"]), d, marker))
                except ValueError:
                    found.append((_step_of_name(d), d, None))  # ordered by its name only to be reported
    return sorted(found, key=lambda t: t[0])


def list_checkpoints(ckpt_dir: Path) -> List[Path]:
    """Complete checkpoints (a readable COMPLETE marker), oldest first, ordered by the step recorded inside."""
    return [d for _, d, marker in _marked(ckpt_dir) if marker is not None]


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint `latest` points to when it is complete, else the newest complete one (no verification)."""
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        target = ckpt_dir / pointer.read_text().strip()
        if (target / COMPLETE).is_file():
            return target
    complete = list_checkpoints(ckpt_dir)
    return complete[-1] if complete else None


def _files_of(ckpt: Path) -> List[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != COMPLETE)


def verify_checkpoint(ckpt: Path, only: Optional[Tuple[str, ...]] = None) -> Optional[str]:
    """None when `ckpt` is intact, else what is wrong (a missing, truncated or altered file, a bad marker).

    `only`: check just these files (e.g. ``("model.safetensors",)`` to load weights), each of which must be
    recorded. Checkpoints written before the marker listed files are only checked for a readable marker.
    """
    try:
        marker = read_marker(ckpt)
    except ValueError as err:
        return str(err)
    except OSError as err:
        return f"its {COMPLETE} marker cannot be read ({err.strerror})"
    files = marker.get("files")
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"its {COMPLETE} marker is unreadable"
    if only is not None:
        missing = [rel for rel in only if rel not in files]
        if missing:
            return f"its {COMPLETE} marker does not list {', '.join(missing)}"
        files = {rel: files[rel] for rel in only}
    for rel, want in files.items():
        path = ckpt / rel
        try:
            size = path.stat().st_size
            if size != want["size"]:
                return f"{rel} has {size} bytes, {want['size']} were written"
            if file_sha256(path) != want["sha256"]:
                return f"{rel} differs from what was written (SHA-256 mismatch)"
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as err:
            return f"{rel} cannot be read ({err.strerror})"
        except (KeyError, TypeError):
            return f"its {COMPLETE} marker is unreadable"
    return None


def damaged_and_usable(ckpt_dir: Path, only: Optional[Tuple[str, ...]] = None
                       ) -> Tuple[List[Tuple[Path, str]], Optional[Path]]:
    """Walk the checkpoints newest first: ([(damaged dir, reason), ...] newer than the first intact one, it)."""
    damaged = []
    for _, d, _marker in reversed(_marked(ckpt_dir)):
        problem = verify_checkpoint(d, only)
        if problem is None:
            return damaged, d
        damaged.append((d, problem))
    return damaged, None


def newest_verified_checkpoint(ckpt_dir: Path, only: Optional[Tuple[str, ...]] = None) -> Optional[Path]:
    """The newest checkpoint in `ckpt_dir` whose files (or just the files in `only`) match their recorded sizes
    and checksums, or None.

    Reads only; changes nothing on disk. Loading weights from a run directory calls it with
    ``only=(MODEL_WEIGHTS,)`` (`newest_run_weights`), so the optimiser state (2/3 of the bytes with AdamW) is not read.
    """
    return damaged_and_usable(Path(ckpt_dir), only)[1]


def newest_run_weights(run_dir: Path) -> Optional[Path]:
    """The newest training checkpoint of the run at `run_dir` whose model weights match their recorded size and
    checksum (the optimiser state is not read), or None. Reads only."""
    return newest_verified_checkpoint(Path(run_dir) / CHECKPOINTS_DIR, only=(MODEL_WEIGHTS,))


def is_checkpoint(path: Path) -> bool:
    """Whether the folder `path` is (or was meant to be) a training checkpoint: a COMPLETE marker, a rank state or a
    checkpoint's name (``step-N``) inside a ``checkpoints/`` folder."""
    path = Path(path)
    return path.is_dir() and ((path / COMPLETE).exists() or rank_state_file(path, 0).is_file() or (
        path.parent.name == CHECKPOINTS_DIR and bool(_STEP_NAME.match(path.name))))


def model_of_checkpoint(ckpt: Path, merge_lora: bool = True) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """The model a complete training checkpoint holds: (state dict, its ``model_config.json`` or None when the
    checkpoint records none, as those written before it did). A LoRA run's weights (its ``model_config.json``
    records ``lora``) come with the adapters merged in, as the plain model's state dict, unless `merge_lora` is
    False.

    The weights are the ones the run's ``model/`` would hold at this step: with ``train.ema_decay`` the weight
    average (saved in rank 0's state) in place of the trained weights, else the trained weights. The marker, the
    weights and the files read are checked first; a checkpoint without its marker (an interrupted save, a partial
    copy) or with a missing or altered file is one `CheckpointError` naming it and why.
    """

    if not (ckpt / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: it has no {COMPLETE} marker (its save was "
                              f"interrupted, or it is a partial copy); use another checkpoint or the run's model/")
    try:
        listed = read_marker(ckpt).get("files") or {}
    except (ValueError, OSError):
        listed = {}  # verify_checkpoint names what is wrong with the marker
    only = tuple(n for n in (MODEL_WEIGHTS, MODEL_CONFIG, rank_state_file(ckpt, 0).name) if n in listed) or None
    problem = verify_checkpoint(ckpt, only)
    if problem is None and not (ckpt / MODEL_WEIGHTS).is_file():
        problem = f"it holds no {MODEL_WEIGHTS} (an FSDP checkpoint keeps its weights sharded: use the run's model/)"
    if problem:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {problem}")
    try:
        state = load_file(str(ckpt / MODEL_WEIGHTS))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for bad headers
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {MODEL_WEIGHTS} is not a readable safetensors file "
                              f"({str(err).splitlines()[0]})") from None
    ema = _ema_of(ckpt)
    if ema is not None:
        unknown = sorted(set(ema) - set(state))
        if unknown:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: its weight average names {len(unknown)} tensors "
                                  f"the weights lack (e.g. {unknown[0]})")
        state.update({n: t.to(state[n].dtype) for n, t in ema.items()})
    state = without_heads(state)  # loss.self_distill's and loss.masked's heads are training parts
    meta = None
    if (ckpt / MODEL_CONFIG).is_file():
        try:
            meta = json.loads((ckpt / MODEL_CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {MODEL_CONFIG} is unreadable "
                                  f"({type(err).__name__})") from None
    if merge_lora and isinstance(meta, dict) and meta.get("lora"):  # a LoRA run's: the adapters merged in

        state = merge_state(state, meta["lora"])
    return state, meta


def _ema_of(ckpt: Path) -> Optional[Dict[str, Any]]:
    """The weight average's tensors by parameter name in `ckpt`, or None when the run kept none."""
    rank0 = rank_state_file(ckpt, 0)
    try:
        state = load_plain(rank0) if rank0.is_file() else {"ema": legacy_custom_states(ckpt).get(LEGACY_EMA)}
    except (OSError, RuntimeError, EOFError) as err:  # a truncated file; a pickled object is a CheckpointError
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {rank0.name} is unreadable "
                              f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    ema = state.get("ema") if isinstance(state, dict) else None
    shadow = ema.get("shadow") if isinstance(ema, dict) else None
    return shadow if isinstance(shadow, dict) else None


def set_aside(ckpt: Path) -> Path:
    """Rename a damaged checkpoint to ``damaged-<name>`` (``-2``, ``-3``... when taken); returns the new path."""
    target = ckpt.with_name(DAMAGED_PREFIX + ckpt.name)
    n = 1
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{DAMAGED_PREFIX}{ckpt.name}-{n}")
    os.replace(ckpt, target)
    return target


# ----------------------------------------------------------------------------------------------- writing
def state_bytes(model, optimizer_slots: int = 2) -> int:
    """Estimated bytes of one checkpoint: the parameters plus `optimizer_slots` float32 values per trainable one
    (AdamW keeps two moments)."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.requires_grad:
            total += optimizer_slots * p.numel() * 4
    return total


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def storage_error(err: BaseException, what: str, where: Path, needed: int = 0,
                  written: Optional[Path] = None) -> Optional[StorageError]:
    """The one-line error for a failed write of `what` into `where`, or None when `err` is not a storage fault.

    torch.save reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc...] unexpected pos``,
    and safetensors as ``SafetensorError: ... IoError(Os { code: 28, kind: StorageFull ...``, neither with the
    errno: when the free space is then below what was still to be written (`needed` minus the bytes already in
    `written`), the cause is reported as no space left on device.
    """
    code = getattr(err, "errno", None)
    probe = where if where.exists() else where.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    if isinstance(err, OSError) and code in _NO_SPACE or "StorageFull" in str(err) or (
            free is not None and needed and free < needed - (_dir_bytes(written) if written else 0)):
        room = f" ({_mb(free)} free, about {_mb(needed)} needed)" if free is not None and needed else ""
        return StorageError(f"cannot write {what} to {where}: no space left on device{room}")
    if isinstance(err, OSError):
        return StorageError(f"cannot write {what} to {err.filename or where}: {err.strerror or err}")
    if isinstance(err, RuntimeError) and ("inline_container" in str(err) or "file write failed" in str(err)):
        return StorageError(f"cannot write {what} to {where}: {str(err).splitlines()[0]}")
    return None


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def check_output_dir(out_dir: Path, ckpt_dir: Path) -> None:
    """Create `out_dir` and prove that it and `ckpt_dir` (when it exists) take a new file; StorageError if not."""
    d = out_dir
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for d in (out_dir, ckpt_dir):
            if d.is_dir():
                probe = d / f".write-test-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
    except OSError as err:
        where = d if d.exists() else err.filename or d  # the missing parent that could not be created, if any
        raise StorageError(f"output directory {where} cannot be written: {err.strerror or err} (choose another "
                           f"train.output_dir or make it writable)") from None


def free_space_warning(out_dir: Path, needed: int) -> Optional[str]:
    """A warning when the free space at `out_dir` is below one checkpoint of `needed` bytes, else None."""
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        return (f"warning: {_mb(free)} free at {out_dir}, below the {_mb(needed)} one checkpoint needs; "
                f"checkpoint saves will fail")
    return None


@contextlib.contextmanager
def _dir_fd(ckpt_dir: Path) -> Iterator[int]:
    """A descriptor of the run's checkpoints folder, opened without following a link (`fsutil.open_dir_inside`),
    checked to be the folder the path names now (else ConfigError: it was swapped during the run)."""
    fd = open_dir_inside(ckpt_dir.parent, ckpt_dir.name)
    try:
        now, held = os.stat(ckpt_dir), os.fstat(fd)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            inside(ckpt_dir.parent, ckpt_dir.name)  # raises for a link swapped in
            raise ConfigError(f"{ckpt_dir} was replaced while it was opened; nothing was deleted there")
        yield fd
    finally:
        os.close(fd)


def save_checkpoint(accelerator, ckpt_dir: Path, progress: Dict[str, int], rank_state: Dict[str, Any], keep: int,
                    agreed: Callable, needed: int = 0, model_meta: Optional[Dict[str, Any]] = None) -> Path:
    """All processes call this. Writes ``.tmp-step-N``, records sizes and SHA-256 of its files in COMPLETE,
    renames it to ``step-N``, moves ``latest`` and removes checkpoints beyond the newest `keep` (0: keep all).

    A write failure on any process (full disk, read-only) removes the temporary directory, leaves the previous
    checkpoints and ``latest`` as they were and raises `StorageError` on every process (through `agreed`, the
    training's ``agree.agreed(accelerator, fn)``: storage knows nothing of how processes agree). `needed` is the
    expected size in bytes (for the message). `model_meta` (``{"model_cfg", "preprocess_cfg"}``) is written as
    ``model_config.json``, so that the checkpoint alone is a model (`model_of_checkpoint`).

    Not `fsutil.atomic_dir`: the temporary directory is made by the main process, filled by every process and
    renamed by the main one in three agreed phases (one with-block cannot span them), a checkpoint directory
    holds no user files to keep, and its completeness is the COMPLETE marker, which resume checks.
    """

    main = is_main_process()
    name = f"{CKPT_PREFIX}{progress['step']:08d}"
    tmp = ckpt_dir / f".tmp-{name}"
    final = ckpt_dir / name
    what = f"checkpoint {name}"

    def start():
        if main:
            try:
                make_folder(ckpt_dir)
                with _dir_fd(ckpt_dir) as fd:  # relative to the folder itself: a link swapped in is never followed
                    shutil.rmtree(tmp.name, ignore_errors=True, dir_fd=fd)
                    os.mkdir(tmp.name, dir_fd=fd)
            except OSError as err:
                raise (storage_error(err, what, ckpt_dir) or err) from None

    def write():
        try:
            with _dir_fd(ckpt_dir):  # still the run's own folder, not a link swapped in since `start`
                pass
            accelerator.save_state(str(tmp))
            # Data position and loss queues differ per process; accelerate saves custom state on the main one only.
            torch.save(rank_state, rank_state_file(tmp, accelerator.process_index))
            if main and model_meta is not None:
                (tmp / MODEL_CONFIG).write_text(json.dumps(model_meta, indent=2) + "\n")
        except Exception as err:  # noqa: BLE001 - torch and safetensors wrap I/O errors in their own types
            converted = storage_error(err, what, ckpt_dir, needed, tmp)
            if converted is None:
                # accelerate writes by path: a folder swapped in the middle of its save fails there (its files'
                # parent is gone) and is named here in one line, as a swap found before the save is
                with _dir_fd(ckpt_dir):
                    pass
                raise
            raise converted from None

    def finish():
        if not main:
            return
        with _dir_fd(ckpt_dir) as fd:  # the marker, rename, `latest` and rotation: all inside the folder itself
            try:
                files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
                         for p in _files_of(tmp)}
                marker = {**progress, "world_size": accelerator.num_processes, "files": files}
                tmp_fd = os.open(tmp.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                try:
                    write_text_at(tmp_fd, COMPLETE, json.dumps(marker))
                finally:
                    os.close(tmp_fd)
                if name in os.listdir(fd):
                    shutil.rmtree(name, dir_fd=fd)  # a dir without a readable marker from an interrupted save
                os.replace(tmp.name, name, src_dir_fd=fd, dst_dir_fd=fd)
            except OSError as err:
                raise (storage_error(err, what, ckpt_dir, needed) or err) from None
            try:
                write_text_at(fd, LATEST, name)
            except OSError:
                pass  # the new checkpoint is complete; resume picks the newest complete one, whatever `latest` says
            here = set(os.listdir(fd))
            for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
                if old.name in here:
                    shutil.rmtree(old.name, ignore_errors=True, dir_fd=fd)

    try:
        agreed(accelerator, start)
        agreed(accelerator, write)
        agreed(accelerator, finish)
    except BaseException:
        if main:  # relative to the folder itself: a link swapped in is refused, and nothing is deleted through it
            with contextlib.suppress(OSError, ConfigError), _dir_fd(ckpt_dir) as fd:
                shutil.rmtree(tmp.name, ignore_errors=True, dir_fd=fd)
        raise
    return final
