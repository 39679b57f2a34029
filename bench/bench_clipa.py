"""CLIPA token-reduction phases (train.phases, configs/clipa.yaml) against the same model trained at full size.

Two parts, in one run, on CPU:

1. Cost. The model of configs/clipa.yaml (tiny: 64 px, patch 8, 32 tokens), one training step at each phase's sizes
   (forward, backward and the AdamW update, the code a run executes) on real batches from the data stream:
   FLOPs (torch.utils.flop_counter.FlopCounterMode), the step's samples/s (median of interleaved rounds), and the
   data loader's samples/s at that phase (2 workers, decoding and cropping at the phase's size), which must keep
   up with the step. Then the FLOPs of the whole schedule against the same steps at full size.
2. Quality at equal compute. For each data set and seed: a run at full size for ``--fixed-steps`` steps, and a
   CLIPA run whose steps are as many as the same FLOPs buy (its phases in the config's proportions), both through
   ``mmcl train`` with everything else equal. Each is evaluated on held-out data: zero-shot top-1 and, where the
   set has distinct captions, retrieval recall. Data: scikit-learn's digits (`lit_digits.make_data`; its captions
   name only the class, so no retrieval there) and a synthetic-shapes set from `mmcl.shards.demo` with another seed
   (zero-shot on colour and shape, retrieval on its held-out shards).

    .venv/bin/python bench/bench_clipa.py --work-dir /tmp/clipa-bench [--seeds 0 1 2] [--fixed-steps 20]
                                          [--batch 32] [--threads 1] [--cost-only]

Prints one JSON line per measurement and run, then a summary. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lit_digits  # noqa: E402  (the digits data and its zero-shot evaluation)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "clipa.yaml"


def phase_sizes(cfg):
    """[(fraction of the steps, image size, context length, patch dropout)] of the config's phases, resolved."""
    from mmcl import models
    from mmcl.config import phase_lengths
    from mmcl.models.resize import full_sizes

    size, _, length = full_sizes(models.resolve_model_config(cfg.model))
    steps = phase_lengths(cfg.train.phases, cfg.train.steps)
    return [(n / cfg.train.steps, p.image_size or size, p.context_length or length, p.patch_dropout or 0.0)
            for p, n in zip(cfg.train.phases, steps)]


# ------------------------------------------------------------------------------------------------ cost
class PhaseStep:
    """The model, optimiser and a real batch at one phase's sizes; `step` runs one training step."""

    def __init__(self, cfg, shards: str, batch: int, image_size: int, context_length: int, prob: float):
        import torch
        from accelerate import Accelerator

        from mmcl import data, models
        from mmcl.config import DataConfig
        from mmcl.models import flip, resize
        from mmcl.training.optim import build_optimizer
        from mmcl.training.step import objective_from_config

        torch.manual_seed(0)
        self.acc = Accelerator(cpu=True)
        model, model_cfg, pp_cfg, _, _, tokenizer = models.build(cfg.model)
        resize.follow_input_size(model)
        self.mods = models.set_patch_dropout(model, prob, seed=0) if prob else []
        self.model, self.flip = model.train(), flip
        self.optimizer = build_optimizer(model, cfg.optim)
        self.objective = objective_from_config(cfg.loss)
        dc = DataConfig(train=shards, batch_size=batch, workers=0, shuffle_buffer=256)
        self.stream_args = (dc, data.ImageSpec.from_config(pp_cfg), models.training_tokenizer(model, tokenizer),
                            [(0, image_size, context_length)])
        stream = data.build_train_stream(*self.stream_args[:3], seed=0, phases=self.stream_args[3])
        self.batch = next(iter(stream))
        self.finish = stream.finish_images
        self.step_no = 0

    def step(self) -> None:
        from mmcl.training.step import apply_update, backward, forward_loss

        self.flip.begin_step(self.mods, self.step_no, True)
        self.step_no += 1
        loss, _, cache = forward_loss(self.model, self.objective, [self.batch], self.acc, self.finish,
                                      with_metrics=False)
        backward(self.acc, self.model, loss, [self.batch], cache, self.finish)
        apply_update(self.acc, self.model, self.model, self.optimizer, 1.0, 4.6052)

    def loader_samples_per_s(self, workers: int, batches: int) -> float:
        """Samples/s of the data stream alone at this phase's sizes (after its first 2 batches)."""
        import dataclasses

        from mmcl import data

        dc = dataclasses.replace(self.stream_args[0], workers=workers)
        stream = data.build_train_stream(dc, *self.stream_args[1:3], seed=1, phases=self.stream_args[3])
        it = iter(stream)
        for _ in range(2):
            next(it)
        t0 = time.perf_counter()
        n = sum(len(next(it)["key"]) for _ in range(batches))
        seconds = time.perf_counter() - t0
        del it
        return n / seconds


