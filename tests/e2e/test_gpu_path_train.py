"""The training loop's GPU path, checked on CPU: which precision a launch trains in, bf16 training for every
objective, a non-finite loss on every process, and GradCache's replay of every generator.

- Precision: ``train.precision=auto`` (the default) takes the launcher's mixed precision, which ``accelerate
  launch`` passes as ACCELERATE_MIXED_PRECISION (the GPU launch files say bf16); a set precision that the launcher
  contradicts is one error line. TF32 follows ``train.tf32`` on CUDA; the startup lines say both.
- bf16: a step of every objective, dense and tiled, with and without accumulation, under accelerate's bf16
  autocast gives the fp32 step's loss and gradients within the rounding of a bf16 tower; end-to-end runs stay
  finite and start from the fp32 run's loss.
- Every process non-finite: the fused optimiser's ``found_inf`` is a 0/1 flag, never the number of processes
  (the kernel skips only on 1 and takes ``found_inf`` off its step count).
- GradCache re-runs each micro-batch from the CPU's and the device's generator states of its first pass.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from typing import Optional

import pytest
import torch

from mmcl import models
from mmcl.config import LossConfig, MochiConfig, load_config
from mmcl.training.loop import train
from mmcl.training.plan import make_accelerator
from mmcl.training.step import backward, forward_loss, objective_from_config

from helpers import ACCELERATE_LAUNCH, ROOT, TRAINING_TOWERS, fake_batch, grads_of, metrics, micro_model, run_args
from spawned import free_port

pytestmark = [pytest.mark.gpu_path, pytest.mark.usefixtures("cpu_device")]  # the same with a GPU

LAUNCHER = "ACCELERATE_MIXED_PRECISION"


# ------------------------------------------------------------------------------------------- precision's home
def test_the_device_is_the_cpu_with_a_gpu_visible(monkeypatch):
    """These tests build their models on the CPU: the accelerator must too, where CUDA is available."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert make_accelerator("fp32").device.type == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # and in the subprocesses they start


def test_auto_precision_takes_the_launchers(monkeypatch):
    from mmcl.config import PRECISIONS
    from mmcl.training.plan import choose_precision

    monkeypatch.delenv(LAUNCHER, raising=False)
    assert choose_precision("auto") == ("fp32", "the default (train.precision=auto, no launcher setting)")
    assert choose_precision("bf16") == ("bf16", "train.precision")
    for precision, name in PRECISIONS.items():
        monkeypatch.setenv(LAUNCHER, name)
        assert choose_precision("auto") == (precision, f"the launcher ({LAUNCHER}={name})")
        assert choose_precision(precision)[0] == precision  # the same from both: no complaint
    assert load_config(None, []).train.precision == "auto"


def test_a_set_precision_the_launcher_contradicts_is_an_error_naming_both(monkeypatch):
    from mmcl.errors import ConfigError
    from mmcl.training.plan import choose_precision

    monkeypatch.setenv(LAUNCHER, "bf16")
    with pytest.raises(ConfigError) as err:
        choose_precision("fp32")
    assert str(err.value) == (
        "train.precision=fp32 disagrees with the launcher's mixed precision bf16 (ACCELERATE_MIXED_PRECISION=bf16): "
        "drop train.precision (or set it to auto) to train in bf16, or launch with mixed_precision 'no' "
        "(--mixed_precision no) to train in fp32")
    monkeypatch.setenv(LAUNCHER, "no")  # a launch file that says 'no' is a setting too
    with pytest.raises(ConfigError, match="train.precision=bf16 disagrees with the launcher's mixed precision fp32"):
        make_accelerator("bf16")
    monkeypatch.setenv(LAUNCHER, "fp8")
    with pytest.raises(ConfigError, match="asks for mixed precision fp8 .* which mmcl does not train in"):
        choose_precision("auto")


