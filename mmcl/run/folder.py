"""A run folder holds one run: the rule `mmcl train` applies to ``train.output_dir`` before it writes anything, the
run's record, the end-of-run summary, and ``out.log``.

The rule (`decide`, printed in one line at start):

* a missing or empty folder (a ``.lock`` left alone counts as empty) starts a run;
* a folder holding this run resumes it. This run means: the folder's record (``mmcl-manifest.json``, command
  ``train``; for folders written before the record, a ``config.yaml`` beside an mmcl checkpoint or model) and a
  ``config.yaml`` equal to this config apart from `RESUME_KEYS`. ``data.batch_size`` and ``train.accum_steps`` may
  differ where the global batch stays the run's, and the same per-process values on another number of processes
  are the same run (`mmcl.training.plan.batch_plan` then keeps the global batch);
* this run, finished (``model/`` saved at or after the last step), is reported finished and nothing is touched;
* a folder whose run stopped before step 1 (no checkpoint, no model, no metrics record: nothing to resume) is
  taken over by the next run, which says so with the differences;
* a folder with another run is refused in one line naming the differences and the two ways on: another
  ``train.output_dir``, or ``train.resume=force`` (resume despite them; ``config.yaml`` then records the new
  config, which trains the weights from there on);
* a folder with files ``mmcl train`` did not write is refused, whatever ``train.resume`` says: nothing of the
  user's is overwritten.

``config.yaml`` is written when a run starts (or is forced on), never on a plain resume: it holds the config the
saved weights were trained with. Changes of resume keys are said in the start line (and so in ``out.log``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from omegaconf import OmegaConf

from ..config import TrainConfig, moved_keys_carried, to_dict
from ..data.skips import counts_text, describe, first_records
from ..data.sources import redact_values
from ..errors import ConfigError, MmclError, RunStopped, TrainingError, preview
from ..storage import checkpoints
from ..storage.fsutil import atomic_write_text, inside, open_inside, unlink_inside
from ..storage.layout import (
    CHECKPOINTS_DIR,
    CONFIG,
    EVAL_RESULTS,
    LOCK,
    MANIFEST,
    METRICS,
    MODEL,
    OUT_LOG,
    PARAM_GROUPS,
    SKIP_LOG,
    WISE_FT,
    RunLayout,
)
from ..storage.weights import CONFIG_FILE
from .lock import in_use

COMMAND = "train"
GLOBAL_BATCH = "global_batch"  # recorded in each checkpoint's COMPLETE marker and in the run's record
# The files of its own that the run writes at the top of its folder (the record lists them)
RUN_FILES = (CONFIG, PARAM_GROUPS, METRICS, OUT_LOG, EVAL_RESULTS, SKIP_LOG)

# Config keys that may change when a run is resumed: how long it trains, how it logs, saves, reads and evaluates;
# none of them changes what a step computes. (docs/reliability.md lists them.) A section name means every key in it.
RESUME_KEYS = ("train.steps", "train.samples", "train.epochs", "data.train_num_samples", "train.output_dir",
               "train.resume", "train.log_every", "train.save_every", "train.keep_checkpoints", "train.progress",
               "train.plot", "train.log_with", "track",
               "train.dist_timeout_s", "train.compile", "eval", "data.workers", "data.worker_nice", "data.retries",
               "data.retry_delay", "data.read_timeout")
BATCH_KEYS = ("data.batch_size", "train.accum_steps")  # free while the global batch stays the run's
_WHOLE = ("model.vision_cfg", "model.text_cfg", "model.text")  # compared as a whole


def flat(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{dotted key: value} of a config dict; open_clip's tower overrides stay whole."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in _WHOLE:
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out


def may_change_on_resume(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_KEYS)


@dataclass
class Decision:
    """What `decide` found: ``start``, ``resume`` or ``finished``, the line that says so, whether config.yaml and
    the record are (re)written, and for a finished run its last metrics record."""

    action: str
    line: str
    write_config: bool = False
    last: Dict[str, Any] = field(default_factory=dict)
    stale_skips: bool = False  # the skip log of an earlier attempt that never trained: `clear_stale_skips`


def _entries(out: Path) -> List[str]:
    return sorted(n for n in os.listdir(out) if n != LOCK)


def read_record(out: Path) -> Optional[Dict[str, Any]]:
    """The run's record in `out` (its ``data``), or None when there is none; ConfigError when the folder's
    manifest names another mmcl command."""
    try:
        meta = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("command") != COMMAND:
        if isinstance(meta.get("command"), str):
            raise ConfigError(f"train.output_dir {out} holds the output of mmcl {meta['command']}, not a training "
                              f"run; nothing was changed: choose another train.output_dir")
        return None
    return meta.get("data") if isinstance(meta.get("data"), dict) else {}


def write_record(out: Path, processes: int, global_batch: int) -> None:
    """Claim `out` for this run (atomically; beside config.yaml, which it vouches for)."""
    meta = {"command": COMMAND, "files": sorted(RUN_FILES),
            "data": {"processes": processes, GLOBAL_BATCH: global_batch}}
    atomic_write_text(out / MANIFEST, json.dumps(meta, indent=1, sort_keys=True) + "\n")


def refuse_links(out: Path) -> None:
    """ConfigError (`mmcl.storage.fsutil.inside`) for a symbolic link, device or FIFO among the run folder's entries
    and those of its model and checkpoint folders: a run folder from elsewhere is never a way out of it."""
    if not out.is_dir():
        return
    for name in os.listdir(out):
        inside(out, name)
    for sub in (MODEL, CHECKPOINTS_DIR, WISE_FT):
        if (out / sub).is_dir():
            for name in os.listdir(out / sub):
                inside(out, f"{sub}/{name}")


def _model_steps(out: Path) -> Optional[int]:
    """The step model/ was saved at (its config's ``mmcl.steps``), or None when there is no readable model/."""

    try:
        meta = json.loads((RunLayout(out).model / CONFIG_FILE).read_text(encoding="utf-8"))
        return int(meta["mmcl"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _newest_marker(out: Path) -> Optional[Dict[str, Any]]:
    ckpt = checkpoints.latest_checkpoint(RunLayout(out).checkpoints)
    if ckpt is None:
        return None
    try:
        return checkpoints.read_marker(ckpt)
    except (ValueError, OSError):
        return None


def _legacy_run(out: Path) -> bool:
    """A folder written by mmcl train before it kept a record: config.yaml beside an mmcl checkpoint or model/."""
    return RunLayout(out).config.is_file() and (_newest_marker(out) is not None or _model_steps(out) is not None)


def saved_config(out: Path) -> Optional[Dict[str, Any]]:
    """The run's config.yaml as a dict, or None when it is missing or unreadable."""
    if not RunLayout(out).config.is_file():
        return None

    try:
        c = OmegaConf.to_container(OmegaConf.load(RunLayout(out).config))
    except Exception:  # noqa: BLE001 - an unreadable config.yaml is reported by the caller
        return None

    return moved_keys_carried(c) if isinstance(c, dict) else None


def saved_global_batch(out: Path, saved: Optional[Dict[str, Any]], record: Optional[Dict[str, Any]]
                       ) -> Optional[int]:
    """The run's global batch: the record's (written with config.yaml), else the newest checkpoint's, else (folders
    written before either recorded it) config.yaml's per-process batch times the checkpoint's processes and
    accumulation."""
    if record and record.get(GLOBAL_BATCH):
        return int(record[GLOBAL_BATCH])
    marker = _newest_marker(out) or {}
    if marker.get(GLOBAL_BATCH):
        return int(marker[GLOBAL_BATCH])
    if saved is None or "world_size" not in marker:
        return None
    try:
        return (int(saved["data"]["batch_size"]) * int(marker["world_size"])
                * int(saved["train"].get("accum_steps", 1)))
    except (KeyError, TypeError, ValueError):
        return None


def _fmt(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(saved: Dict[str, Any], current: Dict[str, Any], saved_global: Optional[int], processes: int
                ) -> Tuple[List[str], List[str]]:
    """(differences that make another run, changes a resume may make), each as ``key old -> new``.

    Keys of this config only: a key added to mmcl after the run started counts as its default there, and one since
    removed is not compared."""

    b = flat(current)
    a = {**flat(to_dict(TrainConfig())), **flat(saved)}
    other, allowed = [], []
    batch_same = all(a.get(k) == b.get(k) for k in BATCH_KEYS)
    try:
        global_now = int(b["data.batch_size"]) * processes * int(b.get("train.accum_steps", 1))
    except (KeyError, TypeError, ValueError):
        global_now = None
    for k in sorted(b):
        if a.get(k) == b.get(k):
            continue
        what = f"{k} {_fmt(a.get(k))} -> {_fmt(b.get(k))}"
        if k in BATCH_KEYS:
            if batch_same:
                continue
            if saved_global is not None and global_now == saved_global:
                allowed.append(what)  # another split of the same global batch
            else:
                other.append(what + (f" (a global batch of {global_now}, the run's is {saved_global})"
                                     if saved_global is not None else ""))
        elif may_change_on_resume(k):
            allowed.append(what)
        else:
            other.append(what)
    return other, allowed


def _last_record(out: Path) -> Dict[str, Any]:
    try:
        lines = [ln for ln in RunLayout(out).metrics.read_text().splitlines() if ln.strip()]
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}


def length_key(train: Dict[str, Any]) -> str:
    """The key that decides a run's length (the ``train`` section as plain values): train.epochs, else
    train.samples, else train.steps."""
    return next((f"train.{k}" for k in ("epochs", "samples") if train.get(k) is not None), "train.steps")


def _stale_skips(out: Path) -> str:
    """The words for the skip log an earlier attempt left in `out` before it trained a step ('' when none)."""
    try:
        with open(RunLayout(out).skipped, "rb") as f:
            records = sum(1 for _ in f)
    except OSError:
        return ""
    return f"; its {RunLayout(out).skipped.name} ({records} records of that attempt) is cleared" if records else ""


def clear_stale_skips(out: Path) -> None:
    """Remove the skip log an earlier attempt that never trained left in the run folder `out` (the name is unlinked:
    another link to the file keeps it)."""
    try:
        unlink_inside(out, RunLayout(out).skipped.name)
    except FileNotFoundError:
        pass


def decide(config: Dict[str, Any], processes: int, total: Union[int, Callable[[], int]]) -> Decision:
    """Apply the rule to ``train.output_dir`` of the run configured by `config` (the config as plain values,
    `mmcl.config.to_dict`) for `total` steps on `processes` processes (a callable is asked only where the folder holds
    a saved model, since counting a run's steps may read the data). Reads only.

    Raises ConfigError (one line, nothing changed) for a folder with another run or with files mmcl train did not
    write."""
    out = Path(config["train"]["output_dir"])
    refuse_links(out)
    busy = in_use(out)
    if busy:  # another run is starting or training there: its files are its own, whatever they hold yet
        raise TrainingError(busy)
    if not out.is_dir() or not _entries(out):  # a path that is a file: check_output_dir names it
        return Decision("start", f"{out}: a new run", write_config=True)
    record = read_record(out)
    if record is None and not _legacy_run(out):
        raise ConfigError(f"train.output_dir {out} holds files mmcl train did not write ({preview(_entries(out))}); "
                          f"nothing was changed: choose another train.output_dir (a new or empty folder starts a "
                          f"run)")
    force = config["train"].get("resume", "auto") == "force"
    saved = saved_config(out)
    marker = _newest_marker(out)
    step = int(marker["step"]) if marker else 0
    if saved is None:
        if marker is None and _model_steps(out) is None:  # claimed, then stopped before it wrote its config
            stale = _stale_skips(out)
            return Decision("start", f"{out}: a new run (the folder holds no training yet){stale}", write_config=True,
                            stale_skips=bool(stale))
        if not force:
            raise ConfigError(f"train.output_dir {out} holds a run at step {step} whose {CONFIG} is missing or "
                              f"unreadable, so it cannot be compared with this config; nothing was changed: "
                              f"choose another train.output_dir, or set train.resume=force to resume it with this "
                              f"config")
        other, allowed = ["config.yaml missing"], []
    else:
        current = redact_values(config)  # config.yaml holds no credentials either
        other, allowed = differences(saved, current, saved_global_batch(out, saved, record), processes)
    if other and not force and marker is None and _model_steps(out) is None and not _last_record(out):
        stale = _stale_skips(out)
        return Decision("start", f"taking over {out}: its last run stopped before step 1 (config differences: "
                                 f"{'; '.join(other)}){stale}", write_config=True, stale_skips=bool(stale))
    if other and not force:
        raise ConfigError(f"train.output_dir {out} holds another run (step {step}): {'; '.join(other)}; nothing was "
                          f"changed: choose another train.output_dir for a new run, or set train.resume=force to "
                          f"resume this one with the new config")
    model_steps = _model_steps(out)
    if model_steps is not None and callable(total):
        total = total()
    if model_steps is not None and model_steps >= total and (marker is None or step <= model_steps):
        return Decision("finished", f"{out} holds this run, finished at step {model_steps} of {total} (the model "
                                    f"is in {RunLayout(out).model}); nothing to do, nothing was changed: raise "
                                    f"{length_key(config['train'])} to train on, or choose another "
                                    f"train.output_dir for a new run",
                        last=_last_record(out))
    of = f" of {total}" if isinstance(total, int) else ""
    stale = "" if marker or model_steps is not None or _last_record(out) else _stale_skips(out)
    how = (f"{out} holds this run (step {step}{of}): resuming it" if marker
           else f"{out} holds this run, not trained yet: starting it{stale}")
    if allowed:
        how += "; changed on resume: " + ", ".join(allowed)
    if other:
        how += "; train.resume=force, resuming despite: " + "; ".join(other)
    return Decision("resume", how, write_config=bool(other) or marker is None or record is None,
                    stale_skips=bool(stale))


# ------------------------------------------------------------------------------------------------ summary
def summary_lines(steps: int, samples: int, seconds: float, trained: int, skipped_samples: int,
                  skipped_steps: int, final: Dict[str, Any], model_dir: Path, skipped_shards: int = 0,
                  skips: Optional[Dict[str, int]] = None) -> List[str]:
    """The end-of-run summary: progress and throughput, skipped data (samples and shards apart; `skips` by reason,
    with the first records of the run's skip log), the final evaluation by set, the model."""
    rate = trained / max(seconds, 1e-9)
    lines = [f"run finished: {steps} steps, {samples} samples ({trained} in {seconds:.1f} s, {rate:.1f} samples/s); "
             f"skipped: {skipped_samples} samples, {skipped_shards} shards, {skipped_steps} steps"]
    if skips and any(skips.values()):
        log = model_dir.parent / SKIP_LOG
        examples = "; ".join(describe(r) for r in first_records(log))
        lines.append(f"skipped by reason: {counts_text(skips)} (each in {log}" +
                     (f"; first: {examples})" if examples else ")"))
    sets: Dict[str, List[str]] = {}
    for key, value in final.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "eval":
            sets.setdefault(f"{parts[1]} {parts[2]}", []).append(f"{parts[3]} {value:.4f}")
    for name, metrics in sets.items():
        lines.append(f"final evaluation, {name}: {', '.join(metrics)}")
    if isinstance(final.get("val/loss"), (int, float)):  # eval.val_loss
        lines.append(f"final validation loss: {final['val/loss']:.4f}")
    lines.append(f"model: {model_dir} (mmcl.load, mmcl zeroshot/export --model {model_dir.parent})")
    return lines


# ------------------------------------------------------------------------------------------------ out.log
class ConsoleLog:
    """A copy of what this process prints (stdout and stderr) in the run folder's ``out.log``, appended on resume,
    as open_clip's ``out.log``. Lines only: a progress bar's redraws (carriage returns) leave their last state.

    Text printed before the folder is taken is held and written when `attach` opens the file."""

    def __init__(self):
        self.file = None
        self.held: List[str] = []
        self._saved: Optional[Tuple[Any, Any]] = None

    def start(self) -> "ConsoleLog":
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)
        return self

    def attach(self, path: Path) -> None:
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            self.file = os.fdopen(open_inside(path.parent, path.name, flags), "a", encoding="utf-8",
                                  errors="backslashreplace")
            self.file.write(f"--- mmcl train, {time.strftime('%Y-%m-%d %H:%M:%S')}\n" + "".join(self.held))
            self.file.flush()
        except OSError:
            self.file = None  # the console still has it all; a failing disk is reported by the saves
        self.held = []

    def line(self, text: str) -> None:
        if self.file is not None:
            try:
                self.file.write(text + "\n")
                self.file.flush()
            except OSError:
                pass
        else:
            self.held.append(text + "\n")

    def stop(self, exc_type=None, exc=None, tb=None) -> bool:
        """Restore the streams and close the file; the line the command line prints after this for an mmcl error
        or a stop is written to the file too."""
        if self._saved is not None:
            for tee in (sys.stdout, sys.stderr):
                if isinstance(tee, _Tee) and tee.pending.strip():
                    self.line(tee.pending.rsplit("\r", 1)[-1])
            sys.stdout, sys.stderr = self._saved
            self._saved = None
        if isinstance(exc, MmclError):  # (the main process's log: it says every error)
            self.line(f"mmcl: error: {exc}")
        elif isinstance(exc, RunStopped):
            self.line(f"mmcl: {exc}")
        if self.file is not None:
            self.file.close()
            self.file = None
        return False


class _Tee:
    """A text stream writing through to `stream` and, line by line, to a `ConsoleLog`."""

    def __init__(self, stream, log: ConsoleLog):
        self.stream, self.log, self.pending = stream, log, ""

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            self.log.line(line.rsplit("\r", 1)[-1].rstrip())
        if "\r" in self.pending:  # a bar redrawn in place: only its newest state can still end as a line
            self.pending = self.pending.rsplit("\r", 1)[-1]
        return n

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding... of the console stream
        return getattr(self.stream, name)
