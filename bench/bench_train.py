"""End-to-end training throughput of mmcl against open_clip's own training script, on the same model and data.

Measured in one run, round by round; each figure is the median over rounds.

1. ``mmcl``: ``python -m mmcl train configs/tiny.yaml`` on the demo shards.
2. ``open_clip``: ``open_clip_train.main`` (open-clip-torch's training script, which needs pandas for CSV data)
   on the same images written as files + a tab-separated CSV (its webdataset path does not run with the
   installed webdataset), the model config registered with ``open_clip.add_model_config`` from a copy of
   ``mmcl/models/model_configs/<model>.json`` (or open_clip's own architecture, e.g. ``--model ViT-B-32``). The files
   hold the shards' own JPEG bytes, so both decode the same input.
3. ``pure`` (and mmcl's own step code on the same batches, ``mmcl_step_in_memory``, alternated with it in one
   process): the same model and objective trained on real batches of the same shards, decoded once and held
   in memory (no data loading, no logging): forward, loss, backward, gradient clipping and the AdamW step, i.e.
   what a training step cannot avoid; a forward + loss + backward figure is printed too. Real batches matter:
   the text tower's cost follows the batch's longest caption.

Both tools run as subprocesses with the same batch size, data workers, number of steps, precision, learning-rate
schedule, weight decay, AdamW betas/eps and gradient clipping. Throughput is timed the same way for both, from
outside: the arrival times of their periodic log records (mmcl's metrics.jsonl, open_clip's out.log) are taken
by polling the files, and samples/s = (samples at the last record - samples at the first record at or after
``--skip-steps``) / (time between them). That steady-state window excludes start-up and the final save and
includes everything else a step costs (data loading, logging, open_clip's per-epoch work). At each record the
CPU seconds of the process and its data-loader workers are read from /proc too, giving CPU ms per sample.

How they share the machine (``--mode``):

- ``sliced`` (the default on a CPU): all of them (mmcl, open_clip, the pure step loop, and the mmcl variant when asked
  for) are started at once, each in its own process group, and only one group runs at any moment: each gets
  ``--slice`` seconds in turn, the others being held with SIGSTOP. Each run's log records are then placed on
  its own clock of running time (wall time minus the time it was held). On a shared machine whose speed changes
  in phases of seconds to tens of seconds (this bench's machine switches between two speeds about 20 % apart,
  the bare step included), every run samples the same phases, so their ratios are not decided by which phase
  each happened to fall in, while no run ever competes with another for the cores.
- ``sequential`` (the default on a GPU, where a held process's queued kernels would go on running): one after
  the other, alternating the order each round (a run that falls in a slow phase loses against one in a fast
  phase).
- ``concurrent``: mmcl and open_clip (then mmcl and the pure loop) at the same time, timed over the same span;
  both then share the cores, which is a different measurement (throughput under contention).

Usage::

    nice .venv/bin/python bench/bench_train.py [--mode sliced|sequential|concurrent] [--rounds 3] [--steps 25]
    python bench/bench_train.py --model ViT-B-32 --precision bf16 --batch-size 256 --workers 8 --steps 60  # GPU
    # the GPU mode's code on a CPU (tests/test_bench_paths.py runs this, with dynamo off to skip code generation):
    python bench/bench_train.py --device cpu --mode sequential --compile yes --steps 3 --skip-steps 1 --log-every 1

On a GPU the default is ``--mode sequential --compile yes``: mmcl and open_clip, each plain and compiled
(``train.compile=true``, ``--torchcompile``), one after the other, all in the ``--precision`` given (bf16 for
the comparison). Each run reports samples/s per device (one process, one GPU), its peak memory (written by the
run's own process at exit: the CUDA allocator's peak, or the peak resident set on a CPU) and, with the step's
counted FLOPs, model FLOPs utilisation.

Prints one JSON line per measurement, then one summary line with the medians and the ratios (and, on a GPU,
model FLOPs utilisation: the step's FLOPs counted by torch's FlopCounterMode over the device's peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from harness import (  # bench/harness.py
    Run,
    Slicer,
    common_interval,
    on_own_clock,
    running_time,
    signal_group,
    steady_rate,
)

REPO = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = {  # dense bf16/fp16 tensor-core peak per GPU (NVIDIA datasheets), for MFU; fp32 needs --peak-tflops
    "H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 125.0,
}


def open_clip_model_name(model: str) -> str:
    """The name open_clip knows `model` by: mmcl's own configs are registered as ``mmcl-<name>`` copies."""
    return f"mmcl-{model}" if (REPO / "mmcl" / "models" / "model_configs" / f"{model}.json").exists() else model


def register_models(work: Path, model: str) -> None:
    (work / "oc-models").mkdir(parents=True, exist_ok=True)
    own = REPO / "mmcl" / "models" / "model_configs" / f"{model}.json"
    if own.exists():
        shutil.copy(own, work / "oc-models" / f"{open_clip_model_name(model)}.json")


