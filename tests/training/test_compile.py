"""``train.compile``: graph breaks and recompiles of the towers and the loss, counted by dynamo on a CPU.

Dynamo's tracing (where a graph breaks, when a guard fails and a frame is compiled again) does not depend on the
backend, so the counts below are those a CUDA run with inductor gets; `CompileCounter` stands in for the backend
to keep the tests free of code generation.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from mmcl import models
from mmcl.config import LossConfig, load_config
from mmcl.models import flip
from mmcl.training.step import backward, forward_loss, objective_from_config

from helpers import fake_batch, micro_model, run_args

EOT = 49407  # open_clip's end-of-text token, the highest id: where the text tower pools


def cut_batch(n, seed, width, context=32):
    """A batch whose tokens end at column `width` (as the data loader cuts them), every caption ending there."""
    b = fake_batch(n, seed, context=context)
    text = b["text"][:, :width].clone()
    text[:, width - 1] = EOT
    b["text"] = text
    return b


def flip_model():
    model = micro_model(0)
    mods = models.set_patch_dropout(model, 0.5, seed=1)
    model.train()
    return model, mods


def test_towers_with_flip_and_a_cut_batch_have_no_graph_break():
    model, _ = flip_model()
    b = cut_batch(8, 1, 13)
    explained = torch._dynamo.explain(model)(b["image"], b["text"])
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("chunk_size", [None, 4])  # dense and tiled
def test_the_loss_on_an_ordinary_step_has_no_graph_break(chunk_size):
    torch.manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    objective = objective_from_config(LossConfig(chunk_size=chunk_size))
    explained = torch._dynamo.explain(objective)(img, txt, torch.tensor(10.0), None, torch.full((8,), -1), False)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]


def test_the_compiled_loss_does_not_ask_torch_for_autocast(monkeypatch):
    """torch 2.11's dynamo cannot trace the builtin behind `torch.amp.is_autocast_available`: asked inside the
    loss, it broke the compiled graph on an H100. The losses ask once, at import."""
    def asked(device_type):
        raise AssertionError(f"is_autocast_available({device_type!r}) asked inside the compiled loss")

    monkeypatch.setattr(torch.amp, "is_autocast_available", asked)
    img = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    objective = objective_from_config(LossConfig(chunk_size=4))
    explained = torch._dynamo.explain(objective)(img, img.flip(0), torch.tensor(10.0), None, torch.full((8,), -1),
                                                 False)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]


def test_the_text_width_is_bucketed_exactly_and_a_full_batch_reads_nothing_back():
    """A batch cut at 13 columns runs the text transformer at 16 (the next multiple of 8) with open_clip's
    full-context features and gradients (the padding comes after every end-of-text token, under the causal mask);
    a batch as wide as the context runs at full width without reading its longest caption from the device."""
    from open_clip.model import CLIP

    from syncwatch import SyncWatch

    model = micro_model(0).train()
    widths = []
    model.transformer.register_forward_pre_hook(lambda m, args, kwargs: widths.append(args[0].shape[1]),
                                                with_kwargs=True)
    b = cut_batch(4, 2, 13)
    b["text"][1, 5:] = 0  # captions of different lengths
    b["text"][1, 4] = EOT
    full_tokens = torch.nn.functional.pad(b["text"], (0, 32 - 13))
    grads = []
    for fn, tokens in ((model.encode_text, b["text"]), (lambda t: CLIP.encode_text(model, t), full_tokens)):
        model.zero_grad()
        features = fn(tokens)
        (features ** 2).sum().backward()
        grads.append((features.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                          if p.grad is not None}))
    assert widths == [16, 32]
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    assert grads[0][1].keys() == grads[1][1].keys()
    for name, want in grads[1][1].items():  # float32 sums over other matmul shapes: rounding only
        assert (grads[0][1][name] - want).abs().max() <= 1e-5 * want.abs().max() + 1e-8, name
    widths.clear()
    long = cut_batch(4, 3, 32)  # a caption fills the context
    with SyncWatch() as watch:
        model.encode_text(long["text"])
    assert widths == [32] and watch.count == 0, watch.summary()


def compiled_steps(widths, chunk_size=None):
    """Train steps of the compiled FLIP model and objective (a new FLIP seed each step) at the given token widths;
    returns the number of frames compiled (model, loss) after each step."""
    from accelerate import Accelerator

    torch._dynamo.reset()
    acc = Accelerator(cpu=True)
    model, mods = flip_model()
    counts, model_frames, loss_frames = [], CompileCounter(), CompileCounter()
    step_model = torch.compile(model, backend=model_frames)
    loss_fn = torch.compile(objective_from_config(LossConfig(chunk_size=chunk_size)), backend=loss_frames)
    for step, width in enumerate(widths):
        flip.begin_step(mods, step, True)
        batches = [cut_batch(8, step, width)]
        loss, _, cache = forward_loss(step_model, loss_fn, batches, acc, with_metrics=False)
        backward(acc, step_model, loss, batches, cache)
        assert torch.isfinite(loss)
        counts.append((model_frames.frame_count, loss_frames.frame_count))
    return counts


@pytest.mark.slow
def test_ten_steps_at_a_fixed_width_compile_once_whatever_the_flip_masks():
    """The FLIP masks change every step (their seeds are a buffer, not a Python number in the graph): one frame for
    the model and one for the loss over 10 steps."""
    assert compiled_steps([20] * 10) == [(1, 1)] * 10


@pytest.mark.slow
def test_token_widths_that_change_every_batch_stop_recompiling_after_the_first_steps():
    """Widths drawn per batch (as the data loader cuts them): the width is bucketed to multiples of 8 in the tower,
    and after the first few steps no width compiles a new frame."""
    widths = [11, 16, 21, 29, 30, 10, 4, 15, 19, 17]
    counts = compiled_steps(widths)
    assert counts[-1][1] == 1  # the loss sees the same shapes every step
    assert counts[-1][0] <= 3 and counts[3:] == [counts[3]] * 7, counts


@pytest.mark.slow
def test_train_compiles_the_prepared_model_and_the_objective(demo, tmp_path, monkeypatch):
    """``train.compile``: the model is compiled after ``accelerator.prepare`` (with DDP, dynamo then cuts the graph
    at the gradient buckets so that their all-reduces overlap the backward), and the objective is compiled too."""
    from accelerate import Accelerator

    from mmcl.losses import ContrastiveObjective
    from mmcl.training.loop import train

    order, real_compile, real_prepare = [], torch.compile, Accelerator.prepare

    def prepare(self, *args, **kwargs):
        order.append("prepare")
        return real_prepare(self, *args, **kwargs)

    def compile_(module, **kwargs):
        order.append(type(module).__name__)
        return real_compile(module, backend="eager")

    monkeypatch.setattr(Accelerator, "prepare", prepare)
    monkeypatch.setattr(torch, "compile", compile_)
    cfg = load_config(None, run_args(demo, tmp_path / "run", "train.steps=2", "train.save_every=0",
                                     "data.batch_size=4", "data.workers=0", "train.compile=true")[2:])
    train(cfg)
    # One process: prepare hands the model back unwrapped (several: DistributedDataParallel, compiled as such).
    assert order == ["prepare", "ShortTextCLIP", ContrastiveObjective.__name__]


def _compile_worker(rank, world, port, cfg_args, out_dir):
    import json
    import os
    from pathlib import Path

    from accelerate import Accelerator

    from mmcl.training.loop import train

    from spawned import end_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    order, real_compile, real_prepare = [], torch.compile, Accelerator.prepare

    def prepare(self, *args, **kwargs):
        order.append("prepare")
        return real_prepare(self, *args, **kwargs)

    def compile_(module, **kwargs):
        order.append(type(module).__name__)
        return real_compile(module, backend="eager")

    Accelerator.prepare, torch.compile = prepare, compile_
    last = train(load_config(None, cfg_args))
    Path(out_dir, f"order-{rank}.json").write_text(json.dumps({"order": order, "loss": last["loss"]}))
    end_worker()


@pytest.mark.slow
def test_two_processes_compile_the_ddp_model_after_prepare(demo, tmp_path):
    """With 2 gloo processes the model handed to torch.compile is accelerate's DistributedDataParallel (whose
    buckets dynamo's DDP support cuts the graph at), and the compiled run trains."""
    import json

    from spawned import free_port, spawn

    args = run_args(demo, tmp_path / "run", "train.steps=3", "train.log_every=3", "train.save_every=0",
                    "data.batch_size=4", "data.workers=0", "train.compile=true", "model.patch_dropout=0.5")[2:]
    spawn(_compile_worker, args=(2, free_port(), args, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"order-{rank}.json").read_text())
        assert got["order"] == ["prepare", "DistributedDataParallel", "ContrastiveObjective"], rank
    assert 0 < got["loss"] < 10


