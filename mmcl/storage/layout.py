"""A training run's folder (``train.output_dir``): the name of each thing in it, spelled here alone, and `RunLayout`,
the paths in one folder. A leaf: it imports nothing of mmcl, so every package that names a run's file takes the name
from here (tests/test_package_layout.py finds a second spelling)."""

from __future__ import annotations

from pathlib import Path
from typing import Union

MODEL = "model"  # the final model directory (`mmcl.storage.weights`)
CONFIG = "config.yaml"  # the config the run trains with
METRICS = "metrics.jsonl"  # one line per logged step
OUT_LOG = "out.log"  # what the main process printed
EVAL_RESULTS = "eval_results.json"  # the final evaluation's whole results, by kind and set name
PARAM_GROUPS = "param_groups.json"  # the optimiser's parameter groups
WISE_FT = "wise_ft"  # train.wise_ft's models, one per alpha, and its results
SKIP_LOG = "skipped.jsonl"  # every sample or shard left out, with its reason (also in `mmcl shards`' output)
LOCK = ".lock"  # held by the run that uses the folder (`mmcl.run.lock`)
MANIFEST = "mmcl-manifest.json"  # the record of a folder a command owns (`mmcl.storage.manifest`)
# The checkpoints (`mmcl.storage.checkpoints`): checkpoints/step-00000012/..., a `latest` pointer, each complete one
# marked by its COMPLETE file, a damaged one set aside under damaged-step-...
CHECKPOINTS_DIR = "checkpoints"
CKPT_PREFIX = "step-"
DAMAGED_PREFIX = "damaged-"
LATEST = "latest"
COMPLETE = "COMPLETE"


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
    skipped = property(lambda self: self.root / SKIP_LOG)
    lock = property(lambda self: self.root / LOCK)
