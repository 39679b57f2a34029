"""Do negative captions from the data (NegCLIP) teach attribute binding? A compositional test on two coloured shapes.

Each image shows two shapes of two colours side by side (the demo's renderer, `mmcl.shards.demo.render`, one shape
per half), captioned "a red circle and a blue square", the two named in either order (so that a caption's word
order says nothing of where a shape is: only which colour goes with which shape). Its attribute swap, "a blue
circle and a red square", holds the same words bound the other way (`mmcl.shards.negatives.rule_negatives` with the
``attributes`` rule). A small CLIP (`configs/tiny.yaml` narrowed to 2 layers of width 64 per tower, 32-d
embedding, 32 px images in 8 px patches) is trained from scratch through `mmcl.training.loop.train` (the path of
``mmcl train``) on the same shards, whose samples carry their swap in their JSON ``negatives``, in two arms:
  - ``clip``: InfoNCE alone (``data.negatives=0``: the negatives are not read);
  - ``clip+neg``: InfoNCE with each sample's swap as a negative column of its own image's row (``data.negatives=1``).
The shards also hold scikit-learn's digits (80 % of them, stratified, the split fixed; grey ink at 32 px, captioned
in `lit_digits.CAPTIONS`'s phrasings, each with its rule negatives: the word-order shuffle, as `mmcl negatives`
makes them; none with ``--digit-negatives none``), shuffled in among the shapes, so that training with negatives
can be checked not to cost zero-shot.
Measured on held-out images of colour-shape combinations never seen in training: the share of images whose true
caption scores above its swap (binding; 0.5 is chance), and image-to-text top-1 among all held-out captions; and
zero-shot top-1 on the held-out fifth of the digits (prompts that are no training caption, `lit_digits.ZS_TEMPLATES`,
through `mmcl.evaluation.evaluate.zeroshot`).

    nice .venv/bin/python bench/bench_negatives.py --work-dir /tmp/bench-negatives [--steps 300] [--seeds 0 1 2]

Prints one JSON line per trained model, then per arm the mean and every seed's. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import lit_digits  # noqa: E402  (the digits' words, training captions and zero-shot prompts)

COLOURS = ("red", "blue", "green", "yellow", "purple")
SHAPES = ("circle", "square", "triangle", "star", "cross")
MODEL = ["model.vision_cfg={layers: 2, width: 64, head_width: 32, patch_size: 8}",
         "model.text_cfg={layers: 2, width: 64, heads: 2}", "model.embed_dim=32", "model.image_size=32",
         "model.context_length=16"]


def two_shapes(left, right, rng, side: int = 32):
    """An image of shape `left` (colour, shape) beside shape `right`: each rendered on its own half."""
    from PIL import Image

    from mmcl.shards.demo import render

    halves = [render(c, s, (1, 1), "large", rng, image_size=side) for c, s in (left, right)]
    canvas = Image.new("RGB", (2 * side, side))
    for i, im in enumerate(halves):
        canvas.paste(im, (i * side, 0))
    return canvas.resize((side, side), Image.BILINEAR)


def caption(left, right) -> str:
    return f"a {left[0]} {left[1]} and a {right[0]} {right[1]}"


def combos(seed: int):
    """(train, test) lists of ((colour, shape), (colour, shape)): every pair of two colours and two shapes, the
    test a fifth of the colour-shape combinations, held out of training."""
    pairs = [((c1, s1), (c2, s2)) for c1, c2 in itertools.permutations(COLOURS, 2)
             for s1, s2 in itertools.permutations(SHAPES, 2)]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pairs))
    n_test = len(pairs) // 5
    return [pairs[i] for i in order[n_test:]], [pairs[i] for i in order[:n_test]]


def digits_data(work: Path, rng, with_negatives: bool = True, side: int = 32):
    """Training samples of 80 % of the digits (captions with their rule negatives, or none without
    `with_negatives`) and the held-out fifth written as an ImageFolder for zero-shot."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from mmcl.shards.negatives import rule_negatives

    digits = load_digits()
    idx_train, idx_test = train_test_split(np.arange(len(digits.target)), test_size=0.2, random_state=0,
                                           stratify=digits.target)

    def image(i: int) -> Image.Image:
        ink = (255 - digits.images[i] * (255 / 16)).clip(0, 255).astype(np.uint8)
        return Image.fromarray(ink, "L").resize((side, side), Image.BILINEAR).convert("RGB")

    samples = []
    for i in idx_train:
        label = int(digits.target[i])
        text = lit_digits.CAPTIONS[rng.integers(len(lit_digits.CAPTIONS))].format(w=lit_digits.WORDS[label],
                                                                                   d=label)
        negs = rule_negatives(text) if with_negatives else []
        samples.append({"image": image(i), "caption": text, "json": {"negatives": negs}})
    folder = work / "digits-test"
    shutil.rmtree(folder, ignore_errors=True)
    for k in range(10):
        (folder / str(k)).mkdir(parents=True)
    for n, i in enumerate(idx_test):
        image(i).save(folder / str(int(digits.target[i])) / f"{n:05d}.png")
    (folder / "classnames.txt").write_text("\n".join(lit_digits.WORDS) + "\n")
    (work / "templates.txt").write_text("\n".join(lit_digits.ZS_TEMPLATES) + "\n")
    return samples, {"test": str(folder), "templates": str(work / "templates.txt")}


