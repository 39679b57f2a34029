"""Zero-shot on images of varied aspect ratio: the NaFlex tower trained and evaluated with the aspect ratio kept,
against the same tower trained and evaluated on fixed squares (open_clip's transform: shortest side resized, centre
crop), at the same patch tokens per batch.

The images are 1/3 to 3 as wide as high, with one shape (circle, square, triangle, cross) in one of four colours
drawn at a random place along the long side; captions name the colour and the shape, and zero-shot asks for each on
800 held-out images (chance 0.25). A centre crop cuts a shape at the ends of a long image out, keeping the aspect
ratio never does; at the same patch count, the square's patches are finer on what it keeps. Both arms run
``mmcl train --config configs/naflex.yaml`` at one sequence length (``--seq-len``, the square's patch grid), on the
same images: the square arm's shards and evaluation folder hold them cropped to squares first.

    .venv/bin/python bench/naflex_accuracy.py [--seeds 0 1 2] [--steps 300] [--work-dir /tmp/naflex-acc]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from mmcl.shards.writer import write_shards

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
REPO = Path(__file__).resolve().parents[1]


def draw(rng: np.random.Generator, base: int):
    """One image: height `base` to 2 * `base` px, aspect ratio log-uniform in [1/3, 3], a shape along the long side."""
    h = int(rng.integers(base, 2 * base))
    w = max(8, int(h * math.exp(rng.uniform(math.log(1 / 3), math.log(3)))))
    shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
    img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(0, 60, 3)))
    d = ImageDraw.Draw(img)
    r = 0.3 * min(w, h)
    cx = rng.uniform(r, w - r) if w >= h else w / 2
    cy = rng.uniform(r, h - r) if h > w else h / 2
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        t = r / 3
        d.rectangle([cx - r, cy - t, cx + r, cy + t], fill=fill)
        d.rectangle([cx - t, cy - r, cx + t, cy + r], fill=fill)
    return img, shape, colour


def square(img: Image.Image, side: int) -> Image.Image:
    """open_clip's fixed-size transform: the shortest side resized to `side`, then a centre crop."""
    w, h = img.size
    s = side / min(w, h)
    img = img.resize((max(side, round(w * s)), max(side, round(h * s))), Image.BICUBIC)
    w, h = img.size
    left, top = (w - side) // 2, (h - side) // 2
    return img.crop((left, top, left + side, top + side))


def make_data(root: Path, n_train: int, n_test: int, base: int, side: int) -> None:
    rng = np.random.default_rng(1234)
    train = [draw(rng, base) for _ in range(n_train)]
    test = [draw(rng, base) for _ in range(n_test)]
    for arm, fix in (("native", lambda im: im), ("square", lambda im: square(im, side))):
        write_shards(({"key": f"{i:06d}", "image": fix(im), "caption": f"a photo of a {c} {s}"}
                      for i, (im, s, c) in enumerate(train)), str(root / arm / "train"), shard_size=500)
        for i, (im, s, c) in enumerate(test):
            for task, cls in (("shape", s), ("colour", c)):
                folder = root / arm / task / cls
                folder.mkdir(parents=True, exist_ok=True)
                fix(im).save(folder / f"{i:05d}.png")
        for task, template in (("shape", "a photo of a {c}"), ("colour", "a photo of a {c} shape")):
            (root / arm / task / "templates.txt").write_text(template + "\n")


def train(root: Path, arm: str, seed: int, steps: int, seq_len: int, tokens: int) -> dict:
    out = root / "runs" / f"{arm}-{seed}"
    cmd = [sys.executable, "-m", "mmcl", "train", "--config", str(REPO / "configs" / "naflex.yaml"),
           f"data.train={root / arm / 'train' / 'shard-*.tar'}", f"data.naflex.seq_lens=[{seq_len}]",
           f"data.naflex.max_tokens_per_batch={tokens}", f"train.steps={steps}", f"train.seed={seed}",
           f"train.output_dir={out}", "train.save_every=0", f"optim.warmup_steps={steps // 10}",
           f"eval.zeroshot=[{root / arm / 'shape'},{root / arm / 'colour'}]", f"eval.naflex_seq_len=[{seq_len}]"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "w") as log:
        subprocess.run(cmd, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    results = json.loads((out / "eval_results.json").read_text())["zeroshot"]
    return {task: results[task]["metrics"]["acc1"] for task in ("shape", "colour")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--n-train", type=int, default=6000)
    p.add_argument("--n-test", type=int, default=800)
    p.add_argument("--base", type=int, default=48, help="smallest image height, px")
    p.add_argument("--seq-len", type=int, default=64, help="patches per image (8 px patches: 64 is a 64 px square)")
    p.add_argument("--tokens", type=int, default=4096, help="data.naflex.max_tokens_per_batch")
    p.add_argument("--work-dir", default="/tmp/naflex-acc")
    args = p.parse_args()
    root = Path(args.work_dir)
    side = 8 * math.isqrt(args.seq_len)
    if not (root / "square" / "colour").is_dir():
        make_data(root, args.n_train, args.n_test, args.base, side)
    acc = {arm: [] for arm in ("native", "square")}
    for seed in args.seeds:
        for arm in acc:
            acc[arm].append(train(root, arm, seed, args.steps, args.seq_len, args.tokens))
            print(json.dumps({"arm": arm, "seed": seed, "acc1": acc[arm][-1]}), flush=True)
    print(json.dumps({arm: {task: {"mean": round(statistics.mean(r[task] for r in v), 4), "seeds": [r[task] for r in v]}
                            for task in ("shape", "colour")} for arm, v in acc.items()}), flush=True)


if __name__ == "__main__":
    main()
