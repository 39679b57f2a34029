"""Training-loader throughput: mmcl's stream against a plain webdataset pipeline on the same JPEG shards.

Both loaders decode with pillow, apply open_clip's 224 px transform, tokenize captions with open_clip's
tokenizer, batch in the workers and run under a torch DataLoader with the same number of workers. The
shards hold photo-like JPEGs of about 500 px (smooth gradients, shapes and noise, quality 90).

    python bench/bench_data.py [--samples 1536] [--workers 2] [--batch 64] [--rounds 2] [--loaders a,b,...]

Prints one JSON line per loader and round, then one line of ratios against the first loader: best round of
each loader, the median over rounds of the ratio within a round, and the ratio of median samples per CPU second
(the loaders' own cost, which the load of a shared machine does not change).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import tempfile
import time
import warnings

import numpy as np
import torch
from PIL import Image, ImageDraw

from harness import tree_cpu_seconds  # bench/harness.py


def photo_like(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A JPEG that compresses like a photo: gradient, a few blurred-edge shapes and sensor-like noise."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 255, size=3)
    slope = rng.uniform(-0.3, 0.3, size=(2, 3))
    img = base + xx[..., None] * slope[0] + yy[..., None] * slope[1]
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    for _ in range(6):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        r = rng.uniform(20, 150)
        draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    arr = np.asarray(pil, dtype=np.float32) + rng.normal(0, 6, size=(height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_shards(folder: str, n: int, per_shard: int) -> str:
    from mmcl.data import write_shards

    rng = np.random.default_rng(0)

    def samples():
        for i in range(n):
            w, h = int(rng.integers(420, 640)), int(rng.integers(380, 560))
            yield {"key": f"{i:07d}", "image": photo_like(rng, w, h), "ext": "jpg",
                   "caption": f"a photo number {i} of some shapes on a gradient", "label": i % 10}

    summary = write_shards(samples(), folder, shard_size=per_shard)
    return os.path.join(folder, "shard-{000000..%06d}.tar" % (summary["n_shards"] - 1))


def reference_loader(spec, preprocess, tokenizer, batch, workers, shuffle):
    import webdataset as wds

    def collate(samples):
        images, captions = zip(*samples)
        return torch.stack(images), tokenizer(list(captions))

    pipeline = (wds.WebDataset(spec, shardshuffle=False, empty_check=False).shuffle(shuffle).decode("pil")
                .to_tuple("jpg", "txt").map_tuple(preprocess, lambda t: t).batched(batch, collation_fn=collate,
                                                                                   partial=False))
    return torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=workers)


def ours_loader(spec, preprocess, tokenizer, batch, workers, shuffle, fast, uint8):
    from mmcl.config import DataConfig
    from mmcl.data import build_train_stream

    cfg = DataConfig(train=spec, batch_size=batch, workers=workers, shuffle_buffer=shuffle, fast_decode=fast,
                     uint8_transfer=uint8)
    return build_train_stream(cfg, preprocess, tokenizer, seed=0)


def cpu_seconds() -> float:
    """CPU time of this process and its DataLoader workers: the loader's own cost, whatever else runs."""
    return sum(tree_cpu_seconds(os.getpid()))


