"""What SigLIP 2's second stage costs per step against SigLIP alone: time and peak memory of one optimiser step of
configs/siglip2.yaml's model and terms, on random batches (no data loading), for each arm:

* ``siglip``: SigLIP alone (``loss.self_distill`` and ``loss.masked`` off);
* ``before``: both terms on, at a step before their start fraction (what the first 80 % of a run costs);
* ``self_distill``, ``masked``: one term from its start (its teacher forward, crops, heads and EMA update);
* ``both``: the recipe's last 20 %.

Time: the arms are built in one process and take turns step by step (the machine's load falls on all alike);
``ms_min`` is the fastest of ``--steps`` steps after a warm-up step, ``time_ratio`` its ratio to ``siglip``'s.
FLOPs: one step counted by torch's dispatcher (``FlopCounterMode``), independent of the load. Memory: each arm also
runs two steps in a process of its own, whose peak resident memory (``ru_maxrss``) is ``rss_mib``;
``rss_extra_mib`` is the difference to ``siglip``'s.

    .venv/bin/python bench/bench_siglip2.py [--batch 64] [--steps 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ARMS = ("siglip", "before", "self_distill", "masked", "both")


def _setup(name: str, batch: int):
    """A `Step` of configs/siglip2.yaml's model with arm `name`'s terms, and a function running one step of it."""
    import torch
    from accelerate import Accelerator

    sys.path.insert(0, ROOT)
    from mmcl import models
    from mmcl.config import load_config
    from mmcl.models import siglip2
    from mmcl.training.ema import WeightEMA
    from mmcl.training.step import Step, objective_from_config

    torch.manual_seed(0)
    overrides = {"siglip": ["loss.self_distill.weight=0", "loss.masked.weight=0"],
                 "self_distill": ["loss.masked.weight=0"], "masked": ["loss.self_distill.weight=0"]}
    cfg = load_config(os.path.join(ROOT, "configs", "siglip2.yaml"), overrides.get(name, []))
    model, *_ = models.build(cfg.model)
    second = siglip2.attach(model, cfg.loss.self_distill, cfg.loss.masked, 10, seed=0, make_ema=WeightEMA)
    acc = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prepared, optimizer = acc.prepare(model, optimizer)
    step = Step(acc, prepared, acc.unwrap_model(prepared), optimizer, objective_from_config(cfg.loss),
                grad_clip=1.0, max_logit_scale=100.0, siglip2=second)
    g = torch.Generator().manual_seed(1)
    size = cfg.model.image_size or 64
    batches = [{"image": torch.randn(batch, 3, size, size, generator=g),
                "text": torch.randint(1, 1000, (batch, 32), generator=g),
                "label": torch.full((batch,), -1, dtype=torch.long)} for _ in range(2)]
    at = 0 if name == "before" else 9  # the terms start at step 8 of 10 (start_fraction 0.8)
    turn = [0]

    def run_step() -> float:
        if second is not None:
            second.begin_step(at, acc.device)
        t0 = time.perf_counter()
        step([batches[turn[0] % 2]], at + 1, False)
        turn[0] += 1
        return time.perf_counter() - t0

    return run_step


def _flops(run_step) -> float:
    """FLOPs of one step (forward, backward, update) counted by torch's dispatcher: independent of the load."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        run_step()
    return float(counter.get_total_flops())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-of", choices=ARMS, help=argparse.SUPPRESS)  # one arm's peak memory, in its own process
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.memory_of:
        run_step = _setup(args.memory_of, args.batch)
        run_step(), run_step()
        print(json.dumps({"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return
    rss = {}
    for arm in ARMS:
        out = subprocess.run([sys.executable, __file__, "--memory-of", arm, "--batch", str(args.batch),
                              "--threads", str(args.threads)], capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONPATH=ROOT))
        rss[arm] = json.loads(out.stdout.strip().splitlines()[-1])["rss_mib"]
    runs = {arm: _setup(arm, args.batch) for arm in ARMS}
    flops = {arm: _flops(run) for arm, run in runs.items()}  # also the warm-up step
    times = {arm: [] for arm in ARMS}
    for _ in range(args.steps):  # the arms take turns step by step: the machine's load falls on all alike
        for arm, run in runs.items():
            times[arm].append(run())
    base = min(times["siglip"])
    for arm in ARMS:
        print(json.dumps({"arm": arm, "batch": args.batch, "threads": args.threads,
                          "ms_min": round(min(times[arm]) * 1e3, 1),
                          "ms_median": round(statistics.median(times[arm]) * 1e3, 1),
                          "time_ratio": round(min(times[arm]) / base, 3),
                          "flops_ratio": round(flops[arm] / flops["siglip"], 3), "gflop": round(flops[arm] / 1e9, 2),
                          "rss_mib": round(rss[arm], 1), "rss_extra_mib": round(rss[arm] - rss["siglip"], 1)}))


if __name__ == "__main__":
    main()
