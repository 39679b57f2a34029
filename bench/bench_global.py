"""Does the global contrastive loss help at a small batch? InfoNCE and the global contrastive term on digits.

A small CLIP (`configs/tiny.yaml` narrowed to 2 layers of width 64 per tower, 32-d embedding, 16 px images in 4 px
patches, its own text transformer) is trained from scratch on scikit-learn's digits (`bench/lit_digits.py`: the
same shards, captions and held-out split) through `mmcl.training.loop.train`, the path of ``mmcl train``, for the
same number of steps in each arm:
  - ``clip@B``: InfoNCE (``loss.clip=1``) at the small batch B;
  - ``global@B``: the global contrastive term alone (``loss.global_contrastive.weight=1``, ``loss.clip=0``) at B,
    with SogCLR's constant gamma 0.9, and ``global-cos@B`` with FastCLIP's cosine decay of gamma from 1 to 0.2
    over half the run;
  - ``clip@4B``: InfoNCE at four times the batch (four times the samples per step: the large-batch target).
Every model is evaluated zero-shot on the held-out digits with the words "zero" .. "nine" and prompts that are not
training captions (`lit_digits.zeroshot`), for several seeds. All runs share one process (one torch import) and
one thread: the machine this was written on is a shared 2-core CPU.

    nice .venv/bin/python bench/bench_global.py --work-dir /tmp/bench-global [--batch-size 16] [--steps 600]
        [--seeds 0 1 2] [--arms clip global global-cos clip4x] [--n-train N]

Prints one JSON line per trained model, then a summary: per arm the mean top-1 and every seed's, its gap to
``clip@B`` and to ``clip@4B``, and the training samples/s. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lit_digits  # noqa: E402  (the same data and evaluation)

ARMS = ("clip", "global", "global-cos", "clip4x")


def arm_settings(arm: str, batch: int, steps: int, gamma: float, gamma_min: float, eps=None) -> tuple:
    """(batch size, config overrides) of one arm."""
    if arm == "clip":
        return batch, []
    if arm == "clip4x":
        return 4 * batch, []
    if arm in ("global", "global-cos"):
        keys = ["loss.clip=0", "loss.global_contrastive.weight=1.0",
                f"loss.global_contrastive.gamma={gamma if arm == 'global' else gamma_min}",
                # a few times the 1437 training samples: few samples share a slot (about 1 - exp(-1437/65536))
                "loss.global_contrastive.table_size=65536"]
        if eps is not None:
            keys.append(f"loss.global_contrastive.eps={eps}")
        if arm == "global-cos":
            keys += ["loss.global_contrastive.gamma_schedule=cosine",
                     f"loss.global_contrastive.gamma_decay_steps={max(1, steps // 2)}"]
        return batch, keys
    raise SystemExit(f"unknown arm {arm!r} (expected one of {', '.join(ARMS)})")


MODEL = ["model.vision_cfg={layers: 2, width: 64, head_width: 32, patch_size: 4}",
         "model.text_cfg={layers: 2, width: 64, heads: 2}", "model.embed_dim=32"]


def subset(work: Path, data: dict, n: int) -> dict:
    """The first `n` training pairs of `data` as their own shards: the papers' regime of many epochs over a small set.

    The split is shuffled and stratified, so its first `n` rows are a random draw with every digit in them.
    """
    import csv

    from PIL import Image

    from mmcl.shards.writer import write_shards

    with open(data["csv"], newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))[1:1 + n]
    out = work / f"shards-{n}"
    shutil.rmtree(out, ignore_errors=True)
    write_shards(({"key": Path(path).stem, "image": Image.open(path).convert("RGB"), "caption": caption}
                  for path, caption in rows), str(out), shard_size=500, prefix="train")
    return {**data, "n_train": len(rows), "shards": str(out / "train-*.tar")}


def train_arm(work: Path, data: dict, args, arm: str, seed: int) -> dict:
    """Train one arm in this process (`mmcl.training.loop.train`, the path ``mmcl train`` takes) and evaluate it."""
    import mmcl
    from mmcl.config import load_config
    from mmcl.training.loop import train

    batch, keys = arm_settings(arm, args.batch_size, args.steps, args.gamma, args.gamma_min, args.eps)
    out = work / f"{arm}-b{batch}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = [*MODEL, f"model.image_size={args.image_size}", f"model.context_length={args.context_length}",
                 f"data.train={data['shards']}", f"data.batch_size={batch}", f"data.workers={args.workers}",
                 "data.shuffle_buffer=2000", f"train.steps={args.steps}", f"train.output_dir={out}",
                 f"train.seed={seed}", f"train.save_every={args.steps}", "train.log_every=10", "train.plot=false",
                 "train.progress=false", f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}",
                 "eval.zeroshot=null", *keys]
    t0 = time.perf_counter()
    train(load_config("configs/tiny.yaml", overrides))
    seconds = time.perf_counter() - t0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    sps = [r["samples_per_s"] for r in rows[1:]] or [rows[-1]["samples_per_s"]]  # the first window warms up
    model, preprocess, tokenizer = mmcl.load(out)
    return {"arm": f"{arm.replace('clip4x', 'clip')}@{batch}", "seed": seed, "steps": args.steps,
            "batch": batch, "train_s": round(seconds, 1), "samples_per_s": round(float(np.median(sps)), 1),
            "final_loss": rows[-1]["loss"], "final_logit_scale": rows[-1]["logit_scale"],
            **lit_digits.zeroshot(model, preprocess, tokenizer, data),
            "command": "mmcl train --config configs/tiny.yaml " + " ".join(repr(o) if " " in o else o
                                                                       for o in overrides)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/bench-global")
    parser.add_argument("--image-size", type=int, default=16, help="digits are 8 x 8 pixels, upscaled to this")
    parser.add_argument("--context-length", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0, help="data.workers")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    parser.add_argument("--batch-size", type=int, default=16, help="the small batch B")
    parser.add_argument("--steps", type=int, default=600, help="optimiser steps of every arm")
    parser.add_argument("--gamma", type=float, default=0.9, help="the global arm's constant gamma (SogCLR's 0.9)")
    parser.add_argument("--gamma-min", type=float, default=0.2, help="where global-cos's gamma ends (FastCLIP's 0.2)")
    parser.add_argument("--eps", type=float, default=None,
                        help="loss.global_contrastive.eps of the global arms (default: null, 1/(batch - 1))")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the train/test split")
    parser.add_argument("--n-train", type=int, default=None,
                        help="train on the first N of the 1437 training pairs only (more epochs per step)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.chdir(lit_digits.ROOT)

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = lit_digits.make_data(work, args.image_size, args.data_seed)
    if args.n_train:
        data = subset(work, data, args.n_train)
    results = []
    for seed in args.seeds:
        for arm in args.arms:
            with contextlib.redirect_stdout(io.StringIO()):  # the runs' own progress lines
                res = train_arm(work, data, args, arm, seed)
            res.update(n_train=data["n_train"], n_test=data["n_test"], chance=0.1)
            print(json.dumps(res), flush=True)
            results.append(res)

    by_arm: dict = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    mean = {arm: float(np.mean([r["acc1"] for r in rs])) for arm, rs in by_arm.items()}
    small, large = f"clip@{args.batch_size}", f"clip@{4 * args.batch_size}"
    summary = {}
    for arm, rs in by_arm.items():
        summary[arm] = {"acc1_mean": round(mean[arm], 4), "acc1_per_seed": [round(r["acc1"], 4) for r in rs],
                        "mean_per_class_recall": round(float(np.mean([r["mean_per_class_recall"] for r in rs])), 4),
                        "samples_per_s": round(float(np.median([r["samples_per_s"] for r in rs])), 1),
                        "final_logit_scale": round(float(np.mean([r["final_logit_scale"] for r in rs])), 2)}
        if small in mean:
            summary[arm]["vs_" + small] = round(mean[arm] - mean[small], 4)
        if large in mean:
            summary[arm]["vs_" + large] = round(mean[arm] - mean[large], 4)
    print(json.dumps({"summary": summary, "steps": args.steps, "seeds": args.seeds, "n_train": data["n_train"],
                      "epochs_at_batch": round(args.steps * args.batch_size / data["n_train"], 1)}), flush=True)


if __name__ == "__main__":
    main()