def _negatives(n, k, seed, dim=16):
    """Unit features of up to `k` negative captions for `n` rows, the number per row drawn (some rows none)."""
    from mmcl.losses import DataNegatives

    g = torch.Generator().manual_seed(seed)
    feats = torch.nn.functional.normalize(torch.randn(n, k, dim, generator=g), dim=2)
    return DataNegatives(feats, torch.rand(n, k, generator=g) < 0.6)


@pytest.mark.parametrize("term", ["clip", "siglip"])
@pytest.mark.parametrize("chunk_size", [None, 4])  # dense and tiled
def test_the_loss_with_data_negatives_has_no_graph_break(term, chunk_size):
    torch.manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    cfg = LossConfig(chunk_size=chunk_size, clip=1.0 if term == "clip" else 0.0,
                     siglip=1.0 if term == "siglip" else 0.0)
    objective = objective_from_config(cfg)
    bias = torch.tensor(-10.0) if term == "siglip" else None
    explained = torch._dynamo.explain(objective)(img, txt, torch.tensor(10.0), bias, torch.full((8,), -1), False,
                                                 negatives=_negatives(8, 3, 1))
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]


def _with_negative_captions(batch, seed, width, k=2):
    """`batch` with up to `k` negative captions per sample (the number per sample drawn, so the text tower's batch
    changes from step to step), their tokens cut at `width` like the captions'."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(batch["text"].shape[0], k, generator=g) < 0.5
    return dict(batch, negatives_valid=valid, negatives=cut_batch(int(valid.sum()), seed + 1000, width)["text"])


@pytest.mark.slow
def test_compiled_steps_with_data_negatives_give_the_eager_losses_and_gradients_and_stop_recompiling():
    """``train.compile`` with ``data.negatives``: the model and the objective compiled (dynamo + AOTAutograd, the
    graphs inductor would be given) give the eager steps' losses and gradients, step after step, while the number
    of negative captions (the text tower's batch) changes every step; after the first steps nothing compiles."""
    from accelerate import Accelerator
    from torch._dynamo.testing import CompileCounterWithBackend

    from helpers import grads_of

    torch._dynamo.reset()
    acc = Accelerator(cpu=True)
    objective = objective_from_config(LossConfig(chunk_size=4))
    eager_model, compiled_model = micro_model(0).train(), micro_model(0).train()
    model_frames, loss_frames = CompileCounterWithBackend("aot_eager"), CompileCounterWithBackend("aot_eager")
    step_model = torch.compile(compiled_model, backend=model_frames)
    loss_fn = torch.compile(objective, backend=loss_frames)
    counts = []
    for step in range(8):
        batches = [_with_negative_captions(cut_batch(8, step, 16), step, 16)]
        results = []
        for model, fn in ((eager_model, objective), (step_model, loss_fn)):
            model.zero_grad()
            loss, _, cache = forward_loss(model, fn, batches, acc, with_metrics=False)
            backward(acc, model, loss, batches, cache)
            results.append((loss.item(), grads_of(eager_model if model is eager_model else compiled_model)))
        (want, want_grads), (got, got_grads) = results
        assert got == pytest.approx(want, rel=1e-5), step
        assert got_grads.keys() == want_grads.keys()
        for name, g in want_grads.items():
            assert (got_grads[name] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-7, (step, name)
        counts.append((model_frames.frame_count, loss_frames.frame_count))
    assert len({int(b.sum()) for b in (_with_negative_captions(cut_batch(8, s, 16), s, 16)["negatives_valid"]
                                         for s in range(8))}) > 2  # the negatives' number did change
    assert counts[3:] == [counts[3]] * 5, counts
