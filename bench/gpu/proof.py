"""mmcl on one GPU, measured in one call within a time budget it keeps itself (about 420 s on an H100 or H200).

Stages, in priority order; each gets a share of the time left when it starts and is skipped, with the reason written
down, when too little is left. Every measurement is an *arm* caught on its own: an exception or an out-of-memory
ends that arm (recorded with its reason), not the stage; an arm that runs past its time is cut and says so.

1. tests: ``pytest -m gpu`` over the test files with CUDA tests (``pytest.mark.gpu``), run on the GPU. Not the
   ``gpu_path`` tests: those run on the CPU by design (the ``cpu_device`` fixture).
2. e2e: ``mmcl train`` of ViT-B-32 in bf16 on a few thousand synthetic photo-like JPEGs written at the start, with a
   checkpoint and an in-run zero-shot evaluation: the default data workers, then more; ``data.decode=device``
   against the workers' decode; then a resume of the first run. Samples/s, data wait, MFU and peak memory, as the
   runs' own metrics.jsonl say them.
3. equal_work: mmcl's training step against open_clip's (model + ClipLoss, autocast, the clip and clamp of
   open_clip_train) on synthetic batches held on the device, batch 1024: both at 77 tokens and the same AdamW
   implementation (fused where mmcl's is), three rounds alternating the order, with their spread; then mmcl's
   trimmed text (captions cut to the batch's longest) as a separate arm, labelled as the feature it is.
4. compiled: the same pair compiled at batch 1024, open_clip's arm first; mmcl's compiled arm is skipped only if
   open_clip's compile overran the stage's time.
5. tiled_step: mmcl's full step (GradCache micro-batches of 1024) at 16k and 32k pairs, the loss tiled
   (``loss.chunk_size=1024``) against dense: step time and peak memory.

summary.json is rewritten after every arm and summary.md at the end (and when a stage fails), so a run that the
budget cuts still leaves what it measured.

    python bench/gpu/proof.py --out DIR [--budget-s 420] [--device cuda|cpu] [--tiny] [--stages a,b]

``--device cpu`` (or ``--tiny``) runs every stage at tiny sizes (the tiny model in float32, batches of 4 and 8, a few
dozen JPEGs, 1 worker): the rehearsal tests/test_gpu_proof.py runs on a CPU.
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

STAGES = ("tests", "e2e", "equal_work", "compiled", "tiled_step")
# Share of the time left that each stage may take when it starts. On an H100 (BENCHMARKS.md, GPU) each compile of
# ViT-B-32 took 67-106 s, and writing 8k JPEG shards about 27 s.
SHARES = {"tests": 0.10, "e2e": 0.34, "equal_work": 0.16, "compiled": 0.30, "tiled_step": 0.10}
# The rehearsal on a shared CPU: each `mmcl train` there starts in 10-60 s (imports), the steps take seconds.
TINY_SHARES = {"tests": 0.08, "e2e": 0.62, "equal_work": 0.12, "compiled": 0.08, "tiled_step": 0.10}
RESERVE_S = 6.0  # kept for the report after the last stage


class OutOfTime(Exception):
    """An arm ran past its time."""


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
        raise OutOfTime(f"cut after {seconds:.0f} s, its time in the budget")

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
        self.out = out
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
        print(json.dumps({"stage": name, **{k: v for k, v in result.items() if k != "traceback"}}, default=str),
              flush=True)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def arm(summary: Summary, stage: str, name: str, seconds: float, fn: Callable[[], Dict[str, Any]],
        device: str = "cpu") -> Dict[str, Any]:
    """Run one measurement `fn` (its figures, a dict) within `seconds`: its exception, out-of-memory or overrun
    ends it alone and is recorded as its status."""
    t0 = time.monotonic()
    if seconds < 3:
        res = {"arm": name, "status": "skipped", "reason": f"budget: {seconds:.0f} s left in the stage"}
    else:
        try:
            with deadline(seconds):
                res = {"arm": name, **(fn() or {})}
            res.setdefault("status", "done")
        except OutOfTime as err:
            res = {"arm": name, "status": "cut", "reason": str(err)}
        except Exception as err:  # noqa: BLE001 - one arm's failure is recorded, the others still run
            res = {"arm": name, "status": "oom" if is_oom(err) else "error",
                   "reason": f"{type(err).__name__}: {str(err)[:400]}", "traceback": traceback.format_exc()[-2500:]}
        res["seconds"] = round(time.monotonic() - t0, 1)
    free_memory(device)
    summary.add(stage, res)
    return res


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



def _jpeg(args):
    import numpy as np

    from bench_data import photo_like

    i, lo, hi = args
    rng = np.random.default_rng(i)
    return photo_like(rng, int(rng.integers(lo, hi)), int(rng.integers(lo * 9 // 10, hi * 9 // 10)))


# ---------------------------------------------------------------------------------------------------- sizes
TINY_TOWERS = ["model.vision_cfg={layers: 1, width: 32, head_width: 16}",
               "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]


def sizes(tiny: bool) -> Dict[str, Any]:
    if tiny:
        # float32 on a CPU: its bf16 matrix products are emulated, four times slower than float32 here.
        return {"model": "tiny", "precision": "fp32", "batch": 8, "warmup": 1, "steps": 1, "rounds": 3,
                "tiled_pairs": [32], "micro": 8, "chunk": 8,
                "e2e": {"config": "configs/tiny.yaml", "samples": 48, "image_px": (96, 128), "batch": 8, "steps": 4,
                        "more_workers": 0, "overrides": [*TINY_TOWERS, "train.precision=fp32"]}}
    return {"model": "ViT-B-32", "precision": "bf16", "batch": 1024, "warmup": 3, "steps": 10, "rounds": 3,
            "tiled_pairs": [16384, 32768], "micro": 1024, "chunk": 1024,
            "e2e": {"config": "configs/vit-b-32.yaml", "samples": 3072, "image_px": (420, 640), "batch": 256,
                    "steps": 30, "more_workers": None, "overrides": ["train.precision=bf16"]}}


# -------------------------------------------------------------------------------------------------- 1. tests
def gpu_test_files() -> List[str]:
    """The test files with CUDA tests (``pytest.mark.gpu``; not ``gpu_path``, whose tests run on the CPU)."""
    found = []
    for path in sorted(REPO.glob("tests/**/test_*.py")):
        if re.search(r"pytest\.mark\.gpu\b(?!_)", path.read_text(errors="replace")):
            found.append(str(path.relative_to(REPO)))
    return found


def stage_tests(summary: Summary, cfg: Dict[str, Any], device: str, end: float, work: Path, out: Path) -> None:
    """pytest -m gpu on the files with CUDA tests; the output goes to $OUT/pytest.log as it runs."""
    log = out / "pytest.log"
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "--tb=short", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-m", "gpu", *files]
    summary.update("tests", command=" ".join(cmd[1:]), log=log.name, files=files)

    def run() -> Dict[str, Any]:
        code, cut = run_cmd(cmd, end - time.monotonic(), log)
        text = log.read_text(errors="replace")
        counts: Dict[str, int] = {}
        for outcome in re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", text):
            counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
        failed = [ln.split(" ")[0] for ln in text.splitlines() if re.search(r" (FAILED|ERROR)\b", ln) and "::" in ln]
        skips = [ln for ln in text.splitlines() if ln.startswith("SKIPPED [")]
        return {"exit_code": code, "counts": counts, "failed": failed[:30], "skip_reasons": skips[:10],
                "on": device, "status": "cut" if cut else "done"}

    arm(summary, "tests", "pytest -m gpu", end - time.monotonic() + 5, run, device)


def run_cmd(cmd: List[str], seconds: float, log: Path, env: Optional[Dict[str, str]] = None):
    """Run `cmd` in its own process group, its output into `log`, killed after `seconds`: (exit code, cut)."""
    with open(log, "a") as sink:
        sink.write(f"\n$ {' '.join(cmd)}\n")
        sink.flush()
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        try:
            return proc.wait(timeout=max(1.0, seconds)), False
        except (subprocess.TimeoutExpired, OutOfTime):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, True


# ---------------------------------------------------------------------------------------------------- 2. e2e
def write_e2e_data(cfg: Dict[str, Any], work: Path) -> Dict[str, Any]:
    """Synthetic photo-like JPEG shards (web-like captions) and a two-class zero-shot ImageFolder."""
    import multiprocessing

    from PIL import Image

    from mmcl.shards.writer import write_shards

    e = cfg["e2e"]
    n, (lo, hi) = e["samples"], e["image_px"]
    t = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(min(16, os.cpu_count() or 1)) as pool:
        images = pool.map(_jpeg, [(i, lo, hi) for i in range(n)], chunksize=16)
    caps = captions(n, 0)
    folder = work / "e2e-shards"
    info = write_shards(({"key": f"{i:07d}", "image": images[i], "ext": "jpg", "caption": caps[i]} for i in range(n)),
                        str(folder), shard_size=max(8, n // 32))
    zs = work / "zeroshot"
    for name, colour in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        (zs / name).mkdir(parents=True, exist_ok=True)
        for i in range(4):
            Image.new("RGB", (64 + 8 * i, 64), colour).save(zs / name / f"{i}.jpg", quality=90)
    return {"train": str(folder / ("shard-{000000..%06d}.tar" % (info["n_shards"] - 1))), "zeroshot": str(zs),
            "samples": n, "shards": info["n_shards"], "written_s": round(time.perf_counter() - t, 1),
            "image_px": [lo, hi]}


def e2e_args(cfg: Dict[str, Any], data: Dict[str, Any], out: Path, steps: int, *extra: str) -> List[str]:
    e = cfg["e2e"]
    every = max(1, e["steps"] // 2)
    return [sys.executable, "-m", "mmcl", "train", "--config", str(REPO / e["config"]), f"data.train={data['train']}",
            f"train.output_dir={out}", f"data.batch_size={e['batch']}", "train.samples=null", f"train.steps={steps}",
            "optim.warmup_steps=2", f"train.log_every={max(1, every // 2)}", f"train.save_every={every}",
            f"eval.zeroshot={data['zeroshot']}", f"eval.every={every}", "train.progress=false", "train.plot=false",
            "train.log_with=[]", "data.resampled=false", "data.shuffle_buffer=256", *e["overrides"], *extra]


def run_figures(out: Path, log_text: str) -> Dict[str, Any]:
    """What a run's metrics.jsonl and start lines say of its speed: the median over the logged windows after the
    first (which holds the workers' start), the allocator's peak, the last zero-shot result."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    steps = [r for r in rows if "samples_per_s" in r]
    steady = steps[1:] or steps

    def med(key):
        vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    zs = {k.split("/", 2)[2]: v for r in rows for k, v in r.items() if k.startswith("eval/zeroshot_classification/")}
    said = [ln[6:] for ln in log_text.splitlines() if ln.startswith("mmcl: ") and any(
        w in ln for w in ("GFLOPs per pair", "images decoded", "data workers per process", "waited for data",
                          "speed:", "resuming from"))]
    peaks = [r["mem/peak_gib"] for r in steps if "mem/peak_gib" in r]
    return {"samples_per_s": med("samples_per_s"), "data_wait": med("data_time_frac"), "mfu": med("mfu"),
            "peak_gib": max(peaks) if peaks else None, "logged_steps": [r["step"] for r in steps],
            "zeroshot": zs, "said": said}


def stage_e2e(summary: Summary, cfg: Dict[str, Any], device: str, end: float, work: Path, out: Path) -> None:
    e = cfg["e2e"]
    data = write_e2e_data(cfg, work)
    summary.update("e2e", data=data, batch=e["batch"], steps=e["steps"], config=e["config"])
    log = out / "e2e.log"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    more = max(2, cpus + cpus // 2) if e["more_workers"] is None else e["more_workers"]
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    plan = [("default workers, decode in workers", "default", []),
            ("default workers, data.decode=device", "device", ["data.decode=device"])]
    if more:  # not in the rehearsal, where it is the first run's path with another number
        plan.append((f"{more} workers, decode in workers", "more", [f"data.workers={more}"]))
    first_out = None
    for i, (name, tag, extra) in enumerate(plan):
        run_out = work / f"e2e-{tag}"
        share = (end - time.monotonic()) / (len(plan) - i + 0.5)  # the resume's half share kept for last

        def one(run_out=run_out, extra=extra, share=share):
            before = log.stat().st_size if log.is_file() else 0
            code, cut = run_cmd(e2e_args(cfg, data, run_out, e["steps"], *extra), share, log, env)
            text = log.read_text(errors="replace")[before:]
            res = {"exit_code": code, **run_figures(run_out, text)}
            if cut:
                res.update(status="cut", reason=f"stopped after {share:.0f} s")
            elif code != 0:
                res.update(status="error", reason=(text.strip().splitlines() or ["(no output)"])[-1][:300])
            return res

        res = arm(summary, "e2e", name, share + 10, one, device)
        if tag == "default" and res.get("status") == "done":
            first_out = run_out
    if first_out is None:
        summary.add("e2e", {"arm": "resume", "status": "skipped", "reason": "the first run did not finish"})
        return

    def resume():
        before = log.stat().st_size
        steps = e["steps"] + max(1, e["steps"] // 2)
        code, cut = run_cmd(e2e_args(cfg, data, first_out, steps), end - time.monotonic(), log, env)
        text = log.read_text(errors="replace")[before:]
        res = {"exit_code": code, "resumed": "resuming from" in text, **run_figures(first_out, text)}
        if cut or code != 0 or not res["resumed"]:
            res.update(status="cut" if cut else "error", reason="stopped" if cut else "no resume, or a failure")
        return res

    arm(summary, "e2e", "resume of the first run", end - time.monotonic() + 5, resume, device)


# ----------------------------------------------------------------------------------- 3-5. the training step
def held_models(cfg: Dict[str, Any], device: str, held: Dict[str, Any]) -> None:
    """mmcl's model, optimiser and objective (as training builds them, Accelerator-prepared) and open_clip's own
    model of the same architecture with open_clip_train's AdamW groups, the same AdamW implementation as mmcl's
    (fused where mmcl's is); built once, kept in `held`."""
    if "mmcl" in held:
        return
    import open_clip
    import torch
    from accelerate import Accelerator

    from mmcl import models
    from mmcl.config import load_config
    from mmcl.data.transforms import ImageSpec, train_image_stages
    from mmcl.training.optim import build_optimizer
    from mmcl.training.step import objective_from_config

    dev = torch.device(device)
    bf16 = cfg["precision"] == "bf16"
    c = load_config(str(REPO / "configs" / "tiny.yaml"), [f"model.name={cfg['model']}"])
    model, _, pp_cfg, _, _, tokenizer = models.build(c.model)
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if bf16 else "no")
    model.to(dev).train()
    optimizer = build_optimizer(model, c.optim, device=dev)
    fused = bool(optimizer.defaults.get("fused"))
    acc_model, acc_optimizer = accelerator.prepare(model, optimizer)
    spec = ImageSpec.from_config(pp_cfg)
    held["mmcl"] = dict(cfg=c, model=model, accelerator=accelerator, acc_model=acc_model, optimizer=acc_optimizer,
                        objective=objective_from_config(c.loss), finish=train_image_stages(spec)[1], spec=spec,
                        trimmed=models.training_tokenizer(model, tokenizer), full=tokenizer, fused=fused)
    open_clip.add_model_config(str(REPO / "mmcl" / "models" / "model_configs"))  # mmcl's tiny, for the rehearsal
    oc = open_clip.create_model(cfg["model"], precision="fp32", device=dev).train()

    def exclude(n, p):  # open_clip_train: no weight decay on gains, biases, embeddings and the logit scale
        return p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n

    named = list(oc.named_parameters())
    oc_opt = torch.optim.AdamW(
        [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
         {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": 0.1}],
        lr=1e-3, betas=(0.9, 0.98), eps=1e-6, fused=fused or None)
    held["open_clip"] = dict(model=oc, optimizer=oc_opt, loss=open_clip.loss.ClipLoss(),
                             tokenizer=open_clip.get_tokenizer(cfg["model"]), fused=fused)


def step_fns(cfg: Dict[str, Any], device: str, batch: int, held: Dict[str, Any], text: str = "full",
             compiled: bool = False) -> Dict[str, Callable[[], Any]]:
    """One optimiser step of mmcl (text "full": 77 tokens as open_clip's; "trimmed": its training tokenizer) and of
    open_clip on one synthetic batch of `batch` pairs held on the device; each returns its loss."""
    import torch

    from mmcl.training.step import apply_update, backward, forward_loss

    held_models(cfg, device, held)
    m, o = held["mmcl"], held["open_clip"]
    dev = torch.device(device)
    g = torch.Generator().manual_seed(batch)
    side = m["spec"].size if isinstance(m["spec"].size, int) else m["spec"].size[0]
    texts = captions(batch, batch)
    tokens = (m["trimmed"] if text == "trimmed" else m["full"])(texts)
    mb = {"image": torch.randint(0, 256, (batch, 3, side, side), generator=g, dtype=torch.uint8).to(dev),
          "text": tokens.contiguous().to(dev), "label": torch.full((batch,), -1, dtype=torch.long).to(dev)}
    with torch.no_grad():
        oc_images = m["finish"](mb["image"]).float()
    oc_texts = o["tokenizer"](texts).to(dev)
    held["text_tokens"] = {"mmcl": int(mb["text"].shape[1]), "open_clip": int(oc_texts.shape[1])}
    if compiled:
        if "mmcl_compiled" not in m:
            m["mmcl_compiled"] = (torch.compile(m["acc_model"]), torch.compile(m["objective"]))
            o["compiled"] = torch.compile(o["model"])
        step_model, loss_fn, oc_model = *m["mmcl_compiled"], o["compiled"]
    else:
        step_model, loss_fn, oc_model = m["acc_model"], m["objective"], o["model"]
    c = m["cfg"]
    bf16 = cfg["precision"] == "bf16"

    def mmcl_step():
        loss, _, cache = forward_loss(step_model, loss_fn, [mb], m["accelerator"], m["finish"], with_metrics=False)
        backward(m["accelerator"], step_model, loss, [mb], cache, m["finish"])
        apply_update(m["accelerator"], m["acc_model"], m["model"], m["optimizer"], c.optim.grad_clip,
                     c.model.max_logit_scale)
        return loss

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
        return loss

    return {"mmcl": mmcl_step, "open_clip": oc_step}


def timed(step: Callable[[], Any], cfg: Dict[str, Any], device: str, batch: int, warmup: Optional[int] = None
          ) -> Dict[str, Any]:
    """`step`'s warm-up, then its timed steps: samples/s, peak memory over the timed steps, the last loss."""
    import torch

    t = time.perf_counter()
    for _ in range(cfg["warmup"] if warmup is None else warmup):
        loss = step()
    sync(device)
    warmup_s = time.perf_counter() - t
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(cfg["steps"]):
        loss = step()
    sync(device)
    elapsed = time.perf_counter() - t
    value = float(loss.detach())
    out = {"samples_per_s": batch * cfg["steps"] / elapsed, "warmup_s": round(warmup_s, 2), "loss": value,
           "finite": math.isfinite(value)}
    if device == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return out


def with_mfu(res: Dict[str, Any], cfg: Dict[str, Any], device: str, held: Dict[str, Any], tokens: int
             ) -> Dict[str, Any]:
    """`res` with the MFU of its samples/s: mmcl.models.flops at the arm's text length (the work it did)."""
    import torch

    from mmcl.models import flops

    key = ("flops", tokens)
    if key not in held:
        m = held["mmcl"]
        held[key] = flops.sample_flops(m["model"], m["spec"].size, tokens)
    peak = flops.device_peak(torch.device(device), cfg["precision"], True)
    res.update(gflops_per_pair=round(held[key] / 1e9, 2), mfu=flops.mfu(res["samples_per_s"], held[key], peak))
    return res


def stage_equal_work(summary: Summary, cfg: Dict[str, Any], device: str, end: float, work: Path, out: Path) -> None:
    held = summary.held
    batch = cfg["batch"]
    fns = step_fns(cfg, device, batch, held, "full")
    summary.update("equal_work", batch=batch, model=cfg["model"], precision=cfg["precision"],
                   text_tokens=dict(held["text_tokens"]), adamw_fused=held["mmcl"]["fused"],
                   note="both 77 tokens, the same AdamW implementation; synthetic batches held on the device")
    warm = set()
    for r in range(cfg["rounds"]):
        for name in (("mmcl", "open_clip") if r % 2 == 0 else ("open_clip", "mmcl")):
            left = (end - time.monotonic()) / (2 * (cfg["rounds"] - r) + 1)

            def one(name=name, r=r):
                res = timed(fns[name], cfg, device, batch, None if name not in warm else 1)
                warm.add(name)
                tokens = held["text_tokens"][name]
                return with_mfu({"tool": name, "round": r, "tokens": tokens, **res}, cfg, device, held, tokens)

            arm(summary, "equal_work", f"{name} round {r}", left + 20, one, device)

    def trimmed():
        f = step_fns(cfg, device, batch, held, "trimmed")
        res = timed(f["mmcl"], cfg, device, batch)
        tokens = held["text_tokens"]["mmcl"]
        return with_mfu({"tool": "mmcl_trimmed_text", "tokens": tokens, **res}, cfg, device, held, tokens)

    arm(summary, "equal_work", "mmcl, text trimmed to the batch's longest caption (the feature)",
        end - time.monotonic(), trimmed, device)
    summary.update("equal_work", table=equal_table(summary.stage("equal_work")))


def equal_table(stage: Dict[str, Any]) -> Dict[str, Any]:
    done = [r for r in stage.get("results", []) if r.get("status") == "done" and "round" in r]
    by: Dict[str, List[float]] = {}
    for r in done:
        by.setdefault(r["tool"], []).append(r["samples_per_s"])
    rows = {t: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": len(v)} for t, v in by.items()}
    rounds = {}
    for r in done:
        rounds.setdefault(r["round"], {})[r["tool"]] = r["samples_per_s"]
    ratios = [x["mmcl"] / x["open_clip"] for x in rounds.values() if "mmcl" in x and "open_clip" in x]
    return {"tools": rows, "ratios": ratios, "ratio_median": statistics.median(ratios) if ratios else None}


def stage_compiled(summary: Summary, cfg: Dict[str, Any], device: str, end: float, work: Path, out: Path) -> None:
    held = summary.held
    batch = cfg["batch"]
    summary.update("compiled", batch=batch, order="open_clip first")
    fns = step_fns(cfg, device, batch, held, "full", compiled=True)
    tokens = held["text_tokens"]["open_clip"]  # 77 for ViT-B-32, in both
    first = arm(summary, "compiled", "open_clip compiled", end - time.monotonic(),
                lambda: with_mfu({"tool": "open_clip_compiled", "tokens": tokens,
                                  **timed(fns["open_clip"], cfg, device, batch)}, cfg, device, held, tokens), device)
    if first.get("status") == "cut":
        summary.add("compiled", {"arm": "mmcl compiled", "status": "skipped",
                                 "reason": f"open_clip's compile overran the stage ({first['seconds']} s)"})
        return
    arm(summary, "compiled", "mmcl compiled", end - time.monotonic(),
        lambda: with_mfu({"tool": "mmcl_compiled", "tokens": tokens, **timed(fns["mmcl"], cfg, device, batch)},
                         cfg, device, held, tokens), device)


def stage_tiled_step(summary: Summary, cfg: Dict[str, Any], device: str, end: float, work: Path, out: Path) -> None:
    """mmcl's step at large global batches: micro-batches of cfg["micro"] (GradCache), the loss dense or tiled."""
    import torch

    from mmcl.config import load_config
    from mmcl.training.step import apply_update, backward, forward_loss, objective_from_config

    held = summary.held
    held_models(cfg, device, held)
    m = held["mmcl"]
    dev = torch.device(device)
    micro = cfg["micro"]
    side = m["spec"].size if isinstance(m["spec"].size, int) else m["spec"].size[0]
    summary.update("tiled_step", micro_batch=micro, chunk=cfg["chunk"], model=cfg["model"])
    plan = [(n, chunk) for n in cfg["tiled_pairs"] for chunk in (cfg["chunk"], None)]
    for i, (n, chunk) in enumerate(plan):
        def one(n=n, chunk=chunk):
            objective = objective_from_config(load_config(str(REPO / "configs" / "tiny.yaml"),
                                                          [f"loss.chunk_size={chunk or 'null'}"]).loss)
            g = torch.Generator().manual_seed(n)
            tokens = m["full"](captions(micro, n)).contiguous().to(dev)
            batches = [{"image": torch.randint(0, 256, (micro, 3, side, side), generator=g, dtype=torch.uint8).to(dev),
                        "text": tokens, "label": torch.full((micro,), -1, dtype=torch.long, device=dev)}
                       for _ in range(n // micro)]

            def step():
                loss, _, cache = forward_loss(m["acc_model"], objective, batches, m["accelerator"], m["finish"],
                                              with_metrics=False)
                backward(m["accelerator"], m["acc_model"], loss, batches, cache, m["finish"])
                apply_update(m["accelerator"], m["acc_model"], m["model"], m["optimizer"], None,
                             m["cfg"].model.max_logit_scale)
                return loss

            res = timed(step, dict(cfg, steps=1), device, n, warmup=1)
            return {"pairs": n, "loss_impl": f"tiled (chunk {chunk})" if chunk else "dense", **res,
                    "step_s": n / res["samples_per_s"]}

        arm(summary, "tiled_step", f"{n} pairs, {'tiled' if chunk else 'dense'}",
            (end - time.monotonic()) / (len(plan) - i), one, device)


# ------------------------------------------------------------------------------------------------- report
def fmt(x, digits=1):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def pct(x):
    return "-" if x is None else f"{100 * x:.1f} %"


def arm_lines(results: List[Dict[str, Any]]) -> List[str]:
    """One line for each arm that did not finish, with its reason."""
    return [f"- {r['arm']}: **{r['status']}** ({r.get('reason', '')})" for r in results
            if r.get("status") not in ("done", None)]


def markdown(data: Dict[str, Any]) -> str:
    env = data["environment"]
    lines = [f"### mmcl on {env.get('gpu') or data['device']} ({data['when']})", "",
             f"torch {env['versions'].get('torch')} (CUDA {env.get('torch_cuda')}), open_clip "
             f"{env['versions'].get('open-clip-torch')}, mmcl {env.get('mmcl_commit')}"
             f"{' (uncommitted changes)' if env.get('mmcl_dirty') else ''}, Python {env['python']}, {env.get('cpus')} "
             f"CPUs, `bench/gpu/proof.py --budget-s {data['budget_s']}`{' --tiny' if data['tiny'] else ''}; "
             f"{data.get('elapsed_s', '?')} s.", ""]
    st = data["stages"]
    for name in STAGES:
        s = st[name]
        if s.get("status") not in ("done", "partial"):
            lines.append(f"- stage {name}: {s.get('status')}: {s.get('reason', '')}")
    res = st["tests"].get("results") or []
    if res and "counts" in res[-1]:
        r = res[-1]
        files = ", ".join(st["tests"].get("files", []))
        lines += ["", f"**1. CUDA tests** (`pytest -m gpu`, on {r.get('on')}; {files}): "
                  + ", ".join(f"{k} {v}" for k, v in r["counts"].items())
                  + (f"; failed: {', '.join(r['failed'])}" if r["failed"] else "")]
    res = st["e2e"].get("results") or []
    if res:
        d = st["e2e"].get("data", {})
        lines += ["", f"**2. `mmcl train` end to end**, {st['e2e'].get('config')}, batch {st['e2e'].get('batch')}, "
                  f"{st['e2e'].get('steps')} steps, {d.get('samples')} synthetic JPEGs of {d.get('image_px')} px in "
                  f"{d.get('shards')} shards, a checkpoint and a zero-shot evaluation mid-run (medians over the logged "
                  "windows after the first):", "",
                  "| run | samples/s | data wait | MFU | peak GiB | zero-shot | status |",
                  "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
        for r in res:
            zs = ", ".join(f"{k} {v:.3f}" for k, v in (r.get("zeroshot") or {}).items() if k.endswith("acc1"))
            lines.append(f"| {r['arm']} | {fmt(r.get('samples_per_s'))} | {pct(r.get('data_wait'))} | "
                         f"{pct(r.get('mfu'))} | {fmt(r.get('peak_gib'), 2)} | {zs or '-'} | {r.get('status')} |")
        said = next((r.get("said") for r in res if r.get("said")), [])
        lines += [""] + [f"    {ln}" for ln in said[:6]]
    res = st["equal_work"].get("results") or []
    if res:
        t = st["equal_work"].get("table") or {}
        tokens = (st["equal_work"].get("text_tokens") or {}).get("open_clip")
        lines += ["", f"**3. Equal work**, batch {st['equal_work'].get('batch')}, both at {tokens} tokens, AdamW "
                  f"fused: {st['equal_work'].get('adamw_fused')} in both; median (min-max) of "
                  f"{len(t.get('ratios', []))} alternated rounds:", "", "| arm | samples/s | spread | MFU | peak GiB |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for tool, row in (t.get("tools") or {}).items():
            mfus = [r.get("mfu") for r in res if r.get("tool") == tool and r.get("mfu") is not None]
            peaks = [r.get("peak_gib") for r in res if r.get("tool") == tool and r.get("peak_gib") is not None]
            lines.append(f"| {tool} | {fmt(row['median'])} | {fmt(row['min'])}-{fmt(row['max'])} | "
                         f"{pct(statistics.median(mfus)) if mfus else '-'} | {fmt(max(peaks) if peaks else None, 2)} |")
        for r in res:
            if r.get("tool") == "mmcl_trimmed_text" and r.get("status") == "done":
                lines.append(f"| mmcl, trimmed text ({r['tokens']} tokens; a feature, not equal work) | "
                             f"{fmt(r['samples_per_s'])} | - | {pct(r.get('mfu'))} (at {r['tokens']} tokens) | "
                             f"{fmt(r.get('peak_gib'), 2)} |")
        if t.get("ratios"):
            lines += ["", f"mmcl / open_clip per round: {', '.join(f'{x:.3f}' for x in t['ratios'])} "
                          f"(median {t['ratio_median']:.3f})"]
        lines += arm_lines(res)
    res = st["compiled"].get("results") or []
    if res:
        lines += ["", f"**4. Compiled**, batch {st['compiled'].get('batch')}, open_clip's arm first:", "",
                  "| arm | samples/s | MFU | warm-up (compile) s | peak GiB | status |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in res:
            lines.append(f"| {r['arm']} | {fmt(r.get('samples_per_s'))} | {pct(r.get('mfu'))} | "
                         f"{fmt(r.get('warmup_s'))} | {fmt(r.get('peak_gib'), 2)} | {r.get('status')} |")
    res = st["tiled_step"].get("results") or []
    if res:
        lines += ["", f"**5. Tiled loss in a real step**, micro-batches of {st['tiled_step'].get('micro_batch')} "
                  "(GradCache), one timed step after one warm-up:", "",
                  "| pairs | loss | step s | peak GiB | status |", "| ---: | --- | ---: | ---: | --- |"]
        for r in res:
            lines.append(f"| {fmt(r.get('pairs'))} | {r.get('loss_impl', r['arm'])} | {fmt(r.get('step_s'), 2)} | "
                         f"{fmt(r.get('peak_gib'), 2)} | {r.get('status')} |")
    lines += ["", "<details><summary>nvidia-smi</summary>", "", "```", env.get("nvidia_smi", ""), "```", "",
              "</details>", ""]
    return "\n".join(lines)


RUNNERS = {"tests": stage_tests, "e2e": stage_e2e, "equal_work": stage_equal_work, "compiled": stage_compiled,
           "tiled_step": stage_tiled_step}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "proof-out")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (automatic with --device cpu)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    if args.device == "cpu":
        # The rehearsal: compiled arms go through torch.compile's wrappers without dynamo generating code (read by
        # torch when it is imported, below).
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
    summary.held = {}  # the models the step stages share, built once
    wanted = [s for s in args.stages.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="mmcl-proof-"))
    for i, name in enumerate(STAGES):
        if name not in wanted:
            summary.update(name, status="skipped", reason="not asked for (--stages)")
            continue
        rest = [s for s in STAGES[i:] if s in wanted]
        left = budget.left()
        shares = TINY_SHARES if tiny else SHARES
        share = left * shares[name] / sum(shares[s] for s in rest)
        if share < 8:
            summary.update(name, status="skipped", reason=f"budget: {left:.0f} s left for {len(rest)} stage(s)")
            continue
        summary.update(name, status="running", share_s=round(share, 1))
        t0 = time.monotonic()
        try:
            RUNNERS[name](summary, cfg, device, t0 + share, work, out)
            arms = summary.stage(name).get("results", [])
            summary.update(name, status="done" if all(r.get("status") == "done" for r in arms) else "partial")
        except Exception as err:  # noqa: BLE001 - what the stage needs before its arms failed; the others still run
            summary.update(name, status="error", reason=f"{type(err).__name__}: {str(err)[:500]}",
                           traceback=traceback.format_exc()[-3000:])
            free_memory(device)
        summary.update(name, seconds=round(time.monotonic() - t0, 1))
        (out / "summary.md").write_text(markdown(summary.data))  # what there is so far, should the run be killed
    summary.data["elapsed_s"] = round(budget.elapsed(), 1)
    summary.write()
    (out / "summary.md").write_text(markdown(summary.data))
    print(f"proof: summary.json and summary.md in {out} after {budget.elapsed():.0f} s", flush=True)
    print(json.dumps({s: summary.stage(s).get("status") for s in STAGES}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