def tar_member_costs(spec: str) -> dict:
    """Microseconds per tar member to read every member's bytes of the shards: `tarfile` in stream mode, and
    mmcl's `TarReader` (tarfile with its damage checks, seeking over unread members)."""
    import tarfile

    from mmcl.data import TarReader, expand_urls

    def with_tarfile(url):
        with open(url, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
            return sum(len(tar.extractfile(m).read()) > -1 for m in tar if m.isfile())

    def with_mmcl(url):
        with open(url, "rb") as f:
            reader = TarReader(f)
            return sum(len(reader.read()) > -1 for _ in reader)

    out = {}
    for name, fn in (("tarfile", with_tarfile), ("mmcl", with_mmcl)):
        t0 = time.perf_counter()
        members = sum(fn(url) for url in expand_urls(spec))
        out[f"{name}_us_per_member"] = round(1e6 * (time.perf_counter() - t0) / members, 2)
    out["members"] = members
    return out


def model_input(loader, batch) -> torch.Tensor:
    """The float images a model would get from `batch`: mmcl's uint8 batches are finished here (counted)."""
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return loader.finish_images(batch["image"])


def measure(loader, n_batches: int, batch: int):
    """(samples per wall second, samples per CPU second) over n_batches after the first batch (worker
    start-up and the first shuffle fill excluded)."""
    it = iter(loader)
    first = model_input(loader, next(it))
    assert first.shape[-1] == 224 and first.dtype == torch.float32
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(n_batches):
        model_input(loader, next(it))
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    if hasattr(it, "close"):
        it.close()
    del it
    return n_batches * batch / elapsed, n_batches * batch / cpu


LOADERS = ("webdataset", "mmcl", "mmcl_fast_decode", "mmcl_fast_decode_uint8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1536)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--shuffle", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loaders", default=",".join(LOADERS),
                        help=f"comma-separated loaders to run (default: all of {','.join(LOADERS)})")
    parser.add_argument("--dir", default=None, help="where to write the shards (default: a temporary folder)")
    args = parser.parse_args()

    import open_clip

    warnings.filterwarnings("ignore")
    preprocess = open_clip.image_transform(224, is_train=False)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    # Both loaders stop before a shard pass ends: the reference pipeline is finite.
    n_batches = args.samples // args.batch - args.workers - 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t0 = time.perf_counter()
        spec = make_shards(tmp, args.samples, args.per_shard)
        print(json.dumps({"bench": "data", "event": "shards_written", "samples": args.samples,
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
        print(json.dumps({"bench": "tar_read", **tar_member_costs(spec)}), flush=True)
        loaders = {
            "webdataset": lambda: reference_loader(spec, preprocess, tokenizer, args.batch, args.workers, args.shuffle),
            "mmcl": lambda: ours_loader(spec, preprocess, tokenizer, args.batch, args.workers, args.shuffle, False,
                                        False),
            "mmcl_fast_decode": lambda: ours_loader(spec, preprocess, tokenizer, args.batch, args.workers,
                                                    args.shuffle, True, False),
            # The default: draft decoding, and uint8 images finished in the main process (on the GPU in training).
            "mmcl_fast_decode_uint8": lambda: ours_loader(spec, preprocess, tokenizer, args.batch, args.workers,
                                                          args.shuffle, True, True),
        }
        loaders = {name: make for name, make in loaders.items() if name in args.loaders.split(",")}
        best, rates, per_cpu = {}, {name: [] for name in loaders}, {name: [] for name in loaders}
        for rnd in range(args.rounds):
            for name, make in loaders.items():
                rate, cpu_rate = measure(make(), n_batches, args.batch)
                best[name] = max(best.get(name, 0.0), rate)
                rates[name].append(rate)
                per_cpu[name].append(cpu_rate)
                print(json.dumps({"bench": "data", "loader": name, "round": rnd, "device": "cpu", "cpu": cpu,
                                  "workers": args.workers, "batch": args.batch, "image_size": 224,
                                  "samples_per_s": round(rate, 1), "samples_per_cpu_s": round(cpu_rate, 2)}),
                      flush=True)
        # Ratios against the first loader run (webdataset unless --loaders says otherwise): of the best rounds,
        # the median of the ratios within a round (loaders run back to back, so less exposed to load drift), and
        # of the median samples per CPU second (the loaders' own cost).
        ref = next(iter(loaders))
        summary = {"bench": "data", "reference": ref, "best_samples_per_s": {k: round(v, 1) for k, v in best.items()}}
        for name in loaders:
            if name == ref:
                continue
            summary[f"ratio_{name}"] = round(best[name] / best[ref], 3)
            summary[f"median_round_ratio_{name}"] = round(float(np.median(np.array(rates[name]) /
                                                                          np.array(rates[ref]))), 3)
            summary[f"cpu_cost_ratio_{name}"] = round(float(np.median(per_cpu[name]) / np.median(per_cpu[ref])), 3)
        print(json.dumps(summary), flush=True)

if __name__ == "__main__":
    main()
