"""mmcl on one GPU, measured in one call within a time budget it keeps itself.

Stages, in order; each gets a share of the time left and is skipped, with the reason written down, when too little
is left; a stage that runs past its share is cut and records what it had:

a. tests: ``pytest -m "gpu or gpu_path"`` over tests/e2e/test_gpu.py and tests/e2e/test_gpu_path_*.py, on CUDA.
b. train_step: mmcl's training step (Accelerator-prepared model, ``forward_loss`` + ``backward`` +
   ``apply_update``, uint8 images finished on the device, its trimmed tokens) against open_clip's own model +
   ClipLoss step (autocast, AdamW, the gradient clip and logit-scale clamp of open_clip_train), the same
   architecture (ViT-B-32), bf16, per-GPU batches 256 and 1024, synthetic batches held on the device: samples/s and
   peak memory, each plain and compiled (``train.compile``: model and objective through torch.compile;
   open_clip: ``--torchcompile``'s torch.compile of the model), in rounds that alternate the order.
c. losses: mmcl's tiled InfoNCE (``clip_loss(chunk_size=1024)``) against open_clip's ClipLoss, and mmcl's chunked
   SigLIP against SigLipLoss, at N = 32k, 64k, 256k pairs of 512-d features under bf16 autocast: fwd+bwd time and
   peak memory; an out-of-memory reference is caught and recorded.
d. data: mmcl's training stream alone with 16 workers (the default fast decode and uint8 transfer) on synthetic
   photo-like JPEG shards written on the machine: samples/s, against the step's samples/s of stage b.
e. report: summary.json (rewritten after every measurement, so a killed run still leaves what it had) and
   summary.md, a table to paste into BENCHMARKS.md, with nvidia-smi's output and the versions.

    python bench/gpu/proof.py --out DIR [--budget-s 480] [--device cuda|cpu] [--tiny]

``--device cpu`` (or ``--tiny``) runs every stage at tiny sizes (the tiny model in float32, batches of 4 and 8, N of a
few thousand, 2 workers): the rehearsal tests/test_gpu_proof.py runs on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]  # harness, bench_losses, bench_data; mmcl from this checkout

STAGES = ("tests", "train_step", "losses", "data")
# Share of the time left that each stage may take when it starts (the report needs seconds only).
# Measured on an H100 (BENCHMARKS.md, GPU): the data stage writes its shards (~27 s) before it measures, and each
# compiled variant warms up for 60-110 s.
SHARES = {"tests": 0.2, "train_step": 0.42, "losses": 0.15, "data": 0.23}
RESERVE_S = 8.0  # kept for the report after the last stage


class OutOfTime(Exception):
    """A stage ran past its share of the budget."""


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.monotonic(), float(seconds)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0) - RESERVE_S

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise `OutOfTime` in this (main) thread once `seconds` have passed."""
    def fire(signum, frame):
        raise OutOfTime(f"cut after {seconds:.0f} s, its share of the budget")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Summary:
    """summary.json, rewritten whole (through a temporary file) after every change."""

    def __init__(self, out: Path, meta: Dict[str, Any]):
        self.path = out / "summary.json"
        self.data: Dict[str, Any] = {**meta, "stages": {s: {"status": "pending"} for s in STAGES}}
        self.write()

    def stage(self, name: str) -> Dict[str, Any]:
        return self.data["stages"][name]

    def update(self, name: str, **fields) -> None:
        self.data["stages"][name].update(fields)
        self.write()

    def add(self, name: str, result: Dict[str, Any]) -> None:
        self.data["stages"][name].setdefault("results", []).append(result)
        print(json.dumps({"stage": name, **result}), flush=True)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------------------------- environment
def run_text(cmd: List[str], timeout: float = 20) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"({' '.join(cmd)}: {err})"


def environment(device: str) -> Dict[str, Any]:
    import importlib.metadata as md

    import torch

    versions = {}
    for dist in ("torch", "torchvision", "open-clip-torch", "timm", "accelerate", "transformers", "webdataset",
                 "numpy", "pillow", "triton"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
           "versions": versions, "torch_cuda": torch.version.cuda,
           "mmcl_commit": run_text(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
           "mmcl_dirty": bool(run_text(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]))}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                   multiprocessors=props.multi_processor_count, nvidia_smi=run_text(["nvidia-smi"]))
    else:
        env.update(gpu=None, nvidia_smi=run_text(["nvidia-smi"]) if device == "cuda" else "(no GPU: device cpu)")
    return env