def device_info(wanted: str = "auto") -> Tuple[str, str]:
    """("cuda" or "cpu", the device's name): `wanted` (auto: a GPU when there is one)."""
    import torch

    if wanted == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if wanted != "cpu" and torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(0)
    return "cpu", cpu_name()


def peak_flops(args, device: str, name: str) -> Optional[float]:
    """The device's peak FLOP/s for MFU: --peak-tflops, else the bf16/fp16 datasheet figure of a known GPU."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device == "cuda" and args.precision in ("bf16", "fp16"):
        for key, tflops in PEAK_TFLOPS.items():  # "H100 PCIe" is listed before "H100"
            if key in name:
                return tflops * 1e12
    return None
OPEN_CLIP_LINE = re.compile(r"Train Epoch: (\d+) \[\s*(\d+)/(\d+)")

# Both tools run under a wrapper that writes the process's peak memory at exit (MMCL_BENCH_PEAK): the CUDA caching
# allocator's peak on a GPU, the peak resident set size on a CPU (the main process; data workers are not counted).
PEAK_HOOK = """\
import atexit
import json
import os
import resource
import sys


def _write_peak():
    path = os.environ.get("MMCL_BENCH_PEAK")
    torch = sys.modules.get("torch")
    if not path:
        return
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak, kind = torch.cuda.max_memory_allocated(), "cuda_max_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max_rss"
    with open(path, "w") as f:
        json.dump({"peak_memory_bytes": peak, "peak_memory_kind": kind}, f)


atexit.register(_write_peak)
"""

MMCL_WRAPPER = PEAK_HOOK + """\
import runpy

sys.argv = ["mmcl", *sys.argv[1:]]
runpy.run_module("mmcl", run_name="__main__", alter_sys=True)
"""

OPEN_CLIP_WRAPPER = PEAK_HOOK + """\
import open_clip

open_clip.add_model_config(sys.argv[1])
from open_clip_train.main import main

main(sys.argv[2:])
"""


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------------------------------- data
def prepare_data(work: Path, n_train: int, image_size: int = 64, n_shards: int = 8) -> Tuple[str, Path, int]:
    """Demo shards for mmcl and the very same encoded images as files + a tab-separated CSV for open_clip."""
    from mmcl.shards.demo import make_demo_data

    # Enough shards that every mmcl worker reads its own shards (as with real data).
    paths = make_demo_data(str(work / "shards"), n_train=n_train, n_val=1, n_zeroshot=1, image_size=image_size,
                           shard_size=-(-n_train // n_shards), progress=False)
    img_dir = work / "files"
    img_dir.mkdir(parents=True, exist_ok=True)
    rows = ["filepath\ttitle"]
    from mmcl.data import expand_urls

    for url in expand_urls(paths["train"]):
        with tarfile.open(url) as tar:
            members = {m.name: m for m in tar.getmembers() if m.isfile()}
            for name in sorted(members):
                key, ext = name.split(".", 1)
                if ext not in ("jpg", "png", "webp", "jpeg"):
                    continue
                # The shard's own bytes, so both tools decode identical files with the same decoder.
                target = img_dir / f"{key}.{ext}"
                target.write_bytes(tar.extractfile(members[name]).read())
                caption = tar.extractfile(members[f"{key}.txt"]).read().decode("utf-8").strip()
                assert "\t" not in caption and "\n" not in caption
                rows.append(f"{target}\t{caption}")
    csv = work / "train.csv"
    csv.write_text("\n".join(rows) + "\n")
    return paths["train"], csv, len(rows) - 1


# ------------------------------------------------------------------------------------------------- the runs
def with_peak(env: Dict[str, str], path: Path) -> Dict[str, str]:
    """`env` with the wrapper's peak-memory file set to `path` (removed first, so a stale file cannot be read)."""
    path.unlink(missing_ok=True)
    return dict(env, MMCL_BENCH_PEAK=str(path))


def read_peak(path: Path) -> Dict[str, object]:
    """The peak memory a wrapped run wrote at exit, in GiB, and what kind of peak it is."""
    if not path.is_file():
        return {"peak_memory_gib": None, "peak_memory_kind": None}
    peak = json.loads(path.read_text())
    return {"peak_memory_gib": peak["peak_memory_bytes"] / 2 ** 30, "peak_memory_kind": peak["peak_memory_kind"]}


def mmcl_command(args, work: Path, shards: str, run_dir: Path, extra: Tuple[str, ...] = ()) -> List[str]:
    """``mmcl train`` (through the peak-memory wrapper) on the bench's data, with the shared settings."""
    return [sys.executable, str(work / "run_mmcl.py"), "train", str(REPO / "configs" / "tiny.yaml"),
            f"data.train={shards}", f"data.batch_size={args.batch_size}", f"data.workers={args.workers}",
            f"train.steps={args.steps}", f"train.output_dir={run_dir}", f"train.log_every={args.log_every}",
            f"model.name={args.model}", f"train.precision={args.precision}", "train.save_every=0",
            "train.plot=false", "train.progress=false",
            "eval.zeroshot=null", "eval.retrieval=null", *args.mmcl_override, *extra]


