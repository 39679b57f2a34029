"""Checks a training config's inputs before anything is built, so that a run fails in seconds, not at its end.

Every local path the run will read is checked: the training shards (each source of ``data.train``: a source of which no
shard exists, or, with ``data.require_all_shards``, any missing shard), the evaluation sets (each set of
``eval.zeroshot`` and ``eval.retrieval`` opened by the evaluation's own loader: an ImageFolder with an empty class
folder, a flat folder of images or a folder without images is refused here; class names, one per class folder;
templates; unique set names; ``eval.val_loss``'s shards), ``model.init_from``, ``model.name`` when it is an architecture
file (readable, an open_clip model config), ``model.pretrained`` (an open_clip tag known for ``model.name``; with
HF_HUB_OFFLINE=1, a hub name in the cache), ``distill.teacher`` and a local Hugging Face text tower (``model.text.hf``).
Remote shards (``pipe:``, ``http://``) and hub model names are not checked. Relative paths resolve against the current
directory, as everywhere in mmcl; the error shows them resolved, so a run started from another directory says where it
looked. A table (CSV, TSV, JSON lines, parquet) given as shards is refused naming ``mmcl shards``, and a global batch
larger than the data, where its size is known, with the numbers.
"""

from __future__ import annotations

import os
import shlex
import shutil
from typing import List, Optional, Tuple

from ..config import DataConfig, DistillConfig, EvalConfig, ModelConfig, data_workers
from ..data import has_scheme, missing_shards
from ..data.sizes import shard_samples
from ..data.sources import redact, split_spec
from ..data.sources import table_problem as table_line
from ..errors import ConfigError, DataError, file_problem
from ..evaluation.evaluate import reading_options
from ..evaluation.in_run import set_problems
from ..models.towers import arch_file_config, is_arch_file
from ..storage.pretrained import pretrained_problem

_SET_TRAIN = "set it with data.train=... (e.g. data.train='shards/shard-{000000..000009}.tar')"


def _is_hub_name(name: str) -> bool:
    """A Hugging Face hub id ('org/name' or 'name'), as opposed to a local path meant as one."""
    if name.startswith(("/", "./", "../", "~", ".\\")) or os.sep != "/" and os.sep in name:
        return False
    # 'models/minilm' where ./models exists is a path; 'sentence-transformers/all-MiniLM-L6-v2' is a hub id.
    return name.count("/") <= 1 and not os.path.isdir(name.split("/", 1)[0])


def _path_problem(key: str, path: str) -> List[str]:
    if has_scheme(path):
        return []
    problem = file_problem(os.path.expanduser(path), folder_ok=True)
    if problem is None:
        return []
    return [f"{key}: {os.path.abspath(os.path.expanduser(path))} "
            f"{'does not exist' if problem.startswith('not found') else problem}"]


def _pipe_problems(spec) -> List[str]:
    """``pipe:`` commands whose program is not installed (a missing gsutil would otherwise fail, be retried and
    skipped shard after shard)."""

    missing = {}
    try:
        urls = split_spec(spec, allow_pipe=True)  # a list file's commands, if not allowed, are reported elsewhere
    except (DataError, OSError):
        return []  # an unreadable spec: `missing_shards` says why
    for url in urls:  # the program is the same for every shard a braced command names
        if not url.startswith("pipe:"):
            continue
        try:
            words = shlex.split(url[len("pipe:"):])
        except ValueError:
            words = url[len("pipe:"):].split()
        program = next((w for w in words if "=" not in w), None)  # after VAR=value assignments
        if program and shutil.which(program) is None:
            missing.setdefault(program, url)
    return [f"data.train: the command '{program}' of {redact(url)} is not installed (not on PATH)"
            for program, url in missing.items()]


def input_problems(data: DataConfig, ev: EvalConfig, model: ModelConfig, distill: DistillConfig) -> List[str]:
    """Every missing input of a training run, one ``key: what`` entry each (empty when all are in place): the
    shards (``data``), the evaluation sets (``eval``), the model's files (``model``), the teacher (``distill``)."""
    problems = []
    if data.train is None or (isinstance(data.train, str) and not data.train.strip()):
        problems.append(f"data.train is not set: {_SET_TRAIN}")
    else:
        # Holes in a range (some shards missing) are trained around by the data layer, with one warning.
        problems += [f"data.train: {p}" for p in missing_shards(data.train, data.allow_pipe,
                                                                 require_all=data.require_all_shards)]
        problems += _pipe_problems(data.train)
    # Each evaluation set opened as its evaluation will open it, with its class names, templates and name.
    problems += set_problems(ev, reading_options(data))
    if model.init_from:
        problems += _path_problem("model.init_from", model.init_from)

    if is_arch_file(model.name):  # a model-config file: there, readable, an open_clip model config
        try:
            arch_file_config(model.name)
        except ConfigError as err:
            problems.append(str(err))
    if model.pretrained:  # a tag of model.name, a hub name cached when offline, or a local path

        problem = pretrained_problem(model.pretrained, model.name)
        problems += [f"model.pretrained: {problem}"] if problem else []
    if distill.teacher:
        problems += _path_problem("distill.teacher", distill.teacher)
    hf = model.text.hf
    if hf and not os.path.isdir(os.path.expanduser(hf)) and not _is_hub_name(hf):
        problems.append(f"model.text.hf: {os.path.abspath(os.path.expanduser(hf))} is not a directory (expected "
                        f"a local model directory or a hub name such as sentence-transformers/all-MiniLM-L6-v2)")
    return problems