@pytest.mark.parametrize("launch_file", sorted(p.name for p in (ROOT / "launch").glob("*.yaml")))
def test_each_launch_file_trains_in_the_precision_it_names(monkeypatch, launch_file):
    """What `accelerate launch --config_file launch/X.yaml` passes on, with the default config."""
    import yaml

    said = str(yaml.safe_load((ROOT / "launch" / launch_file).read_text())["mixed_precision"])
    monkeypatch.setenv(LAUNCHER, said)
    assert make_accelerator(load_config(None, []).train.precision).mixed_precision == said

    from mmcl.config import PRECISIONS
    from mmcl.training.plan import choose_precision

    assert choose_precision("auto") == ({v: k for k, v in PRECISIONS.items()}[said],
                                        f"the launcher (ACCELERATE_MIXED_PRECISION={said})")


def test_a_run_under_a_bf16_launcher_trains_in_bf16_and_says_so(demo, tmp_path, monkeypatch, capsys):
    """As `accelerate launch --config_file launch/gpu-1.yaml` sets it: no train.precision, bf16 autocast."""
    import mmcl.training.step as step_mod

    real, seen = step_mod.forward_loss, []

    def watched(model, objective, batches, accelerator, *a):
        with accelerator.autocast():
            seen.append((accelerator.mixed_precision, (torch.ones(2, 2) @ torch.ones(2, 2)).dtype))
        return real(model, objective, batches, accelerator, *a)

    monkeypatch.setattr(step_mod, "forward_loss", watched)
    monkeypatch.setenv(LAUNCHER, "bf16")
    out = tmp_path / "run"
    train(load_config(None, run_args(demo, out, "train.steps=2", "train.log_every=1", "data.batch_size=8",
                                     "data.workers=0", "train.save_every=0")[2:]))
    assert seen == [("bf16", torch.bfloat16)] * 2
    lines = capsys.readouterr().out.splitlines()
    assert "mmcl: 1 process(es), NO on cpu, bf16; global batch 8; 0 data workers per process" in lines
    assert "mmcl: precision bf16 from the launcher (ACCELERATE_MIXED_PRECISION=bf16); TF32 n/a on cpu" in lines
    assert all(math.isfinite(r["loss"]) for r in metrics(out))


