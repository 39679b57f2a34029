"""Training runtime: learning, exact resume after SIGKILL, atomic checkpoints, accumulation, NaN handling,
multi-process equality."""

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmcl.config import LossConfig, OptimConfig, load_config
from mmcl.errors import TrainingError
from mmcl.storage.checkpoints import latest_checkpoint, list_checkpoints
from mmcl.training import optim
from mmcl.training.loop import train
from mmcl.training.optim import lr_at
from mmcl.training.step import backward, forward_loss, objective_from_config

from helpers import ACCELERATE_LAUNCH, ROOT, fake_batch, final_weights, grads_of, metrics, micro_model, run_args
from spawned import end_worker, spawn
from spawned import free_port as _free_port


# ----------------------------------------------------------------------------------------- unit pieces
def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr=0.1)
    lrs = [lr_at(s, cfg, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lr_at(20, cfg, 20) == pytest.approx(0.1)
    assert lr_at(12, cfg, 20) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_no_weight_decay_on_gains_biases_and_logit_scale():
    model = micro_model()
    decay, no_decay = optim.optimizer_groups(optim.param_groups(model, OptimConfig(weight_decay=0.2)))
    names = {id(p): n for n, p in model.named_parameters()}
    assert "logit_scale" in [names[id(p)] for p in no_decay["params"]]
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim < 2 or "logit" in names[id(p)] or names[id(p)].endswith(".bias") for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.2


def test_accumulation_equals_the_large_batch():
    """GradCache accumulation: 2 micro-batches of 6 give the loss and gradients of one batch of 12."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    objective = objective_from_config(LossConfig())
    big = fake_batch(12, seed=1)
    halves = [{k: v[:6] for k, v in big.items()}, {k: v[6:] for k, v in big.items()}]

    model = micro_model()
    loss_big, _, cache = forward_loss(model, objective, [big], acc)
    backward(acc, model, loss_big, [big], cache)
    g_big = grads_of(model)

    model = micro_model()
    loss_acc, _, cache = forward_loss(model, objective, halves, acc)
    backward(acc, model, loss_acc, halves, cache)
    g_acc = grads_of(model)

    # float32 reductions run in a different order (two forwards of 6 vs one of 12): agreement to ~1e-6 relative.
    assert loss_acc.item() == pytest.approx(loss_big.item(), rel=1e-5)
    assert g_big.keys() == g_acc.keys() and "logit_scale" in g_big
    for name in g_big:
        torch.testing.assert_close(g_acc[name], g_big[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_loss_input_error_is_one_data_error_and_a_changed_queue_a_checkpoint_error(tmp_path):
    from mmcl.config import MochiConfig
    from mmcl.errors import CheckpointError, DataError
    from mmcl.run.resume import check_objective_state
    from mmcl.training.step import score

    img = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    with pytest.raises(DataError, match="labels must be an integer tensor of shape"):
        score(objective_from_config(LossConfig(clip=0.0, supcon=1.0)), img, img, torch.tensor(10.0), None,
              torch.zeros(3, dtype=torch.long))
    mochi = dict(weight=1.0, n_hard=2, s=1, s_prime=1)
    saved = objective_from_config(LossConfig(mochi=MochiConfig(queue_size=8, **mochi)))
    saved(img, img, torch.tensor(10.0))  # fills the queue with width-8 features
    state = saved.state_dict()
    check_objective_state(objective_from_config(LossConfig(mochi=MochiConfig(queue_size=8, **mochi))), state,
                          tmp_path)
    with pytest.raises(CheckpointError, match=r"MoCHi queue has shape \(8, 8\), expected \(4, D\)"):
        check_objective_state(objective_from_config(LossConfig(mochi=MochiConfig(queue_size=4, **mochi))), state,
                              tmp_path)


class _HalfScale(torch.nn.Module):
    """A model whose forward's scale is not ``exp`` of a ``logit_scale`` parameter of its own (half of the inner
    model's), with a SigLIP bias: the loss must use the scale and bias the forward returns."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.bias = torch.nn.Parameter(torch.tensor(-3.0))

    def forward(self, images, texts):
        out = dict(self.inner(images, texts))
        out["logit_scale"] = out["logit_scale"] * 0.5
        out["logit_bias"] = self.bias * 1.0
        return out


def test_accumulation_reads_the_scale_and_bias_from_the_forward():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    objective = objective_from_config(LossConfig(clip=1.0, siglip=0.5))
    big = fake_batch(12, seed=2)
    thirds = [{k: v[i:i + 4] for k, v in big.items()} for i in (0, 4, 8)]
    runs = []
    for batches in ([big], thirds):
        model = _HalfScale(micro_model())
        loss, terms, cache = forward_loss(model, objective, batches, acc)
        backward(acc, model, loss, batches, cache)
        runs.append((loss.item(), terms, grads_of(model)))
    (loss_big, terms_big, g_big), (loss_acc, terms_acc, g_acc) = runs
    # float32 reductions in another order (three forwards of 4 vs one of 12): agreement to ~1e-6 relative.
    assert loss_acc == pytest.approx(loss_big, rel=1e-5)
    assert terms_acc["loss/siglip"] == pytest.approx(terms_big["loss/siglip"], rel=1e-5)
    assert g_big.keys() == g_acc.keys() and {"bias", "inner.logit_scale"} <= set(g_big)
    for name in g_big:
        torch.testing.assert_close(g_acc[name], g_big[name], rtol=1e-4, atol=1e-6, msg=name)


def _ddp_worker(rank, world, port, out_path, micro_batches=1):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    objective = objective_from_config(LossConfig())
    model = acc.prepare(micro_model())
    big = fake_batch(12, seed=1)
    n = 12 // world
    local = {k: v[rank * n:(rank + 1) * n] for k, v in big.items()}
    m = n // micro_batches
    parts = [{k: v[i * m:(i + 1) * m] for k, v in local.items()} for i in range(micro_batches)]
    loss, terms, cache = forward_loss(model, objective, parts, acc)
    backward(acc, model, loss, parts, cache)
    if rank == 0:
        torch.save({"loss": terms["loss/clip"], "grads": grads_of(acc.unwrap_model(model))}, out_path)
    end_worker()


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])  # 2: GradCache accumulation inside DDP
def test_two_processes_equal_one_process_with_the_global_batch(tmp_path, micro_batches):
    from accelerate import Accelerator

    out = tmp_path / "ddp.pt"
    spawn(_ddp_worker, args=(2, _free_port(), str(out), micro_batches), nprocs=2)
    ddp = torch.load(out)

    acc = Accelerator(cpu=True)
    model = micro_model()
    batches = [fake_batch(12, seed=1)]
    loss, terms, cache = forward_loss(model, objective_from_config(LossConfig()), batches, acc)
    backward(acc, model, loss, batches, cache)
    single = grads_of(model)
    # Same math, different float32 summation order across the all-gather: agreement to ~1e-6 relative.
    assert ddp["loss"] == pytest.approx(terms["loss/clip"], rel=1e-5)
    assert single.keys() == ddp["grads"].keys()
    for name in single:
        # With micro-batches a token embedding's row sums its occurrences in two parts per process; the terms
        # partly cancel, so the float32 error is relative to the largest entry (~10 ulps of it), not to each sum.
        atol = 1e-6 if micro_batches == 1 else max(1e-6, 1e-5 * single[name].abs().max().item())
        torch.testing.assert_close(ddp["grads"][name], single[name], rtol=1e-4, atol=atol, msg=name)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_training_learns_on_demo_data(demo, tmp_path):
    from mmcl.cli import main

    out = tmp_path / "run"
    args = run_args(demo, out, "train.steps=60", "data.batch_size=32", "train.log_every=5", "optim.lr=2e-3",
                    "optim.warmup_steps=5", f"eval.zeroshot={demo['zeroshot_colour']}", "train.save_every=0",
                    f"eval.retrieval={demo['val']}", "eval.every=30")
    assert main(["train", *args]) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(5, 61, 5))
    for key in ("samples", "loss", "loss/clip", "lr", "logit_scale", "samples_per_s", "align", "uniform_image",
                "uniform_text", "data/skipped_samples", "data/skipped_shards"):
        assert key in rows[0], key
    first, last = rows[0]["loss"], rows[-1]["loss"]
    # ln(32) = 3.47 is the loss of a model that has learned nothing; a learning model goes well below it.
    assert first > 3.0 and last < first - 0.5, (first, last)
    assert "eval/zeroshot_classification/colour/acc1" in rows[5]  # step 30: the periodic evaluation
    recall = [v for k, v in rows[-1].items() if k.startswith("eval/zeroshot_retrieval/")
              and k.endswith("/image_retrieval_recall@5")]
    assert len(recall) == 1 and 0.0 <= recall[0] <= 1.0
    acc = rows[-1]["eval/zeroshot_classification/colour/acc1"]
    # 8 colours: chance is 0.125; this 60-step micro model reaches about 0.4 (the tiny config's demo:
    # see docs/benchmarks.md).
    assert acc >= 0.25, acc
    assert (out / "config.yaml").is_file() and (out / "model" / "open_clip_model.safetensors").is_file()

    import mmcl

    model, preprocess, tokenizer = mmcl.load(out)
    with torch.no_grad():
        f = model.encode_text(tokenizer(["a red circle"]), normalize=True)
    assert f.shape == (1, 32) and torch.allclose(f.norm(dim=-1), torch.ones(1))


