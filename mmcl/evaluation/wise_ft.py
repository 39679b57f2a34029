"""WiSE-FT (Wortsman et al. 2022) as a command: interpolated models written and evaluated zero-shot.

`mmcl.storage.interpolate` writes ``(1 - alpha) * initial + alpha * fine-tuned`` for each alpha as a model folder;
here each one is evaluated with the zero-shot evaluation of ``mmcl zeroshot`` when a set is given, and the results
of all alphas go to one JSON file, ``wise_ft.json`` in the output folder (`mmcl interpolate`). With
``train.wise_ft`` a run does the same at its end, between its initial and final weights (`wise_ft_of_run`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..storage.fsutil import atomic_write_text
from ..storage.interpolate import write_alphas, write_interpolations
from ..storage.layout import RunLayout
from ..storage.weights import load, load_model_dir
from .evaluate import zeroshot

RESULTS_FILE = "wise_ft.json"


def wise_ft(init, finetuned, alphas: Sequence[float], out_dir, data: Optional[str] = None,
            classnames=None, templates: str = "auto", batch_size: int = 128, workers: int = 0, device="cpu",
            keys=None, progress: bool = True) -> Dict[str, Any]:
    """Write the model of each alpha under ``out_dir/alpha_<a>/`` and, with `data` (an ImageFolder or labelled
    shards, as ``mmcl zeroshot --data``), evaluate each zero-shot. Returns the results, also written to
    ``out_dir/wise_ft.json``: ``{"task": "wise_ft", "from", "to", "dataset", "results": [{"alpha", "model",
    "metrics"}, ...]}`` (``metrics`` only with `data`), in the order of `alphas`."""
    written, manifest = write_interpolations(init, finetuned, alphas, out_dir)
    results = []
    for alpha, folder in written:
        entry: Dict[str, Any] = {"alpha": alpha, "model": str(folder)}
        if data is not None:

            model, preprocess, tokenizer = load(folder)
            res = zeroshot(model, preprocess, tokenizer, data, classnames=classnames, templates=templates,
                           batch_size=batch_size, workers=workers, device=device, progress=progress,
                           model_name=str(folder), keys=keys)
            entry.update(metrics=res["metrics"], n_samples=res["n_samples"])
        results.append(entry)
    out = {"task": "wise_ft", "from": manifest.data["from"], "to": manifest.data["to"], "dataset": data,
           "results": results}
    manifest.will_write([RESULTS_FILE])
    atomic_write_text(Path(out_dir) / RESULTS_FILE, json.dumps(out, indent=2) + "\n")
    return out


def wise_ft_of_run(init_state, start: str, model, model_cfg: Dict[str, Any], pp_cfg: Dict[str, Any],
                   alphas: Sequence[float], out_dir, evaluate: Callable[[Any], Dict[str, float]]) -> List[str]:
    """``train.wise_ft`` at the end of a run: each alpha between the run's initial weights `init_state` (named by
    `start`, as ``mmcl interpolate`` names them) and its final
    `model` (not changed) written under ``out_dir/wise_ft/alpha_<a>/`` and scored by `evaluate` (the run's final
    evaluation, every set); results in ``out_dir/wise_ft/wise_ft.json``. Returns the lines to log."""

    folder = RunLayout(out_dir).wise_ft  # the alphas' models and wise_ft.json
    device = next(model.parameters()).device
    work = copy.deepcopy(model).to("cpu")
    written, manifest = write_alphas(init_state, model_cfg, work, model_cfg, pp_cfg, alphas, folder,
                                     {"from": start, "to": str(RunLayout(out_dir).model)})
    del work
    results, lines = [], []
    for alpha, alpha_dir in written:

        alpha_model, _, _ = load_model_dir(alpha_dir)
        with torch.no_grad():
            metrics = evaluate(alpha_model.to(device))
        del alpha_model
        results.append({"alpha": alpha, "model": str(alpha_dir), "metrics": metrics})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if k.endswith("acc1"))
        lines.append(f"WiSE-FT alpha {alpha:g}: {alpha_dir}" + (f" ({shown})" if shown else ""))
    out = {"task": "wise_ft", "from": manifest.data["from"], "to": manifest.data["to"], "results": results}
    manifest.will_write([RESULTS_FILE])
    atomic_write_text(folder / RESULTS_FILE, json.dumps(out, indent=2) + "\n")
    return lines
