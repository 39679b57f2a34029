"""SigLIP 2's recipe against SigLIP alone, measured on scikit-learn's digits: zero-shot, retrieval and a dense probe.

Arms (`ARMS`, each a set of config overrides on ``configs/siglip.yaml``, all with the same small towers):
  - ``siglip``: the sigmoid loss alone;
  - ``caption``: + the captioning decoder (``model.name=coca_tiny``, ``loss.caption``);
  - ``stage2``: + self-distillation and masked prediction in the last 20 % of the steps (no decoder);
  - ``full``: + captioning, self-distillation and masked prediction, the last two in the last 20 % of the steps.
An arm whose keys or model this build does not have is reported "not available in this build" (`availability`)
and skipped; the others run.

Data (fixed for every arm and seed; `dense_probe.Digits`: every fifth digit held out):
  - training shards (``mmcl shards``' writer): scenes of one or two training digits pasted at random places and
    sizes on a coloured background, captioned with each digit and its place ("a seven at the top left and the
    numeral 3 at the right"), and a share of single digits filling the image ("a handwritten seven at the centre");
  - zero-shot: the held-out digits upscaled to the model's size (dark on white), class names "zero" .. "nine",
    prompts that are no training caption (`mmcl.evaluation.evaluate.zeroshot`);
  - retrieval: scenes of two held-out digits with their captions, as shards (`mmcl.evaluation.evaluate.retrieval`:
    R@5 image -> text and text -> image);
  - dense probe (`dense_probe.dense_probe`): scenes of 1-3 digits with per-pixel labels (digit class or
    background); a linear classifier on the frozen image tower's patch tokens of training-digit scenes, mIoU over
    the 11 classes on held-out-digit scenes.

Training runs through ``python -m mmcl train --config configs/siglip.yaml ...`` in a subprocess, each arm and seed
in its own run folder. ``--steps N`` trains every arm N steps (equal steps); ``--wall-seconds S`` gives every arm
the same seconds of training: a short timing run of each arm (``--timing-steps``, its phases in the run's
proportions) gives its seconds per step from the steps' own rates in metrics.jsonl, and the arm trains
S / (seconds per step) steps.

    nice .venv/bin/python bench/siglip2_digits.py --work-dir /tmp/bench-siglip2 [--arms siglip caption stage2 full]
        [--seeds 0 1 2] [--steps 600 | --wall-seconds 60] [--image-size 32] [--context-length 24] [--reuse]

Prints one JSON line per arm and seed (also in WORK/results.jsonl), then a Markdown table of the means ± standard
deviations over the seeds (also in WORK/summary.md). Not a test; CPU minutes per run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dense_probe  # noqa: E402  (the labelled scenes, patch tokens, the probe and mIoU)
from dense_probe import WORDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "siglip.yaml"
# The same small towers in every arm (coca_tiny's sizes): 2 blocks of width 64 each, 8 px patches, 64-d embedding.
TOWERS = ["model.vision_cfg={layers: 2, width: 64, head_width: 32, patch_size: 8}",
          "model.text_cfg={layers: 2, width: 64, heads: 2}", "model.embed_dim=64"]
# SigLIP 2's second stage (configs/siglip2.yaml's settings, its heads sized for a tiny model): self-distillation and
# masked prediction in the last 20 % of the steps, each weighed as the sigmoid loss.
STAGE2 = ["loss.self_distill.weight=1.0", "loss.self_distill.start_fraction=0.8", "loss.self_distill.prototypes=1024",
          "loss.self_distill.head_hidden=256", "loss.self_distill.head_bottleneck=64",
          "loss.self_distill.local_crops=4", "loss.masked.weight=1.0", "loss.masked.start_fraction=0.8",
          "loss.masked.mask_ratio=0.5", "loss.masked.prototypes=1024"]
# Each arm: the overrides it adds to configs/siglip.yaml and TOWERS. SigLIP 2 weighs the decoder's loss as the
# sigmoid loss.
ARMS: Dict[str, List[str]] = {
    "siglip": [],
    "caption": ["model.name=coca_tiny", "loss.caption=1.0"],
    "stage2": STAGE2,  # without the decoder: self-distillation and masked prediction alone
    "full": ["model.name=coca_tiny", "loss.caption=1.0", *STAGE2],
}
ZS_TEMPLATES = ["the number {}.", "a picture of a {}.", "{}"]  # none is a training caption


# ------------------------------------------------------------------------------------------------------- arms
def availability(overrides: List[str]) -> Tuple[bool, str]:
    """Whether this build can train an arm: its config loads (every key exists, every value passes the checks)
    and its model config resolves. (False, the reason) otherwise."""
    from mmcl import models
    from mmcl.config import load_config
    from mmcl.errors import MmclError

    try:
        cfg = load_config(str(CONFIG), [*TOWERS, *overrides])
        models.resolve_model_config(cfg.model)
    except MmclError as err:
        first = str(err).splitlines()[0]
        return False, first if len(first) <= 200 else first[:197] + "..."
    return True, ""


# ------------------------------------------------------------------------------------------------------- data
def make_data(work: Path, image_size: int, n_train: int, n_retrieval: int, n_probe_train: int, n_probe_test: int,
              full_frame: float, seed: int = 0) -> dict:
    """The training shards, the zero-shot ImageFolder, the retrieval shards and the probe's labelled scenes."""
    from mmcl.shards.writer import write_shards

    digits = dense_probe.Digits.load()
    rng = np.random.default_rng(seed)
    small = (image_size // 4, image_size // 2)
    out = {"n_train": n_train, "image_size": image_size}

    def training_samples():
        for n in range(n_train):
            if rng.random() < full_frame:
                img, _, text = dense_probe.scene(rng, digits, digits.train, image_size, 1, (image_size, image_size))
            else:
                img, _, text = dense_probe.scene(rng, digits, digits.train, image_size, int(rng.integers(1, 3)),
                                                 small)
            yield {"key": f"{n:06d}", "image": img, "caption": text}

    for d in ("shards", "retrieval", "zeroshot"):
        shutil.rmtree(work / d, ignore_errors=True)
    write_shards(training_samples(), str(work / "shards"), shard_size=1000, prefix="train")
    out["shards"] = str(work / "shards" / "train-*.tar")

    # Zero-shot: ImageFolder folders "0".."9" (sorted order = label), class names as words.
    zs = work / "zeroshot"
    for k in range(10):
        (zs / str(k)).mkdir(parents=True)
    for n, i in enumerate(digits.test):
        dense_probe.ink_image(digits.images[i], image_size).save(zs / str(int(digits.labels[i])) / f"{n:05d}.png")
    (zs / "classnames.txt").write_text("\n".join(WORDS) + "\n")
    (work / "templates.txt").write_text("\n".join(ZS_TEMPLATES) + "\n")
    out.update(test=str(zs), templates=str(work / "templates.txt"), n_zeroshot=len(digits.test))

    def retrieval_samples():
        for n in range(n_retrieval):
            img, _, text = dense_probe.scene(rng, digits, digits.test, image_size, 2, small)
            yield {"key": f"{n:06d}", "image": img, "caption": text}

    write_shards(retrieval_samples(), str(work / "retrieval"), shard_size=1000, prefix="test")
    out.update(retrieval=str(work / "retrieval" / "test-*.tar"), n_retrieval=n_retrieval)
    out["probe_train"] = dense_probe.labelled_set(rng, digits, digits.train, n_probe_train, image_size)
    out["probe_test"] = dense_probe.labelled_set(rng, digits, digits.test, n_probe_test, image_size)
    return out


# --------------------------------------------------------------------------------------------------- training
def train_command(arm: str, data: dict, args, seed: int, steps: int, out: Path, log_every: int) -> List[str]:
    return [sys.executable, "-m", "mmcl", "train", "--config", str(CONFIG), *TOWERS, *ARMS[arm],
            f"model.image_size={data['image_size']}", f"model.context_length={data['context_length']}",
            f"data.train={data['shards']}",
            f"data.batch_size={args.batch_size}", f"data.workers={args.workers}", "data.shuffle_buffer=2000",
            f"train.steps={steps}", f"train.output_dir={out}", f"train.seed={seed}", f"train.save_every={steps}",
            f"train.log_every={log_every}", "train.plot=false", "train.progress=false", "train.log_with=[]",
            f"optim.lr={args.lr}", f"optim.warmup_steps={min(args.warmup, max(steps // 5, 1))}",
            "eval.zeroshot=null"]


def run_training(cmd: List[str], out: Path, reuse: bool, threads: int = 1) -> Tuple[Optional[dict], str]:
    """Run a training command into `out` (replaced unless `reuse` finds the same command finished there).
    The run's torch uses `threads` threads (OMP_NUM_THREADS). Returns ({"train_s", "cpu_s"}, "") or (None, the
    error's last line)."""
    record = out.parent / f"{out.name}.done.json"
    if reuse and record.is_file() and (out / "model").exists():
        saved = json.loads(record.read_text())
        if saved["command"] == cmd:
            return saved, ""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        return None, (lines[-1] if lines else f"exit code {proc.returncode}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    saved = {"command": cmd, "train_s": round(seconds, 1), "cpu_s": round(cpu, 1)}
    record.write_text(json.dumps(saved))
    return saved, ""


def step_seconds(metrics: Path, batch_size: int) -> Tuple[float, float]:
    """(seconds per step over the run's logged windows after the first, the steps those windows cover), from
    metrics.jsonl's samples_per_s (each window's own rate; start-up and the first window left out)."""
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if "samples_per_s" in r]
    if len(rows) < 2:
        raise RuntimeError(f"{metrics}: too few logged steps to time ({len(rows)}); raise --timing-steps")
    total = steps = 0.0
    for prev, row in zip(rows, rows[1:]):
        n = row["step"] - prev["step"]
        total += n * batch_size / row["samples_per_s"]
        steps += n
    return total / steps, steps


def logged_train_seconds(metrics: Path, batch_size: int) -> float:
    """Seconds of training steps in a run (every logged window's steps over its own rate)."""
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    total, prev = 0.0, 0
    for row in rows:
        if "samples_per_s" in row:
            total += (row["step"] - prev) * batch_size / row["samples_per_s"]
            prev = row["step"]
    return total


# ------------------------------------------------------------------------------------------------- evaluation
def untrained(arm: str, data: dict, seed: int):
    """The arm's model at its initialisation (train.seed `seed`), with its evaluation transform and tokenizer: what
    the probe reads before any training."""
    import torch

    from mmcl import models
    from mmcl.config import load_config

    cfg = load_config(str(CONFIG), [*TOWERS, *ARMS[arm], f"model.image_size={data['image_size']}",
                                    f"model.context_length={data['context_length']}"])
    torch.manual_seed(seed)
    model, _, _, _, preprocess, tokenizer = models.build(cfg.model)
    return model, preprocess, tokenizer


def evaluate_model(model, preprocess, tokenizer, data: dict, probe_steps: int, seed: int) -> dict:
    from mmcl.evaluation import evaluate

    model.eval()
    zs = evaluate.zeroshot(model, preprocess, tokenizer, data["test"], classnames=WORDS,
                           templates=data["templates"], batch_size=128, progress=False)["metrics"]
    rt = evaluate.retrieval(model, preprocess, tokenizer, data["retrieval"], batch_size=128,
                            progress=False)["metrics"]
    dense = dense_probe.dense_probe(model, preprocess, data["probe_train"], data["probe_test"], steps=probe_steps,
                                    seed=seed)
    return {"zeroshot_top1": round(zs["acc1"], 4),
            "i2t_r5": round(rt["text_retrieval_recall@5"], 4), "t2i_r5": round(rt["image_retrieval_recall@5"], 4),
            **dense}


def evaluate_run(out: Path, data: dict, probe_steps: int, seed: int) -> dict:
    import mmcl

    return evaluate_model(*mmcl.load(out), data, probe_steps, seed)


METRICS = ["zeroshot_top1", "i2t_r5", "t2i_r5", "dense_miou", "dense_patch_acc", "steps", "train_s", "cpu_s"]


def summary_table(results: List[dict], arms: List[str], unavailable: Dict[str, str], failed: Dict[str, str]) -> str:
    """Markdown: one row per arm, each metric's mean ± standard deviation over its seeds (n - 1)."""
    head = ["arm", "seeds", *METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        mine = [r for r in results if r["arm"] == arm]
        if not mine:
            why = unavailable.get(arm) or failed.get(arm) or "no run"
            status = "not available in this build" if arm in unavailable else "failed"
            lines.append(f"| {arm} | - | {status}: {why.replace('|', '/')} |" + " |" * (len(METRICS) - 1))
            continue
        cells = []
        for key in METRICS:
            values = np.array([r[key] for r in mine], dtype=float)
            std = values.std(ddof=1) if len(values) > 1 else 0.0
            digits = 0 if key in ("steps", "train_s", "cpu_s") else 3
            cells.append(f"{values.mean():.{digits}f} ± {std:.{digits}f}")
        lines.append(f"| {arm} | {','.join(str(r['seed']) for r in mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/bench-siglip2")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600, help="steps of every arm (equal steps)")
    parser.add_argument("--wall-seconds", type=float, default=None,
                        help="equal wall time: every arm trains this many seconds of steps (steps from a timing run)")
    parser.add_argument("--timing-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--context-length", type=int, default=24,
                        help="text positions of every arm (the captions are under 20 tokens; the decoder's cost grows "
                             "with it)")
    parser.add_argument("--n-train", type=int, default=6000)
    parser.add_argument("--full-frame", type=float, default=0.8, help="share of training images of one whole digit")
    parser.add_argument("--n-retrieval", type=int, default=300)
    parser.add_argument("--n-probe-train", type=int, default=300)
    parser.add_argument("--n-probe-test", type=int, default=200)
    parser.add_argument("--probe-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the evaluation (this process)")
    parser.add_argument("--train-threads", type=int, default=1, help="torch threads of each training run")
    parser.add_argument("--reuse", action="store_true", help="evaluate finished runs of the same command again")
    parser.add_argument("--untrained", action="store_true",
                        help="also evaluate each arm's model at initialisation (arm name + '@init', 0 steps)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    unavailable: Dict[str, str] = {}
    for arm in args.arms:
        ok, why = availability(ARMS[arm])
        if not ok:
            unavailable[arm] = why
            print(json.dumps({"arm": arm, "status": "not available in this build", "reason": why}), flush=True)
    arms = [a for a in args.arms if a not in unavailable]
    data = make_data(work, args.image_size, args.n_train, args.n_retrieval, args.n_probe_train, args.n_probe_test,
                     args.full_frame)
    data["context_length"] = args.context_length
    mode = "equal steps" if args.wall_seconds is None else f"equal wall time ({args.wall_seconds:g} s)"
    steps_of = {arm: args.steps for arm in arms}
    failed: Dict[str, str] = {}
    if args.wall_seconds is not None:
        for arm in arms:
            out = work / f"timing-{arm}"
            cmd = train_command(arm, data, args, args.seeds[0], args.timing_steps, out, log_every=5)
            done, err = run_training(cmd, out, args.reuse, args.train_threads)
            if done is None:
                failed[arm] = err
                continue
            per_step, timed = step_seconds(out / "metrics.jsonl", args.batch_size)
            steps_of[arm] = max(1, round(args.wall_seconds / per_step))
            print(json.dumps({"arm": arm, "timing_s_per_step": round(per_step, 4), "timed_steps": timed,
                              "steps": steps_of[arm]}), flush=True)
    results = []
    with open(work / "results.jsonl", "a") as sink:
        for seed in args.seeds if args.untrained else []:
            for arm in arms:
                r = {"arm": f"{arm}@init", "seed": seed, "mode": "untrained", "steps": 0, "train_s": 0.0,
                     "cpu_s": 0.0, **evaluate_model(*untrained(arm, data, seed), data, args.probe_steps, seed)}
                print(json.dumps(r), flush=True)
                sink.write(json.dumps(r) + "\n")
                sink.flush()
                results.append(r)
        for seed in args.seeds:
            for arm in arms:
                if arm in failed:
                    continue
                out = work / f"{arm}-seed{seed}"
                cmd = train_command(arm, data, args, seed, steps_of[arm], out, log_every=max(steps_of[arm] // 20, 1))
                done, err = run_training(cmd, out, args.reuse, args.train_threads)
                if done is None:
                    failed[arm] = err
                    print(json.dumps({"arm": arm, "seed": seed, "status": "failed", "error": err}), flush=True)
                    continue
                rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
                r = {"arm": arm, "seed": seed, "mode": mode, "steps": steps_of[arm], "batch": args.batch_size,
                     "train_s": done["train_s"], "cpu_s": done["cpu_s"],
                     "step_s": round(logged_train_seconds(out / "metrics.jsonl", args.batch_size), 1),
                     "final_loss": rows[-1].get("loss"),
                     **evaluate_run(out, data, args.probe_steps, seed),
                     "command": " ".join(c if " " not in c else repr(c) for c in cmd[1:])}
                print(json.dumps(r), flush=True)
                sink.write(json.dumps(r) + "\n")
                sink.flush()
                results.append(r)
    shown = [*(f"{a}@init" for a in arms if args.untrained), *args.arms]
    table = summary_table(results, shown, unavailable, failed)
    head = (f"siglip2_digits, {mode}, batch {args.batch_size}, seeds {args.seeds}; zero-shot on "
            f"{data['n_zeroshot']} held-out digits (chance 0.10), retrieval R@5 over {data['n_retrieval']} held-out "
            f"scenes, dense probe mIoU over {dense_probe.N_CLASSES} classes on {args.n_probe_test} held-out scenes")
    (work / "summary.md").write_text(head + "\n\n" + table + "\n")
    print(head + "\n\n" + table, flush=True)


if __name__ == "__main__":
    main()