def table_problem(spec) -> Optional[str]:
    """A table (the CSV open_clip trains from, or any table `mmcl shards` reads) named as a training source: the
    line that names the command making shards of it (`mmcl.data.sources.table_problem`)."""
    return table_line(spec)


def batch_problem(data: DataConfig, processes: int, batch: Tuple[int, int]) -> Optional[str]:
    """A global batch larger than the training data, where the data's size is known (``data.train_num_samples``,
    else the shards' counts, as `mmcl.training.plan.run_length` takes them): a contrastive batch would hold the same
    sample more than once, each copy a false negative of the other. `batch`: the run's (per-process batch,
    micro-batches), as `mmcl.training.plan.batch_plan` finds them."""
    batch, accum = batch
    if data.train_num_samples is not None:
        samples, source = data.train_num_samples, "data.train_num_samples"
    else:
        try:
            samples, source = shard_samples(data.train, data.allow_pipe, data.require_all_shards)
        except (DataError, OSError):
            return None  # not known before reading the data
    if batch * processes * accum <= samples:
        return None
    fits = samples // (processes * accum)
    return (f"the global batch of {batch * processes * accum} samples (data.batch_size={batch} x {processes} "
            f"process{'es' if processes > 1 else ''} x train.accum_steps={accum}) is larger than the data's "
            f"{samples} samples ({source}): one batch would hold the same samples twice, as false negatives of "
            f"each other; " + (f"set data.batch_size to at most {fits}" if fits else "use fewer processes or "
                                                                             "train.accum_steps, or more data"))


def check_inputs(data: DataConfig, ev: EvalConfig, model: ModelConfig, distill: DistillConfig, processes: int,
                 batch: Tuple[int, int]) -> None:
    """Raise one `ConfigError`: a table given as shards (`table_problem`), every missing input of the run (see
    `input_problems`), or a global batch of `processes` x `batch` (per-process batch, micro-batches) larger than the
    data (`batch_problem`)."""
    text = table_problem(data.train)
    problems = [] if text else input_problems(data, ev, model, distill)
    if problems:
        text = "; ".join(problems)
        if any(not p.startswith("data.train is not set") for p in problems):
            text = (f"missing input{'s' if len(problems) > 1 else ''} (relative paths resolve against the current "
                    f"directory, {os.getcwd()}): {text}")
    text = text or batch_problem(data, processes, batch)
    if not text:
        return
    err = ConfigError(text)
    err.everywhere = True  # every process of a launched run checks alike: the line shows once
    raise err


# Batches a DataLoader keeps in flight per worker (its default prefetch_factor), each in its own shared-memory segment.
PREFETCH = 2


def shared_memory_problem(batch_size: int, image_size, channels: int, bytes_per_value: int, workers: int,
                          processes: int = 1, prefetch: int = PREFETCH, path: str = "/dev/shm") -> Optional[str]:
    """The line to show when `path` (where data workers put each batch they send) has less free space than the
    batches in flight need: ``workers x prefetch`` batches of ``batch_size`` images per process, for the
    `processes` training processes of this machine. None when it has enough, when no worker runs, or where there
    is no such folder. A container's default (Docker: 64 MB) fails with a bus error or a worker killed mid-batch."""
    if workers <= 0 or not os.path.isdir(path):
        return None
    height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    batch_bytes = batch_size * channels * height * width * bytes_per_value
    need = batch_bytes * workers * prefetch * max(1, processes)
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free >= need:
        return None
    mb = 10 ** 6
    suggest = -(-int(need * 1.25) // 10 ** 9)  # GB, with a quarter to spare
    procs = f" x {processes} processes" if processes > 1 else ""
    return (f"{path} has {free // mb} MB free; data.workers={workers} with batches of {batch_size} images need about "
            f"{-(-need // mb)} MB ({prefetch} batches of {-(-batch_bytes // mb)} MB per worker{procs}): run docker "
            f"with --shm-size={suggest}g or lower data.workers/data.batch_size")


def check_shared_memory(data_cfg, image_size, uint8: bool, processes: int = 1) -> None:
    """Raise one `ConfigError` with `shared_memory_problem`'s line for this run's data settings (``data.*``)."""
    text = shared_memory_problem(data_cfg.batch_size, image_size, 3, 1 if uint8 else 4,
                                 data_workers(data_cfg.workers), processes)
    if text:
        err = ConfigError(text)
        err.everywhere = True
        raise err