def test_a_run_with_fp32_under_a_bf16_launcher_is_one_error_line(demo, tmp_path, monkeypatch, capsys):
    from mmcl.cli import main

    monkeypatch.setenv(LAUNCHER, "bf16")
    out = tmp_path / "run"
    code = main(["train", *run_args(demo, out, "train.steps=1", "data.batch_size=8", "data.workers=0",
                                    "train.precision=fp32")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("mmcl: error: train.precision=fp32 disagrees with the launcher's mixed precision bf16")
    assert not (out / "checkpoints").exists()


def test_tf32_follows_the_key_on_cuda_and_leaves_other_devices_alone():
    from mmcl.training.plan import set_tf32, tf32_setting

    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    try:
        set_tf32(True, torch.device("cpu"))
        set_tf32(False, torch.device("cpu"))
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before
        set_tf32(True, torch.device("cuda", 0))  # flags only: nothing runs on the device
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("high", True)
        set_tf32(False, torch.device("cuda", 0))
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("highest", False)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
    assert tf32_setting(True, torch.device("cuda", 0)) == "TF32 for float32 matmuls on (train.tf32)"
    assert tf32_setting(False, torch.device("cuda")) == "TF32 for float32 matmuls off (train.tf32)"
    assert load_config(None, []).train.tf32 is True
    assert load_config(None, ["train.tf32=false"]).train.tf32 is False


# ---------------------------------------------------------------------------------------------- bf16 training
OBJECTIVES = {  # loss.* of each objective, and whether its model needs a logit bias
    "clip": (dict(), False),
    "siglip": (dict(clip=0.0, siglip=1.0), True),
    "supcon": (dict(clip=0.0, supcon=1.0), False),
    "debiased": (dict(clip=0.0, debiased=1.0), False),
    "hard_negative": (dict(clip=0.0, hard_negative=1.0), False),
    "mochi": (dict(mochi=MochiConfig(weight=1.0, n_hard=4, s=2, s_prime=2, queue_size=16)), False),
    "align_uniform": (dict(align=0.5, uniform=0.5), False),
    "distill": (dict(distill=1.0), False),
}


def _step_batches(step: int, accum: int, n: int = 8):
    """Step `step`'s batch of `n` in `accum` micro-batches: three classes (SupCon) and stored teacher embeddings
    (distillation), as reinforced shards give them."""
    b = fake_batch(n, seed=10 + step)
    b["label"] = torch.arange(n) % 3
    g = torch.Generator().manual_seed(99 + step)
    b["teacher_image_features"] = torch.randn(n, 16, generator=g).half()
    b["teacher_text_features"] = torch.randn(n, 16, generator=g).half()
    b["teacher_scale"] = torch.full((n,), 20.0)
    m = n // accum
    return [{k: v[i * m:(i + 1) * m] for k, v in b.items()} for i in range(accum)]


def _two_steps(precision, name, chunk, accum, fresh_state):
    """Losses and flat gradients of two steps (the same weights; MoCHi's queue filled by the first) under
    `make_accelerator(precision)`."""
    fresh_state()
    acc = make_accelerator(precision)
    weights, bias = OBJECTIVES[name]
    torch.manual_seed(0)
    model, *_ = models.build(load_config(None, TRAINING_TOWERS + (["model.init_logit_bias=-10"] if bias else [])).model)
    objective = objective_from_config(LossConfig(chunk_size=chunk, **weights))
    objective.reseed(0)
    out = []
    for step in range(2):
        batches = _step_batches(step, accum)
        loss, terms, cache = forward_loss(model, objective, batches, acc)
        backward(acc, model, loss, batches, cache)
        out.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
        model.zero_grad(set_to_none=True)
    return out


FAST = {("clip", 4, 2), ("siglip", 4, 1), ("supcon", None, 1), ("mochi", None, 2)}


@pytest.mark.parametrize("name,chunk,accum", [
    pytest.param(name, chunk, accum, marks=() if (name, chunk, accum) in FAST else pytest.mark.slow)
    for name in OBJECTIVES for chunk in (None, 4) for accum in (1, 2)])
def test_a_bf16_step_gives_the_fp32_loss_and_gradients(name, chunk, accum, fresh_accelerate_state):
    """The micro model's tower in bf16 autocast moves the loss by about 0.2 % and the gradient by 1-4 % (L2,
    relative) against fp32; the objective itself runs in float32, so a bf16 loss (logits in bf16: several % on
    the gradients at larger scales) or a crash of a tiled loss fails here."""
    fp32 = _two_steps("fp32", name, chunk, accum, fresh_accelerate_state)
    bf16 = _two_steps("bf16", name, chunk, accum, fresh_accelerate_state)
    for step, ((loss32, grad32), (loss16, grad16)) in enumerate(zip(fp32, bf16)):
        assert math.isfinite(loss16) and torch.isfinite(grad16).all(), step
        assert loss16 == pytest.approx(loss32, rel=0.01), step
        off = ((grad16 - grad32).norm() / grad32.norm()).item()
        assert 1e-4 < off < 0.08, (step, off)  # above 1e-4: the tower did run in bf16


BF16_RUNS = {
    "clip-tiled-accum": ["loss.chunk_size=4", "train.accum_steps=2"],
    "mochi-queue": ["loss.mochi.weight=1.0", "loss.mochi.n_hard=4", "loss.mochi.s=2", "loss.mochi.s_prime=2",
                    "loss.mochi.queue_size=32"],
    "siglip-tiled": ["loss.clip=0", "loss.siglip=1", "model.init_logit_bias=-10", "loss.chunk_size=4"],
    "supcon-debiased-hn-accum": ["loss.clip=0", "loss.supcon=1", "loss.debiased=0.5", "loss.hard_negative=0.5",
                                 "loss.chunk_size=4", "train.accum_steps=2"],
    "align-uniform": ["loss.align=0.5", "loss.uniform=0.5"],
}


@pytest.mark.parametrize("recipe", [
    pytest.param(k, marks=() if k == "clip-tiled-accum" else pytest.mark.slow) for k in BF16_RUNS])
def test_bf16_training_runs_are_finite_and_start_from_the_fp32_loss(demo, tmp_path, recipe, fresh_accelerate_state):
    common = ["train.steps=3", "train.log_every=1", "data.batch_size=8", "data.workers=0", "train.save_every=0",
              *BF16_RUNS[recipe]]
    rows = {}
    for precision in ("fp32", "bf16"):
        fresh_accelerate_state()
        out = tmp_path / precision
        train(load_config(None, run_args(demo, out, f"train.precision={precision}", *common)[2:]))
        rows[precision] = metrics(out)
    assert [r["step"] for r in rows["bf16"]] == [1, 2, 3]
    for r in rows["bf16"]:
        assert all(math.isfinite(v) for k, v in r.items() if isinstance(v, float)), r
    first32, first16 = rows["fp32"][0], rows["bf16"][0]
    assert first16["loss"] == pytest.approx(first32["loss"], rel=0.02)
    assert first16["grad_norm"] == pytest.approx(first32["grad_norm"], rel=0.1)


# ------------------------------------------------------------------------------ every process non-finite
class _SameOnEveryRank:
    """`torch.distributed.all_reduce` as `world` processes holding the same tensor would see it."""

    def __init__(self, world):
        self.world = world

    def __call__(self, tensor, op=None, group=None, async_op=False):
        import torch.distributed as dist

        if op is None or op == dist.ReduceOp.SUM:
            tensor.mul_(self.world)
        elif op not in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            raise AssertionError(f"unexpected reduction {op}")


@pytest.mark.parametrize("world", [2, 3])
def test_a_loss_non_finite_on_every_process_skips_the_fused_step(monkeypatch, world):
    """All `world` processes non-finite: the fused AdamW gets found_inf 1, and leaves the weights and its step
    count as they were (with found_inf = world it would apply NaN gradients and count back)."""
    import torch.distributed as dist

    from mmcl.config import OptimConfig
    from mmcl.training.optim import build_optimizer
    from mmcl.training.step import FiniteChecks

    class Accelerator:
        num_processes = world
        scaler = None

    monkeypatch.setattr(dist, "all_reduce", _SameOnEveryRank(world))
    model = micro_model()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    checks = FiniteChecks(Accelerator(), optimizer)
    assert checks.on_device
    objective = objective_from_config(LossConfig())

    def step(seed, poisoned):
        batch = fake_batch(8, seed)
        out = model(batch["image"], batch["text"])
        loss, _ = objective(out["image_features"], out["text_features"], out["logit_scale"], None, batch["label"])
        if poisoned:
            loss = loss * float("nan")
        checks.arm(loss, seed)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(1, False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step(2, True)
    assert float(optimizer.found_inf) == 1.0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(int(s["step"]) == 1 for s in optimizer.state.values())
    step(3, False)
    assert all(int(s["step"]) == 2 for s in optimizer.state.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [s for s, _ in checks.resolve()] == [2]


POISON_EVERY_RANK = """\
import json, os, sys
import torch
import mmcl.training.step as step_mod
from mmcl.cli import main

real_loss, real_update, real_arm = step_mod.forward_loss, step_mod.apply_update, step_mod.FiniteChecks.arm
seen = {"weights_finite": [], "steps": [], "armed": 0, "equal_after_skip": None}
held = {}


def poisoned(model, objective, batches, accelerator, *a):
    calls = len(seen["weights_finite"]) + 1
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    seen["weights_finite"].append(all(bool(torch.isfinite(v).all()) for v in weights.values()))
    if calls == 3:
        held["before"] = weights
    if calls == 4:  # after the skipped step 3
        seen["equal_after_skip"] = all(torch.equal(v, held["before"][k]) for k, v in weights.items())
    loss, terms, cache = real_loss(model, objective, batches, accelerator, *a)
    if calls == 3:  # every process: a NaN loss and, from its backward (one micro-batch), NaN gradients
        loss = loss * float("nan")
    return loss, terms, cache


def update(accelerator, model, raw_model, optimizer, *a):
    out = real_update(accelerator, model, raw_model, optimizer, *a)
    inner = getattr(optimizer, "optimizer", optimizer)
    seen["steps"].append(sorted({float(s["step"]) for s in inner.state.values()}))
    return out


def arm(self, loss, step):
    seen["armed"] += 1
    return real_arm(self, loss, step)


step_mod.forward_loss, step_mod.apply_update, step_mod.FiniteChecks.arm = poisoned, update, arm
code = main(sys.argv[1:])
with open(os.environ["SEEN"] + os.environ["RANK"], "w") as f:
    json.dump(seen, f)
sys.exit(code)
"""


@pytest.mark.slow
def test_a_loss_non_finite_on_both_processes_skips_the_step_and_the_run_goes_on(demo, tmp_path):
    """2 gloo processes, both with a NaN loss and NaN gradients at step 3 (nan_policy=skip): the device-side skip
    leaves the weights finite and as they were, the optimiser's step count does not move, the step is counted as
    skipped and the run finishes."""
    out = tmp_path / "run"
    script = tmp_path / "poison.py"
    script.write_text(POISON_EVERY_RANK)
    cmd = [*ACCELERATE_LAUNCH, "--config_file",
           str(ROOT / "launch" / "cpu-2proc.yaml"), "--main_process_port", str(free_port()), str(script), "train",
           *run_args(demo, out, "train.steps=5", "train.log_every=1", "data.batch_size=4", "data.workers=0",
                     "train.save_every=0", "train.nan_policy=skip")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", SEEN=str(tmp_path / "seen-"))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "skipped step 3: loss is not finite on some process (nan here)" in p.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 4, 5] and [r["samples"] for r in rows] == [8, 16, 24, 32]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen-{rank}").read_text())
        assert seen["armed"] == 5  # the device-side decision (mmcl/training/step.py) ran every step
        assert seen["weights_finite"] == [True] * 5 and seen["equal_after_skip"] is True, seen
        assert seen["steps"] == [[1.0], [2.0], [2.0], [3.0], [4.0]], seen
    from safetensors.torch import load_file

    final = load_file(str(out / "model" / "open_clip_model.safetensors"))
    assert all(torch.isfinite(v).all() for v in final.values())


# ------------------------------------------------------------------------------------ GradCache's RNG replay
class _NoisyFeatures(torch.nn.Module):
    """The micro model with dropout on its image features, drawn from the CPU's generator and, with `noise`, also
    from that generator (standing in for the device's). One draw per generator and forward, so the masks of two
    micro-batches of 6, drawn in turn, are those of the batch of 12."""

    def __init__(self, noise: Optional[torch.Generator] = None):
        super().__init__()
        self.inner = micro_model()
        self.noise = noise

    def forward(self, images, texts):
        out = dict(self.inner(images, texts))
        f = out["image_features"]
        keep = torch.rand(f.shape) >= 0.3
        if self.noise is not None:
            keep = keep & (torch.rand(f.shape, generator=self.noise) >= 0.3)
        out["image_features"] = torch.nn.functional.normalize(f * keep, dim=-1)
        return out


class FakeDeviceRng:
    """What `torch.get_device_module("cuda")` offers for generator states, over a CPU generator."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def get_rng_state(self, device=None):
        return self.generator.get_state()

    def set_rng_state(self, state, device=None):
        self.generator.set_state(state)


def _noisy_grads(batches, noise=None, seed=5):
    """Loss and gradients of one GradCache step (or a plain one, for one batch) of `_NoisyFeatures`."""
    from accelerate import Accelerator

    model = _NoisyFeatures(noise)
    torch.manual_seed(seed)
    if noise is not None:
        noise.manual_seed(seed + 1)
    acc = Accelerator(cpu=True)
    loss, _, cache = forward_loss(model, objective_from_config(LossConfig()), batches, acc)
    backward(acc, model, loss, batches, cache)
    return loss.item(), grads_of(model)


def _worst(a, b):
    """The largest difference of two gradient dicts, relative to each tensor's largest entry."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def _big_and_halves():
    big = fake_batch(12, seed=4)
    return big, [{k: v[:6] for k, v in big.items()}, {k: v[6:] for k, v in big.items()}]


def test_without_the_replay_gradcache_under_dropout_is_not_the_large_batch(monkeypatch):
    """Under dropout GradCache equals the batch of 12 because its second pass draws the first pass's masks; with
    the replay made a no-op, the second pass draws new ones and the gradients move."""
    import contextlib

    import mmcl.training.step as train_mod

    big, halves = _big_and_halves()
    loss_big, g_big = _noisy_grads([big])
    loss_acc, g_acc = _noisy_grads(halves)
    assert loss_acc == pytest.approx(loss_big, rel=1e-5)
    assert _worst(g_acc, g_big) < 1e-4  # float32 summation order only
    monkeypatch.setattr(train_mod, "replayed_rng", lambda state, device: contextlib.nullcontext())
    loss_broken, g_broken = _noisy_grads(halves)
    assert loss_broken == pytest.approx(loss_big, rel=1e-5)  # the first pass is unchanged
    assert _worst(g_broken, g_big) > 0.05


def test_gradcache_replays_the_device_generator_too(monkeypatch):
    """A second generator that the device module reports (`device_rng`, here a stand-in for ``torch.cuda``) is
    replayed like the CPU's: the gradients are the batch of 12's. Replaying the CPU's alone (on CUDA, the masks
    of dropout and drop-path come from the device's) changes them."""
    import mmcl.training.step as train_mod

    big, halves = _big_and_halves()
    noise = torch.Generator()
    loss_big, g_big = _noisy_grads([big], noise)
    monkeypatch.setattr(train_mod, "device_rng", lambda device: FakeDeviceRng(noise))
    loss_acc, g_acc = _noisy_grads(halves, noise)
    assert loss_acc == pytest.approx(loss_big, rel=1e-5)
    assert _worst(g_acc, g_big) < 1e-4
    monkeypatch.undo()  # the device's generator is not replayed: new masks from it in the second pass
    loss_cpu_only, g_cpu_only = _noisy_grads(halves, noise)
    assert loss_cpu_only == pytest.approx(loss_big, rel=1e-5)
    assert _worst(g_cpu_only, g_big) > 0.05


def test_the_device_generator_state_is_taken_and_put_back(monkeypatch):
    """`replayed_rng` on a device: the block runs from the saved states of both generators, and the states it
    found are back afterwards."""
    import mmcl.training.step as train_mod

    gen = torch.Generator().manual_seed(1)
    monkeypatch.setattr(train_mod, "device_rng", lambda device: FakeDeviceRng(gen))
    device = torch.device("cuda", 0)  # named only: every call goes to the stand-in
    saved = train_mod.rng_state(device)
    first = (torch.rand(3), torch.rand(3, generator=gen))
    found = train_mod.rng_state(device)
    with train_mod.replayed_rng(saved, device):
        again = (torch.rand(3), torch.rand(3, generator=gen))
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    after = (torch.rand(3), torch.rand(3, generator=gen))
    torch.set_rng_state(found[0])
    gen.set_state(found[1])
    assert torch.equal(after[0], torch.rand(3)) and torch.equal(after[1], torch.rand(3, generator=gen))
    monkeypatch.undo()  # the real lookup: CUDA's generators live in torch.cuda; the CPU's is torch's own
    assert train_mod.device_rng(torch.device("cuda", 0)) is torch.cuda
    assert train_mod.device_rng(torch.device("cpu")) is None
