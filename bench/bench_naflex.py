"""NaFlex against a fixed-size tower on a CPU, tiny towers: the padding waste of aspect-kept batches, and training
samples/s at equal tokens per batch.

* ``waste``: padded patch slots / all slots over images of aspect ratio log-uniform in [1/3, 3] and 100-800 px
  high, per sequence length (SigLIP 2's 128, 256, 576, 784 with 16 px patches; timm's ResizeToSequence and
  mmcl.data.naflex.patch_batch), and the mean over a run drawing lengths uniformly.
* ``tower``: forward + backward of the image tower on one batch of ``--tokens`` patch tokens: a timm NaFlexVit
  (width 64, depth 2, 16 px patches) at each length L with tokens // L images, against open_clip's fixed
  VisionTransformer of the same width and depth at 224 px (196 patches) with tokens // 196 images; samples/s and
  the ratio to the fixed tower, measured in the same run.
* ``data``: per-image CPU cost of the NaFlex data path (resize to the length, uint8, patchify into a padded batch)
  against open_clip's eval transform at 224 px on the same images.

    .venv/bin/python bench/bench_naflex.py [--tokens 12544] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch
from PIL import Image

from mmcl.data.decode import pil_to_uint8
from mmcl.data.naflex import SeqResize, padding_waste, patch_batch

LENGTHS = (128, 256, 576, 784)


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ratio, h = math.exp(rng.uniform(math.log(1 / 3), math.log(3))), int(rng.integers(100, 800))
        out.append(Image.fromarray(rng.integers(0, 255, (h, max(16, int(h * ratio)), 3), dtype=np.uint8)))
    return out


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_fn(tower, x):
    def run():
        tower.zero_grad(set_to_none=True)
        tower(x).float().pow(2).mean().backward()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=12544)  # 64 images at 224 px
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pics = images(200)
    waste = {}
    for n in LENGTHS:
        batch = patch_batch([pil_to_uint8(SeqResize(n, 16)(p)) for p in pics], n, 16)
        waste[n] = padding_waste(batch["patch_valid"])
    print(json.dumps({"waste": waste, "waste_mean": statistics.mean(waste.values())}))
    import timm
    from open_clip.transformer import VisionTransformer

    torch.manual_seed(0)
    flex = timm.create_model("naflexvit_base_patch16_siglip", embed_dim=64, depth=2, num_heads=2, num_classes=0)
    fixed = VisionTransformer(image_size=224, patch_size=16, width=64, layers=2, heads=2, mlp_ratio=4.0,
                              output_dim=64)
    n_fixed = args.tokens // 196
    t_fixed = timed(step_fn(fixed, torch.randn(n_fixed, 3, 224, 224)), args.repeats)
    rows = {"fixed_224": {"images": n_fixed, "samples_per_s": n_fixed / t_fixed}}
    for n in LENGTHS:
        k = args.tokens // n
        batch = patch_batch([pil_to_uint8(SeqResize(n, 16)(pics[i % len(pics)])) for i in range(k)], n, 16)
        batch["patches"] = batch["patches"].float() / 255
        t = timed(step_fn(flex, batch), args.repeats)
        rows[f"naflex_{n}"] = {"images": k, "samples_per_s": k / t, "vs_fixed": (k / t) / (n_fixed / t_fixed)}
    print(json.dumps({"tower": rows, "tokens": args.tokens, "threads": args.threads}))
    from open_clip.transform import PreprocessCfg, image_transform_v2

    oc = image_transform_v2(PreprocessCfg(size=224), is_train=False)
    sample = pics[:50]
    t_oc = timed(lambda: torch.stack([oc(p) for p in sample]), 2) / len(sample)
    t_nf = timed(lambda: patch_batch([pil_to_uint8(SeqResize(256, 16)(p)) for p in sample], 256, 16), 2) / len(sample)
    print(json.dumps({"data": {"open_clip_224_ms": 1e3 * t_oc, "naflex_256_ms": 1e3 * t_nf, "ratio": t_nf / t_oc}}))


if __name__ == "__main__":
    main()
