"""Training-loader throughput: mmcl's stream against a plain webdataset pipeline on the same JPEG shards.

Both loaders decode with pillow, apply open_clip's 224 px transform, tokenize captions with open_clip's
tokenizer, batch in the workers and run under a torch DataLoader with the same number of workers. The
shards hold photo-like JPEGs of about 500 px (smooth gradients, shapes and noise, quality 90).

    python bench/bench_data.py [--samples 1536] [--workers 2] [--batch 64] [--rounds 2] [--loaders a,b,...]

With ``--images laion`` the shards hold LAION-like photos instead (sides 500-1100 px, random aspect, about
100 kB, quality 85-95), and the loaders to compare are (``--loaders floor,open_clip,mmcl_train,mmcl_train_float``):

- ``floor``: what decoding costs at least: each JPEG (read from the shards beforehand) decoded at the smallest
  DCT scale that keeps a 224 px centre square (Pillow's ``draft('RGB', (224, 224))``) and one bicubic resize of
  that square to 224 x 224; nothing else (no tar reading, no tensor, no caption), in as many processes as the
  loaders have workers.
- ``open_clip``: open_clip_train's own pipeline, ``open_clip_train.data.get_wds_dataset`` with
  ``open_clip.image_transform(224, is_train=True)`` and its tokenizer.
- ``mmcl_train``: the stream training builds (``build_train_stream`` with the model's `ImageSpec`, defaults:
  draft decoding, uint8 batches), tokenizing and collating included; its uint8 batches are the measured output
  (training finishes them on the GPU). ``mmcl_train_float`` also finishes them here, on the CPU (float32,
  normalised: what open_clip's workers hand over).
- ``mmcl_device_bytes`` (not in the default list): the stream with ``data.decode=device``, its batches of encoded
  JPEGs and crop boxes the measured output (what the loader costs when the GPU decodes); ``mmcl_device_cpu``
  decodes, crops and finishes them here too, on the CPU (libjpeg-turbo at full size, no draft).

All three are counted in samples per CPU second (this process and its workers).

    python bench/bench_data.py --rss [--rss-samples 1000,10000,100000] [--loaders mmcl_train,open_clip]

measures instead the resident memory of each data worker (and of this process) after 1k, 10k and 100k samples
of small images (about 110 px, so that 100k samples take minutes), the stream going round its shards.

Prints one JSON line per loader and round, then one line of ratios against the first loader: best round of
each loader, the median over rounds of the ratio within a round, and the ratio of median samples per CPU second
(the loaders' own cost, which the load of a shared machine does not change).
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import platform
import tempfile
import time
import warnings

import numpy as np
import torch
from harness import tree_cpu_seconds  # bench/harness.py
from PIL import Image, ImageDraw


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


class LaionLike:
    """LAION-like photos: the long side uniform in 500-1100 px, the aspect ratio log-uniform in 1:2-2:1 (the
    short side at least 500 px), quality 85-95, about 100 kB. Smooth colour gradients (a few-pixel random field
    upsampled bicubically), mid-frequency texture (a 1/16-scale random field) and sensor-like noise (a window of one
    fixed noise field, so that making them costs little), which make JPEG sizes like photos'."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.noise = rng.normal(0, 1, size=(1100 + 64, 1100 + 64, 3)).astype(np.float32)

    def __call__(self) -> bytes:
        rng = self.rng
        long_side = int(rng.integers(500, 1101))
        aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
        short = max(500, int(long_side / max(aspect, 1 / aspect)))
        w, h = (long_side, short) if aspect >= 1 else (short, long_side)
        coarse = rng.uniform(0, 255, size=(int(rng.integers(3, 9)), int(rng.integers(3, 9)), 3)).astype(np.uint8)
        img = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.float32)
        texture = rng.integers(88, 168, size=(h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
        img += np.asarray(Image.fromarray(texture).resize((w, h), Image.BICUBIC), dtype=np.float32) - 128
        y, x = rng.integers(0, 64, 2)
        img += float(rng.uniform(2.5, 5.5)) * self.noise[y:y + h, x:x + w]
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG",
                                                                     quality=int(rng.integers(85, 96)))
        return buf.getvalue()


def make_shards(folder: str, n: int, per_shard: int, images: str = "small") -> str:
    from mmcl.shards.writer import write_shards

    rng = np.random.default_rng(0)
    laion = LaionLike(rng) if images == "laion" else None

    def image() -> bytes:
        if laion is not None:
            return laion()
        if images == "tiny":
            return photo_like(rng, int(rng.integers(96, 128)), int(rng.integers(96, 128)))
        return photo_like(rng, int(rng.integers(420, 640)), int(rng.integers(380, 560)))

    def samples():
        for i in range(n):
            yield {"key": f"{i:07d}", "image": image(), "ext": "jpg",
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


def open_clip_loader(spec, samples, batch, workers, resampled=False):
    """open_clip_train's own training pipeline (`get_wds_dataset`) with open_clip's 224 px train transform."""
    import argparse as ap

    import open_clip
    import open_clip_train.data as ocd
    from webdataset import tariterators

    # open_clip-torch 3.3 pins webdataset <= 0.2.86; webdataset 1.0 (installed here) ends each shard with an empty
    # marker that open_clip_train's grouping cannot read. Without the marker it reads as with 0.2.x (the workers,
    # forked, inherit this).
    ocd.tar_file_expander = functools.partial(tariterators.tar_file_expander, eof_value=None)
    args = ap.Namespace(train_data=spec, val_data=None, train_num_samples=samples, batch_size=batch,
                        workers=workers, world_size=1, seed=0, dataset_resampled=resampled,
                        train_data_upsampling_factors=None)
    preprocess = open_clip.image_transform(224, is_train=True)
    return ocd.get_wds_dataset(args, preprocess, is_train=True, epoch=0,
                           tokenizer=open_clip.get_tokenizer("ViT-B-32")).dataloader


def mmcl_train_loader(spec, batch, workers, shuffle, finish_on_device=False, decode="worker"):
    """mmcl's stream as training builds it: the transform made from the model's image numbers, defaults. Its
    batches hold uint8 images; with `finish_on_device` they are what is measured (in training the float
    conversion and normalisation run on the GPU), otherwise they are finished here, on the CPU (counted)."""
    import open_clip
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    from mmcl.config import DataConfig
    from mmcl.data import ImageSpec, build_train_stream

    cfg = DataConfig(train=spec, batch_size=batch, workers=workers, shuffle_buffer=shuffle, decode=decode)
    spec_ = ImageSpec(size=224, mean=OPENAI_DATASET_MEAN, std=OPENAI_DATASET_STD)
    stream = build_train_stream(cfg, spec_, open_clip.get_tokenizer("ViT-B-32"), seed=0)
    stream.finish_on_device = finish_on_device
    return stream


def shard_images(spec: str) -> list:
    """The encoded images of the shards, in order."""
    from mmcl.data import TarReader, expand_urls

    out = []
    for url in expand_urls(spec):
        with open(url, "rb") as f:
            reader = TarReader(f)
            for member in reader:
                name = getattr(member, "name", str(member))
                data = reader.read()
                if name.endswith(".jpg"):
                    out.append(data)
    return out


def floor_decode(data: bytes, size: int = 224) -> Image.Image:
    """The floor of decoding one training image: the smallest DCT scale that keeps a `size` px centre square,
    and one bicubic resize of that square to `size` x `size`."""
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (size, size))
    w, h = img.size
    side = min(w, h)
    box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
    return img.convert("RGB").resize((size, size), Image.BICUBIC, box=box)


def _floor_share(args) -> int:
    start, n, step = args
    for i in range(start, n, step):
        floor_decode(_FLOOR_BLOBS[i % len(_FLOOR_BLOBS)])
    return n


_FLOOR_BLOBS: list = []


def measure_floor(blobs: list, n: int, workers: int):
    """(samples per wall second, samples per CPU second) of `floor_decode` over `n` images, shared among
    `workers` processes as the loaders' work is (so that all run with the same parallelism on the machine)."""
    import multiprocessing

    global _FLOOR_BLOBS
    _FLOOR_BLOBS = blobs
    workers = max(1, workers)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(_floor_share, [(i, 2 * workers, workers) for i in range(workers)])  # started and warm
        c0, t0 = cpu_seconds(), time.perf_counter()
        pool.map(_floor_share, [(i, n, workers) for i in range(workers)], chunksize=1)
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return n / elapsed, n / cpu


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
    """The float images a model would get from `batch`: mmcl's uint8 batches are finished here (counted), unless
    the loader is marked ``finish_on_device`` (training finishes them on the GPU: the uint8 batch is the input)."""
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if "jpeg" in batch:  # data.decode=device: encoded JPEGs; decoded here on the CPU unless measured as sent
        if getattr(loader, "finish_on_device", False):
            return batch["jpeg"]
        return loader.finish_images.batch(batch, torch.device("cpu"))
    if getattr(loader, "finish_on_device", False):
        return batch["image"]
    return loader.finish_images(batch["image"])


def measure(loader, n_batches: int, batch: int):
    """(samples per wall second, samples per CPU second) over n_batches after the first batch (worker
    start-up and the first shuffle fill excluded)."""
    it = iter(loader)
    first = model_input(loader, next(it))
    assert first.dtype == torch.uint8 and first.dim() == 1 or first.shape[-1] == 224 and first.dtype in (
        torch.float32, torch.uint8)
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(n_batches):
        model_input(loader, next(it))
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    if hasattr(it, "close"):
        it.close()
    if hasattr(it, "_shutdown_workers"):  # open_clip's loader keeps its workers between iterations
        it._shutdown_workers()
    del it
    return n_batches * batch / elapsed, n_batches * batch / cpu


def rss_mb(pid: int) -> dict:
    """Resident and unique (USS) memory of process `pid`, MB."""
    import psutil

    info = psutil.Process(pid).memory_full_info()
    return {"rss_mb": round(info.rss / 2**20, 1), "uss_mb": round(info.uss / 2**20, 1)}


def measure_rss(loader, batch: int, marks: list) -> list:
    """Memory of this process and of each data worker when `marks` (sample counts) have been consumed."""
    import psutil

    out, seen, marks = [], 0, sorted(marks)
    it = iter(loader)
    t0 = time.perf_counter()
    while marks:
        model_input(loader, next(it))
        seen += batch
        if seen >= marks[0]:
            workers = [p.pid for p in psutil.Process(os.getpid()).children(recursive=True)]
            out.append({"samples": marks.pop(0), "seconds": round(time.perf_counter() - t0, 1),
                        "main": rss_mb(os.getpid()), "workers": [rss_mb(pid) for pid in workers]})
    if hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    del it
    return out


LOADERS = ("webdataset", "mmcl", "mmcl_fast_decode", "mmcl_fast_decode_uint8")
LAION_LOADERS = ("floor", "open_clip", "mmcl_train", "mmcl_train_float")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1536)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--shuffle", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loaders", default=None,
                        help=f"comma-separated loaders to run (default: all of {','.join(LOADERS)}; with --images "
                             f"laion {','.join(LAION_LOADERS)}; with --rss mmcl_train)")
    parser.add_argument("--images", choices=("small", "laion"), default="small",
                        help="small: photo-like JPEGs of about 500 px; laion: LAION-like photos (500-1100 px)")
    parser.add_argument("--rss", action="store_true", help="measure the data workers' memory instead")
    parser.add_argument("--rss-samples", default="1000,10000,100000")
    parser.add_argument("--dir", default=None, help="where to write the shards (default: a temporary folder)")
    args = parser.parse_args()
    if args.rss:
        return main_rss(args)
    if args.loaders is None:
        args.loaders = ",".join(LAION_LOADERS if args.images == "laion" else LOADERS)

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
        spec = make_shards(tmp, args.samples, args.per_shard, args.images)
        blobs = shard_images(spec) if "floor" in args.loaders.split(",") else []
        print(json.dumps({"bench": "data", "event": "shards_written", "samples": args.samples,
                          "images": args.images, "seconds": round(time.perf_counter() - t0, 1),
                          "mean_jpeg_kb": round(sum(map(len, blobs)) / max(1, len(blobs)) / 1e3, 1)}), flush=True)
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
            "floor": lambda: "floor",
            "open_clip": lambda: open_clip_loader(spec, args.samples, args.batch, args.workers),
            "mmcl_train": lambda: mmcl_train_loader(spec, args.batch, args.workers, args.shuffle, True),
            "mmcl_train_float": lambda: mmcl_train_loader(spec, args.batch, args.workers, args.shuffle),
            # data.decode=device: the workers' batches of encoded JPEGs (what a GPU run's loader costs), and the same
            # decoded, cropped and finished here on the CPU (what the device's decode costs when it is a CPU).
            "mmcl_device_bytes": lambda: mmcl_train_loader(spec, args.batch, args.workers, args.shuffle, True,
                                                           "device"),
            "mmcl_device_cpu": lambda: mmcl_train_loader(spec, args.batch, args.workers, args.shuffle, False,
                                                         "device"),
        }
        order = args.loaders.split(",")
        loaders = {name: loaders[name] for name in order}
        best, rates, per_cpu = {}, {name: [] for name in loaders}, {name: [] for name in loaders}
        for rnd in range(args.rounds):
            for name, make in loaders.items():
                loader = make()
                if loader == "floor":
                    rate, cpu_rate = measure_floor(blobs, n_batches * args.batch, args.workers)
                else:
                    rate, cpu_rate = measure(loader, n_batches, args.batch)
                del loader
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
        summary["samples_per_cpu_s"] = {k: round(float(np.median(v)), 1) for k, v in per_cpu.items()}
        print(json.dumps(summary), flush=True)


def main_rss(args) -> None:
    """`--rss`: the memory of each data worker after each of `--rss-samples` samples, per loader."""
    warnings.filterwarnings("ignore")
    marks = [int(x) for x in args.rss_samples.split(",")]
    names = (args.loaders or "mmcl_train").split(",")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        spec = make_shards(tmp, args.samples, args.per_shard, "tiny")
        for name in names:
            if name == "mmcl_train":
                loader = mmcl_train_loader(spec, args.batch, args.workers, args.shuffle, True)
            elif name == "open_clip":  # resampled: an endless stream, as mmcl's
                loader = open_clip_loader(spec, max(marks) + 10 * args.batch, args.batch, args.workers, True)
            else:
                raise SystemExit(f"--rss measures mmcl_train or open_clip, not {name}")
            for row in measure_rss(loader, args.batch, marks):
                print(json.dumps({"bench": "data_rss", "loader": name, "workers": args.workers,
                                  "batch": args.batch, "image_px": "96-128", **row}), flush=True)
            del loader


if __name__ == "__main__":
    main()
