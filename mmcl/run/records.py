"""Experiment trackers through accelerate (``train.log_with``: tensorboard, wandb, mlflow, aim).

accelerate's tracking API does the work: the Accelerator is created with ``log_with`` and the run directory as its
project directory, `start` calls ``init_trackers`` with the resolved config as hyperparameters, and `log` sends
each metrics record's scalars to every tracker (main process only; accelerate decorates its calls so). mmcl's own
record is metrics.jsonl (`MetricsLog`), written whichever trackers are on.

- tensorboard: event files in ``<output_dir>/tensorboard`` (a resumed run purges the events after its step);
- wandb: project, entity, run name, notes and tags from ``track.*`` (else WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME,
  WANDB_NOTES, WANDB_TAGS; else project ``mmcl``, the run named after the output directory), files under
  ``<output_dir>/wandb`` (``WANDB_MODE=offline`` works without an account);
- mlflow: experiment ``track.project`` (MLFLOW_EXPERIMENT_NAME first, else ``mmcl``), run name, description and
  tags from ``track.*``, in ``MLFLOW_TRACKING_URI``, or a local file store ``<output_dir>/mlruns``; metric
  names keep the characters mlflow accepts (``/`` becomes ``.``: its file store cannot hold both ``loss`` and
  ``loss/clip``; ``@`` becomes ``_at_``);
- aim: a repository in ``<output_dir>``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

from accelerate.tracking import TensorBoardTracker

from ..config import is_main_process
from ..data.sources import redact
from ..errors import ConfigError
from ..storage import checkpoints
from ..storage.fsutil import atomic_write_text, inside, open_inside
from ..storage.layout import RunLayout

PROJECT = "mmcl"


def check(names: List[str]) -> List[str]:
    """The ``train.log_with`` trackers whose package is not installed (the names themselves are
    `mmcl.config.TRACKERS`, checked by `mmcl.config.validate`; each is also its package's name)."""
    return [f"train.log_with: {name} is not installed (pip install {name})"
            for name in names if importlib.util.find_spec(name) is None]


def accelerator_kwargs(names: List[str], out_dir: Path) -> Dict[str, Any]:
    """``log_with`` and ``project_dir`` for the Accelerator (nothing when no tracker is asked for)."""
    problems = check(names)
    if problems:
        raise ConfigError("; ".join(problems))
    if not names:
        return {}

    # TensorBoard as an instance, so its events keep the run directory's ``tensorboard/`` (accelerate would name
    # the folder after the project) and a resumed run can purge the events after its step (see `start`).
    log_with = [TensorBoardTracker("tensorboard", str(out_dir)) if n == "tensorboard" else n for n in names]
    return {"log_with": log_with, "project_dir": str(out_dir)}


def hyperparameters(config: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """The resolved config as flat ``section.key`` scalars (lists, dicts and None as text), as trackers take them,
    with the credentials a ``pipe:`` command or URL may carry hidden (`mmcl.errors.redact`): a tracker's
    records travel to servers and colleagues."""

    out: Dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in ("model.vision_cfg", "model.text_cfg"):
            out.update(hyperparameters(v, key + "."))
        elif isinstance(v, (bool, int, float)):
            out[key] = v
        else:
            out[key] = redact(v if isinstance(v, str) else str(v))
    return out


def start(accelerator, names: List[str], config: Dict[str, Any], out_dir: Path, resume_step: int) -> None:
    """``init_trackers`` with the resolved config (main process; no-op without trackers)."""
    if not names or not is_main_process():
        return
    for tracker in accelerator.log_with:
        if getattr(tracker, "name", None) == "tensorboard" and resume_step:
            # Drop the events a killed run wrote after its checkpoint. The tracker was built before the resume step
            # was known and accelerate has no public way to give it a writer argument now: its init_kwargs, read
            # when init_trackers starts it (tests/test_dependency_names.py; accelerate's bound in pyproject).
            tracker.init_kwargs["purge_step"] = resume_step + 1
    project, init_kwargs = run_names(config.get("track") or {}, names, out_dir)
    if "mlflow" in names:
        import mlflow

        # accelerate's tracker reads the tracking URI from mlflow (its logging_dir is the artifact location). Without
        # MLFLOW_TRACKING_URI the run directory holds a local file store, which mlflow 3 accepts only when asked.
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (out_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
    (out_dir / "wandb").mkdir(parents=True, exist_ok=True) if "wandb" in names else None
    accelerator.init_trackers(project, config=hyperparameters(config), init_kwargs=init_kwargs)


def run_names(track: Dict[str, Any], names: List[str], out_dir: Path) -> Tuple[str, Dict[str, Dict[str, Any]]]:
    """The project and each tracker's ``init_kwargs`` from the ``track.*`` keys. A key left null leaves the tracker
    its own environment variable (wandb reads WANDB_ENTITY, WANDB_NOTES and WANDB_TAGS itself; accelerate gives
    MLFLOW_EXPERIMENT_NAME and MLFLOW_TAGS priority over its arguments), else mmcl's default: project ``mmcl``,
    the run named after its output folder."""
    project = track.get("project") or ("wandb" in names and os.environ.get("WANDB_PROJECT")) or PROJECT
    tags = track.get("tags")
    return project, {
        "wandb": {"name": track.get("run_name") or os.environ.get("WANDB_NAME") or out_dir.name,
                  "entity": track.get("entity"), "notes": track.get("notes"), "tags": tags, "dir": str(out_dir),
                  "resume": "allow"},
        "mlflow": {"run_name": track.get("run_name") or out_dir.name, "description": track.get("notes"),
                   "tags": None if tags is None else {t: "true" for t in tags}},
        "aim": {"logging_dir": str(out_dir)},
    }


_MLFLOW_BAD = re.compile(r"[^0-9A-Za-z_\-. ]")


def log(accelerator, record: Dict[str, Any]) -> None:
    """The record's numeric values (``step`` as the step) to every tracker; main process only."""
    if not is_main_process() or not getattr(accelerator, "trackers", None):
        return
    values = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    for tracker in accelerator.trackers:
        if tracker.name == "mlflow":
            tracker.log({_MLFLOW_BAD.sub("_", k.replace("@", "_at_").replace("/", ".")): v for k, v in values.items()},
                        step=record["step"])
        else:
            tracker.log(values, step=record["step"])


def finish(accelerator, stopped: bool = False) -> List[str]:
    """Flush and close every tracker (main process only), for a run that ends before `end_training`: a stop
    signal must not lose what a tracker still buffers, nor leave its run marked as running. With ``stopped``
    an MLflow run is ended as KILLED (the resumed run starts a new one). A tracker that fails to close does not
    stop the others; returns one line per failure for the caller to print."""
    problems = []
    if not is_main_process():
        return problems
    for tracker in list(getattr(accelerator, "trackers", None) or []):
        try:
            if stopped and tracker.name == "mlflow":
                import mlflow

                mlflow.end_run(status="KILLED")
            else:
                tracker.finish()
        except Exception as err:  # a tracker's own failure; the run's records in metrics.jsonl are safe
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            problems.append(f"warning: tracker {tracker.name} did not close: {detail}")
    accelerator.trackers = []
    return problems


class MetricsLog:
    """metrics.jsonl (flushed each line, so it can be tailed) plus the ``train.log_with`` trackers through
    accelerate (`mmcl.run.records`); main process only."""

    def __init__(self, out_dir: Path, resume_step: int, enabled: bool, accelerator=None):
        self.enabled = enabled
        self.path = RunLayout(out_dir).metrics
        self.accelerator = accelerator
        if not enabled:
            return
        try:
            if inside(out_dir, self.path.name).exists():  # a resumed run continues the file without duplicated steps
                kept = [ln for ln in self.path.read_text().splitlines()
                        if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
                atomic_write_text(self.path, "".join(ln + "\n" for ln in kept))
            self.file = os.fdopen(open_inside(out_dir, self.path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")
        except OSError as err:
            raise checkpoints.storage_error(err, "metrics", out_dir) from None

    def write(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as err:  # a full disk or quota while training: one line, the checkpoints are untouched
            raise checkpoints.storage_error(err, "metrics", self.path.parent) from None
        if self.accelerator is not None:
            log(self.accelerator, record)

    def close(self) -> None:
        if self.enabled:
            self.file.close()


@dataclasses.dataclass(frozen=True)
class RunRecords:
    """Where a run's records go, opened once when it starts or resumes: metrics.jsonl and the trackers
    (`MetricsLog`) and, on the main process, out.log (`mmcl.run.folder.ConsoleLog`; None elsewhere)."""

    metrics: MetricsLog
    console: Any = None