# ---------------------------------------------------------------------------------------------------- sizes
def sizes(tiny: bool) -> Dict[str, Any]:
    if tiny:
        # float32 on a CPU: its bf16 matrix products are emulated, four times slower than float32 here.
        return {"model": "tiny", "precision": "fp32", "batches": [4, 8], "warmup": 1, "steps": 1, "rounds": 2,
                "loss_n": [512, 1024, 2048], "loss_dim": 64, "chunk": 256, "loss_repeats": 1, "workers": 2,
                "data_batch": 16, "data_samples": 96, "data_batches": 4, "image_px": (96, 128),
                "test_files": ["tests/e2e/test_gpu.py"]}
    return {"model": "ViT-B-32", "precision": "bf16", "batches": [256, 1024], "warmup": 3, "steps": 10, "rounds": 2,
            "loss_n": [32768, 65536, 262144], "loss_dim": 512, "chunk": 1024, "loss_repeats": 2, "workers": 16,
            "data_batch": 256, "data_samples": 8192, "data_batches": 24, "image_px": (420, 640),
            "test_files": ["tests/e2e/test_gpu.py", *sorted(str(p.relative_to(REPO))
                                                        for p in REPO.glob("tests/e2e/test_gpu_path_*.py"))]}


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def free_memory(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ a. tests
def stage_tests(summary: Summary, cfg: Dict[str, Any], device: str, seconds: float, work: Path, out: Path) -> None:
    """pytest -m "gpu or gpu_path" on the GPU test files, the CUDA tests (the first file) in a pytest of their own
    so that their failures' tracebacks are written even when the rest is cut; the output goes to $OUT/pytest.log
    as it runs."""
    log = out / "pytest.log"
    base = [sys.executable, "-m", "pytest", "-v", "-rs", "--tb=short", "-p", "no:cacheprovider",
            "-m", "gpu or gpu_path"]
    files = cfg["test_files"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    summary.update("tests", command=" ".join(base[1:] + files), log=log.name)
    end, code, cut = time.monotonic() + seconds, 0, None
    with open(log, "w") as sink:
        for group in (files[:1], files[1:]):
            if not group or cut:
                continue
            proc = subprocess.Popen(base + group, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=max(1.0, end - time.monotonic())) or code
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code, cut = None, f"pytest stopped after {seconds:.0f} s, the stage's share of the budget"
    text = log.read_text(errors="replace")
    counts: Dict[str, int] = {}
    for outcome in re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", text):
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    failed = [ln.split(" ")[0] for ln in text.splitlines() if re.search(r" (FAILED|ERROR)\b", ln) and "::" in ln]
    skips = [ln for ln in text.splitlines() if ln.startswith("SKIPPED [")]
    summary.add("tests", {"exit_code": code, "counts": counts, "failed": failed[:30], "skip_reasons": skips[:10],
                          "tail": text.splitlines()[-1:] if text else []})
    summary.update("tests", status="partial" if cut else "done", **({"reason": cut} if cut else {}))


# ------------------------------------------------------------------------------------------- b. train step
def captions(n: int, seed: int) -> List[str]:
    """Captions of web-like lengths (log-normal word counts, median about 11 words, some past the 77-token
    context): a batch's longest caption, which sets the trimmed text length, is as long as in real data."""
    import random

    rng = random.Random(seed)
    words = ("photo image picture of a the small large red blue green dog cat car house tree person man woman on in "
             "with at near street city beach mountain sunset vintage poster logo design art illustration for sale "
             "new best quality high resolution white background black and").split()
    return [" ".join(rng.choice(words) for _ in range(max(1, min(120, int(rng.lognormvariate(2.4, 0.7))))))
            for _ in range(n)]


class Variant:
    """One tool's training step on held batches: `step()` does one optimiser step."""

    def __init__(self, name: str, step: Callable[[], Any], check: Callable[[], float], resident: int):
        self.name, self.step, self.check, self.resident = name, step, check, resident


def build_variants(cfg: Dict[str, Any], device: str, batch: int, compiled: bool, held: Dict[str, Any]) -> List[Variant]:
    """mmcl's and open_clip's steps (plain, or with compile) at `batch`; models and optimisers are built once
    per tool and kept in `held` (the compiled variants wrap the same model and optimiser)."""
    import open_clip
    import torch
    from accelerate import Accelerator

    from mmcl import models
    from mmcl.config import load_config
    from mmcl.data.transforms import ImageSpec, train_image_stages
    from mmcl.training.optim import build_optimizer
    from mmcl.training.step import apply_update, backward, forward_loss, objective_from_config

    dev = torch.device(device)
    bf16 = cfg["precision"] == "bf16"

    def allocated() -> int:
        return torch.cuda.memory_allocated() if device == "cuda" else 0

    if "mmcl" not in held:
        c = load_config(str(REPO / "configs" / "tiny.yaml"), [f"model.name={cfg['model']}", f"data.batch_size={batch}"])
        before = allocated()
        model, _, pp_cfg, _, _, tokenizer = models.build(c.model)
        accelerator = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if bf16 else "no")
        model.to(dev).train()
        optimizer = build_optimizer(model, c.optim, device=dev)
        acc_model, acc_optimizer = accelerator.prepare(model, optimizer)
        spec = ImageSpec.from_config(pp_cfg)
        _, finish = train_image_stages(spec)
        held["mmcl"] = dict(cfg=c, model=model, accelerator=accelerator, acc_model=acc_model, optimizer=acc_optimizer,
                            objective=objective_from_config(c.loss), finish=finish, spec=spec,
                            tokenizer=models.training_tokenizer(model, tokenizer), full_tokenizer=tokenizer,
                            resident=0, compiled=None)
        held["mmcl"]["resident_before"] = before
        # open_clip's own model of the same architecture (mmcl's configs registered as open_clip ones).
        before = allocated()
        open_clip.add_model_config(str(REPO / "mmcl" / "models" / "model_configs"))
        oc = open_clip.create_model(cfg["model"], precision="fp32", device=dev).train()
        # open_clip_train's AdamW: no weight decay on gains, biases, embeddings and the logit scale.
        def exclude(n, p):
            return p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n

        named = list(oc.named_parameters())
        oc_opt = torch.optim.AdamW(
            [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
             {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": 0.1}],
            lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
        held["open_clip"] = dict(model=oc, optimizer=oc_opt, loss=open_clip.loss.ClipLoss(), compiled=None,
                                 resident_before=before)
    m, o = held["mmcl"], held["open_clip"]
    g = torch.Generator().manual_seed(batch)
    side = m["spec"].size if isinstance(m["spec"].size, int) else m["spec"].size[0]
    texts = captions(batch, batch)
    mmcl_batch = {"image": torch.randint(0, 256, (batch, 3, side, side), generator=g, dtype=torch.uint8).to(dev),
                  "text": m["tokenizer"](texts).contiguous().to(dev),
                  "label": torch.full((batch,), -1, dtype=torch.long).to(dev)}
    with torch.no_grad():
        oc_images = m["finish"](mmcl_batch["image"]).float()
    oc_texts = open_clip.get_tokenizer(cfg["model"])(texts).to(dev)
    held["text_tokens"] = {"mmcl": int(mmcl_batch["text"].shape[1]), "open_clip": int(oc_texts.shape[1])}
    if compiled and m["compiled"] is None:
        m["compiled"] = (torch.compile(m["acc_model"]), torch.compile(m["objective"]))
        o["compiled"] = torch.compile(o["model"])
    step_model, loss_fn = m["compiled"] if compiled else (m["acc_model"], m["objective"])
    oc_model = o["compiled"] if compiled else o["model"]
    c = m["cfg"]
    last = {}

    def mmcl_step():
        loss, _, cache = forward_loss(step_model, loss_fn, [mmcl_batch], m["accelerator"], m["finish"],
                                      with_metrics=False)
        backward(m["accelerator"], step_model, loss, [mmcl_batch], cache, m["finish"])
        apply_update(m["accelerator"], m["acc_model"], m["model"], m["optimizer"], c.optim.grad_clip,
                     c.model.max_logit_scale)
        last["mmcl"] = loss

    def oc_step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            img, txt, scale = oc_model(oc_images, oc_texts)[:3]
            loss = o["loss"](img, txt, scale)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(o["model"].parameters(), 1.0)
        o["optimizer"].step()
        o["optimizer"].zero_grad(set_to_none=True)
        with torch.no_grad():
            o["model"].logit_scale.clamp_(0, math.log(100))
        last["open_clip"] = loss

    suffix = "_compiled" if compiled else ""
    return [Variant("mmcl" + suffix, mmcl_step, lambda: float(last["mmcl"].detach()), 0),
            Variant("open_clip" + suffix, oc_step, lambda: float(last["open_clip"].detach()), 0)]


def measure_variant(v: Variant, cfg: Dict[str, Any], device: str, warm: Dict[str, bool], key: str) -> Dict[str, Any]:
    """`v`'s warm-up (its first at this batch size: compilation) and timed steps; `warm` holds the `key`s
    (variant and batch) already warmed up."""
    import torch

    first = key not in warm
    t = time.perf_counter()
    for _ in range(cfg["warmup"] if first else 1):
        v.step()
    sync(device)
    warmup_s = time.perf_counter() - t
    warm[key] = True
    if device == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(cfg["steps"]):
        v.step()
    sync(device)
    elapsed = time.perf_counter() - t
    loss = v.check()
    out = {"step_s": elapsed / cfg["steps"], "warmup_s": round(warmup_s, 2), "first_warmup": first, "loss": loss,
           "finite": math.isfinite(loss)}
    if device == "cuda":
        out.update(peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                   step_peak_gib=(torch.cuda.max_memory_allocated() - base) / 2 ** 30)
    else:
        import resource

        out.update(peak_gib=None, max_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20)
    return out


def stage_train_step(summary: Summary, cfg: Dict[str, Any], device: str, budget_end: float) -> None:

    held: Dict[str, Any] = {}
    warm: Dict[str, bool] = {}
    summary.update("train_step", model=cfg["model"], precision=cfg["precision"], batches=cfg["batches"],
                   timed_steps=cfg["steps"], data="synthetic batches held on the device",
                   note="mmcl: default objective (dense clip), uint8 images finished on the device, trimmed tokens; "
                        "open_clip: float images, full context")
    skipped = []
    for batch in cfg["batches"]:
        for compiled in (False, True):
            for r in range(cfg["rounds"]):
                try:
                    variants = build_variants(cfg, device, batch, compiled, held)
                except Exception as err:  # noqa: BLE001 - recorded, the stage goes on
                    if not is_oom(err):
                        raise
                    skipped.append({"batch": batch, "compiled": compiled, "reason": f"out of memory building: {err}"})
                    free_memory(device)
                    break
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    left = budget_end - time.monotonic()
                    if left < 5:
                        skipped.append({"batch": batch, "variant": v.name, "round": r,
                                        "reason": f"budget: {left:.0f} s left in the stage"})
                        continue
                    try:
                        res = measure_variant(v, cfg, device, warm, f"{v.name}@{batch}")
                    except OutOfTime:
                        raise
                    except Exception as err:  # noqa: BLE001
                        if not is_oom(err):
                            raise
                        free_memory(device)
                        skipped.append({"batch": batch, "variant": v.name, "round": r,
                                        "reason": f"out of memory: {str(err).splitlines()[0][:200]}"})
                        continue
                    res.update(variant=v.name, batch=batch, round=r, compiled=compiled,
                               samples_per_s=batch / res["step_s"], text_tokens=held["text_tokens"])
                    summary.add("train_step", res)
                    summary.update("train_step", table=train_table(summary.stage("train_step")))
        summary.update("train_step", skipped=skipped)
    summary.update("train_step", skipped=skipped)


def train_table(stage: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Median samples/s and peak memory per (batch, variant), and mmcl over open_clip per batch."""
    rows: Dict[tuple, List[Dict[str, Any]]] = {}
    for res in stage.get("results", []):
        rows.setdefault((res["batch"], res["variant"]), []).append(res)
    table = []
    for (batch, variant), rs in sorted(rows.items()):
        peaks = [r["peak_gib"] for r in rs if r.get("peak_gib") is not None]
        table.append({"batch": batch, "variant": variant, "rounds": len(rs),
                      "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                      "peak_gib": max(peaks) if peaks else None,
                      "first_warmup_s": next((r["warmup_s"] for r in rs if r["first_warmup"]), None)})
    by = {(t["batch"], t["variant"]): t for t in table}
    for t in table:
        if t["variant"].startswith("mmcl"):
            ref = by.get((t["batch"], t["variant"].replace("mmcl", "open_clip")))
            if ref:
                t["over_open_clip"] = t["samples_per_s"] / ref["samples_per_s"]
    return table


# ----------------------------------------------------------------------------------------------- c. losses
def stage_losses(summary: Summary, cfg: Dict[str, Any], device: str, budget_end: float) -> None:
    import torch
    from bench_losses import REFERENCE, features, make_loss

    summary.update("losses", dim=cfg["loss_dim"], chunk=cfg["chunk"], autocast="bf16" if device == "cuda" else None,
                   sizes=cfg["loss_n"])
    skipped = []
    dev = torch.device(device)
    for n in cfg["loss_n"]:
        g = torch.Generator().manual_seed(n)
        img0, txt0 = features(n, cfg["loss_dim"], "aligned", g)
        for kind in ("clip", "siglip"):
            values = {}
            for impl in ("tiled", "reference"):
                name = REFERENCE[kind] if impl == "reference" else f"mmcl_{kind}_chunk{cfg['chunk']}"
                left = budget_end - time.monotonic()
                if left < 3:
                    skipped.append({"n": n, "impl": name, "reason": f"budget: {left:.0f} s left in the stage"})
                    continue
                fn = make_loss(impl, n, cfg["loss_dim"], cfg["chunk"], kind, device)
                img = img0.to(dev).requires_grad_(True)
                txt = txt0.to(dev).requires_grad_(True)
                scale = torch.tensor(14.3, device=dev, requires_grad=True)

                def once():
                    img.grad = txt.grad = scale.grad = None
                    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=device == "cuda"):
                        loss = fn(img, txt, scale)
                    loss.backward()
                    return loss

                try:
                    free_memory(device)
                    if device == "cuda":
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                    t = time.perf_counter()
                    loss = once()  # the first call: also the warm-up
                    sync(device)
                    first_s = time.perf_counter() - t
                    times = []  # at the largest size the first call is the only one (seconds each)
                    for _ in range(cfg["loss_repeats"] if n < 200_000 else 0):
                        t = time.perf_counter()
                        loss = once()
                        sync(device)
                        times.append(time.perf_counter() - t)
                    res = {"n": n, "kind": kind, "impl": name, "first_s": round(first_s, 3),
                           "time_s": statistics.median(times) if times else first_s, "loss": float(loss)}
                    if device == "cuda":
                        res["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                    values[impl] = float(loss)
                except OutOfTime:
                    raise
                except Exception as err:  # noqa: BLE001
                    if not is_oom(err):
                        raise
                    res = {"n": n, "kind": kind, "impl": name, "oom": True,
                           "error": str(err).splitlines()[0][:200],
                           "dense_logits_gib": n * n * 2 / 2 ** 30}
                finally:
                    img = txt = scale = None  # freed before the next size (the closure keeps the names)
                    free_memory(device)
                if "tiled" in values and "reference" in values:
                    res["abs_diff_vs_tiled"] = abs(values["tiled"] - values["reference"])
                summary.add("losses", res)
    summary.update("losses", skipped=skipped)


# -------------------------------------------------------------------------------------------------- d. data
def _jpeg(args):
    import numpy as np

    from bench_data import photo_like

    i, lo, hi = args
    rng = np.random.default_rng(i)
    return photo_like(rng, int(rng.integers(lo, hi)), int(rng.integers(lo * 9 // 10, hi * 9 // 10)))


def stage_data(summary: Summary, cfg: Dict[str, Any], device: str, budget_end: float, work: Path) -> None:
    import multiprocessing

    import open_clip

    from mmcl import models
    from mmcl.data.transforms import ImageSpec
    from mmcl.shards.writer import write_shards

    from bench_data import measure, ours_loader

    n = cfg["data_samples"]
    lo, hi = cfg["image_px"]
    t = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(min(16, os.cpu_count() or 1)) as pool:
        images = pool.map(_jpeg, [(i, lo, hi) for i in range(n)], chunksize=16)
    caps = captions(n, 0)
    per_shard = max(8, n // (4 * cfg["workers"]))
    folder = work / "data-shards"
    info = write_shards(({"key": f"{i:07d}", "image": images[i], "ext": "jpg", "caption": caps[i], "label": i % 10}
                         for i in range(n)), str(folder), shard_size=per_shard)
    spec = str(folder / ("shard-{000000..%06d}.tar" % (info["n_shards"] - 1)))
    made_s = time.perf_counter() - t
    summary.update("data", samples=n, shards=info["n_shards"], shards_written_s=round(made_s, 1),
                   workers=cfg["workers"], batch=cfg["data_batch"], image_px=[lo, hi])
    if budget_end - time.monotonic() < 5:
        summary.update("data", skipped=[{"reason": "budget: no time left after writing the shards"}])
        return
    # The images of ViT-B-32 (224 px) at every size: the loader's work does not depend on the model trained.
    model_cfg = models.resolve_model_config(models_config("ViT-B-32"))
    spec_in = ImageSpec.from_config(models.preprocess_config(model_cfg))
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    loader = ours_loader(spec, spec_in, tokenizer, cfg["data_batch"], cfg["workers"], 1000, True, True)
    if device == "cuda":
        import torch

        loader.pin_memory = True  # as training on a GPU builds it
        finish = loader.finish_images
        loader.finish_images = lambda x: finish(x.to("cuda", non_blocking=True))
        torch.cuda.synchronize()
    rate, per_cpu = measure(loader, cfg["data_batches"], cfg["data_batch"])
    step = next((t for t in summary.stage("train_step").get("table", [])
                 if t["variant"] == "mmcl" and t["batch"] == cfg["data_batch"]), None)
    res = {"loader": "mmcl_fast_decode_uint8", "samples_per_s": rate, "samples_per_cpu_s": per_cpu,
           "step_samples_per_s": step["samples_per_s"] if step else None,
           "loader_over_step": rate / step["samples_per_s"] if step else None}
    summary.add("data", res)


def models_config(name: str):
    from mmcl.config import ModelConfig

    return ModelConfig(name=name)


# ------------------------------------------------------------------------------------------------ e. report
def fmt(x, digits=1):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def markdown(data: Dict[str, Any]) -> str:
    env = data["environment"]
    lines = [f"### mmcl on {env.get('gpu') or data['device']} ({data['when']})", "",
             f"torch {env['versions'].get('torch')} (CUDA {env.get('torch_cuda')}), open_clip "
             f"{env['versions'].get('open-clip-torch')}, mmcl {env.get('mmcl_commit')}"
             f"{' (uncommitted changes)' if env.get('mmcl_dirty') else ''}, Python {env['python']}, "
             f"`bench/gpu/proof.py --budget-s {data['budget_s']}`{' --tiny' if data['tiny'] else ''}.", ""]
    st = data["stages"]
    for name in STAGES:
        s = st[name]
        if s.get("status") not in ("done", "partial"):
            lines.append(f"- {name}: {s.get('status')}: {s.get('reason', '')}")
    t = st["tests"]
    if t.get("results"):
        r = t["results"][-1]
        lines += ["", f"**GPU tests** ({t.get('status')}): " + ", ".join(f"{k} {v}" for k, v in r["counts"].items())
                  + (f"; failed: {', '.join(r['failed'])}" if r["failed"] else "")]
    tb = st["train_step"].get("table") or []
    if tb:
        step = st["train_step"]
        lines += ["", f"**Training step**, {step.get('model')}, {step.get('precision')}, one device, synthetic "
                  "batches on the device (median of rounds; peak = CUDA allocator peak during the timed steps):", "",
                  "| batch | variant | samples/s | vs open_clip | peak GiB | first warm-up s |",
                  "| ---: | --- | ---: | ---: | ---: | ---: |"]
        for row in tb:
            lines.append(f"| {row['batch']} | {row['variant']} | {fmt(row['samples_per_s'])} | "
                         f"{fmt(row.get('over_open_clip'), 2)} | {fmt(row['peak_gib'], 2)} | "
                         f"{fmt(row['first_warmup_s'])} |")
    lr = st["losses"].get("results") or []
    if lr:
        lines += ["", f"**Loss fwd+bwd**, {st['losses'].get('dim')}-d features, autocast "
                  f"{st['losses'].get('autocast')}, peak = allocator growth over the inputs:", "",
                  "| N | loss | implementation | time s | peak GiB |", "| ---: | --- | --- | ---: | ---: |"]
        for r in lr:
            lines.append(f"| {r['n']:,} | {r['kind']} | {r['impl']} | "
                         f"{'OOM' if r.get('oom') else fmt(r.get('time_s'), 3)} | "
                         f"{'OOM' if r.get('oom') else fmt(r.get('peak_gib'), 2)} |")
    dr = st["data"].get("results") or []
    if dr:
        d = dr[-1]
        lines += ["", f"**Data loader alone**, {st['data'].get('workers')} workers, batch {st['data'].get('batch')}, "
                  f"{st['data'].get('samples')} synthetic JPEGs of {st['data'].get('image_px')} px: "
                  f"{fmt(d['samples_per_s'])} samples/s; the plain mmcl step: {fmt(d['step_samples_per_s'])} "
                  f"samples/s (loader / step {fmt(d['loader_over_step'], 2)})."]
    lines += ["", "<details><summary>nvidia-smi</summary>", "", "```", env.get("nvidia_smi", ""), "```", "",
              "</details>", ""]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "proof-out")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (automatic with --device cpu)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    if args.device == "cpu":
        # The rehearsal: compiled variants go through torch.compile's wrappers without dynamo generating code
        # (read by torch when it is imported, below).
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    tiny = args.tiny or device == "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # a small model on a shared CPU: more threads mostly wait for each other
    cfg = sizes(tiny)
    summary = Summary(out, {"device": device, "tiny": tiny, "budget_s": args.budget_s,
                            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sizes": cfg,
                            "environment": environment(device)})
    wanted = [s for s in args.stages.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="mmcl-proof-"))
    for i, name in enumerate(STAGES):
        if name not in wanted:
            summary.update(name, status="skipped", reason="not asked for (--stages)")
            continue
        rest = [s for s in STAGES[i:] if s in wanted]
        left = budget.left()
        share = left * SHARES[name] / sum(SHARES[s] for s in rest)
        if share < 10:
            summary.update(name, status="skipped", reason=f"budget: {left:.0f} s left for {len(rest)} stage(s)")
            continue
        summary.update(name, status="running", share_s=round(share, 1))
        t0 = time.monotonic()
        end = t0 + share
        try:
            if name == "tests":
                stage_tests(summary, cfg, device, share, work, out)
            else:
                with deadline(share + 5):  # the stage watches `end` itself; this cuts one that hangs past it
                    if name == "train_step":
                        stage_train_step(summary, cfg, device, end)
                    elif name == "losses":
                        stage_losses(summary, cfg, device, end)
                    else:
                        stage_data(summary, cfg, device, end, work)
                summary.update(name, status="done")
        except OutOfTime as err:
            summary.update(name, status="partial", reason=str(err))
        except Exception as err:  # noqa: BLE001 - one stage's failure is recorded, the others still run
            summary.update(name, status="error", reason=f"{type(err).__name__}: {str(err)[:500]}",
                           traceback=traceback.format_exc()[-3000:])
            free_memory(device)
        summary.update(name, seconds=round(time.monotonic() - t0, 1))
    summary.data["elapsed_s"] = round(budget.elapsed(), 1)
    summary.write()
    (out / "summary.md").write_text(markdown(summary.data))
    print(f"proof: summary.json and summary.md in {out} after {budget.elapsed():.0f} s", flush=True)
    print(json.dumps({s: summary.stage(s).get("status") for s in STAGES}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
