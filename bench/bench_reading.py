"""Tar reading: mmcl's reader (`mmcl.data.reading.read_raw_samples`) against webdataset's own tar iteration, on the
same generated shards of JPEGs, and what each does with the inputs mmcl must survive.

    python bench/bench_reading.py [--images tiny|laion] [--shards 4] [--per-shard 500] [--rounds 3]

Throughput: raw samples (a sample's undecoded members, grouped by key) per CPU second of this process, best round,
for

- ``mmcl``: ``read_raw_samples`` over the shard plan (members read: ``jpg``, ``txt``, ``cls``, ``json``);
- ``wds_tarfile_samples``: ``webdataset.tariterators.tarfile_samples`` (``url_opener`` -> ``tar_file_expander`` ->
  ``group_by_keys``), the reader under every webdataset pipeline;
- ``wds_pipeline``: ``wds.WebDataset(urls, shardshuffle=False)`` iterated without decoding.

``--images tiny`` writes photo-like JPEGs of about 110 px (a few kB: the reader's own cost shows), ``laion``
bench_data's `LaionLike` photos (about 100 kB: reading is mostly copying bytes).

Then one JSON line per property mmcl needs, each measured on both readers:

- ``size_limit``: a gzip shard whose first sample holds a member of 64 MiB of zeros (64 kB on disk), read with
  ``max_member_bytes`` 1 MiB: the peak of Python allocations (tracemalloc) and what each reader gives for it;
- ``truncated``: a shard cut inside a member and one cut inside a header: what each reader yields and raises;
- ``resume``: seconds to the first sample after resuming at the last sample of the last shard (mmcl passes over
  the samples before it by their headers; webdataset has no position within a shard, so a caller reads and drops
  them).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
import tarfile
import tempfile
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_data import LaionLike, photo_like  # noqa: E402  (bench/bench_data.py)

MEMBERS = ("jpg", "txt", "cls", "json")


def make_shards(folder: str, images: str, shards: int, per_shard: int):
    from mmcl.shards.writer import write_shards

    rng = np.random.default_rng(0)
    laion = LaionLike(rng) if images == "laion" else None

    def samples():
        for i in range(shards * per_shard):
            data = laion() if laion else photo_like(rng, int(rng.integers(96, 128)), int(rng.integers(96, 128)))
            yield {"key": f"{i:07d}", "image": data, "ext": "jpg", "caption": f"a photo number {i}", "label": i % 10,
                   "json": {"i": i}}

    return write_shards(samples(), folder, shard_size=per_shard)["shards"]


def read_mmcl(urls, **kw):
    from mmcl.data.reading import read_raw_samples

    return read_raw_samples([(u, None) for u in urls], members=MEMBERS, **kw)


def read_wds(urls, handler=None):
    from webdataset import handlers
    from webdataset.tariterators import tarfile_samples

    return tarfile_samples([{"url": u} for u in urls], handler=handler or handlers.reraise_exception)


def read_wds_pipeline(urls):
    import webdataset as wds

    return iter(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


READERS = {"mmcl": read_mmcl, "wds_tarfile_samples": read_wds, "wds_pipeline": read_wds_pipeline}


def throughput(urls, rounds: int):
    results = {}
    for rnd in range(rounds):
        for name, reader in READERS.items():
            cpu, wall = time.process_time(), time.perf_counter()
            n = sum(1 for _ in reader(urls))
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(json.dumps({"measurement": "throughput", "reader": name, "round": rnd, "samples": n,
                              "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                              "samples_per_cpu_s": round(n / cpu, 1)}), flush=True)
            results.setdefault(name, []).append(n / cpu)
    best = {k: round(max(v), 1) for k, v in results.items()}
    print(json.dumps({"measurement": "throughput_best", "samples_per_cpu_s": best,
                      "wds_over_mmcl": {k: round(v / best["mmcl"], 3) for k, v in best.items()}}), flush=True)


def _tar_bytes(members, compress: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0) if compress else buf.getvalue()


def _outcome(fn):
    """(what a reader yielded, the exception it raised or None), with the peak of Python allocations."""
    import warnings

    tracemalloc.start()
    got, error = [], None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for item in fn():
                got.append(item)
    except Exception as err:
        error = f"{type(err).__name__}: {str(err)[:120]}"
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return got, error, peak


def _shown(items):
    out = []
    for item in items:
        if hasattr(item, "pos"):  # a RawSample
            out.append({"key": item.key, "index": item.index, "error": item.error,
                        "members": sorted(item.files) if item.files is not None else None})
        else:
            out.append({"key": item.get("__key__"), "members": sorted(k for k in item if not k.startswith("__"))})
    return out


def properties(folder: str):
    from webdataset import handlers

    big = os.path.join(folder, "big.tar.gz")
    with open(big, "wb") as f:
        f.write(_tar_bytes([("a.jpg", b"\0" * (64 << 20)), ("a.txt", b"big"), ("b.jpg", b"x"), ("b.txt", b"ok")],
                           compress=True))
    for name, fn in (("mmcl", lambda: read_mmcl([big], max_member_bytes=1 << 20)),
                     ("wds_tarfile_samples", lambda: read_wds([big]))):
        got, error, peak = _outcome(fn)
        print(json.dumps({"measurement": "size_limit", "reader": name, "on_disk_bytes": os.path.getsize(big),
                          "peak_python_alloc_mib": round(peak / 2 ** 20, 1), "yielded": _shown(got),
                          "raised": error}), flush=True)
    whole = _tar_bytes([(f"{i:03d}.{ext}", os.urandom(3000) if ext == "jpg" else b"caption")
                        for i in range(4) for ext in ("jpg", "txt")])
    # Members are 512-byte header + 3072 (jpg) or 512 (txt) bytes: sample 2's jpg data starts at 2 * 4608 + 512.
    cuts = {"inside_a_member": 2 * 4608 + 512 + 1000, "inside_a_header": 2 * 4608 + 200}
    for cut_name, cut in cuts.items():
        path = os.path.join(folder, f"cut-{cut_name}.tar")
        with open(path, "wb") as f:
            f.write(whole[:cut])
        for name, fn in (("mmcl", lambda: read_mmcl([path])),
                         ("wds_tarfile_samples", lambda: read_wds([path])),
                         ("wds_tarfile_samples_warn_and_continue",
                          lambda: read_wds([path], handler=handlers.warn_and_continue))):
            got, error, _ = _outcome(fn)
            print(json.dumps({"measurement": "truncated", "cut": cut_name, "reader": name, "yielded": _shown(got),
                              "raised": error}), flush=True)


def resume(urls, per_shard: int):
    last = len(urls) - 1
    t = time.perf_counter()
    first = next(iter(read_mmcl(urls, start=(last, per_shard - 1))))
    mmcl_s = time.perf_counter() - t
    t = time.perf_counter()
    stream = read_wds(urls)
    for _ in range(last * per_shard + per_shard - 1):
        next(stream)
    wds_first = next(stream)
    wds_s = time.perf_counter() - t
    print(json.dumps({"measurement": "resume", "at": [last, per_shard - 1],
                      "mmcl": {"seconds": round(mmcl_s, 4), "first_key": first.key},
                      "wds_read_and_drop": {"seconds": round(wds_s, 4), "first_key": wds_first["__key__"]}}),
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", choices=("tiny", "laion"), default="tiny")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--per-shard", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import webdataset

    with tempfile.TemporaryDirectory() as folder:
        urls = make_shards(folder, args.images, args.shards, args.per_shard)
        size = sum(os.path.getsize(u) for u in urls)
        print(json.dumps({"measurement": "setup", "images": args.images, "shards": len(urls),
                          "samples": args.shards * args.per_shard, "mb": round(size / 1e6, 1),
                          "python": sys.version.split()[0], "webdataset": webdataset.__version__,
                          "load_average": os.getloadavg()[0]}), flush=True)
        throughput(urls, args.rounds)
        resume(urls, args.per_shard)
        properties(folder)


if __name__ == "__main__":
    main()
