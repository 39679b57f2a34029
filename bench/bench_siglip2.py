"""What SigLIP 2's second stage costs per step against SigLIP alone: time and peak memory of one optimiser step of
configs/siglip2.yaml's model and terms, on random batches (no data loading), for each arm:

* ``siglip``: SigLIP alone (``loss.self_distill`` and ``loss.masked`` off);
* ``before``: both terms on, at a step before their start fraction (what the first 80 % of a run costs);
* ``self_distill``, ``masked``: one term from its start (its teacher forward, crops, heads and EMA update);
* ``both``: the recipe's last 20 %.

Each arm runs in its own process (so that its peak resident memory, ``ru_maxrss``, is its own), the arms taking
turns round by round; ``ms`` is the median step time over the rounds' steps after a warm-up step, ``rss_mib`` the
process's peak, and the JSON line of each arm gives its ratios to ``siglip`` measured in the same run.

    .venv/bin/python bench/bench_siglip2.py [--batch 64] [--steps 6] [--rounds 3] [--threads 2]
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


def _arm(name: str, batch: int, steps: int, threads: int) -> dict:
    import torch
    from accelerate import Accelerator

    sys.path.insert(0, ROOT)
    from mmcl import models
    from mmcl.config import load_config
    from mmcl.models import siglip2
    from mmcl.training.ema import WeightEMA
    from mmcl.training.step import Step, objective_from_config

    torch.set_num_threads(threads)
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
    times = []
    for i in range(steps + 1):
        if second is not None:
            second.begin_step(at, acc.device)
        t0 = time.perf_counter()
        step([batches[i % 2]], at + 1, False)
        if i:
            times.append(time.perf_counter() - t0)
    return {"times": times, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm and round (after one warm-up step)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in its own process
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(_arm(args.arm, args.batch, args.steps, args.threads)))
        return
    results = {arm: {"times": [], "rss_mib": []} for arm in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:
            out = subprocess.run([sys.executable, __file__, "--arm", arm, "--batch", str(args.batch), "--steps",
                                  str(args.steps), "--threads", str(args.threads)], capture_output=True, text=True,
                                 check=True, env=dict(os.environ, PYTHONPATH=ROOT))
            got = json.loads(out.stdout.strip().splitlines()[-1])
            results[arm]["times"] += got["times"]
            results[arm]["rss_mib"].append(got["rss_mib"])
    base_ms = statistics.median(results["siglip"]["times"]) * 1e3
    base_rss = max(results["siglip"]["rss_mib"])
    for arm in ARMS:
        ms = statistics.median(results[arm]["times"]) * 1e3
        rss = max(results[arm]["rss_mib"])
        print(json.dumps({"arm": arm, "batch": args.batch, "threads": args.threads, "ms": round(ms, 1),
                          "time_ratio": round(ms / base_ms, 3), "rss_mib": round(rss, 1),
                          "rss_extra_mib": round(rss - base_rss, 1), "steps": len(results[arm]["times"])}))


if __name__ == "__main__":
    main()