def flops_of(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def cost(cfg, shards: str, args) -> dict:
    """FLOPs, step samples/s and loader samples/s per phase, and the schedule's FLOPs against full size."""
    sizes = phase_sizes(cfg)
    full = sizes[-1][1:3] + (0.0,)
    arms = {"full": PhaseStep(cfg, shards, args.batch, *full)}
    for i, (_, size, length, prob) in enumerate(sizes):
        if (size, length, prob) != full:
            arms[f"phase{i}"] = PhaseStep(cfg, shards, args.batch, size, length, prob)
    times = {name: [] for name in arms}
    for arm in arms.values():
        arm.step()  # warm-up
    for _ in range(args.rounds):  # interleaved: a busy machine slows every arm alike
        for name, arm in arms.items():
            t0 = time.perf_counter()
            arm.step()
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, arm in arms.items():
        out[name] = {"image": list(arm.batch["image"].shape[-2:]), "text_tokens": int(arm.batch["text"].shape[1]),
                     "patch_dropout": arm.mods[0].prob if arm.mods else 0.0,
                     "gflops_per_step": round(flops_of(arm.step) / 1e9, 3),
                     "step_samples_per_s": round(args.batch / statistics.median(times[name]), 1),
                     "loader_samples_per_s": round(arm.loader_samples_per_s(2, args.loader_batches), 1)}
        print(json.dumps({"cost": name, **out[name]}), flush=True)
    phase_flops = [out[f"phase{i}"]["gflops_per_step"] if f"phase{i}" in out else out["full"]["gflops_per_step"]
                   for i in range(len(sizes))]
    per_step = sum(frac * f for (frac, *_), f in zip(sizes, phase_flops))
    summary = {"schedule_gflops_per_step": round(per_step, 3), "full_gflops_per_step": out["full"]["gflops_per_step"],
               "flops_reduction": round(out["full"]["gflops_per_step"] / per_step, 2)}
    print(json.dumps({"cost": "schedule", **summary}), flush=True)
    return {"phases": out, **summary}


# ------------------------------------------------------------------------------------------------ quality
def shapes_data(work: Path) -> dict:
    from mmcl.shards.demo import make_demo_data

    out = make_demo_data(str(work / "shapes"), seed=7, n_train=3000, n_val=300, n_zeroshot=40, progress=False)
    return {"shards": out["train"], "val": out["val"], "zeroshot": {"colour": out["zeroshot_colour"],
                                                                    "shape": out["zeroshot_shape"]}}


def evaluate_run(run: Path, name: str, data: dict) -> dict:
    import mmcl
    from mmcl.evaluation import evaluate

    model, preprocess, tokenizer = mmcl.load(run)
    model.eval()
    if name == "digits":
        return {"zeroshot_acc1": round(lit_digits.zeroshot(model, preprocess, tokenizer, data)["acc1"], 4)}
    res = {}
    for task, folder in data["zeroshot"].items():
        res[f"zeroshot_{task}_acc1"] = round(evaluate.zeroshot(model, preprocess, tokenizer, folder,
                                                               progress=False)["metrics"]["acc1"], 4)
    m = evaluate.retrieval(model, preprocess, tokenizer, data["val"], progress=False)["metrics"]
    res["image_retrieval_recall@5"] = round(m["image_retrieval_recall@5"], 4)
    res["text_retrieval_recall@5"] = round(m["text_retrieval_recall@5"], 4)
    return res


def train(work: Path, name: str, data: dict, arm: str, steps: int, phases, seed: int, args) -> dict:
    out = work / f"{name}-{arm}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mmcl", "train", "--config", str(CONFIG), f"data.train={data['shards']}",
           f"data.batch_size={args.batch}", "data.workers=2", "data.shuffle_buffer=1000", f"train.steps={steps}",
           f"train.output_dir={out}", f"train.seed={seed}", "train.save_every=0", "train.log_every=10",
           "train.plot=false", "train.progress=false", f"optim.warmup_steps={max(1, steps // 10)}",
           "eval.zeroshot=null", "train.phases=" + json.dumps(phases)]
    seconds = lit_digits.run(cmd, work / f"{out.name}.log", False, out / "model")
    res = {"data": name, "arm": arm, "seed": seed, "steps": steps, "train_s": round(seconds, 1),
           **evaluate_run(out, name, data), "command": " ".join(map(str, cmd))}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/clipa-bench")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loader-batches", type=int, default=12)
    parser.add_argument("--fixed-steps", type=int, default=20, help="steps of the full-size arm")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sets", nargs="+", default=["digits", "shapes"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the cost part (1 is steadier on "
                                                                "a shared machine)")
    parser.add_argument("--cost-only", action="store_true", help="part 1 only")
    args = parser.parse_args()
    import torch

    from mmcl.config import load_config

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config(str(CONFIG))
    t0 = time.perf_counter()
    sets = {"digits": lambda: lit_digits.make_data(work / "digits", 64, seed=0), "shapes": lambda: shapes_data(work)}
    datasets = {name: sets[name]() for name in args.sets}
    first = next(iter(datasets.values()))
    measured = cost(cfg, first["shards"], args)
    if args.cost_only:
        return
    # Equal FLOPs: the CLIPA run gets the steps the full-size run's FLOPs buy at the schedule's mean cost per step.
    sched_steps = int(round(args.fixed_steps * measured["flops_reduction"]))
    fracs = [frac for frac, *_ in phase_sizes(cfg)]
    split = [max(1, int(round(f * sched_steps))) for f in fracs[:-1]]
    split.append(sched_steps - sum(split))
    sched = [dict({k: v for k, v in (("image_size", p.image_size), ("context_length", p.context_length),
                                      ("patch_dropout", p.patch_dropout)) if v is not None}, steps=n)
             for p, n in zip(cfg.train.phases, split)]
    results = []
    for name, data in datasets.items():
        for seed in args.seeds:  # the arms alternate, so machine load affects them alike
            results.append(train(work, name, data, "full", args.fixed_steps, [{"steps": args.fixed_steps}], seed,
                                 args))
            results.append(train(work, name, data, "clipa", sched_steps, sched, seed, args))
    summary = {"summary": "bench_clipa", "flops_reduction_same_steps": measured["flops_reduction"],
               "fixed_steps": args.fixed_steps, "clipa_steps_at_equal_flops": sched_steps,
               "total_s": round(time.perf_counter() - t0, 1)}
    for name in datasets:
        for arm in ("full", "clipa"):
            rows = [r for r in results if r["data"] == name and r["arm"] == arm]
            metrics = [k for k in rows[0] if k.startswith(("zeroshot", "image_", "text_"))]
            summary[f"{name}/{arm}"] = {
                **{k: {"mean": round(float(np.mean([r[k] for r in rows])), 4), "seeds": [r[k] for r in rows]}
                   for k in metrics},
                "train_s_mean": round(float(np.mean([r["train_s"] for r in rows])), 1)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
