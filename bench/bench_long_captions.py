"""Fine-tuning on captions longer than the text tower's positions: Long-CLIP's stretch against plain truncation.

Data: scikit-learn's digits at 32 px, each drawn in one of five ink colours, split 80/20 (stratified, the split
fixed); the held-out fifth is never trained on. A small CLIP (`configs/tiny.yaml` narrowed to 2 layers of width 64
per tower, 32-d embedding, 32 px images in 8 px patches, 32 text positions) is first trained on short captions of
the training digits ("a handwritten seven", the phrasings of `lit_digits.CAPTIONS`, no colour named). It is then
fine-tuned from those weights (``model.init_from``) on long captions of the same images, which name the digit
first and the ink colour only after about 40 tokens ("a handwritten seven. " + a fixed description + "the ink is
red."), in the arms of `ARMS`:
  - ``truncate``: the tower's own 32 positions; the tokenizer cuts every long caption (counted in
    ``data/cut_captions``), so only the digit is read;
  - ``stretch``: ``model.context_length=128``, the trained positions stretched as Long-CLIP does (the first 20 as
    trained, the rest interpolated), so the whole caption is read;
  - ``stretch_short``: the stretch and Long-CLIP's short-caption term (``loss.short_caption``: each long caption's
    first sentence against the images rebuilt from the batch's top 4 principal directions);
  - ``stretch_short_all``: the same with all 32 directions kept (InfoNCE on the short captions: no principal
    components).
Measured before (the short-caption model) and after, on the held-out digits: zero-shot top-1 with short prompts
that are no training caption (`lit_digits.ZS_TEMPLATES`, class names "zero" .. "nine", through
`mmcl.evaluation.evaluate.zeroshot`), and long-caption retrieval R@5 and R@1 (image -> text over the held-out
images' long captions; a hit is any of the five, or the first, equal to the image's own: same digit and colour).
A tower that reads only the digit still scores R@5 well above chance (its top five are captions of the right digit
in whichever colours), so R@1 tells the arms apart more plainly.

    nice .venv/bin/python bench/bench_long_captions.py --work-dir /tmp/bench-long [--steps 150] [--seeds 0 1 2]
        [--arms truncate stretch stretch_short stretch_short_all]

Prints one JSON line per model, then per arm the mean and every seed's. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
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

MODEL = ["model.vision_cfg={layers: 2, width: 64, head_width: 32, patch_size: 8}",
         "model.text_cfg={layers: 2, width: 64, heads: 2}", "model.embed_dim=32", "model.image_size=32"]
INKS = {"red": (200, 30, 30), "blue": (30, 60, 210), "green": (20, 150, 50), "purple": (130, 40, 160),
        "orange": (235, 125, 20)}
FILLER = ("this is a small picture made for a test of long captions, a digit written by hand on a plain white "
          "background, scanned at a low resolution and scaled up, with nothing else in it apart from the digit;")


# The fine-tuning arms: their overrides beside the long-caption shards and the short-caption model's weights.
# With loss.short_caption each long caption's first sentence ("a handwritten seven") is scored against the images
# rebuilt from the batch's top principal directions (Long-CLIP); 4 of the 32 embedding dimensions keep its share
# (Long-CLIP: 32 of 512 or 768), and 32 of 32 keep every direction: InfoNCE on the short captions, the same captions
# without the principal components.
SHORT = ["model.context_length=128", "loss.short_caption.weight=1.0"]
ARMS = {"truncate": [], "stretch": ["model.context_length=128"],
        "stretch_short": [*SHORT, "loss.short_caption.components=4"],
        "stretch_short_all": [*SHORT, "loss.short_caption.components=32"]}


def long_caption(label: int, ink: str) -> str:
    return f"a handwritten {lit_digits.WORDS[label]}. {FILLER} the ink is {ink}."


def make_data(work: Path, image_size: int = 32) -> dict:
    """Short- and long-caption shards of the training digits, the held-out digits as an ImageFolder (with their
    long captions, in the folder's file order)."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from mmcl.shards.writer import write_shards

    digits = load_digits()
    idx_train, idx_test = train_test_split(np.arange(len(digits.target)), test_size=0.2, random_state=0,
                                           stratify=digits.target)
    rng = np.random.default_rng(0)
    inks = {int(i): list(INKS)[int(rng.integers(len(INKS)))] for i in range(len(digits.target))}

    def image(i: int) -> Image.Image:
        a = (digits.images[i] / 16.0)[..., None]
        px = (255 * (1 - a) + np.array(INKS[inks[int(i)]]) * a).clip(0, 255).astype(np.uint8)
        return Image.fromarray(px, "RGB").resize((image_size, image_size), Image.BILINEAR)

    for d in ("short", "long", "test"):
        shutil.rmtree(work / d, ignore_errors=True)
    short, long = [], []
    for n, i in enumerate(idx_train):
        label = int(digits.target[i])
        img = image(i)
        text = lit_digits.CAPTIONS[rng.integers(len(lit_digits.CAPTIONS))].format(w=lit_digits.WORDS[label],
                                                                                   d=label)
        short.append({"key": f"{n:05d}", "image": img, "caption": text})
        long.append({"key": f"{n:05d}", "image": img, "caption": long_caption(label, inks[int(i)])})
    write_shards(short, str(work / "short"), shard_size=1000, prefix="train")
    write_shards(long, str(work / "long"), shard_size=1000, prefix="train")
    test_images, test_captions = [], []
    for k in range(10):
        (work / "test" / str(k)).mkdir(parents=True)
    for n, i in enumerate(idx_test):
        label = int(digits.target[i])
        image(i).save(work / "test" / str(label) / f"{n:05d}.png")
        test_images.append(image(i))
        test_captions.append(long_caption(label, inks[int(i)]))
    (work / "test" / "classnames.txt").write_text("\n".join(lit_digits.WORDS) + "\n")
    (work / "templates.txt").write_text("\n".join(lit_digits.ZS_TEMPLATES) + "\n")
    return {"short": str(work / "short" / "train-*.tar"), "long": str(work / "long" / "train-*.tar"),
            "test": str(work / "test"), "templates": str(work / "templates.txt"), "test_images": test_images,
            "test_captions": test_captions, "n_train": len(idx_train), "n_test": len(idx_test)}


def evaluate(run: Path, data: dict) -> dict:
    import torch

    import mmcl

    model, preprocess, tokenizer = mmcl.load(run)
    model.eval()
    captions = data["test_captions"]
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(im) for im in data["test_images"]]), normalize=True)
        txt = model.encode_text(tokenizer(captions), normalize=True)
        top5 = (img @ txt.T).topk(5, dim=1).indices
    same = np.array(captions)
    r5 = float(np.mean([same[i] in set(same[top5[i].tolist()]) for i in range(len(captions))]))
    r1 = float(np.mean([same[i] == same[top5[i, 0]] for i in range(len(captions))]))
    zs = lit_digits.zeroshot(model, preprocess, tokenizer, data)
    return {"digits_zeroshot_top1": round(zs["acc1"], 4), "long_r5": round(r5, 4),
            "long_r1": round(r1, 4), "context_length": int(tokenizer.context_length)}


