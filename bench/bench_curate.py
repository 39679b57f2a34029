"""Does `mmcl curate` find injected noise, does training on its output help, and what does it cost?

Data: scikit-learn's digits at 32 px, split three ways (stratified): a held-out test set (20 %, an ImageFolder for
zero-shot and shards for retrieval), a clean *scorer* split (the model that curates is trained on it) and a *pool*
into which noise is injected, with the truth kept:
  - the captions of a known fraction of the pool are shuffled among those samples (a sample is *mismatched* when
    its caption names another digit than its image);
  - exact duplicates (the same PNG bytes under a new key) and near duplicates (the image shifted by one pixel and
    brightened, re-encoded) of known samples are added, and the pool is shuffled.

Measured:
  1. precision and recall of the CLIP-score filter (``--clip-score-top``) against the mismatched samples, and of
     ``--dedup`` against the injected copies (a group of copies needs all but one of its members dropped), at the
     thresholds of the run and, from the same stored scores and embeddings, at several others;
  2. zero-shot top-1 and retrieval recall@1 of `configs/tiny.yaml` trained on the curated pool and on the uncurated
     pool for the same number of steps, for several seeds;
  3. throughput: `mmcl curate` (embedding pass + decision + writing) in samples/s, against computing the same
     CLIP scores with `mmcl index` (the image embeddings) plus the caption embeddings (`encode_texts`).

    nice .venv/bin/python bench/bench_curate.py --work-dir /tmp/bench-curate [--seeds 0 1 2]

Prints one JSON line per measurement and a summary. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lit_digits  # noqa: E402  (the digits captions, zero-shot prompts, the training-run wrapper)

ROOT = Path(__file__).resolve().parents[1]


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="png")
    return buf.getvalue()


def make_data(work: Path, args) -> dict:
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from mmcl.shards.writer import write_shards

    digits = load_digits()
    everything = np.arange(len(digits.target))
    rest, test = train_test_split(everything, test_size=0.2, random_state=0, stratify=digits.target)
    scorer, pool = train_test_split(rest, test_size=args.pool_fraction, random_state=0,
                                    stratify=digits.target[rest])
    rng = np.random.default_rng(0)

    def pixels(i: int) -> np.ndarray:
        ink = (255 - digits.images[i] * (255 / 16)).clip(0, 255).astype(np.uint8)
        img = Image.fromarray(ink, "L").resize((args.image_size, args.image_size), Image.BILINEAR).convert("RGB")
        return np.asarray(img)

    def caption(label: int) -> str:
        return lit_digits.CAPTIONS[rng.integers(len(lit_digits.CAPTIONS))].format(w=lit_digits.WORDS[label],
                                                                                   d=label)

    for d in ("scorer", "pool", "test", "test_shards"):
        shutil.rmtree(work / d, ignore_errors=True)
    write_shards([{"key": f"c{n:05d}", "image": _png(pixels(i)), "ext": "png",
                   "caption": caption(int(digits.target[i])), "label": int(digits.target[i])}
                  for n, i in enumerate(scorer)],
                 str(work / "scorer"), shard_size=500, prefix="scorer")
    # the pool: (key, png bytes, caption, image label, caption label, group) with group = the injected copies' id
    rows = [[f"p{n:05d}", _png(pixels(i)), None, int(digits.target[i]), int(digits.target[i]), -1]
            for n, i in enumerate(pool)]
    for r in rows:
        r[2] = caption(r[4])
    n = len(rows)
    shuffled = rng.choice(n, size=int(round(args.shuffle * n)), replace=False)
    perm = rng.permutation(shuffled)
    captions = [(rows[j][2], rows[j][4]) for j in perm]
    for j, (cap, lab) in zip(shuffled, captions):
        rows[j][2], rows[j][4] = cap, lab
    originals = rng.choice(n, size=int(round((args.exact + args.near) * n)), replace=False)
    copies = []
    for c, j in enumerate(originals):
        rows[j][5] = c
        key = f"d{c:05d}"
        if c < int(round(args.exact * n)):
            copies.append([key, rows[j][1], caption(rows[j][3]), rows[j][3], rows[j][3], c])
        else:
            from PIL import Image as _I

            img = np.asarray(_I.open(io.BytesIO(rows[j][1])).convert("RGB")).astype(np.int16)
            img = np.roll(img, 1, axis=1) + 12
            copies.append([key, _png(img.clip(0, 255).astype(np.uint8)), caption(rows[j][3]), rows[j][3],
                           rows[j][3], c])
    rows += copies
    rows = [rows[j] for j in rng.permutation(len(rows))]
    write_shards([{"key": r[0], "image": r[1], "ext": "png", "caption": r[2], "label": r[3]} for r in rows],
                 str(work / "pool"), shard_size=250, prefix="pool")
    truth = {r[0]: {"mismatched": r[3] != r[4], "group": r[5], "exact": r[0].startswith("d")
                    and r[5] < int(round(args.exact * n))} for r in rows}
    for k in range(10):
        (work / "test" / str(k)).mkdir(parents=True)
    test_samples = []
    for n_, i in enumerate(test):
        px = pixels(i)
        Image.fromarray(px).save(work / "test" / str(int(digits.target[i])) / f"{n_:05d}.png")
        test_samples.append({"key": f"t{n_:05d}", "image": _png(px), "ext": "png",
                             "caption": caption(int(digits.target[i])), "label": int(digits.target[i])})
    write_shards(test_samples, str(work / "test_shards"), shard_size=1000, prefix="test")
    (work / "test" / "classnames.txt").write_text("\n".join(lit_digits.WORDS) + "\n")
    (work / "templates.txt").write_text("\n".join(lit_digits.ZS_TEMPLATES) + "\n")
    return {"n_scorer": len(scorer), "n_pool": len(rows), "n_pool_original": n, "truth": truth,
            "scorer": str(work / "scorer" / "scorer-*.tar"), "pool": str(work / "pool" / "pool-*.tar"),
            "test": str(work / "test"), "test_shards": str(work / "test_shards" / "test-*.tar"),
            "templates": str(work / "templates.txt")}


def train(work: Path, name: str, shards: str, steps: int, seed: int, args) -> Path:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mmcl", "train", "--config", "configs/tiny.yaml",
           f"model.image_size={args.image_size}", f"model.context_length={args.context_length}",
           f"data.train={shards}", f"data.batch_size={args.batch_size}", "data.workers=1",
           "data.shuffle_buffer=2000", f"train.steps={steps}", f"train.output_dir={out}", f"train.seed={seed}",
           f"train.save_every={steps}", "train.log_every=20", "train.plot=false", "train.progress=false",
           f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}", "eval.zeroshot=null"]
    seconds = lit_digits.run(cmd, work / f"{name}.log", False, out / "model")
    print(json.dumps({"trained": name, "steps": steps, "seconds": round(seconds, 1)}), flush=True)
    return out


def evaluate(run: Path, data: dict) -> dict:
    import mmcl
    from mmcl.evaluation import evaluate as ev

    model, preprocess, tokenizer = mmcl.load(run)
    zs = lit_digits.zeroshot(model, preprocess, tokenizer, data)
    rt = ev.retrieval(model, preprocess, tokenizer, data["test_shards"], progress=False)["metrics"]
    return {"zeroshot_acc1": zs["acc1"], "image_retrieval_recall@1": rt["image_retrieval_recall@1"],
            "text_retrieval_recall@1": rt["text_retrieval_recall@1"],
            "image_retrieval_recall@5": rt["image_retrieval_recall@5"]}


def _pr(predicted: set, actual: set) -> dict:
    tp = len(predicted & actual)
    return {"precision": round(tp / len(predicted), 3) if predicted else None,
            "recall": round(tp / len(actual), 3) if actual else None, "flagged": len(predicted),
            "actual": len(actual)}


def filter_quality(curated: Path, data: dict, fractions) -> dict:
    """Precision/recall of the CLIP-score filter against the mismatched captions, at `fractions` kept."""
    from mmcl.curation.rules import top_count

    tables = [np.load(p) for p in sorted((curated / "embeddings").glob("*.npz"))]
    keys = np.concatenate([t["key"] for t in tables])
    score = np.concatenate([t["score"] for t in tables]).astype(np.float64)
    mismatched = {k for k in keys if data["truth"][str(k)]["mismatched"]}
    out = {}
    order = np.lexsort((np.arange(len(score)), -score))
    for f in fractions:
        dropped = {str(k) for k in keys[order[top_count(f, len(score)):]]}
        out[f"top{f:g}"] = _pr(dropped, mismatched)
    return out


def dedup_quality(curated: Path, data: dict, thresholds) -> dict:
    """Precision/recall of greedy dedup (over the whole pool, in shard order) against the injected copies: of each
    injected group (an original and its copy) all members but one are redundant."""
    from mmcl.curation.rules import greedy_dedup

    tables = [np.load(p) for p in sorted((curated / "embeddings").glob("*.npz"))]
    keys = [str(k) for t in tables for k in t["key"]]
    images = np.concatenate([t["image"] for t in tables]).astype(np.float32)
    groups = {}
    for k in keys:
        g = data["truth"][k]["group"]
        if g >= 0:
            groups.setdefault(g, []).append(k)
    redundant = {k for members in groups.values() for k in members[1:]}  # all but the first in order
    out = {}
    for t in thresholds:
        keep, of, _ = greedy_dedup(images, t)
        dropped = {keys[i] for i in np.flatnonzero(~keep)}
        # a dropped member of an injected group is right whatever member of the group was kept
        right = {k for k in dropped if data["truth"][k]["group"] >= 0
                 and data["truth"][keys[int(of[keys.index(k)])]]["group"] == data["truth"][k]["group"]}
        out[f"dedup{t:g}"] = {**_pr(dropped, redundant), "precision": round(len(right) / len(dropped), 3)
                              if dropped else None, "recall": round(len(right) / len(redundant), 3)}
    return out


def throughput(work: Path, model: Path, data: dict, args) -> dict:
    from mmcl.curation import Rules, curate
    from mmcl.evaluation import evaluate as ev
    from mmcl.evaluation.index import build_index
    from mmcl.storage import weights

    out = work / "curate-timing"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    summary = curate(str(model), data["pool"], str(out), Rules(clip_score_top=args.top, dedup=args.dedup),
                     batch_size=128, device="cpu", progress=False)
    curate_s = time.perf_counter() - t0
    shutil.rmtree(work / "index-timing", ignore_errors=True)
    t0 = time.perf_counter()
    build_index(model, data["pool"], work / "index-timing", batch_size=128, device="cpu", progress=False)
    m, _, tokenizer = weights.load(weights.find_model_dir(model))
    items = [json.loads(ln) for ln in (work / "index-timing" / "items.jsonl").read_text().splitlines()]
    ev.encode_texts(m, tokenizer, [it["caption"] for it in items], 128, "cpu")
    index_s = time.perf_counter() - t0
    n = summary["samples"]
    return {"samples": n, "curate_s": round(curate_s, 2), "curate_samples_per_s": round(n / curate_s, 1),
            "index_plus_text_s": round(index_s, 2), "index_plus_text_samples_per_s": round(n / index_s, 1),
            "ratio": round(index_s / curate_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default="/tmp/bench-curate")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--context-length", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--pool-fraction", type=float, default=0.6, help="of the non-test digits: the pool")
    parser.add_argument("--shuffle", type=float, default=0.3, help="fraction of the pool with shuffled captions")
    parser.add_argument("--exact", type=float, default=0.1, help="exact duplicates added, fraction of the pool")
    parser.add_argument("--near", type=float, default=0.1, help="near duplicates added, fraction of the pool")
    parser.add_argument("--scorer-epochs", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2, help="training epochs of the uncurated pool (both arms)")
    parser.add_argument("--top", type=float, default=0.7, help="--clip-score-top of the curated arm")
    parser.add_argument("--dedup", type=float, default=0.98, help="--dedup of the curated arm")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    data = make_data(work, args)
    print(json.dumps({k: v for k, v in data.items() if k != "truth"}), flush=True)
    scorer = train(work, "scorer-run", data["scorer"], args.scorer_epochs * data["n_scorer"] // args.batch_size, 0,
                   args)
    print(json.dumps({"scorer": evaluate(scorer, data)}), flush=True)

    from mmcl.curation import Rules, curate

    curated = work / "curated"
    shutil.rmtree(curated, ignore_errors=True)
    summary = curate(str(scorer), data["pool"], str(curated), Rules(clip_score_top=args.top, dedup=args.dedup),
                     batch_size=128, device="cpu", progress=False)
    print(json.dumps({"curate": summary}), flush=True)
    quality = {"filter": filter_quality(curated, data, [0.6, args.top, 0.8]),
               "dedup": dedup_quality(curated, data, [0.95, args.dedup, 0.99, 0.999])}
    print(json.dumps({"quality": quality}), flush=True)
    # the curated run's own dedup, as it was written: exact + near duplicates dropped
    dropped = [json.loads(ln) for ln in (curated / "dropped.jsonl").read_text().splitlines()]
    mism = {k for k, t in data["truth"].items() if t["mismatched"]}
    by_score = {d["key"] for d in dropped if d["reason"].startswith("clip_score")}
    print(json.dumps({"run_filter": _pr(by_score, mism)}), flush=True)

    steps = args.epochs * data["n_pool"] // args.batch_size
    results = {"curated": [], "uncurated": []}
    for seed in args.seeds:
        for arm, shards in (("uncurated", data["pool"]), ("curated", str(curated / "pool-*.tar"))):
            run = train(work, f"{arm}-seed{seed}", shards, steps, seed, args)
            res = {"arm": arm, "seed": seed, "steps": steps, **evaluate(run, data)}
            results[arm].append(res)
            print(json.dumps(res), flush=True)
    tp = throughput(work, scorer, data, args)
    print(json.dumps({"throughput": tp}), flush=True)
    means = {arm: {m: round(float(np.mean([r[m] for r in rs])), 4) for m in rs[0] if m not in ("arm", "seed", "steps")}
             for arm, rs in results.items()}
    print(json.dumps({"summary": means, "per_seed": {arm: [r["zeroshot_acc1"] for r in rs]
                                                     for arm, rs in results.items()},
                      "kept": summary["kept"], "pool": data["n_pool"],
                      "total_s": round(time.perf_counter() - t_start, 1)}), flush=True)


if __name__ == "__main__":
    main()
