"""Fine-tuning on captions longer than the text tower's positions: Long-CLIP's stretch against plain truncation.

A small CLIP (`configs/tiny.yaml` narrowed to 2 layers of width 64 per tower, 32-d embedding, 32 px images in 8 px
patches, 32 text positions) is first trained on the demo's short captions (`mmcl.shards.demo`). It is then fine-tuned
on long captions of the same images, which name the colour first and the size, shape and position only after
about 40 tokens ("a red object. " + a fixed description of the picture + "it is a small circle at the top left"),
from the same weights (``model.init_from``), in two arms:
  - ``truncate``: the tower's own 32 positions; the tokenizer cuts every long caption (counted in
    ``data/cut_captions``), so only the colour is read;
  - ``stretch``: ``model.context_length=128``, the trained positions stretched as Long-CLIP does (the first 20 as
    trained, the rest interpolated), so the whole caption is read.
Measured before and after on held-out data: long-caption retrieval R@5 (image -> text, over the val set's long
captions) and short-caption zero-shot top-1 on the demo's held-out colour images (prompts "a photo of a {} shape.",
never a training caption).

    nice .venv/bin/python bench/bench_long_captions.py --work-dir /tmp/bench-long [--steps 200] [--seeds 0 1 2]

Prints one JSON line per model, then per arm the mean and every seed's. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ["model.vision_cfg={layers: 2, width: 64, head_width: 32, patch_size: 8}",
         "model.text_cfg={layers: 2, width: 64, heads: 2}", "model.embed_dim=32", "model.image_size=32"]
FILLER = ("this is a small synthetic picture made for a test of long captions, with a plain background of soft "
          "grey tones, some stripes or checks, and nothing else in it apart from the one object described here;")


def long_caption(meta: dict) -> str:
    return (f"a {meta['colour']} object. {FILLER} it is a {meta['size']} {meta['shape']} at the "
            f"{meta['position']}.")


def long_shards(src_spec: str, out: Path) -> str:
    """The demo shards of `src_spec` copied with each caption replaced by its long caption."""
    from mmcl.data.reading import read_raw_samples
    from mmcl.data.sources import expand_urls
    from mmcl.shards.writer import write_shards

    shutil.rmtree(out, ignore_errors=True)

    def samples():
        for item in read_raw_samples([(u, None) for u in expand_urls(src_spec)]):
            meta = json.loads(item.files["json"])
            yield {"key": item.key, "image": (item.files["jpg"], "jpg"), "caption": long_caption(meta), "json": meta}

    write_shards(samples(), str(out), shard_size=2000, prefix="train")
    return str(out / "train-*.tar")


def val_set(spec: str):
    from PIL import Image

    from mmcl.data.reading import read_raw_samples
    from mmcl.data.sources import expand_urls

    images, captions = [], []
    for item in read_raw_samples([(u, None) for u in expand_urls(spec)]):
        images.append(Image.open(io.BytesIO(item.files["jpg"])).convert("RGB"))
        captions.append(long_caption(json.loads(item.files["json"])))
    return images, captions


def evaluate(run: Path, val, zeroshot_dir: str) -> dict:
    import torch
    from PIL import Image

    import mmcl

    model, preprocess, tokenizer = mmcl.load(run)
    model.eval()
    images, captions = val
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(im) for im in images]), normalize=True)
        txt = model.encode_text(tokenizer(captions), normalize=True)
        sims = img @ txt.T
        # A caption may describe several val images (same attributes): a hit is any caption equal to the image's own.
        top5 = sims.topk(5, dim=1).indices
        same = np.array(captions)
        r5 = float(np.mean([same[i] in set(same[top5[i].tolist()]) for i in range(len(images))]))
        classes = sorted(os.listdir(zeroshot_dir))
        classes = [c for c in classes if os.path.isdir(os.path.join(zeroshot_dir, c))]
        prompts = model.encode_text(tokenizer([f"a photo of a {c} shape." for c in classes]), normalize=True)
        correct = total = 0
        for k, c in enumerate(classes):
            folder = os.path.join(zeroshot_dir, c)
            ims = [preprocess(Image.open(os.path.join(folder, f)).convert("RGB")) for f in sorted(os.listdir(folder))]
            pred = (model.encode_image(torch.stack(ims), normalize=True) @ prompts.T).argmax(1)
            correct += int((pred == k).sum())
            total += len(ims)
    return {"long_r5": round(r5, 4), "zeroshot_colour_top1": round(correct / total, 4),
            "context_length": int(tokenizer.context_length)}


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
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n-train", type=int, default=6000)
    args = parser.parse_args()
    import torch

    from mmcl.shards.demo import make_demo_data

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    demo = make_demo_data(str(work / "demo"), n_train=args.n_train, n_val=300, n_zeroshot=40, image_size=32,
                          progress=False)
    long_train = long_shards(demo["train"], work / "long")
    val = val_set(demo["val"])
    results = []
    for seed in args.seeds:
        base = work / f"pretrain-seed{seed}"
        train_run(base, [f"data.train={demo['train']}"], seed, args.pretrain_steps, 2e-3)
        r = {"arm": "pretrained", "seed": seed, **evaluate(base, val, demo["zeroshot_colour"])}
        print(json.dumps(r), flush=True)
        results.append(r)
        for arm, extra in (("truncate", []), ("stretch", ["model.context_length=128"])):
            out = work / f"{arm}-seed{seed}"
            seconds = train_run(out, [f"data.train={long_train}", f"model.init_from={base / 'model'}", *extra],
                                seed, args.steps, 5e-4)
            last = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()][-1]
            r = {"arm": arm, "seed": seed, "train_s": round(seconds, 1), "cut_share": last["data/cut_captions_share"],
                 **evaluate(out, val, demo["zeroshot_colour"]),
                 "command": f"mmcl train --config configs/tiny.yaml data.train={long_train} "
                            f"model.init_from={base / 'model'} {' '.join(extra)} (+ the bench's model and run keys)"}
            print(json.dumps(r), flush=True)
            results.append(r)
    for arm in ("pretrained", "truncate", "stretch"):
        mine = [r for r in results if r["arm"] == arm]
        for key in ("long_r5", "zeroshot_colour_top1"):
            values = [r[key] for r in mine]
            print(f"{arm:10s} {key:20s} mean {np.mean(values):.3f}  seeds {values}", flush=True)


if __name__ == "__main__":
    main()
