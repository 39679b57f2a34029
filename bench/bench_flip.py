"""FLIP patch dropout: time, FLOPs and memory of masked (model.patch_dropout) vs unmasked training, on CPU.

A ViT whose token count dominates: mmcl's tiny towers with the image tower at 224 px and patch 8 (784 patches +
the class token, width 128, 4 blocks) and the tiny text tower (32 tokens). Measured in one run, interleaved
(masked, unmasked, masked, ... so a busy machine slows both alike), medians over the rounds:

- the image tower's forward+backward (encode_image, then backward of a sum of its features);
- the whole training step: both towers, the CLIP loss, backward, gradient clipping and the AdamW step
  (mmcl.training.step.forward_loss, backward and apply_update, the code a run executes);
- FLOPs of both, from torch.utils.flop_counter.FlopCounterMode;
- memory: the bytes autograd saves for backward in the step (activations; counted per storage through
  saved_tensors_hooks), and from it the largest batch whose masked step saves no more than the unmasked step at
  the given batch; with ``--rss`` that batch and the unmasked one are also run each in a fresh process and their
  peak RSS growth (VmHWM, reset after the model and optimiser exist) is compared.

    nice python bench/bench_flip.py [--batch 16] [--image-size 224] [--patch 8] [--prob 0.5] [--rounds 5]
                                    [--threads 2] [--rss]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def build(args, prob):
    import torch

    from mmcl import models
    from mmcl.config import load_config

    torch.manual_seed(0)
    cfg = load_config(None, [f"model.image_size={args.image_size}",
                             f"model.vision_cfg={{patch_size: {args.patch}}}"]).model
    model, *_ = models.build(cfg)
    mods = models.set_patch_dropout(model, prob, seed=0) if prob else []
    model.train()
    return model, mods


def batch(args, n, seed=1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"image": torch.randn(n, 3, args.image_size, args.image_size, generator=g),
            "text": torch.randint(1, 1000, (n, 32), generator=g), "label": torch.full((n,), -1, dtype=torch.long)}


class Setup:
    """A model, its optimiser and objective, and the two measured calls."""

    def __init__(self, args, prob, n):
        from accelerate import Accelerator

        from mmcl.config import LossConfig, OptimConfig
        from mmcl.training.optim import build_optimizer
        from mmcl.training.step import objective_from_config as build_objective

        self.acc = Accelerator(cpu=True)
        self.model, self.mods = build(args, prob)
        self.optimizer = build_optimizer(self.model, OptimConfig(lr=1e-4))
        self.objective = build_objective(LossConfig())
        self.batch = batch(args, n)
        self.step_no = 0

    def image_fwd_bwd(self):
        for m in self.mods:
            m.begin_step(self.step_no)
        self.step_no += 1
        self.model.visual(self.batch["image"]).sum().backward()
        self.model.zero_grad(set_to_none=True)

    def train_step(self):
        from mmcl.training.step import apply_update, backward, forward_loss

        for m in self.mods:
            m.begin_step(self.step_no)
        self.step_no += 1
        loss, _, cache = forward_loss(self.model, self.objective, [self.batch], self.acc, with_metrics=False)
        backward(self.acc, self.model, loss, [self.batch], cache)
        apply_update(self.acc, self.model, self.model, self.optimizer, 1.0, 4.6052)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward during `fn` (its activation memory)."""
    import torch

    seen = {}

    def pack(t):
        try:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def rss_child(args) -> None:
    """In a fresh process: peak RSS growth of `args.child_steps` training steps at (prob, batch)."""
    import torch

    torch.set_num_threads(args.threads)
    s = Setup(args, args.prob if args.child_masked else 0.0, args.batch)
    s.train_step()  # optimiser state, kernels and thread pools exist before the mark is reset
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))

    base = status("VmRSS")
    for _ in range(2):
        s.train_step()
    print(json.dumps({"peak_growth_bytes": status("VmHWM") - base}))


def run_rss(args, masked: bool, n: int) -> int:
    cmd = [sys.executable, __file__, "--child", "--batch", str(n), "--image-size", str(args.image_size),
           "--patch", str(args.patch), "--prob", str(args.prob), "--threads", str(args.threads)]
    if masked:
        cmd.append("--child-masked")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_growth_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--prob", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rss", action="store_true", help="also compare peak RSS in fresh processes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-masked", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return rss_child(args)

    import torch

    torch.set_num_threads(args.threads)
    masked, plain = Setup(args, args.prob, args.batch), Setup(args, 0.0, args.batch)
    tokens = (args.image_size // args.patch) ** 2
    kept = max(1, int(tokens * (1 - args.prob)))
    print(json.dumps({"image_size": args.image_size, "patch": args.patch, "patch_tokens": tokens,
                      "kept_tokens": kept, "prob": args.prob, "batch": args.batch, "threads": args.threads}))
    for s in (masked, plain):  # warm-up: kernels, thread pools, optimiser state
        s.image_fwd_bwd()
        s.train_step()
    times = {k: [] for k in ("image_masked", "image_plain", "step_masked", "step_plain")}
    for _ in range(args.rounds):
        times["image_masked"].append(timed(masked.image_fwd_bwd))
        times["image_plain"].append(timed(plain.image_fwd_bwd))
        times["step_masked"].append(timed(masked.train_step))
        times["step_plain"].append(timed(plain.train_step))
    med = {k: statistics.median(v) for k, v in times.items()}
    fl = {"image_masked": flops(masked.image_fwd_bwd), "image_plain": flops(plain.image_fwd_bwd),
          "step_masked": flops(masked.train_step), "step_plain": flops(plain.train_step)}
    act_masked, act_plain = saved_bytes(masked.train_step), saved_bytes(plain.train_step)
    per_sample_masked = act_masked / args.batch
    same_memory_batch = int(act_plain // per_sample_masked)
    result = {
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "time_ratio_image_fwd_bwd": round(med["image_masked"] / med["image_plain"], 3),
        "time_ratio_step": round(med["step_masked"] / med["step_plain"], 3),
        "gflops": {k: round(v / 1e9, 2) for k, v in fl.items()},
        "flop_ratio_image_fwd_bwd": round(fl["image_masked"] / fl["image_plain"], 3),
        "flop_ratio_step": round(fl["step_masked"] / fl["step_plain"], 3),
        "saved_activation_mib": {"masked": round(act_masked / 2 ** 20, 1), "plain": round(act_plain / 2 ** 20, 1)},
        "activation_ratio": round(act_masked / act_plain, 3),
        "masked_batch_at_the_same_activation_memory": same_memory_batch,
        "batch_gain": round(same_memory_batch / args.batch, 2),
    }
    if args.rss:
        plain_peak = run_rss(args, False, args.batch)
        big_peak = run_rss(args, True, same_memory_batch)
        result["rss_peak_growth_mib"] = {f"plain@{args.batch}": round(plain_peak / 2 ** 20, 1),
                                         f"masked@{same_memory_batch}": round(big_peak / 2 ** 20, 1)}
        result["rss_ratio_masked_big_batch_over_plain"] = round(big_peak / plain_peak, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main()
