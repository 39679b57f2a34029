"""A training run's folder (``train.output_dir``): the name of each thing in it, spelled here alone, and `RunLayout`,
the paths in one folder. The checkpoints' folder is named with their layout (`checkpoints.CHECKPOINTS_DIR`), the
skip log with the skips (`mmcl.data.skips.SKIP_LOG`)."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from .checkpoints import CHECKPOINTS_DIR

MODEL = "model"  # the final model directory (`mmcl.storage.weights`)
CONFIG = "config.yaml"  # the config the run trains with
METRICS = "metrics.jsonl"  # one line per logged step
OUT_LOG = "out.log"  # what the main process printed
EVAL_RESULTS = "eval_results.json"  # the final evaluation's whole results, by kind and set name
PARAM_GROUPS = "param_groups.json"  # the optimiser's parameter groups
WISE_FT = "wise_ft"  # train.wise_ft's models, one per alpha, and its results


class RunLayout:
    """The paths of a run folder's files and folders."""

    def __init__(self, root: Union[str, Path]):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    model = property(lambda self: self.root / MODEL)
    checkpoints = property(lambda self: self.root / CHECKPOINTS_DIR)
    config = property(lambda self: self.root / CONFIG)
    metrics = property(lambda self: self.root / METRICS)
    out_log = property(lambda self: self.root / OUT_LOG)
    eval_results = property(lambda self: self.root / EVAL_RESULTS)
    param_groups = property(lambda self: self.root / PARAM_GROUPS)
    wise_ft = property(lambda self: self.root / WISE_FT)

    @property
    def skipped(self) -> Path:
        from ..data.skips import SKIP_LOG  # here, not above: the data package brings torch

        return self.root / SKIP_LOG