def train_run(out: Path, overrides, seed: int, steps: int, lr: float) -> float:
    from mmcl.config import load_config
    from mmcl.training.loop import train

    shutil.rmtree(out, ignore_errors=True)
    keys = [*MODEL, *overrides, "data.workers=0", "data.shuffle_buffer=2000", f"train.steps={steps}",
            f"train.output_dir={out}", f"train.seed={seed}", f"train.save_every={steps}", "train.log_every=25",
            "train.plot=false", "train.progress=false", f"optim.lr={lr}", "optim.warmup_steps=20",
            "eval.zeroshot=null", "data.batch_size=64"]
    t0 = time.perf_counter()
    train(load_config(str(ROOT / "configs" / "tiny.yaml"), keys))
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/bench-long")
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--pretrain-lr", type=float, default=2e-3)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    data = make_data(work)
    results = []
    for seed in args.seeds:
        base = work / f"pretrain-seed{seed}"
        seconds = train_run(base, [f"data.train={data['short']}"], seed, args.pretrain_steps, args.pretrain_lr)
        r = {"arm": "before", "seed": seed, "train_s": round(seconds, 1), **evaluate(base, data)}
        print(json.dumps(r), flush=True)
        results.append(r)
        for arm in args.arms:
            extra = ARMS[arm]
            out = work / f"{arm}-seed{seed}"
            keys = [f"data.train={data['long']}", f"model.init_from={base / 'model'}", *extra]
            seconds = train_run(out, keys, seed, args.steps, args.lr)
            last = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()][-1]
            r = {"arm": arm, "seed": seed, "train_s": round(seconds, 1), "cut_share": last["data/cut_captions_share"],
                 **evaluate(out, data),
                 "command": f"mmcl train --config configs/tiny.yaml {' '.join(keys)} (+ the bench's model and run "
                            f"keys, lr {args.lr}, {args.steps} steps)"}
            print(json.dumps(r), flush=True)
            results.append(r)
    for arm in ("before", *args.arms):
        mine = [r for r in results if r["arm"] == arm]
        for key in ("digits_zeroshot_top1", "long_r5", "long_r1"):
            values = [r[key] for r in mine]
            print(f"{arm:9s} {key:21s} mean {np.mean(values):.3f}  seeds {values}", flush=True)


if __name__ == "__main__":
    main()