def start_mmcl(args, work: Path, shards: str, tag: str, env: Dict[str, str], extra: Tuple[str, ...] = ()) -> Run:
    run_dir = work / f"mmcl-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = with_peak(env, work / f"mmcl-{tag}.peak.json")
    run = Run("mmcl", mmcl_command(args, work, shards, run_dir, extra), run_dir / "metrics.jsonl", env,
              work / f"mmcl-{tag}.out", REPO)
    run.run_dir, run.peak_file = run_dir, Path(env["MMCL_BENCH_PEAK"])
    return run


def mmcl_points(run: Run, lines) -> List[Tuple[float, Tuple[float, float], int]]:
    """(time, (main CPU s, workers CPU s), samples) per metrics.jsonl record."""
    shutil.rmtree(run.run_dir, ignore_errors=True)
    return [(t, cpu, int(json.loads(line)["samples"])) for t, cpu, line in lines]


def start_open_clip(args, work: Path, csv: Path, n_train: int, tag: str, env: Dict[str, str],
                    compiled: bool = False) -> Run:
    logs = work / "oc-logs"
    env = with_peak(env, work / f"open_clip-{tag}.peak.json")
    name = f"open_clip-{tag}"
    shutil.rmtree(logs / name, ignore_errors=True)
    run = Run("open_clip", open_clip_command(args, work, csv, n_train, logs, name, compiled), logs / name / "out.log",
              env, work / f"{name}.out", REPO)
    run.run_dir, run.peak_file = logs / name, Path(env["MMCL_BENCH_PEAK"])
    return run