def _python_mmcl(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "mmcl", "train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


# The training recipes whose state must survive a kill: the weights' EMA, FLIP masks drawn per step.
RECIPES = ["train.ema_decay=0.8", "model.patch_dropout=0.5", "train.unmasked_steps=3"]


@pytest.mark.slow
@pytest.mark.parametrize("recipes", [[], RECIPES], ids=["plain", "recipes"])
def test_sigkill_and_resume_gives_the_weights_of_an_uninterrupted_run(demo, tmp_path, recipes):
    common = ["train.steps=16", "train.save_every=2", "train.keep_checkpoints=2", "data.batch_size=16",
              "data.workers=2", "train.log_every=2", *recipes]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    p = _python_mmcl(run_args(demo, ref, *common))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out

    p = _python_mmcl(run_args(demo, killed, *common))
    deadline = time.time() + 600
    while latest_checkpoint(killed / "checkpoints") is None and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    assert not (killed / "model").exists(), "the run finished before it could be killed"
    ckpt = latest_checkpoint(killed / "checkpoints")
    assert ckpt is not None

    p = _python_mmcl(run_args(demo, killed, *common))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    resumed = [ln for ln in out.splitlines() if "resuming from" in ln]
    assert len(resumed) == 1 and "at step" in resumed[0], out

    a, b = final_weights(ref), final_weights(killed)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, worst
    if recipes:  # model/ holds the EMA; the last checkpoints hold the trained weights, also equal
        from safetensors.torch import load_file

        ca, cb = (load_file(str(latest_checkpoint(r / "checkpoints") / "model.safetensors")) for r in (ref, killed))
        assert ca.keys() == cb.keys()
        assert max((ca[k] - cb[k]).abs().max().item() for k in ca) <= 1e-5
        assert any((ca[k] - a[k]).abs().max().item() > 1e-4 for k in a)  # the EMA is not the trained weights
    steps = [r["step"] for r in metrics(killed)]
    assert steps == sorted(set(steps)) and steps[-1] == 16  # no step logged twice after the resume


def test_half_written_checkpoints_are_never_picked(demo, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, run_args(demo, out, "train.steps=4", "train.save_every=2", "data.batch_size=8",
                                     "data.workers=0")[2:])
    train(cfg)
    ckpts = out / "checkpoints"
    good = latest_checkpoint(ckpts)
    assert good is not None and good.name == "step-00000004"
    # What a kill during saving leaves behind: a temp dir, a renamed dir without its marker, a stale pointer.
    (ckpts / ".tmp-step-00000006").mkdir()
    (ckpts / "step-00000008").mkdir()
    (ckpts / "step-00000008" / "model.safetensors").write_bytes(b"\0" * 10)
    (ckpts / "latest").write_text("step-00000008")
    assert latest_checkpoint(ckpts) == good
    assert [c.name for c in list_checkpoints(ckpts)] == ["step-00000002", "step-00000004"]

    # Resuming goes on from the complete checkpoint (step 4) to the new end.
    cfg2 = load_config(None, run_args(demo, out, "train.steps=6", "train.save_every=2", "data.batch_size=8",
                                      "data.workers=0")[2:])
    train(cfg2)
    assert [r["step"] for r in metrics(out)] == [4, 6]  # log_every=10: the last step of each run is logged
    assert latest_checkpoint(ckpts).name == "step-00000006"


def test_samples_budget_sets_the_number_of_steps(demo, tmp_path, capsys):
    out = tmp_path / "run"
    # 20 samples at 8 per step: 3 steps (24 samples), the smallest number that covers the budget.
    cfg = load_config(None, run_args(demo, out, "train.samples=20", "train.steps=1000", "data.batch_size=8",
                                     "data.workers=0", "train.log_every=1", "train.save_every=0")[2:])
    train(cfg)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["samples"] == 24
    assert "train.samples=20: 3 steps of 8 samples" in capsys.readouterr().out


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss(demo, tmp_path, monkeypatch, policy):
    import mmcl.training.step as step_mod

    real = step_mod.forward_loss
    calls = {"n": 0}

    def poisoned(*args):
        loss, terms, cache = real(*args)
        calls["n"] += 1
        if calls["n"] == 3:
            loss = loss * float("nan")
        return loss, terms, cache

    monkeypatch.setattr(step_mod, "forward_loss", poisoned)
    out = tmp_path / "run"
    cfg = load_config(None, run_args(demo, out, "train.steps=4", "train.save_every=2", "data.batch_size=8",
                                     "data.workers=0", "train.log_every=1", f"train.nan_policy={policy}")[2:])
    if policy == "stop":
        with pytest.raises(TrainingError, match=r"at step 3; last good checkpoint: .*step-00000002"):
            train(cfg)
        assert latest_checkpoint(out / "checkpoints").name == "step-00000002"
        assert not (out / "model").exists()
    else:
        train(cfg)
        rows = metrics(out)
        assert [r["step"] for r in rows] == [1, 2, 4]  # step 3 was skipped, not logged as a number
        assert all(math.isfinite(r["loss"]) for r in rows)
        state = torch.load(latest_checkpoint(out / "checkpoints") / "rank_state_0.pt", weights_only=True)["progress"]
        assert state["skipped_steps"] == 1 and state["step"] == 4


POISON_ONE_RANK = """\
import os, sys
import mmcl.training.step as step_mod
from mmcl.cli import main

real, calls = step_mod.forward_loss, [0]


def poisoned(*args):
    loss, terms, cache = real(*args)
    calls[0] += 1
    if calls[0] == 3 and os.environ.get("RANK") == "1":
        loss = loss * float("nan")
    return loss, terms, cache


step_mod.forward_loss = poisoned
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_non_finite_loss_on_one_process_is_decided_by_all(demo, tmp_path, policy):
    """A loss that is non-finite on one of 2 processes only: both skip the step (or both stop), no hang."""
    out = tmp_path / "run"
    script = tmp_path / "poison.py"
    script.write_text(POISON_ONE_RANK)
    cmd = [*ACCELERATE_LAUNCH, "--config_file",
           str(ROOT / "launch" / "cpu-2proc.yaml"), str(script), "train",
           *run_args(demo, out, "train.steps=4", "train.log_every=1", "data.batch_size=4", "data.workers=0",
                     "train.save_every=2", f"train.nan_policy={policy}")]
    p = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300)
    if policy == "skip":
        assert p.returncode == 0, p.stdout + p.stderr
        rows = metrics(out)
        assert [r["step"] for r in rows] == [1, 2, 4] and [r["samples"] for r in rows] == [8, 16, 24]
        assert "skipped step 3: loss is not finite on some process" in p.stdout
        state = torch.load(latest_checkpoint(out / "checkpoints") / "rank_state_0.pt", weights_only=True)["progress"]
        assert state["skipped_steps"] == 1 and state["step"] == 4
    else:
        assert p.returncode != 0
        assert "at step 3; last good checkpoint: " in p.stdout + p.stderr
        assert latest_checkpoint(out / "checkpoints").name == "step-00000002"


@pytest.mark.slow
def test_accelerate_launch_runs_two_cooperating_processes(demo, tmp_path):
    """`accelerate launch --config_file launch/cpu-2proc.yaml` must give one run of 2 processes, not 2 lone ones."""
    out = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(ROOT / "launch" / "cpu-2proc.yaml"), "-m", "mmcl", "train",
           *run_args(demo, out, "train.steps=2", "train.log_every=1", "data.batch_size=4", "data.workers=1",
                     "train.save_every=2")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = metrics(out)
    assert [r["samples"] for r in rows] == [8, 16]  # global batch = 2 processes x 4
    assert "mmcl: 2 process(es), MULTI_CPU on cpu, fp32; global batch 8" in p.stdout  # said once, by rank 0
    assert p.stdout.count("process(es)") == 1
    ckpt = latest_checkpoint(out / "checkpoints")
    assert sorted(f.name for f in ckpt.glob("rank_state_*.pt")) == ["rank_state_0.pt", "rank_state_1.pt"]


def test_bf16_autocast_and_gradient_checkpointing(demo, tmp_path, fresh_accelerate_state):
    """bf16 autocast trains: its losses are finite, within 2 % of the same run in fp32, and not equal to them (a
    silent fall-back to fp32 would give the fp32 losses bit for bit); gradient checkpointing leaves the gradients
    unchanged."""
    from accelerate import Accelerator

    losses = {}
    for precision in ("bf16", "fp32"):
        fresh_accelerate_state()  # accelerate holds one precision per process
        out = tmp_path / precision
        cfg = load_config(None, run_args(demo, out, "train.steps=2", "train.log_every=1", "data.batch_size=8",
                                         "data.workers=0", f"train.precision={precision}", "train.save_every=0")[2:])
        train(cfg)
        losses[precision] = [r["loss"] for r in metrics(out) if "loss" in r]
    assert len(losses["bf16"]) == len(losses["fp32"]) == 2
    assert all(math.isfinite(x) for x in losses["bf16"])
    assert losses["bf16"] != losses["fp32"]
    for low, full in zip(losses["bf16"], losses["fp32"]):
        assert abs(low - full) <= 0.02 * abs(full), (low, full)

    acc = Accelerator(cpu=True)
    batch = fake_batch(6, seed=3)
    grads = []
    for checkpointing in (False, True):
        model = micro_model()
        model.set_grad_checkpointing(checkpointing)
        loss, _, cache = forward_loss(model, objective_from_config(LossConfig()), [batch], acc)
        backward(acc, model, loss, [batch], cache)
        grads.append(grads_of(model))
    for name in grads[0]:
        # Recomputation runs the same float32 kernels in the same order: identical up to rounding of reductions.
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


# ------------------------------------------------------------------------- the end of a run; one-line warnings
def test_final_evaluation_failure_keeps_the_model(demo, tmp_path, capsys):
    """The final model is written before the final evaluation; an evaluation that fails ends the run with one error
    line naming model/, which loads."""
    from PIL import Image

    import mmcl
    from mmcl.cli import main
    from mmcl.shards.writer import write_shards

    # Shards with class names but without .cls labels: the pre-flight check passes (it reads no sample), but they
    # are no zero-shot set.
    unlabelled = tmp_path / "unlabelled"
    write_shards([{"key": f"u{i}", "image": Image.new("RGB", (20, 30), (40 * i, 0, 0)), "caption": f"thing {i}"}
                  for i in range(4)], str(unlabelled))
    (unlabelled / "classnames.txt").write_text("dark\nbright\n")
    out = tmp_path / "run"
    code = main(["train", *run_args(demo, out, "train.steps=3", "data.batch_size=8", "data.workers=1",
                                    f"eval.zeroshot={unlabelled}", "train.log_every=1")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"mmcl: error: final evaluation failed: 4 of 4 samples in {unlabelled} have no "
                             f"label"), err
    assert err[0].endswith(f"; the trained model is saved in {out / 'model'} (evaluate it with mmcl "
                           f"zeroshot/retrieval --model {out})"), err
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]  # the last step's record is kept, without eval keys
    assert not any(k.startswith("eval/") for k in metrics(out)[-1])
    assert latest_checkpoint(out / "checkpoints").name == "step-00000003"
    model, _, tokenizer = mmcl.load(out)
    assert torch.equal(model.state_dict()["logit_scale"], final_weights(out)["logit_scale"])
    with torch.no_grad():
        assert torch.isfinite(model.encode_text(tokenizer(["thing 1"]), normalize=True)).all()


def test_a_failing_periodic_evaluation_warns_and_training_goes_on(demo, tmp_path, capsys, monkeypatch):
    """An evaluation set that breaks during the run (removed, unreadable) costs a warning line at each periodic
    evaluation, not the steps since the last checkpoint."""
    import mmcl.training.end as finish_mod
    from mmcl.cli import main
    from mmcl.errors import DataError

    real, calls = finish_mod.run_eval, []

    def broken_until_final(cfg, model, *a):
        calls.append(1)
        if len(calls) < 3:  # the periodic evaluations at steps 2 and 4; the final one (step 5) works
            raise DataError("cannot read /gone/eval-set")
        return real(cfg, model, *a)

    monkeypatch.setattr(finish_mod, "run_eval", broken_until_final)
    out = tmp_path / "run"
    code = main(["train", *run_args(demo, out, "train.steps=5", "data.batch_size=8", "data.workers=0",
                                    f"eval.zeroshot={demo['zeroshot_colour']}", "eval.every=2",
                                    "train.log_every=1", "train.save_every=0")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for step in (2, 4):
        assert (f"mmcl: warning: evaluation at step {step} failed, training goes on: cannot read /gone/eval-set"
                in captured.out.splitlines())
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert not any(k.startswith("eval/") for r in records[:-1] for k in r)
    assert any(k.startswith("eval/") for k in records[-1])
    assert (out / "model" / "open_clip_config.json").is_file()


def _bad_shard_set(demo, root: Path) -> Path:
    """The demo's first training shard, a file that is not a tar and an empty archive; returns the directory."""
    import shutil

    root.mkdir()
    first = sorted(Path(demo["train"].split("{")[0]).parent.glob("*.tar"))[0]
    shutil.copy(first, root / "shard-000000.tar")
    (root / "shard-000001.tar").write_bytes(b"<html>403 Forbidden</html>\n" * 30)  # a failed download
    subprocess.run(["tar", "-cf", str(root / "shard-000002.tar"), "-T", "/dev/null"], check=True)
    return root


@pytest.mark.slow
def test_a_bad_shard_read_by_two_workers_warns_in_one_line_once(demo, tmp_path):
    shards = _bad_shard_set(demo, tmp_path / "shards")
    out = tmp_path / "run"
    # 3 shards for 2 workers: each pass deals one shard whole to each worker and splits the third by sample index, so
    # both workers open the bad shard on most passes, and the worker without the good shard passes quickly.
    p = subprocess.run([sys.executable, "-m", "mmcl", "train", *run_args(
        demo, out, f"data.train={shards}/shard-*.tar", "train.steps=16", "data.batch_size=16", "data.workers=2",
        "train.log_every=16", "train.save_every=0")], env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [
        f"mmcl: warning: cannot open shard {shards}/shard-000001.tar: TarFormatError: not a tar file; skipping it"]
    # Counted by the one worker that owns the split shard's problems; the empty archive counts nothing.
    assert metrics(out)[-1]["data/skipped_shards"] >= 1


@pytest.mark.slow
def test_a_bad_shard_read_by_two_processes_warns_once(demo, tmp_path):
    """2 processes x 2 workers, 3 shards: every one of the 4 slots opens the bad shard; one line in all.

    A worker's warnings travel with its next batch, so each worker here delivers two: 24 of the good shard's 96
    pairs reach each slot per pass, one batch."""
    shards = _bad_shard_set(demo, tmp_path / "shards")
    out = tmp_path / "run"
    cmd = [*ACCELERATE_LAUNCH, "--config_file",
           str(ROOT / "launch" / "cpu-2proc.yaml"), "--main_process_port", str(_free_port()), "-m", "mmcl", "train",
           *run_args(demo, out, f"data.train={shards}/shard-*.tar", "train.steps=4", "train.log_every=1",
                     "data.batch_size=24", "data.workers=2", "train.save_every=0")]
    p = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    # Other lines may come from the launcher (e.g. accelerate's note on a busy port).
    warned = [ln for ln in p.stderr.splitlines() if ln.startswith("mmcl:") or "shard" in ln]
    assert warned == [
        f"mmcl: warning: cannot open shard {shards}/shard-000001.tar: TarFormatError: not a tar file; skipping it"], \
        p.stderr
    assert not re.search(r"mmcl[/\\]\w+\.py:\d+: \w*Warning", p.stderr), p.stderr  # none in Python's format


def test_a_second_run_in_one_process_with_another_precision_is_one_config_error(fresh_accelerate_state):
    """accelerate keeps its precision for the life of the process: the same precision again is fine, another one
    is a ConfigError naming both; in a fresh process (here: fresh state) bf16 autocasts."""
    from mmcl.errors import ConfigError
    from mmcl.training.plan import make_accelerator

    assert make_accelerator("fp32").mixed_precision == "no"
    assert make_accelerator("fp32").mixed_precision == "no"
    with pytest.raises(ConfigError, match=r"train.precision=bf16, but .* already ran accelerate with "
                                          r"train.precision=fp32"):
        make_accelerator("bf16")
    fresh_accelerate_state()
    bf16 = make_accelerator("bf16")
    assert bf16.mixed_precision == "bf16"
    with bf16.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="train.precision=fp16, but .* train.precision=bf16"):
        make_accelerator("fp16")
