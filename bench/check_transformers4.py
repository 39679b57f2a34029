"""The ``hf`` export under transformers 4.x: ``CLIPProcessor.from_pretrained`` and the zero-shot image
classification pipeline load it, and the pipeline's predictions agree with `mmcl zeroshot`'s on the same images.

CI has one transformers (5.x, the project's venv); this script installs transformers 4.x (with the tokenizers and
huggingface-hub it needs, no other packages: it reuses this venv's torch, numpy, safetensors, ...) into a directory
of its own with ``pip install --target`` and runs the 4.x side in a subprocess with that directory first on
``PYTHONPATH``.

    python bench/check_transformers4.py [--model RUN_OR_MODEL] [--work /tmp/mmcl-tf4] [--transformers 4.46.3]

Without ``--model`` it writes the demo data and trains ``configs/tiny.yaml`` for ``--steps`` steps first. Prints one
JSON line: versions, images, acc1 of both, per-image agreement of the top-1 class; exits 1 when they disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "a photo of a {}."

# Runs under transformers 4.x: loads the export as a user of 4.x would, and prints the top-1 label per image.
HF4_SIDE = r"""
import json, sys
import transformers
from transformers import CLIPProcessor, pipeline
export_dir, images, labels, template = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
assert transformers.__version__.startswith("4."), transformers.__version__
proc = CLIPProcessor.from_pretrained(export_dir)
pipe = pipeline("zero-shot-image-classification", model=export_dir, device="cpu")
top = []
for out in pipe(images, candidate_labels=labels, hypothesis_template=template, batch_size=32):
    top.append(max(out, key=lambda d: d["score"])["label"])
print(json.dumps({"transformers": transformers.__version__, "tokenizer": type(proc.tokenizer).__name__,
                  "image_processor": type(proc.image_processor).__name__, "top1": top}))
"""


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def ensure_transformers4(site: Path, version: str) -> None:
    if (site / "transformers" / "__init__.py").is_file():
        return
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    # transformers 4.46 pins tokenizers 0.20.x; later 4.x releases take 0.21.
    tokenizers = "tokenizers>=0.20,<0.21" if major_minor <= (4, 46) else "tokenizers>=0.21,<0.22"
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site,
         f"transformers=={version}", tokenizers, "huggingface-hub>=0.23.2,<1.0"])
    # huggingface-hub 0.x imports requests (1.x, which this venv has, does not); with its own dependencies
    run([sys.executable, "-m", "pip", "install", "--quiet", "--target", site, "requests"])


def mmcl_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return run([sys.executable, "-m", "mmcl", *args], env=env, stdout=subprocess.PIPE, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="trained run or model directory (default: train configs/tiny.yaml)")
    ap.add_argument("--work", default="/tmp/mmcl-tf4")
    ap.add_argument("--transformers", default="4.46.3")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--data", default=None, help="ImageFolder to classify (default: the demo colour set)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    site = work / f"site-transformers-{args.transformers}"
    ensure_transformers4(site, args.transformers)

    demo = work / "demo"
    if args.data is None or args.model is None:
        if not (demo / "zeroshot" / "colour").is_dir():
            mmcl_cli("demo-data", "--out", demo)
    data = Path(args.data) if args.data else demo / "zeroshot" / "colour"
    model = Path(args.model) if args.model else work / "run"
    if args.model is None and not (model / "model").is_dir():
        mmcl_cli("train", "--config", REPO / "configs" / "tiny.yaml", f"data.train={demo}/train/shard-*.tar",
                 f"train.output_dir={model}", f"train.steps={args.steps}", "eval.zeroshot=null",
                 "train.progress=false", "data.workers=0")
    export_dir = work / "hf"
    mmcl_cli("export", "--model", model, "--format", "hf", "--out", export_dir)

    templates = work / "template.txt"
    templates.write_text(TEMPLATE + "\n")
    t0 = time.time()
    zs = json.loads(mmcl_cli("zeroshot", "--model", model, "--data", data, "--templates", templates,
                             "--out", work / "mmcl_zeroshot.json").stdout)
    t_mmcl = time.time() - t0

    # mmcl's own top-1 per image (the computation `mmcl zeroshot` scores), on the same files in the same order.
    sys.path.insert(0, str(REPO))
    import torch
    from PIL import Image

    import mmcl

    m, preprocess, tokenizer = mmcl.load(str(model))
    m.eval()
    classnames = [ln.strip() for ln in (data / "classnames.txt").read_text().splitlines() if ln.strip()]
    folders = sorted(p for p in data.iterdir() if p.is_dir())
    images, truth = [], []
    for label, folder in enumerate(folders):
        for path in sorted(folder.iterdir()):
            images.append(str(path))
            truth.append(label)
    with torch.no_grad():
        text = m.encode_text(tokenizer([TEMPLATE.format(c) for c in classnames]), normalize=True)
        feats = torch.cat([m.encode_image(torch.stack([preprocess(Image.open(p).convert("RGB"))
                                                      for p in images[i:i + 64]]), normalize=True)
                           for i in range(0, len(images), 64)])
    mmcl_top = (feats @ text.T).argmax(1).tolist()

    env = dict(os.environ, PYTHONPATH=str(site))
    t0 = time.time()
    out = run([sys.executable, "-c", HF4_SIDE, export_dir, json.dumps(images), json.dumps(classnames), TEMPLATE],
              env=env, stdout=subprocess.PIPE, text=True)
    t_hf = time.time() - t0
    hf = json.loads(out.stdout.strip().splitlines()[-1])
    hf_top = [classnames.index(lbl) for lbl in hf["top1"]]
    agree = sum(a == b for a, b in zip(hf_top, mmcl_top)) / len(images)
    n = len(images)
    result = {"transformers": hf["transformers"], "tokenizer": hf["tokenizer"],
              "image_processor": hf["image_processor"], "images": n, "classes": len(classnames),
              "acc1_mmcl_zeroshot": zs["metrics"]["acc1"],
              "acc1_mmcl_top1": sum(a == b for a, b in zip(mmcl_top, truth)) / n,
              "acc1_transformers4_pipeline": sum(a == b for a, b in zip(hf_top, truth)) / n,
              "top1_agreement": agree, "wall_s_mmcl_zeroshot": round(t_mmcl, 1),
              "wall_s_transformers4": round(t_hf, 1)}
    print(json.dumps(result))
    return 0 if agree == 1.0 and abs(result["acc1_mmcl_top1"] - result["acc1_mmcl_zeroshot"]) < 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
