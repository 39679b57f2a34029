"""Optimisers compared on scikit-learn's digits: for each ``optim.name`` and each learning rate of a small sweep,
the steps a tiny CLIP takes to bring its smoothed training loss under a threshold, and its zero-shot top-1 on the
held-out digits at the end.

Each arm trains the same tiny model (2-block towers of width 64, 32 px images of patch 8, a 1000-word vocabulary)
from the same initialisation on the same batches, with mmcl's parameter groups, schedule (warmup, cosine to 0),
gradient clipping and logit-scale clamp; only ``optim.name`` and ``optim.lr`` change. A caption is one token per
digit class ("<sot> <digit> <eot>"), so a batch holds repeated captions and the contrastive loss cannot reach 0:
with a batch of 32 over 10 classes the loss of a model that matches every image to its class is about ln 3.2 =
1.2, and chance is ln 32 = 3.5. Runs in one process, in-memory batches: the optimiser's step is the
only thing that differs between arms.

    nice .venv/bin/python bench/bench_optimizers.py
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from mmcl import models
from mmcl.config import LossConfig, load_config
from mmcl.training import optim
from mmcl.training.step import objective_from_config

SWEEPS = {"adamw": (1e-3, 3e-3, 1e-2), "lamb": (3e-3, 1e-2, 3e-2), "lion": (1e-4, 3e-4, 1e-3),
          "muon": (1e-3, 3e-3, 1e-2)}
TOWERS = ["model.vision_cfg={layers: 2, width: 64, head_width: 32, patch_size: 8}",
          "model.text_cfg={layers: 2, width: 64, heads: 2, vocab_size: 1000}", "model.embed_dim=32",
          "model.image_size=32", "model.context_length=8"]
SOT, EOT = 1, 999  # open_clip's text tower pools at the highest token id: the end token's


def digits(seed: int = 0):
    """(train images, train labels, held-out images, held-out labels): 32 px, 3 channels, standardised."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    x = torch.nn.functional.interpolate(x, size=32, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def captions(labels: torch.Tensor) -> torch.Tensor:
    text = torch.zeros(len(labels), 8, dtype=torch.long)
    text[:, 0], text[:, 1], text[:, 2] = SOT, 10 + labels, EOT
    return text


def train_arm(name: str, lr: float, data, args) -> dict:
    xs, ys, xv, yv = data
    cfg = load_config(None, [*TOWERS, f"optim.name={name}", f"optim.lr={lr}", "optim.weight_decay=0.1",
                             f"optim.warmup_steps={args.warmup}"])
    torch.manual_seed(args.seed)
    model, *_ = models.build(cfg.model)
    optimizer = optim.build_optimizer(model, cfg.optim)
    objective = objective_from_config(LossConfig())
    batches = torch.Generator().manual_seed(args.seed + 1)
    smooth, reached, losses, start = None, None, [], time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(0, len(ys), (args.batch,), generator=batches)
        out = model(xs[idx], captions(ys[idx]))
        loss, _ = objective(out["image_features"], out["text_features"], out["logit_scale"], None,
                            torch.full((args.batch,), -1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optim.set_lr(optimizer, optim.lr_at(step, cfg.optim, args.steps))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        models.clamp_logit_scale(model, cfg.model.max_logit_scale)
        value = loss.item()
        losses.append(value)
        smooth = value if smooth is None else 0.9 * smooth + 0.1 * value
        if reached is None and math.isfinite(smooth) and smooth <= args.threshold:
            reached = step + 1
    with torch.no_grad():
        img = torch.nn.functional.normalize(model.encode_image(xv), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(captions(torch.arange(10))), dim=-1)
        top1 = (img @ txt.T).argmax(1).eq(yv).float().mean().item()
    return {"optim": name, "lr": lr, "steps_to_threshold": reached, "final_loss": float(np.mean(losses[-20:])),
            "zeroshot_top1": round(top1, 4), "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optims", nargs="+", default=list(SWEEPS), help="optim.name of each arm")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threshold", type=float, default=2.5, help="smoothed (EMA 0.9) training loss to reach")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the rows as JSON here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = digits(args.seed)
    rows = []
    for name in args.optims:
        for lr in SWEEPS[name]:
            rows.append(train_arm(name, lr, data, args))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| optim.name | lr | steps to loss {args.threshold} | final loss | zero-shot top-1 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optim']} | {r['lr']:g} | {r['steps_to_threshold'] or '-'} | {r['final_loss']:.3f} | "
              f"{r['zeroshot_top1']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
