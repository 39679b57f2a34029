"""Peak memory and fwd+bwd time of open_clip's ClipLoss (or SigLipLoss) vs mmcl's tiled loss, float32 on CPU.

Each case runs in a fresh subprocess so its peak RSS is its own: the growth of the peak RSS (VmHWM, reset
once the inputs exist and after a small warm-up that loads kernels and thread pools; ``ru_maxrss`` where the
reset is unavailable) over the RSS at that point. Time is the
median over repeats of one forward+backward, which produces the gradients of both feature sets and of the
logit scale. Prints one JSON line per measurement, then one per N with the ratios tiled / ClipLoss.

    nice python bench/bench_losses.py [--loss clip supcon siglip debiased hard_negative mochi]
                                      [--sizes 4096 16384] [--scales 14.3 100] [--align random aligned]
                                      [--dim 512] [--chunk 1024] [--repeats 3] [--threads T]

Op-count mode (``--op-count``): dispatched ops (each at most one kernel launch on a GPU) and host syncs of one
rank's tiled forward+backward, counted with tests/syncwatch.py's dispatch mode, for ranks of ``--sizes`` rows in a
``--world``-process job, with the CPU's tile (2^22 logits) and the tile an 80 GB GPU gets (`cuda_tile_elements`).
The count depends only on the tile grid (row blocks x column tiles per pass), not on the device or the widths, so it
is counted on a replica with the same grid and 2-row tiles of 8-wide features, which runs in seconds on a CPU at
any batch size; ``--full-size`` counts at the real shapes on the meta device instead (no memory, no arithmetic; a
package whose losses read device values on the host cannot run there). SupCon's per-class tables add a few ops per
block of feature columns, which the replica's narrow features do not have: count it with ``--full-size``.

    python bench/bench_losses.py --op-count [--loss clip siglip supcon] [--sizes 32768] [--world 8] [--chunk 1024]

For memory figures stable to about 1 MiB, run with ``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment (it
reaches every case's process): glibc otherwise raises its mmap threshold after the first large free, later tiles
come from the heap, and the peak RSS of the same case varies by tens of MiB with allocation order (measured
156-214 MiB for tiled clip at N=16384; 89.5-90.0 MiB at N=8192 with the fixed threshold).

Every loss is measured at each logit scale and feature alignment (random, aligned, near-duplicate pairs); the
ratio lines divide by the reference measured in the same run (for supcon, debiased and hard_negative the loss
value differs from ClipLoss's by definition, only time and memory compare).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

# ClipLoss peaks at about four N x N float32 matrices (4.0 GiB measured at N=16384).
CLIPLOSS_MATRICES = 4


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where that is not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(resettable: bool) -> int:
    if resettable:
        return _status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


REFERENCE = {"clip": "ClipLoss", "supcon": "ClipLoss", "debiased": "ClipLoss", "hard_negative": "ClipLoss",
             "siglip": "SigLipLoss", "mochi": "mmcl_dense_mochi"}


def features(n: int, dim: int, align: str, generator):
    """L2-normalised (image, text) pairs. random: independent (a randomly initialised model); aligned: each text
    at cosine ~0.9 to its image (a trained model); duplicate: cosine ~0.999 (near-duplicate pairs)."""
    import torch
    import torch.nn.functional as F

    img = F.normalize(torch.randn(n, dim, generator=generator), dim=1)
    noise = torch.randn(n, dim, generator=generator) / dim ** 0.5  # unit-norm-ish noise
    if align == "random":
        txt = F.normalize(noise, dim=1)
    else:
        txt = F.normalize(img + {"aligned": 0.5, "duplicate": 0.05}[align] * noise, dim=1)
    return img, txt


def make_loss(impl: str, n: int, dim: int, chunk: int, kind: str, device: str = "cpu"):
    """The loss as a function of (image, text, scale): the reference for impl "reference", else mmcl's tiled
    (SigLIP's bias and, for mochi and supcon, the queues and labels on `device`)."""
    import torch
    import torch.nn.functional as F

    bias = torch.tensor(-10.0, device=device, requires_grad=True)  # SigLIP's learned bias at its usual initial value
    labels = None
    if kind == "mochi":
        # open_clip has no MoCHi: the reference is mmcl's own dense form. Queues of N past features each, the
        # defaults of configs/mochi.yaml for the mixing (n_hard 64, s 32, s' 16).
        from mmcl.losses import mochi_loss

        g0 = torch.Generator().manual_seed(1)
        queues = [F.normalize(torch.randn(n, dim, generator=g0), dim=1).to(device) for _ in range(2)]
        tile = None if impl == "reference" else chunk

        def loss_fn(i, t, s):
            qi, qt = queues if i.shape[0] == n else (None, None)  # the small warm-up call runs without queues
            return mochi_loss(i, t, s, 64, 32, 16, 0.5, torch.Generator().manual_seed(0), qi, qt, chunk_size=tile)
    elif impl == "reference" and kind == "siglip":
        from open_clip.loss import SigLipLoss

        siglip = SigLipLoss()

        def loss_fn(i, t, s):
            return siglip(i, t, s, bias)
    elif impl == "reference":
        from open_clip.loss import ClipLoss

        clip = ClipLoss()

        def loss_fn(i, t, s):
            return clip(i, t, s)
    elif kind == "siglip":
        from mmcl.losses import siglip_loss

        def loss_fn(i, t, s):
            return siglip_loss(i, t, s, bias, chunk_size=chunk)
    elif kind == "supcon":
        from mmcl.losses import supcon_loss

        # 100 classes: every pair has about N / 100 positives in each direction.
        labels = torch.arange(n, device=device) % 100

        def loss_fn(i, t, s):
            return supcon_loss(i, t, labels[:i.shape[0]], s, chunk_size=chunk)
    elif kind in ("debiased", "hard_negative"):
        from mmcl.losses import hard_negative_clip_loss

        beta = 0.0 if kind == "debiased" else 1.0  # tau_plus 0.1 as in Chuang et al.; beta 1 (Robinson et al.)

        def loss_fn(i, t, s):
            return hard_negative_clip_loss(i, t, s, 0.1, beta, chunk_size=chunk)
    else:
        from mmcl.losses import clip_loss

        def loss_fn(i, t, s):
            return clip_loss(i, t, s, chunk_size=chunk)

    return loss_fn


def run_case(impl: str, n: int, dim: int, chunk: int, repeats: int, threads: int, kind: str = "clip",
             scale_value: float = 14.3, align: str = "random") -> dict:
    import torch
    import torch.nn.functional as F

    if threads > 0:
        torch.set_num_threads(threads)

    loss_fn = make_loss(impl, n, dim, chunk, kind)

    g = torch.Generator().manual_seed(0)
    # Warm-up at a small size: kernels, thread pools and allocator arenas are not the loss's memory.
    w_img = F.normalize(torch.randn(256, dim, generator=g), dim=1).requires_grad_(True)
    w_txt = F.normalize(torch.randn(256, dim, generator=g), dim=1).requires_grad_(True)
    loss_fn(w_img, w_txt, torch.tensor(14.3, requires_grad=True)).backward()
    del w_img, w_txt

    img, txt = features(n, dim, align, g)
    img, txt = img.requires_grad_(True), txt.requires_grad_(True)
    scale = torch.tensor(scale_value, requires_grad=True)
    # Creating the inputs passed through temporaries larger than what stays resident; the peak mark is reset
    # so that it measures the loss alone (ru_maxrss cannot be reset and would hide up to that overshoot).
    resettable = _reset_peak_rss()
    baseline = _status_bytes("VmRSS") if resettable else _peak_rss_bytes(False)

    times, value = [], None
    for _ in range(repeats):
        img.grad = txt.grad = scale.grad = None
        start = time.perf_counter()
        loss = loss_fn(img, txt, scale)
        loss.backward()
        times.append(time.perf_counter() - start)
        value = loss.item()
        del loss
    return {
        "bench": f"{kind}_loss_fwd_bwd",
        "impl": REFERENCE[kind] if impl == "reference" else f"mmcl_tiled_chunk{chunk}",
        "scale": scale_value,
        "align": align,
        "device": "cpu",
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "load_avg_1min": os.getloadavg()[0],
        "dtype": "float32",
        "batch": n,
        "dim": dim,
        "repeats": repeats,
        "time_s_median": statistics.median(times),
        "time_s_all": [round(t, 4) for t in times],
        "pairs_per_s": n / statistics.median(times),
        "peak_mem_growth_mib": (_peak_rss_bytes(resettable) - baseline) / 2**20,
        "peak_source": "VmHWM after clear_refs" if resettable else "ru_maxrss",
        "loss": value,
        "grad_scale": float(scale.grad),
    }


def run_interleaved(n: int, dim: int, chunk: int, rounds: int, threads: int, kind: str, scale_value: float,
                    align: str) -> dict:
    """Time ratio tiled / reference from one process that alternates the two (reference first in odd rounds,
    tiled first in even ones), so that a machine shared with other jobs slows both alike; memory is measured
    by the separate-process runs."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    fns = {impl: make_loss(impl, n, dim, chunk, kind) for impl in ("reference", "tiled")}
    g = torch.Generator().manual_seed(0)
    img, txt = features(n, dim, align, g)
    img, txt = img.requires_grad_(True), txt.requires_grad_(True)
    scale = torch.tensor(scale_value, requires_grad=True)

    def once(impl):
        img.grad = txt.grad = scale.grad = None
        start = time.perf_counter()
        fns[impl](img, txt, scale).backward()
        return time.perf_counter() - start

    for impl in fns:  # warm-up at full size: allocator arenas and thread pools
        once(impl)
    times = {"reference": [], "tiled": []}
    for r in range(rounds):
        for impl in (("reference", "tiled") if r % 2 == 0 else ("tiled", "reference")):
            times[impl].append(once(impl))
    ratios = [t / ref for t, ref in zip(times["tiled"], times["reference"])]
    return {
        "bench": f"{kind}_loss_interleaved", "reference": REFERENCE[kind], "batch": n, "dim": dim, "chunk": chunk,
        "scale": scale_value, "align": align, "threads": torch.get_num_threads(), "rounds": rounds,
        "load_avg_1min": os.getloadavg()[0], "cpu": _cpu_name(),
        "reference_s": [round(t, 3) for t in times["reference"]], "tiled_s": [round(t, 3) for t in times["tiled"]],
        "time_ratio_median": statistics.median(ratios), "time_ratio_all": [round(x, 3) for x in ratios],
    }


def _tile_policies():
    """(name, logits per tile) of the CPU's tile and of an 80 GB GPU's (absent from packages without the choice)."""
    from mmcl.losses import tiling

    policies = [("cpu", 1 << 22)]
    if hasattr(tiling, "cuda_tile_elements"):
        policies.append(("cuda_80GB", tiling.cuda_tile_elements(80 * 10 ** 9)))
    return policies


def count_ops(kind: str, n: int, world: int, chunk: int, tile: int, full_size: bool, dim: int) -> dict:
    """Ops and host syncs of one rank's tiled fwd+bwd of `kind` at n rows per rank x `world` ranks (see the module
    docstring: a replica with the same tile grid unless `full_size`)."""
    import math

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import mmcl
    from mmcl import losses
    from mmcl.losses import tiling

    from syncwatch import SyncWatch

    m = n * world
    width = min(m, max(chunk, tile // chunk))
    row_blocks, col_tiles = math.ceil(n / chunk), math.ceil(m / width)
    if full_size:
        device, rows, cols, c, e, d = "meta", n, m, chunk, tile, dim
    else:  # 2-row tiles, as many row blocks and column tiles as at the real size
        c, device, d = 2, "cpu", 8
        rows = row_blocks * c
        w = max(c, math.ceil(rows * world / col_tiles))  # columns per tile
        cols = col_tiles * w if world > 1 else rows  # one process: the columns are the rows
        e = c * w
    tiling._TILE_ELEMENTS = e  # the tile of the chosen policy on this process's device
    g = torch.Generator().manual_seed(0)

    def feats(k):
        if device == "meta":
            return torch.empty(k, d, device="meta", requires_grad=True)
        return F.normalize(torch.randn(k, d, generator=g), dim=1).requires_grad_(True)

    q_img, q_txt = feats(rows), feats(rows)
    gathered = None
    if world > 1:
        gathered = losses.Gathered(feats(cols), feats(cols), offset=cols - rows)
    scale = torch.full((), 14.3, device=device).requires_grad_(True)
    bias = torch.full((), -5.0, device=device).requires_grad_(True)
    with SyncWatch() as watch:
        if kind == "clip":
            loss = losses.clip_loss(q_img, q_txt, scale, c, gathered=gathered)
        elif kind == "supcon":
            labels = torch.arange(cols, device=device) % max(2, cols // 3)
            if gathered is not None:
                gathered = gathered._replace(all_labels=labels)
            loss = losses.supcon_loss(q_img, q_txt, labels[cols - rows:], scale, c, gathered=gathered)
        elif kind == "siglip":
            loss = losses.siglip_loss(q_img, q_txt, scale, bias, chunk_size=c, gathered=gathered)
        else:
            raise SystemExit(f"--op-count measures clip, supcon or siglip (got {kind})")
        loss.backward()
    return {"bench": f"{kind}_loss_ops_per_step", "rows_per_rank": n, "world": world, "chunk": chunk,
            "tile_logits": tile, "row_blocks": row_blocks, "column_tiles_per_block": col_tiles,
            "counted_on": "meta, full size" if full_size else f"replica grid {rows} x {cols} rows/cols",
            "ops": watch.op_count, "host_syncs": watch.count, "mmcl": os.path.dirname(mmcl.__file__)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", nargs="+", choices=tuple(REFERENCE), default=["clip"],
                        help="tiled losses to measure; clip, supcon, debiased and hard_negative are compared with "
                             "open_clip's ClipLoss (measured once per case), siglip with SigLipLoss, mochi with "
                             "mmcl's dense MoCHi (open_clip has none)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--scales", type=float, nargs="+", default=[14.3, 100.0],
                        help="logit scales (14.3 = CLIP's initial 1/0.07, 100 = its trained maximum)")
    parser.add_argument("--align", nargs="+", choices=("random", "aligned", "duplicate"),
                        default=["random", "aligned"], help="how the text features relate to the images")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-repeats-65536", type=int, default=1,
                        help="repeats at N >= 65536, where one fwd+bwd takes minutes on 2 cores")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per case (0: torch's default)")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="time only: per case one process alternating reference and tiled ROUNDS times "
                             "(the ratio stays meaningful on a machine shared with other jobs)")
    parser.add_argument("--tiled-only", action="store_true",
                        help="measure mmcl's tiled losses alone (memory ratios then divide by a reference measured "
                             "in another run: ClipLoss's allocation does not depend on the scale or the features, "
                             "while its time at scale 100 with aligned pairs runs past 1000 s at N=16384)")
    parser.add_argument("--op-count", action="store_true",
                        help="count dispatched ops and host syncs per tiled step instead of timing (see above)")
    parser.add_argument("--world", type=int, default=8, help="--op-count: processes of the job")
    parser.add_argument("--full-size", action="store_true", help="--op-count: at the real shapes on the meta device")
    parser.add_argument("--case", nargs=5, metavar=("IMPL", "N", "KIND", "SCALE", "ALIGN"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.op_count:
        for n in args.sizes:
            for kind in args.loss:
                for policy, tile in _tile_policies():
                    out = count_ops(kind, n, args.world, args.chunk, tile, args.full_size, args.dim)
                    print(json.dumps(dict(out, tile_policy=policy)), flush=True)
        return

    if args.interleave:
        for n in args.sizes:
            for scale in args.scales:
                for align in args.align:
                    for kind in args.loss:
                        print(json.dumps(run_interleaved(n, args.dim, args.chunk, args.interleave, args.threads,
                                                         kind, scale, align)), flush=True)
        return

    if args.case:  # child process: one measurement
        impl, n, kind, scale, align = args.case
        print(json.dumps(run_case(impl, int(n), args.dim, args.chunk, args.repeats, args.threads, kind,
                                  float(scale), align)), flush=True)
        return

    def measure(impl, n, kind, scale, align, repeats):
        cmd = [sys.executable, __file__, "--case", impl, str(n), kind, str(scale), align, "--dim", str(args.dim),
               "--chunk", str(args.chunk), "--repeats", str(repeats), "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(json.dumps({"bench": f"{kind}_loss_fwd_bwd", "impl": impl, "batch": n, "scale": scale,
                              "align": align, "error": out.stderr.strip().splitlines()[-1:]}), flush=True)
            return None
        line = out.stdout.strip().splitlines()[-1]
        print(line, flush=True)
        return json.loads(line)

    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for n in args.sizes:
        repeats = args.repeats if n < 65536 else min(args.repeats, args.max_repeats_65536)
        for scale in args.scales:
            for align in args.align:
                references = {}  # one measurement of each reference per case, shared by the losses it serves
                for kind in args.loss:
                    ref_name = REFERENCE[kind]
                    if args.tiled_only:
                        references[ref_name] = None
                    if ref_name not in references:
                        need = CLIPLOSS_MATRICES * n * n * 4
                        if ref_name != "mmcl_dense_mochi" and need > 0.8 * have:
                            print(json.dumps({"bench": f"{kind}_loss_fwd_bwd", "impl": ref_name, "batch": n,
                                              "skipped": f"{ref_name} needs about {need / 2**30:.0f} GiB for N={n} "
                                              f"(four N x N float32 matrices at its peak); this machine has "
                                              f"{have / 2**30:.0f} GiB"}), flush=True)
                            references[ref_name] = None
                        else:
                            references[ref_name] = measure("reference", n, kind, scale, align, repeats)
                    ours = measure("tiled", n, kind, scale, align, repeats)
                    ref = references[ref_name]
                    if ref is None or ours is None:
                        continue
                    ratio = {
                        "bench": f"{kind}_loss_ratio", "reference": ref_name, "batch": n, "dim": args.dim,
                        "chunk": args.chunk, "scale": scale, "align": align,
                        "time_ratio_tiled_over_reference": ours["time_s_median"] / ref["time_s_median"],
                        "mem_ratio_tiled_over_reference": ours["peak_mem_growth_mib"] / ref["peak_mem_growth_mib"],
                    }
                    if kind in ("clip", "siglip", "mochi"):  # the same loss as its reference
                        ratio["loss_abs_diff_vs_reference"] = abs(ours["loss"] - ref["loss"])
                    print(json.dumps(ratio), flush=True)


if __name__ == "__main__":
    main()
