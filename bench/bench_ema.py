"""mmcl's `WeightEMA` against timm's ``ModelEmaV3`` on a model mmcl builds: what each does of what a run needs, and
the time of one update.

For each model (a ViT config of configs/, optionally with the image tower locked as ``model.lock_image=true`` does
it) and each way of updating, one JSON line:

* ``ms_min``, ``ms_median``: wall time of one update over ``--repeats`` (after two warm-up updates), float32
  weights, the ways taking turns update by update;
* ``syncs``: host-synchronising ops of one update (tests/syncwatch.py: value reads, data-dependent ops, blocking
  copies), the number `tests/training/test_no_stalls.py` requires to be 0 on an ordinary step;
* ``ops``: aten ops dispatched by one update (an upper bound on kernel launches on a GPU);
* ``ema_mib``: memory the average holds;
* ``skips``: whether an update given a device-side flag set to 1 (the optimiser skipped a non-finite step) leaves
  the average as it was, and one with the flag at 0 moves it;
* ``locked_kept_out``: whether locked parameters are left out of the average (no copy, no work);
* ``resume_exact``: whether ``load_state_dict(state_dict())`` into a fresh average, then the same update on both,
  gives bitwise the same average.

Ways: ``mmcl`` (``update(model)``), ``mmcl-flag`` (``update(model, skipped=flag)``), ``timm``
(``ModelEmaV3(model, decay, exclude_buffers=True).update(model)``), ``timm-read-flag`` (a wrapper that skips
timm's update when ``bool(flag)``: one host read per step), ``timm-tensor-decay`` (a wrapper that sets timm's
``decay`` to a 0-dim device tensor, 1 on a skipped step: timm documents a float there, and its lerp then takes
the per-tensor path).

    .venv/bin/python bench/bench_ema.py [--config configs/tiny.yaml configs/vit-b-32.yaml] [--repeats 20]
                                        [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from mmcl import models  # noqa: E402
from mmcl.config import load_config  # noqa: E402
from mmcl.training.ema import WeightEMA  # noqa: E402

from syncwatch import SyncWatch  # noqa: E402

DECAY = 0.999


class TimmReadFlag:
    """timm's average, skipped on the host: the flag is read every step."""

    def __init__(self, model):
        from timm.utils import ModelEmaV3

        self.ema = ModelEmaV3(model, decay=DECAY, exclude_buffers=True)

    def update(self, model, skipped=None):
        if skipped is None or not bool(skipped):
            self.ema.update(model)


class TimmTensorDecay:
    """timm's average with its decay replaced by a device tensor each step (1 on a skipped step)."""

    def __init__(self, model):
        from timm.utils import ModelEmaV3

        self.ema = ModelEmaV3(model, decay=DECAY, exclude_buffers=True)

    def update(self, model, skipped=None):
        flag = torch.zeros(()) if skipped is None else skipped
        self.ema.decay = torch.where(flag != 0, torch.ones(()), torch.full((), DECAY))
        self.ema.update(model)


def _timm(model):
    from timm.utils import ModelEmaV3

    return ModelEmaV3(model, decay=DECAY, exclude_buffers=True)


def _averages(ema):
    """The averaged tensors, by name, as plain float32 copies."""
    if isinstance(ema, WeightEMA):
        return {n: t.clone() for n, t in ema.shadow.items()}
    module = ema.ema.module if hasattr(ema, "ema") else ema.module
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _mib(ema):
    return round(sum(t.numel() * t.element_size() for t in _averages(ema).values()) / 2 ** 20, 1)


def _nudge(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p), alpha=1e-2)


def _update(ema, model, flag):
    if flag is None:
        ema.update(model)
    else:
        ema.update(model, skipped=flag)


def timings(emas, model, repeats):
    """Per way, the wall times of `repeats` updates, the ways taking turns update by update (a load that comes and
    goes on the machine then falls on all of them alike)."""
    times = {way: [] for way in emas}
    for round_ in range(repeats + 2):
        for way, (ema, takes_flag) in emas.items():
            flag = torch.zeros((), dtype=torch.int32) if takes_flag else None
            start = time.perf_counter()
            _update(ema, model, flag)
            if round_ >= 2:  # two warm-up updates
                times[way].append(time.perf_counter() - start)
    return times


def measure(way, ema, make, model, takes_flag, times):
    flag = torch.zeros((), dtype=torch.int32) if takes_flag else None
    with SyncWatch() as watch:
        _update(ema, model, flag)
    row = {"way": way, "ms_min": round(1e3 * min(times), 2), "ms_median": round(1e3 * statistics.median(times), 2),
           "syncs": watch.count, "ops": watch.op_count, "ema_mib": _mib(ema)}
    locked = {n for n, p in model.named_parameters() if not p.requires_grad}
    row["locked_kept_out"] = not (locked & set(_averages(ema))) if locked else None
    if takes_flag:
        before = _averages(ema)
        _nudge(model, 1)
        ema.update(model, skipped=torch.ones((), dtype=torch.int32))
        kept = all(torch.equal(before[n], t) for n, t in _averages(ema).items())
        ema.update(model, skipped=torch.zeros((), dtype=torch.int32))
        moved = any(not torch.equal(before[n], t) for n, t in _averages(ema).items())
        row["skips"] = kept and moved
    else:
        row["skips"] = False
    row["resume_exact"] = _resume_exact(ema, make, model)
    return row


def _resume_exact(ema, make, model):
    target = ema.ema if hasattr(ema, "ema") else ema
    fresh = make(model)
    (fresh.ema if hasattr(fresh, "ema") else fresh).load_state_dict(copy.deepcopy(target.state_dict()))
    _nudge(model, 2)
    ema.update(model)
    fresh.update(model)
    a, b = _averages(ema), _averages(fresh)
    return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


WAYS = (("mmcl", lambda m: WeightEMA(m, DECAY), False), ("mmcl-flag", lambda m: WeightEMA(m, DECAY), True),
        ("timm", _timm, False), ("timm-read-flag", TimmReadFlag, True), ("timm-tensor-decay", TimmTensorDecay, True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=[os.path.join(ROOT, "configs", "tiny.yaml"),
                                                    os.path.join(ROOT, "configs", "vit-b-32.yaml")])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for config in args.config:
        for lock in (False, True):
            cfg = load_config(config, ["model.lock_image=true"] if lock else [])
            torch.manual_seed(0)
            model = models.build(cfg.model)[0]
            models.apply_locks(model, cfg.model)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            emas = {way: (make(model), takes_flag) for way, make, takes_flag in WAYS}
            times = timings(emas, model, args.repeats)
            for way, make, takes_flag in WAYS:
                row = measure(way, emas[way][0], make, model, takes_flag, times[way])
                print(json.dumps({"model": cfg.model.name, "lock_image": lock, "params": total,
                                  "trainable": trainable, **row}), flush=True)


if __name__ == "__main__":
    main()