def open_clip_command(args, work: Path, csv: Path, n_train: int, logs: Path, name: str, compiled: bool) -> List[str]:
    """open_clip's training script (through the peak-memory wrapper) with the settings mmcl's run gets."""
    steps_per_epoch = n_train // args.batch_size
    epochs = -(-args.steps // steps_per_epoch)
    cmd = [sys.executable, str(work / "run_open_clip.py"), str(work / "oc-models"),
           "--model", open_clip_model_name(args.model), "--train-data", str(csv), "--dataset-type", "csv",
           "--csv-img-key", "filepath",
           "--csv-caption-key", "title", "--csv-separator", "\t", "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--epochs", str(epochs),
           "--precision", {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp"}[args.precision],
           "--lr", "1e-3", "--wd", "0.1", "--warmup", "15", "--beta1", "0.9", "--beta2", "0.98", "--eps", "1e-6",
           "--grad-clip-norm", "1.0", "--seed", "0", "--log-every-n-steps", str(args.log_every),
           "--save-frequency", "0", "--logs", str(logs), "--name", name, "--report-to", "",
           *(["--torchcompile"] if compiled else [])]
    if args.device == "cpu":
        cmd.append("--device=cpu")  # open_clip_train's own device flag (it would otherwise take a visible GPU)
    return cmd


def open_clip_points(run: Run, lines) -> List[Tuple[float, Tuple[float, float], int]]:
    """(time, (main CPU s, workers CPU s), samples) per 'Train Epoch' log line of open_clip."""
    points = []
    for t, cpu, line in lines:
        m = OPEN_CLIP_LINE.search(line)
        if m:
            epoch, seen, per_epoch = (int(g) for g in m.groups())
            points.append((t, cpu, epoch * per_epoch + seen))
    if not points:
        raise RuntimeError(f"no training log lines in {run.run_dir / 'out.log'}")
    shutil.rmtree(run.run_dir, ignore_errors=True)
    return points


def run_pure(args, work: Path, shards: str, env: Dict[str, str]) -> Dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pure-step-child", *child_args(args, work, shards),
           "--pure-steps", str(args.pure_steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"pure step child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_pure_loop(args, work: Path, shards: str, tag: str, env: Dict[str, str]) -> Run:
    """The pure step in an endless loop that logs its samples like a training run (stopped by the parent)."""
    log = work / f"pure-{tag}.jsonl"
    log.unlink(missing_ok=True)
    return Run("pure", [sys.executable, str(Path(__file__).resolve()), "--pure-step-child",
                        *child_args(args, work, shards), "--log-every", str(args.log_every), "--pure-log", str(log)],
               log, env, work / f"pure-{tag}.out", REPO)


def child_args(args, work: Path, shards: str) -> List[str]:
    return ["--batch-size", str(args.batch_size), "--pure-batches", str(args.pure_batches), "--model", args.model,
            "--precision", args.precision, "--oc-models", str(work / "oc-models"), "--shards", shards]


def pure_points(lines) -> List[Tuple[float, Tuple[float, float], int]]:
    return [(t, cpu, int(json.loads(line)["samples"])) for t, cpu, line in lines]


def sliced_round(args, work: Path, shards: str, csv: Path, n_train: int, r: int, env: Dict[str, str]
                 ) -> List[Tuple[str, Dict[str, float]]]:
    """mmcl, open_clip, the pure step loop (and the mmcl variant) taking turns on the machine (see `Slicer`)."""
    tag = f"sliced-{r}"
    runs = [("mmcl", start_mmcl(args, work, shards, tag, env), mmcl_points),
            ("open_clip", start_open_clip(args, work, csv, n_train, tag, env), open_clip_points)]
    if args.mmcl_variant or args.mmcl_variant_env:
        variant_env = dict(env, **dict(kv.split("=", 1) for kv in args.mmcl_variant_env))
        runs.insert(1, ("mmcl_variant", start_mmcl(args, work, shards, f"variant-{tag}", variant_env,
                                                   tuple(args.mmcl_variant)), mmcl_points))
    pure = start_pure_loop(args, work, shards, tag, env)
    finite = [run for _, run, _ in runs]
    turns = finite + [pure]
    try:
        Slicer(turns[::-1] if r % 2 else turns, finite, args.slice).run()
        out = []
        skip = args.skip_steps * args.batch_size
        for name, run, parse in runs:
            lines, wall = run.finish()
            points = on_own_clock(run, parse(run, lines))
            res = steady_rate(points, skip)
            res.update(wall_s=wall, running_s=running_time(run.running, math.inf),
                       last_step=max(p[2] for p in points) // args.batch_size, **read_peak(run.peak_file))
            out.append((name, res))
        p_lines, p_wall = pure.finish(stop=True)
    finally:
        for run in turns:  # after a failure or an interrupt, leave no held process behind
            if run.proc.poll() is None:
                signal_group(run.proc, signal.SIGKILL)
                run.proc.wait()
    res = steady_rate(on_own_clock(pure, pure_points(p_lines)), 0)
    res.update(wall_s=p_wall, running_s=running_time(pure.running, math.inf))
    res["step_s"] = args.batch_size / res["samples_per_s"]
    out.append(("pure_sliced", res))
    return out


def paired_pure(args, work: Path, shards: str, tag: str, env: Dict[str, str]) -> List[Tuple[str, Dict[str, float]]]:
    """mmcl training and the pure in-memory step loop at the same time, timed over the same span.

    Both then see the same load from other jobs; the ratio of their throughputs is mmcl's step time over the pure
    step time. The pure loop runs until mmcl's run has ended.
    """
    pure = start_pure_loop(args, work, shards, tag, env)
    mmcl = start_mmcl(args, work, shards, f"paired-{tag}", env)
    m_lines, m_wall = mmcl.finish()
    p_lines, p_wall = pure.finish(stop=True)
    m_points = mmcl_points(mmcl, m_lines)
    p_points = pure_points(p_lines)
    skips = [args.skip_steps * args.batch_size, 0]  # the pure loop logs only after its warm-up steps
    interval = common_interval([m_points, p_points], skips)
    out = []
    for name, pts, skip, wall in (("mmcl_beside_pure", m_points, skips[0], m_wall),
                                  ("pure_beside_mmcl", p_points, skips[1], p_wall)):
        res = steady_rate(pts, skip, interval)
        res["wall_s"] = wall
        out.append((name, res))
    return out


def pure_step_child(args) -> None:
    """Time the model's training step on one in-memory batch; prints one JSON line (seconds per step)."""
    import open_clip
    import torch

    from mmcl import models
    from mmcl.config import load_config
    from mmcl.training.optim import build_optimizer
    from mmcl.training.step import objective_from_config

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [f"data.batch_size={args.batch_size}",
                                                              f"model.name={args.model}"])
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    model, _, pp_cfg, _, _, tokenizer = models.build(cfg.model)
    # The model open_clip builds (from the registered copy of an mmcl config) must be the one mmcl trains.
    open_clip.add_model_config(args.oc_models)
    oc_model = open_clip.create_model(open_clip_model_name(args.model), precision="fp32", device="cpu")
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in oc_model.state_dict().items()}
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))[:6]
        raise SystemExit(f"mmcl and open_clip build different models: {diff}")
    n_params = sum(p.numel() for p in model.parameters())
    del oc_model

    model.to(device)
    objective = objective_from_config(cfg.loss)
    optimizer = build_optimizer(model, cfg.optim)
    # Mixed precision as accelerate runs it for mmcl and open_clip's amp does: autocast for forward and loss,
    # float32 weights and optimiser (and a gradient scaler for fp16).
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

    def sync():
        if cuda:
            torch.cuda.synchronize()
    b = args.batch_size
    # Real batches of the same data, decoded once and held in memory: the same images and captions (so the same
    # text lengths after the padding cut) as the training runs, without any loading.
    from mmcl.data import ImageSpec, build_train_stream

    data_cfg = dataclasses.replace(cfg.data, train=args.shards, workers=0)  # the loaded config is read-only
    stream = build_train_stream(data_cfg, ImageSpec.from_config(pp_cfg), models.training_tokenizer(model, tokenizer),
                                seed=0)  # as train does
    it = iter(stream)
    held, raw = [], []
    for _ in range(args.pure_batches):
        batch = next(it)
        raw.append(batch)
        held.append((stream.finish_images(batch["image"].to(device)), batch["text"].to(device),
                     batch["label"].to(device)))
    it.close()
    step_no = [0]
    model.train()

    def fwd_bwd():
        images, texts, labels = held[step_no[0] % len(held)]
        step_no[0] += 1
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = model(images, texts)
            loss, _ = objective(out["image_features"], out["text_features"], out["logit_scale"], None, labels)
        scaler.scale(loss).backward()
        return loss

    def full_step():
        fwd_bwd()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        models.clamp_logit_scale(model, cfg.model.max_logit_scale)

    # mmcl's own step on the same batches: the training loop's code path (Accelerator-prepared model and
    # optimiser, forward_loss with the uint8 -> float finish, finiteness check, accelerate's clipping), no data
    # loading. Its time over full_step's is the step's code overhead.
    from accelerate import Accelerator

    from mmcl.training.step import apply_update, backward, forward_loss

    accelerator = Accelerator(cpu=not cuda, mixed_precision={"fp32": "no"}.get(args.precision, args.precision))
    acc_model, acc_optimizer = accelerator.prepare(model, optimizer)

    def mmcl_step():
        batches = [raw[step_no[0] % len(raw)]]
        loss, _, cache = forward_loss(acc_model, objective, batches, accelerator, stream.finish_images)
        step_no[0] += 1
        if not torch.isfinite(loss.detach()):
            raise SystemExit("non-finite loss in the step benchmark")
        backward(accelerator, acc_model, loss, batches, cache, stream.finish_images)
        apply_update(accelerator, acc_model, model, acc_optimizer, cfg.optim.grad_clip, cfg.model.max_logit_scale)

    for _ in range(3):  # allocator and kernel warm-up
        full_step()
        mmcl_step()
    # Model FLOPs of one training step (forward + backward of towers and loss, counted per aten op by torch's
    # FlopCounterMode: matmuls, convolutions, attention), for MFU.
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fwd_bwd()
    optimizer.zero_grad(set_to_none=True)
    flops_per_sample = counter.get_total_flops() / b
    sync()
    if cuda:  # the steps timed below set the peak (after the warm-up's, which are the same steps)
        torch.cuda.reset_peak_memory_stats()
    if args.pure_trace:
        # The bare step alone, its speed over consecutive windows of --log-every steps: shows the machine's
        # speed phases that the sliced mode exists for.
        rates, t = [], time.perf_counter()
        for i in range(args.pure_trace):
            full_step()
            if (i + 1) % args.log_every == 0:
                sync()
                now = time.perf_counter()
                rates.append(round(args.log_every * b / (now - t), 1))
                t = now
        print(json.dumps({"measurement": "pure_trace", "steps_per_window": args.log_every,
                          "samples_per_s": rates, "min": min(rates), "max": max(rates)}))
        return
    if args.pure_log:
        # Paired mode: full steps until the parent stops us, logging samples like a training run does.
        with open(args.pure_log, "a") as log:
            for i in range(100_000):
                if i % args.log_every == 0:
                    sync()
                    log.write(json.dumps({"samples": i * b}) + "\n")
                    log.flush()
                full_step()
        return
    # The two variants alternate step by step, so a burst of load from elsewhere hits both alike.
    wall = {"step": [], "fwd_bwd": [], "mmcl_step": []}
    cpu = {"step": [], "fwd_bwd": [], "mmcl_step": []}
    for _ in range(args.pure_steps):
        for name, fn in (("step", full_step), ("fwd_bwd", fwd_bwd), ("mmcl_step", mmcl_step)):
            sync()
            t, c = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
            optimizer.zero_grad(set_to_none=True)
    # Means, as the training runs' windows are means over their steps.
    print(json.dumps({"step_s": statistics.fmean(wall["step"]), "fwd_bwd_s": statistics.fmean(wall["fwd_bwd"]),
                      "mmcl_step_in_memory_s": statistics.fmean(wall["mmcl_step"]),
                      "cpu_ms_per_sample": 1000 * statistics.fmean(cpu["step"]) / b,
                      "fwd_bwd_cpu_ms_per_sample": 1000 * statistics.fmean(cpu["fwd_bwd"]) / b,
                      "params": n_params, "threads": torch.get_num_threads(),
                      "flops_per_sample": flops_per_sample, "device": str(device), "precision": args.precision,
                      **peak_memory(torch, cuda)}))


