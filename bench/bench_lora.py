"""LoRA against full fine-tuning: trainable parameters, peak memory and samples/s of a training step, then zero-shot
accuracy on scikit-learn's digits after fine-tuning a model that has never seen digits.

Step costs (``--steps``): each arm (full, LoRA) runs in its own process on mmcl's tiny CLIP (configs/tiny.yaml's
model at ``--image-size``), random batches of ``--batch-size``, AdamW: forward, loss, backward, update. Memory is the
process's peak resident set (``resource.getrusage``'s ru_maxrss, which counts torch's CPU allocations; tracemalloc
would see only Python's objects), given as it is and as its growth over the resident set after the model is built.

Fine-tuning (``--digits``): a base model is trained through ``mmcl train`` on mmcl's demo data (coloured shapes, no
digits), then fine-tuned on the digits' training split (`lit_digits.make_data`) with all weights training and with
``model.lora.r``, the same steps and schedule; each is evaluated zero-shot on the held-out digits with the class
names as words (`lit_digits.zeroshot`), as is the base model.

    nice .venv/bin/python bench/bench_lora.py --work-dir /tmp/bench-lora [--digits] [--epochs 6]

Prints one JSON line per measurement and a summary. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lit_digits  # noqa: E402  (the digits data and the zero-shot evaluation)

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def step_costs(arm: str, args) -> dict:
    """One arm's trainable parameters, peak RSS and samples/s (this process)."""
    import torch

    from mmcl import models
    from mmcl.config import load_config
    from mmcl.models import lora
    from mmcl.training.step import objective_from_config

    torch.manual_seed(0)
    overrides = [f"model.image_size={args.image_size}", f"model.lora.r={args.r if arm == 'lora' else 0}"]
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), overrides)
    model, *_ = models.build(cfg.model)
    if arm == "lora":
        lora.apply_lora(model, cfg.model.lora)
    built = _rss_mb()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    objective = objective_from_config(cfg.loss)
    model.train()
    times = []
    for s in range(args.steps):
        g = torch.Generator().manual_seed(s)
        image = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
        text = torch.randint(1, 49000, (args.batch_size, 32), generator=g)
        t0 = time.perf_counter()
        out = model(image, text)
        loss, _ = objective(out["image_features"], out["text_features"], out["logit_scale"], None)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    peak = _rss_mb()
    return {"arm": arm, "trainable": sum(p.numel() for p in params),
            "total": sum(p.numel() for p in model.parameters()), "peak_rss_mb": round(peak, 1),
            "rss_growth_mb": round(peak - built, 1),
            "samples_per_s": round(args.batch_size / statistics.median(times[2:] or times), 1)}


def _train(cmd_extra, out: Path, args, log: Path) -> float:
    cmd = [sys.executable, "-m", "mmcl", "train", "--config", "configs/tiny.yaml",
           f"model.image_size={args.image_size}",
           "model.context_length=16", f"data.batch_size={args.batch_size}", "data.workers=1",
           f"train.output_dir={out}", "train.log_every=10", "train.plot=false", "train.progress=false",
           "eval.zeroshot=null", *cmd_extra]
    return lit_digits.run(cmd, log, args.reuse, out / "model")


def digits(args) -> list:
    """The base model's, full fine-tuning's and LoRA's zero-shot accuracy on the held-out digits."""
    import mmcl
    from mmcl.shards.demo import make_demo_data

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = lit_digits.make_data(work / "digits", args.image_size, seed=0)
    demo = work / "demo-data"
    if not (demo / "train").is_dir():
        make_demo_data(str(demo), n_train=4000, n_val=100, image_size=args.image_size, progress=False)
    base = work / "base"
    _train([f"data.train={demo}/train/shard-*.tar", f"train.steps={args.base_steps}", "optim.lr=1e-3",
            f"train.save_every={args.base_steps}"], base, args, work / "base.log")
    steps = args.epochs * (data["n_train"] // args.batch_size)
    rows = [{"arm": "base (demo shapes only)", **lit_digits.zeroshot(*mmcl.load(base), data)}]
    arms = [("full", args.full_lr, [])]
    arms += [("lora", lr, [f"model.lora.r={args.r}", "optim.weight_decay=0"]) for lr in args.lora_lr]
    for (arm, lr, extra), seed in [(a, s) for a in arms for s in args.seeds]:
        out = work / f"ft-{arm}-lr{lr:g}" if seed == 0 else work / f"ft-{arm}-lr{lr:g}-seed{seed}"
        if not args.reuse:
            shutil.rmtree(out, ignore_errors=True)
        extra = [f"optim.lr={lr}", f"train.seed={seed}", *extra]
        seconds = _train([f"data.train={data['shards']}", f"model.init_from={base}", f"train.steps={steps}",
                          f"train.save_every={steps}", "optim.warmup_steps=20", *extra], out, args,
                         work / f"{out.name}.log")
        metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        sps = [r["samples_per_s"] for r in metrics[1:]] or [metrics[-1]["samples_per_s"]]
        rows.append({"arm": f"{arm} lr {lr:g}", "seed": seed, "steps": steps, "train_s": round(seconds, 1),
                     "samples_per_s": round(statistics.median(sps), 1),
                     **lit_digits.zeroshot(*mmcl.load(out), data)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/bench-lora")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per arm")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--digits", action="store_true", help="also fine-tune on digits and evaluate zero-shot")
    parser.add_argument("--base-steps", type=int, default=150)
    parser.add_argument("--epochs", type=int, default=4, help="fine-tuning epochs on the digits")
    parser.add_argument("--full-lr", type=float, default=3e-4)
    parser.add_argument("--lora-lr", type=float, nargs="+", default=[2e-3, 1e-2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="fine-tuning seeds (train.seed) per arm")
    parser.add_argument("--reuse", action="store_true", help="take finished earlier runs")
    parser.add_argument("--no-costs", action="store_true", help="skip the step costs (with --digits)")
    parser.add_argument("--arm", choices=["full", "lora"], help=argparse.SUPPRESS)  # one arm, in its own process
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(step_costs(args.arm, args)), flush=True)
        return
    costs, summary = [], {}
    for arm in () if args.no_costs else ("full", "lora"):
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--arm", arm], capture_output=True,
                              text=True, check=True, cwd=ROOT)
        costs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(costs[-1]), flush=True)
    if costs:
        summary = {"trainable_ratio": round(costs[1]["trainable"] / costs[0]["trainable"], 4),
                   "rss_growth_ratio": round(costs[1]["rss_growth_mb"] / max(costs[0]["rss_growth_mb"], 1e-9), 3),
                   "speed_ratio": round(costs[1]["samples_per_s"] / costs[0]["samples_per_s"], 3)}
    if args.digits:
        by_arm = {}
        for row in digits(args):
            print(json.dumps(row), flush=True)
            by_arm.setdefault(row["arm"], []).append(row["acc1"])
        for arm, accs in by_arm.items():  # the mean over the seeds, and each seed's
            summary[f"acc1 {arm}"] = {"mean": round(statistics.mean(accs), 4), "seeds": accs}
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