def make_data(work: Path, n_train: int, seed: int, digit_negatives: bool = True) -> dict:
    from mmcl.shards.negatives import rule_negatives
    from mmcl.shards.writer import write_shards

    train, test = combos(seed)
    rng = np.random.default_rng(seed + 1)
    out = work / "shards"
    shutil.rmtree(out, ignore_errors=True)
    digit_samples, digits_test = digits_data(work, rng, digit_negatives)
    # Where each digit goes among the shapes: positions drawn once, so the mix is the same for every arm and seed.
    at = set(rng.choice(n_train + len(digit_samples), size=len(digit_samples), replace=False).tolist())

    def samples():
        digit = iter(digit_samples)
        for i in range(n_train + len(digit_samples)):
            if i in at:
                yield {"key": f"{i:06d}", **next(digit)}
                continue
            left, right = train[int(rng.integers(len(train)))]
            text = caption(left, right) if rng.integers(2) else caption(right, left)
            yield {"key": f"{i:06d}", "image": two_shapes(left, right, rng), "caption": text,
                   "json": {"negatives": rule_negatives(text, rules=["attributes"])}}

    write_shards(samples(), str(out), shard_size=1000, prefix="train")
    test_images = [two_shapes(left, right, rng) for left, right in test]
    return {"shards": str(out / "train-*.tar"), "test": test, "test_images": test_images, "digits": digits_test}


def evaluate(model, preprocess, tokenizer, data) -> dict:
    import torch

    test = data["test"]
    true = [caption(left, right) for left, right in test]
    swap = [caption((right[0], left[1]), (left[0], right[1])) for left, right in test]
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(im) for im in data["test_images"]]), normalize=True)
        t_true = model.encode_text(tokenizer(true), normalize=True)
        t_swap = model.encode_text(tokenizer(swap), normalize=True)
    binding = ((img * t_true).sum(1) > (img * t_swap).sum(1)).float().mean().item()
    top1 = ((img @ t_true.T).argmax(1) == torch.arange(len(test))).float().mean().item()
    zs = lit_digits.zeroshot(model, preprocess, tokenizer, data["digits"])
    return {"binding": round(binding, 4), "i2t_top1": round(top1, 4), "n_test": len(test),
            "digits_zeroshot_top1": round(zs["acc1"], 4)}


def train_arm(work: Path, data: dict, args, arm: str, seed: int) -> dict:
    import mmcl
    from mmcl.config import load_config
    from mmcl.training.loop import train

    out = work / f"{arm}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = [*MODEL, f"data.train={data['shards']}", f"data.batch_size={args.batch_size}", "data.workers=0",
                 "data.shuffle_buffer=2000", f"train.steps={args.steps}", f"train.output_dir={out}",
                 f"train.seed={seed}", f"train.save_every={args.steps}", "train.log_every=25", "train.plot=false",
                 "train.progress=false", f"optim.lr={args.lr}", "optim.warmup_steps=20", "eval.zeroshot=null",
                 f"data.negatives={1 if arm == 'clip+neg' else 0}"]
    t0 = time.perf_counter()
    train(load_config(str(ROOT / "configs" / "tiny.yaml"), overrides))
    seconds = time.perf_counter() - t0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    model, preprocess, tokenizer = mmcl.load(out)
    model.eval()
    return {"arm": arm, "seed": seed, "steps": args.steps, "batch": args.batch_size, "train_s": round(seconds, 1),
            "final_loss": rows[-1]["loss"], **evaluate(model, preprocess, tokenizer, data),
            "command": "mmcl train --config configs/tiny.yaml " + " ".join(repr(o) if " " in o else o
                                                                       for o in overrides)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/bench-negatives")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--digit-negatives", choices=["order", "none"], default="order",
                        help="the digits' negatives: their rule negatives (the word-order shuffle), or none")
    parser.add_argument("--arms", nargs="+", default=["clip", "clip+neg"], choices=["clip", "clip+neg"])
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    data = make_data(work, args.n_train, 0, args.digit_negatives == "order")
    results = []
    for seed in args.seeds:
        for arm in args.arms:
            r = train_arm(work, data, args, arm, seed)
            print(json.dumps(r), flush=True)
            results.append(r)
    for arm in args.arms:
        mine = [r for r in results if r["arm"] == arm]
        for key in ("binding", "i2t_top1", "digits_zeroshot_top1"):
            values = [r[key] for r in mine]
            print(f"{arm:9s} {key:20s} mean {np.mean(values):.3f}  seeds {values}", flush=True)


if __name__ == "__main__":
    main()