def peak_memory(torch, cuda: bool) -> Dict[str, object]:
    """This process's peak memory in GiB: the CUDA allocator's peak on a GPU, the peak resident set on a CPU."""
    import resource

    if cuda:
        return {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
                "peak_memory_kind": "cuda_max_allocated"}
    return {"peak_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2 ** 30,
            "peak_memory_kind": "max_rss"}


# ------------------------------------------------------------------------------------------------------ main
def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=25, help="optimiser steps per training run")
    p.add_argument("--skip-steps", type=int, default=5, help="steps before the timed window")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pure-steps", type=int, default=8, help="timed steps of each pure variant")
    p.add_argument("--pure-batches", type=int, default=8, help="real batches the pure step cycles through")
    p.add_argument("--model", default="tiny",
                   help="mmcl model config (mmcl/models/model_configs) or open_clip architecture, e.g. ViT-B-32")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--image-size", type=int, default=None,
                   help="side of the generated demo images (default 64 for tiny, else 256)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for MFU (default: datasheet bf16/fp16 figure of known GPUs)")
    p.add_argument("--mode", choices=("sliced", "sequential", "concurrent"), default=None,
                   help="sliced (default on CPU): all runs started together, taking turns on the machine (--slice "
                        "seconds each); sequential (default on GPU): one after the other; "
                        "concurrent: mmcl beside open_clip, then beside the pure "
                        "loop, sharing the cores")
    p.add_argument("--slice", type=float, default=1.0, help="seconds per turn in --mode sliced")
    p.add_argument("--concurrent", action="store_true", help="same as --mode concurrent")
    p.add_argument("--mmcl-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for the mmcl runs (repeatable), e.g. data.worker_nice=0")
    p.add_argument("--mmcl-variant", action="append", default=[], metavar="KEY=VALUE",
                   help="also run mmcl with these overrides in every round (next to the default run), e.g. "
                        "data.worker_nice=0; the summary gives default / variant throughput per round")
    p.add_argument("--mmcl-variant-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for the variant run (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where every run trains (auto: the GPU when there is one); --device cpu runs the GPU mode's "
                        "code on a CPU, e.g. --device cpu --mode sequential --compile yes --steps 3")
    p.add_argument("--compile", choices=("auto", "yes", "no"), default="auto",
                   help="also measure both tools compiled (mmcl train.compile=true, open_clip --torchcompile) in "
                        "--mode sequential; auto: yes on a GPU")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for every run (repeatable)")
    p.add_argument("--work-dir", default=None, help="keep data and logs here (default: a temporary directory)")
    p.add_argument("--pure-trace", type=int, default=0, metavar="STEPS",
                   help="only run the bare step alone for STEPS steps and print its samples/s per --log-every "
                        "steps (the machine's speed over time)")
    p.add_argument("--pure-step-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--oc-models", help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    p.add_argument("--pure-log", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pure_step_child:
        pure_step_child(args)
        return
    if args.device == "cpu":  # the children too: no GPU is visible to them
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    device, device_name = device_info(args.device)
    args.device = device
    if args.compile == "auto":
        args.compile = "yes" if device == "cuda" else "no"
    if args.concurrent:
        args.mode = "concurrent"
    if args.mode is None:
        # Held processes' queued GPU kernels would still run during others' turns, so GPUs go one run at a time.
        args.mode = "sliced" if device == "cpu" else "sequential"
    args.concurrent = args.mode == "concurrent"
    if args.compile == "yes" and args.mode != "sequential":
        raise SystemExit("--compile yes is measured in --mode sequential (compilation would fill the turns of "
                         "--mode sliced and compete with the other run in --mode concurrent)")
    if args.image_size is None:
        args.image_size = 64 if args.model == "tiny" else 256
    if args.skip_steps >= args.steps - args.log_every:
        raise SystemExit(f"--steps ({args.steps}) must exceed --skip-steps + --log-every")

    if args.pure_trace:
        work = Path(tempfile.mkdtemp(prefix="mmcl-bench-trace-"))
        register_models(work, args.model)
        from mmcl.shards.demo import make_demo_data

        paths = make_demo_data(str(work / "shards"), n_train=args.batch_size * args.pure_batches, n_val=1,
                               n_zeroshot=1, image_size=args.image_size, shard_size=args.batch_size * args.pure_batches,
                               progress=False)
        args.oc_models, args.shards = str(work / "oc-models"), paths["train"]
        try:
            pure_step_child(args)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="mmcl-bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    register_models(work, args.model)
    (work / "run_open_clip.py").write_text(OPEN_CLIP_WRAPPER)
    (work / "run_mmcl.py").write_text(MMCL_WRAPPER)
    # One epoch of open_clip covers the whole run, so neither tool restarts its loader inside the window.
    shards, csv, n_train = prepare_data(work, n_train=args.steps * args.batch_size, image_size=args.image_size,
                                        n_shards=max(8, args.workers))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               **dict(kv.split("=", 1) for kv in args.env))
    common = {"device": device, "device_name": device_name, "mode": args.mode, "cpu": cpu_name(),
              "cores": os.cpu_count(), "model": args.model, "precision": args.precision,
              "image_size": args.image_size, "batch": args.batch_size, "workers": args.workers, "steps": args.steps,
              "window_from_step": args.skip_steps, "mmcl_overrides": args.mmcl_override}

    results: Dict[str, List[Dict[str, float]]] = {"mmcl": [], "open_clip": [], "pure": [], "mmcl_beside_pure": [],
                                                  "pure_beside_mmcl": [], "mmcl_variant": [], "pure_sliced": [],
                                                  "mmcl_compiled": [], "open_clip_compiled": []}
    for r in range(args.rounds):
        order = ["mmcl", "open_clip", "pure"] if r % 2 == 0 else ["pure", "open_clip", "mmcl"]
        if args.mmcl_variant or args.mmcl_variant_env:  # next to mmcl, on the side that alternates with it
            order.insert(order.index("mmcl") + (1 if r % 2 == 0 else 0), "mmcl_variant")
        if args.concurrent:
            order = ["paired_pure", "both"] if r % 2 else ["both", "paired_pure"]
        if args.mode == "sliced":
            # The in-process pure step (and mmcl's step code beside it) is measured on its own, after the turns.
            order = ["sliced", "pure"]
        if args.compile == "yes":  # each tool compiled (train.compile / --torchcompile), beside its plain run
            order += ["open_clip_compiled", "mmcl_compiled"] if r % 2 else ["mmcl_compiled", "open_clip_compiled"]
        for what in order:
            if what == "sliced":
                done = sliced_round(args, work, shards, csv, n_train, r, env)
            elif what == "paired_pure":
                done = paired_pure(args, work, shards, str(r), env)
            elif what == "pure":
                res = run_pure(args, work, shards, env)
                res["samples_per_s"] = args.batch_size / res["step_s"]
                done = [("pure", res)]
            else:
                runs = []
                if what in ("mmcl", "both"):
                    runs.append(("mmcl", start_mmcl(args, work, shards, str(r), env), mmcl_points))
                if what == "mmcl_compiled":
                    runs.append(("mmcl_compiled", start_mmcl(args, work, shards, f"compiled-{r}", env,
                                                             ("train.compile=true",)), mmcl_points))
                if what == "open_clip_compiled":
                    runs.append(("open_clip_compiled", start_open_clip(args, work, csv, n_train, f"compiled-{r}", env,
                                                                       compiled=True), open_clip_points))
                if what == "mmcl_variant":
                    variant_env = dict(env, **dict(kv.split("=", 1) for kv in args.mmcl_variant_env))
                    runs.append(("mmcl_variant", start_mmcl(args, work, shards, f"variant-{r}", variant_env,
                                                            tuple(args.mmcl_variant)), mmcl_points))
                if what in ("open_clip", "both"):
                    runs.append(("open_clip", start_open_clip(args, work, csv, n_train, str(r), env),
                                 open_clip_points))
                finished = [run.finish() for _, run, _ in runs]
                points = [parse(run, lines) for (_, run, parse), (lines, _) in zip(runs, finished)]
                skip = args.skip_steps * args.batch_size
                # Running together, both are timed over the same span, so both see the same load.
                interval = common_interval(points, [skip] * len(runs)) if len(runs) > 1 else None
                done = []
                for (name, run, _), (_, wall), pts in zip(runs, finished, points):
                    res = steady_rate(pts, skip, interval)
                    res["wall_s"] = wall
                    res.update(read_peak(run.peak_file))
                    res["last_step"] = max(p[2] for p in pts) // args.batch_size
                    done.append((name, res))
            for name, res in done:
                results[name].append(res)
                print(json.dumps({"measurement": name, "round": r, **common, **res}), flush=True)

    def median(what: str, key: str) -> Optional[float]:
        return statistics.median(x[key] for x in results[what]) if results[what] else None

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or b is None else a / b

    mmcl_sps, oc_sps = median("mmcl", "samples_per_s"), median("open_clip", "samples_per_s")
    per_round = [m["samples_per_s"] / o["samples_per_s"] for m, o in zip(results["mmcl"], results["open_clip"])]
    mmcl_cpu, oc_cpu = median("mmcl", "cpu_ms_per_sample"), median("open_clip", "cpu_ms_per_sample")
    paired = [p["samples_per_s"] / m["samples_per_s"]
              for m, p in zip(results["mmcl_beside_pure"], results["pure_beside_mmcl"])]
    summary = {
        "measurement": "summary", **common, "rounds": args.rounds,
        "mmcl_samples_per_s": mmcl_sps, "open_clip_samples_per_s": oc_sps,
        # Rounds pair the two tools under similar load: the median of the per-round ratios is the result.
        "speedup_vs_open_clip": statistics.median(per_round),
        "per_round_speedup": per_round, "ratio_of_median_throughputs": ratio(mmcl_sps, oc_sps),
        "mmcl_cpu_ms_per_sample": mmcl_cpu, "open_clip_cpu_ms_per_sample": oc_cpu,
        "cpu_efficiency_vs_open_clip": ratio(oc_cpu, mmcl_cpu),
    }
    if args.concurrent:
        # mmcl and the pure loop side by side, timed over the same span: mmcl step time / pure step time.
        summary.update({"step_over_pure_step": statistics.median(paired), "per_round_step_over_pure_step": paired})
    else:
        mmcl_step = args.batch_size / mmcl_sps
        pure_step, pure_fb = median("pure", "step_s"), median("pure", "fwd_bwd_s")
        if args.mode == "sliced":
            # The pure loop took turns with the training runs: per round, mmcl's step time over its.
            per_round_pure = [p["samples_per_s"] / m["samples_per_s"]
                              for m, p in zip(results["mmcl"], results["pure_sliced"])]
            summary.update({"step_over_pure_step": statistics.median(per_round_pure),
                            "per_round_step_over_pure_step": per_round_pure,
                            "open_clip_step_over_pure_step": statistics.median(
                                p["samples_per_s"] / o["samples_per_s"]
                                for o, p in zip(results["open_clip"], results["pure_sliced"])),
                            "pure_sliced_samples_per_s": median("pure_sliced", "samples_per_s"),
                            "cpu_over_pure_step": ratio(mmcl_cpu, median("pure_sliced", "cpu_ms_per_sample"))})
        else:
            summary.update({"step_over_pure_step": mmcl_step / pure_step,
                            "cpu_over_pure_step": ratio(mmcl_cpu, median("pure", "cpu_ms_per_sample"))})
        summary.update({
            "mmcl_step_s": mmcl_step, "pure_step_s": pure_step, "pure_fwd_bwd_s": pure_fb,
            # fwd+bwd is timed only in the in-process pure step: its share of that step scales the ratio above.
            "step_over_pure_fwd_bwd": summary["step_over_pure_step"] * pure_step / pure_fb,
            # mmcl's step code on the same in-memory batches, alternated with the pure step in one process.
            "in_memory_mmcl_step_over_pure_step": statistics.median(
                r["mmcl_step_in_memory_s"] / r["step_s"] for r in results["pure"]),
            "cpu_over_pure_fwd_bwd": ratio(mmcl_cpu, median("pure", "fwd_bwd_cpu_ms_per_sample")),
        })
    # One process per run, on one device: samples/s is per device (per GPU on a GPU).
    summary["samples_per_s_per_device"] = {name: median(name, "samples_per_s") for name in
                                           ("mmcl", "open_clip", "mmcl_compiled", "open_clip_compiled", "pure")
                                           if results[name]}
    summary["peak_memory_gib"] = {name: median(name, "peak_memory_gib") for name in
                                  ("mmcl", "open_clip", "mmcl_compiled", "open_clip_compiled", "pure")
                                  if results[name] and all(x.get("peak_memory_gib") is not None
                                                           for x in results[name])}
    summary["peak_memory_kind"] = "cuda_max_allocated" if device == "cuda" else "max_rss"
    if results["mmcl_compiled"] and results["open_clip_compiled"]:
        compiled_sps = median("mmcl_compiled", "samples_per_s")
        summary.update({
            "compiled_speedup_vs_open_clip_compiled": statistics.median(
                m["samples_per_s"] / o["samples_per_s"]
                for m, o in zip(results["mmcl_compiled"], results["open_clip_compiled"])),
            "mmcl_compiled_over_mmcl": ratio(compiled_sps, mmcl_sps),
            "open_clip_compiled_over_open_clip": ratio(median("open_clip_compiled", "samples_per_s"), oc_sps)})
    flops = median("pure", "flops_per_sample")
    peak = peak_flops(args, device, device_name)
    summary["flops_per_sample"] = flops
    if flops and peak:
        # Model FLOPs utilisation: the step's counted FLOPs at each run's samples/s over the device's peak.
        summary.update({"peak_tflops": peak / 1e12, "mfu_mmcl": flops * mmcl_sps / peak,
                        "mfu_open_clip": flops * oc_sps / peak,
                        "mfu_pure_step": flops * args.batch_size / median("pure", "step_s") / peak})
        for name in ("mmcl_compiled", "open_clip_compiled"):
            if results[name]:
                summary[f"mfu_{name}"] = flops * median(name, "samples_per_s") / peak
    if results["mmcl_variant"]:
        per_round_variant = [m["samples_per_s"] / v["samples_per_s"]
                             for m, v in zip(results["mmcl"], results["mmcl_variant"])]
        summary.update({"variant_overrides": args.mmcl_variant, "variant_env": args.mmcl_variant_env,
                        "mmcl_over_variant": statistics.median(
            per_round_variant), "per_round_mmcl_over_variant": per_round_variant})
    print(json.dumps(summary), flush=True)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
