"""The evaluations a training run makes: its named sets, when each is due, their check before step 1, the
validation loss, and the results by name.

``eval.zeroshot`` and ``eval.retrieval`` each hold one set or a list of named sets with their own frequency
(`mmcl.config.eval_sets`), as big_vision's evaluators do; ``eval.val_loss`` scores held-out shards with the run's
own objective, as open_clip's ``--val-data``. A set's results are logged as ``eval/<task>/<name>/<metric>`` (the
task as the results JSON names it: ``zeroshot_classification``, ``zeroshot_retrieval``) and the validation loss
as ``val/loss`` and ``val/<term>`` (with ``data.negatives``, the held-out negative captions' scores as
``val/negatives/...``). Every set is opened by the same loader (`mmcl.data.build_eval_dataset`) here,
in ``mmcl zeroshot`` and in the check before step 1, so all three say the same about a broken set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import data as data_mod
from .. import losses, models
from ..config import EvalConfig, EvalSet, duplicate_set_names, eval_sets, is_main_process
from ..data.sources import redact_values
from ..errors import ConfigError, DataError, file_problem
from .evaluate import (
    AUTO_TEMPLATES,
    dataset_name,
    eval_batches,
    eval_loader,
    input_dtype,
    is_template_name_or_text,
    load_templates,
    resolve_classnames,
    retrieval,
    zeroshot,
)

VAL_PREFIX = "val/"  # the validation loss's metric keys: val/loss, val/loss/<term>, val/<metric>
NEGATIVES_PREFIX = "negatives/"  # and of its scores with the data's negative captions: val/negatives/loss, ...
# The top-level keys of the end-of-run results (eval_results.json): one per kind of evaluation, then set names
RESULT_KINDS = ("zeroshot", "retrieval", "val_loss")


def set_name(s: EvalSet) -> str:
    """The name a set's results go under: its own, else its data's (`evaluate.dataset_name`: a file's stem, else
    its folder)."""
    return s.name if s.name is not None else dataset_name(s.data)


def named_sets(ev: EvalConfig) -> List[EvalSet]:
    """``eval.zeroshot`` then ``eval.retrieval`` as `EvalSet` items, every one named. Raises `ConfigError` (one line)
    when two sets of a task end up with the same name: their results would overwrite each other."""
    sets, problems = eval_sets(ev)
    sets = [dataclasses.replace(s, name=set_name(s)) for s in sets]
    problems += duplicate_set_names(sets)
    if problems:
        raise ConfigError("; ".join(dict.fromkeys(problems)))
    return sets


def val_loss_every(ev: EvalConfig) -> int:
    """Steps between validation losses: ``eval.val_loss_every``, else ``eval.every`` (0: at the end only)."""
    return ev.every if ev.val_loss_every is None else ev.val_loss_every


def has_evaluation(ev: EvalConfig) -> bool:
    """Whether the run evaluates anything (sets or the validation loss)."""
    return bool(ev.zeroshot or ev.retrieval or ev.val_loss)


def due(ev: EvalConfig, step: Optional[int]) -> Tuple[List[EvalSet], bool]:
    """The sets to evaluate after optimiser step `step` (1-based; the run's periodic evaluations, `any_due`) and
    whether the validation loss is due too, each on its own ``every``; `step` None is the final evaluation, of
    everything."""
    sets = named_sets(ev) if (ev.zeroshot or ev.retrieval) else []
    if step is None:
        return sets, bool(ev.val_loss)
    every = val_loss_every(ev)
    return ([s for s in sets if s.every and step % s.every == 0],
            bool(ev.val_loss) and bool(every) and step % every == 0)


def any_due(ev: EvalConfig, step: int, total: int) -> bool:
    """Whether a periodic evaluation falls after step `step` (before the last; the last has the final one)."""
    if step >= total or not has_evaluation(ev):
        return False
    every = [s.every for s in eval_sets(ev)[0]] + ([val_loss_every(ev)] if ev.val_loss else [])
    return any(e and step % e == 0 for e in every)


# ------------------------------------------------------------------------------------------------- checks
def _file_problem(key: str, path: str) -> List[str]:
    problem = file_problem(os.path.expanduser(path), folder_ok=True)
    if problem is None:
        return []
    return [f"{key}: {os.path.abspath(os.path.expanduser(path))} "
            f"{'does not exist' if problem.startswith('not found') else problem}"]


def _is_local(spec: Any) -> bool:
    return isinstance(spec, str) and not data_mod.has_scheme(spec)


def _data_problems(where: str, data: Any, task: str, reading: Dict[str, Any]) -> Tuple[List[str], Any]:
    """Open a set's data as the evaluation will (`build_eval_dataset`, no transform): (its problems, the dataset
    or None)."""
    missing = data_mod.missing_shards(data, reading.get("allow_pipe", False))
    folder = os.path.expanduser(data) if _is_local(data) else None
    if missing and not (folder and os.path.isdir(folder)):
        return [f"{where}: {p}" for p in missing], None
    try:
        ds = data_mod.build_eval_dataset(data, None, **reading)
    except DataError as err:
        return [f"{where}: {err}"], None
    if task != "zeroshot" and isinstance(ds, data_mod.ImageFolderDataset):
        what = "retrieval" if task == "retrieval" else "a validation loss"
        return [f"{where}: {data} is an ImageFolder, which has no captions ({what} needs shards with captions, "
                f"KEY.txt)"], None
    if missing and not isinstance(ds, data_mod.ImageFolderDataset):  # a directory whose shards are not there
        return [f"{where}: {p}" for p in missing], None
    return [], ds


def set_problems(ev: EvalConfig, reading: Optional[Dict[str, Any]] = None) -> List[str]:
    """Every problem of the run's evaluation sets, found before step 1 without a model: each set opened as the
    evaluation opens it (an ImageFolder with an empty class folder, a flat folder of images, a folder with no images
    or shards, missing shards), a zero-shot set's class names (one per class folder) and templates, the files they
    name, and set names that collide. One ``<key>: <what>`` entry each."""
    reading = dict(reading or {})
    problems: List[str] = []
    try:
        sets = named_sets(ev)
    except ConfigError as err:
        return [str(err)]
    files: Dict[str, str] = {}  # classnames and templates files to check, by path, with the first key naming them
    for s in sets:
        # A file named by eval.classnames / eval.templates is reported under that key, a set's own under the set's.
        names_key = "eval.classnames" if s.classnames == ev.classnames else f"{s.where}.classnames"
        templates_key = "eval.templates" if s.templates == ev.templates else f"{s.where}.templates"
        if s.classnames:
            files.setdefault(s.classnames, names_key)
        if s.task == "zeroshot" and not is_template_name_or_text(s.templates):
            files.setdefault(s.templates, templates_key)
        elif s.task == "zeroshot" and s.templates != AUTO_TEMPLATES:  # a set's name or one template, read as the
            try:                                                      # evaluation reads it
                load_templates(s.templates)
            except DataError as err:
                problems.append(f"{templates_key}: {err}")
        found, ds = _data_problems(s.where, s.data, s.task, reading)
        problems += found
        if ds is None or s.task != "zeroshot":
            continue
        if s.classnames and not os.path.isfile(os.path.expanduser(s.classnames)):
            continue  # reported below with the other missing files
        try:
            resolve_classnames(s.data, ds, os.path.expanduser(s.classnames) if s.classnames else None)
        except DataError as err:
            problems.append(f"{names_key if s.classnames else s.where}: {err}")
    if ev.val_loss:
        problems += _data_problems("eval.val_loss", ev.val_loss, "val_loss", reading)[0]
    for path, key in files.items():
        found = _file_problem(key, path)
        problems += found
        if not found and key.endswith("templates"):
            try:
                load_templates(os.path.expanduser(path))
            except DataError as err:
                problems.append(f"{key}: {err}")
    return problems


# ------------------------------------------------------------------------------------------------- running
def run_sets(sets: List[EvalSet], model, preprocess, tokenizer, ev: EvalConfig, device, keys=None,
             reading: Optional[Dict[str, Any]] = None, results: Optional[Dict[str, Any]] = None,
             model_name: str = "") -> Dict[str, float]:
    """Evaluate `sets` in order; returns their ``eval/<task>/<name>/<metric>`` entries and, into `results`
    (``{"zeroshot": {name: result}, "retrieval": {...}}``), each set's whole result in CLIP_benchmark's shape with
    ``dataset`` its name and ``model`` `model_name` (a run's folder)."""
    out: Dict[str, float] = {}
    for s in sets:
        if s.task == "zeroshot":
            res = zeroshot(model, preprocess, tokenizer, s.data, classnames=s.classnames, templates=s.templates,
                           batch_size=ev.batch_size, device=device, progress=False, keys=keys, reading=reading,
                           model_name=model_name)
        else:
            res = retrieval(model, preprocess, tokenizer, s.data, batch_size=ev.batch_size, device=device,
                            progress=False, keys=keys, reading=reading, model_name=model_name)
        res = dict(res, dataset=s.name, data=redact_values(s.data))
        out.update({f"eval/{res['task']}/{s.name}/{k}": v for k, v in res["metrics"].items()})
        if results is not None:
            results.setdefault(s.task, {})[s.name] = res
    return out


def _forward(model, objective, images: torch.Tensor, tokens: torch.Tensor):
    """Features, scale, bias and the sample terms' per-sample sums and counts (the captioning term's: the
    objective's `sample_losses` of the model's output dict), detached, in float32."""
    out = model(images, tokens)
    samples = {name: losses.SampleLosses(v.sums.detach().float(), v.counts.detach().float())
               for name, v in objective.sample_losses(out).items()}
    return out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"), samples


@torch.no_grad()
def validation_loss(model, objective, data, preprocess, tokenizer, batch_size: int, device="cpu",
                    chunk: int = 128, keys=None, reading: Optional[Dict[str, Any]] = None,
                    autocast: Callable = contextlib.nullcontext, negatives: int = 0) -> Dict[str, Any]:
    """The objective averaged over held-out shards: open_clip's validation loss with the run's own loss terms.

    The shards are read once in order; their samples form consecutive batches of `batch_size` (the run's global
    batch, so the loss is on the scale of the training loss; the last batch may be smaller), each scored as one
    contrastive problem by `objective` without gathering (the main process scores the global batch), averaged over
    samples as open_clip does; a sample term (the captioning term of a CoCa model) scores each batch from its
    samples' sums and counts, as in training (the terms scored on a training step's own views, SigLIP 2's
    self-distillation and masked prediction, are not in the validation objective). The towers run in chunks of
    `chunk` samples under `autocast` without gradient; the caller puts `model` and `objective` in eval mode (a fresh
    objective: MoCHi's queue stays untouched). A sample's caption is its ``.txt`` (with several caption sources in
    `keys`, the first caption); samples without an image or a caption are skipped and counted.

    With `negatives` > 0 (the run's ``data.negatives``) the samples' negative captions are read as training reads
    them (at most that many each, the same ones at every evaluation) and, where the shards carry any, scored
    apart from the pairs, so that ``loss`` stays comparable with a run without negatives: ``negatives/loss`` and
    ``negatives/loss/<term>`` are the objective with each negative as a column of its own image's row (as the
    run trains, `mmcl.losses.data_negatives`), and ``negatives/accuracy`` is the share of the negatives that their
    image scores below its own caption (NegCLIP's test); ``n_negatives`` counts them.

    Returns:
        ``{"dataset", "task": "val_loss", "metrics": {"loss", "loss/<term>", ..., ["negatives/loss", ...]},
        "n_samples", "n_batches", "n_skipped", "skipped": {reason: count}, ["n_negatives"]}``.
    """
    ds, loader = eval_loader(data, preprocess, chunk, 0, keys, reading, negatives=negatives)
    if isinstance(ds, data_mod.ImageFolderDataset):
        raise DataError(f"{data} is an ImageFolder, which has no captions (a validation loss needs shards with "
                        f"captions, KEY.txt)")
    several = keys is not None and len(keys.caption_keys) > 1
    dtype = input_dtype(model)
    sums: Dict[str, float] = {}
    # (image, text, label features, the sample terms' sums and counts[, the negatives' (n, K, D) features, their
    # (n, K) mask]) per chunk
    pending: List[Tuple[Any, ...]] = []
    counts = {"samples": 0, "batches": 0, "negatives": 0, "below": 0}
    skipped: Dict[str, int] = {}
    scale = bias = None

    def score(img: torch.Tensor, txt: torch.Tensor, lab: torch.Tensor, samples: Dict[str, Any],
              *neg: torch.Tensor) -> None:
        # the global batch on one process: no gathering; the sample terms (captioning) from their sums and counts
        _, terms = objective(img, txt, scale, bias, lab, True, samples=samples)
        n = img.shape[0]
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + float(v) * n
        if neg:
            _, terms = objective(img, txt, scale, bias, lab, False, negatives=losses.DataNegatives(*neg),
                                 samples=samples)
            for k, v in terms.items():
                if k == "loss" or k.startswith("loss/"):
                    sums[f"{NEGATIVES_PREFIX}{k}"] = sums.get(f"{NEGATIVES_PREFIX}{k}", 0.0) + float(v) * n
            feats, valid = neg
            below = (img[:, None, :] * feats).sum(2) < (img * txt).sum(1, keepdim=True)
            counts["negatives"] += int(valid.sum())
            counts["below"] += int((below & valid).sum())
        counts["samples"] += n
        counts["batches"] += 1

    def flush(final: bool) -> None:
        while pending and (final or sum(p[0].shape[0] for p in pending) >= batch_size):
            parts = [torch.cat([p[i] for p in pending]) if i != 3 else
                     {name: losses.joined(p[3][name] for p in pending) for name in pending[0][3]}
                     for i in range(len(pending[0]))]
            n = parts[0].shape[0]

            def rows(x, start, stop):
                return {k: v.rows(start, stop) for k, v in x.items()} if isinstance(x, dict) else x[start:stop]

            score(*(rows(x, 0, batch_size) for x in parts))
            pending.clear()
            if n > batch_size:
                pending.append(tuple(rows(x, batch_size, n) for x in parts))

    batches = eval_batches(loader)
    try:
        for images, labels, captions, _, problems, negs in batches:
            for problem in problems:
                if isinstance(problem, data_mod.EvalFailure):
                    raise problem.error
                skipped[problem.reason] = skipped.get(problem.reason, 0) + 1
            if images is None:
                continue
            texts = [c.splitlines()[0] if several and c.strip() else c for c in captions]
            keep = [i for i, t in enumerate(texts) if t.strip()]
            if len(keep) < len(texts):
                skipped["missing_caption"] = skipped.get("missing_caption", 0) + len(texts) - len(keep)
            if not keep:
                continue
            negs = [negs[i] for i in keep] if negatives > 0 else []
            # The negatives' tokens after the captions', in one text forward (as a training step encodes them).
            tokens = tokenizer([texts[i] for i in keep] + [t for ns in negs for t in ns]).to(device)
            with autocast():
                img, txt, scale, bias, samples = _forward(model, objective, images[keep].to(device=device, dtype=dtype),
                                                          tokens)
            chunk_parts = (img.float(), txt[:len(keep)].float(), labels[keep].to(device), samples)
            if negatives > 0:
                valid = torch.arange(negatives)[None, :] < torch.tensor([len(ns) for ns in negs])[:, None]
                slots = valid.reshape(-1).nonzero().squeeze(1).to(device)
                feats = txt.new_zeros((valid.numel(), txt.shape[1])).float()
                feats = feats.index_copy(0, slots, txt[len(keep):].float()).reshape(*valid.shape, -1)
                chunk_parts += (feats, valid.to(device))
            pending.append(chunk_parts)
            flush(final=False)
        flush(final=True)
    finally:
        batches.close()
    if not counts["negatives"]:  # no negatives in these shards: their entries would repeat the pairs' loss
        sums = {k: v for k, v in sums.items() if not k.startswith(NEGATIVES_PREFIX)}
    if not counts["samples"]:
        raise DataError(f"the validation data {data} holds no sample with an image and a caption"
                        + (f" (skipped: {', '.join(f'{k}={v}' for k, v in sorted(skipped.items()))})"
                           if skipped else ""))
    metrics = {k: v / counts["samples"] for k, v in sums.items()}
    extra: Dict[str, Any] = {}
    if counts["negatives"]:
        metrics[f"{NEGATIVES_PREFIX}accuracy"] = counts["below"] / counts["negatives"]
        extra["n_negatives"] = counts["negatives"]
    return {"dataset": dataset_name(data), "task": "val_loss", "metrics": metrics, "n_samples": counts["samples"],
            "n_batches": counts["batches"], "n_skipped": sum(skipped.values()), "skipped": skipped, **extra}


def val_entries(res: Dict[str, Any]) -> Dict[str, float]:
    """A validation loss's metrics-record entries: ``val/loss``, ``val/loss/<term>`` and ``val/<metric>``."""
    return {f"{VAL_PREFIX}{k}": v for k, v in res["metrics"].items()}


@dataclasses.dataclass(frozen=True)
class RunEvaluation:
    """How a training run evaluates, fixed when it is set up: its ``eval`` section, the training data's sample
    members (`keys`) and reading limits (`reading`) the sets are read with, the validation loss's objective (a fresh
    one from ``loss.*`` each time, `make_objective`, reseeded with `seed`), the per-process batch it falls back on,
    the name results give the model, and the negative captions per sample the validation loss reads."""

    ev: EvalConfig
    keys: Any
    reading: Dict[str, Any]
    make_objective: Callable[[], Any]
    seed: int
    batch_size: int
    model_name: str
    negatives: int = 0  # data.negatives: the validation loss reads that many negative captions per sample


def naflex_views(ev: EvalConfig, pp_cfg: Dict[str, Any], sets: List[EvalSet]) -> List[Tuple[list, Any]]:
    """With several ``eval.naflex_seq_len``: each length's (sets named ``<name>@<length>``, transform at that
    length); else nothing (the sets at the model's own transform)."""
    lengths = list(ev.naflex_seq_len)
    if len(lengths) < 2 or not pp_cfg.get("naflex_seq_len"):
        return []
    return [([dataclasses.replace(s, name=f"{s.name}@{n}") for s in sets],
             models.build_transforms(dict(pp_cfg, naflex_seq_len=int(n)))[1]) for n in lengths]


def run_eval(evaluation: RunEvaluation, model, tokenizer, pp_cfg, accelerator, step: Optional[int] = None,
             global_batch: Optional[int] = None, results: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """The evaluations due after optimiser step `step` (None: the final one, every set), on the main process:
    returns their ``eval/<task>/<name>/<metric>`` and ``val/...`` entries, and puts each whole result into
    `results` by kind and name. The validation loss scores batches of `global_batch` (the run's) with a fresh
    objective in eval mode, so the training objective's state is untouched."""
    out: Dict[str, float] = {}
    ev = evaluation.ev
    if not is_main_process() or not has_evaluation(ev):
        return out
    sets, val_due = due(ev, step)
    if not sets and not val_due:
        return out
    _, eval_tf = models.build_transforms(pp_cfg)
    views = naflex_views(ev, pp_cfg, sets) or [(sets, eval_tf)]
    keys, reading = evaluation.keys, evaluation.reading
    was_training = model.training
    model.eval()
    try:
        with accelerator.autocast():  # the run's mixed precision, as the validation loss and open_clip evaluate
            for view_sets, view_tf in views:
                out.update(run_sets(view_sets, model, view_tf, tokenizer, ev, accelerator.device, keys=keys,
                                    reading=reading, results=results, model_name=evaluation.model_name))
        if val_due:
            objective = evaluation.make_objective()
            objective.reseed(evaluation.seed)  # MoCHi's mixing draws: the same at every evaluation
            objective.to(accelerator.device).eval()
            res = validation_loss(model, objective, ev.val_loss, eval_tf, tokenizer,
                                  global_batch or evaluation.batch_size, accelerator.device, chunk=ev.batch_size,
                                  keys=keys, reading=reading, autocast=accelerator.autocast,
                                  negatives=evaluation.negatives)
            out.update(val_entries(res))
            if results is not None:
                results["val_loss"] = res
    finally:
        model.train(was_training)
    return out
