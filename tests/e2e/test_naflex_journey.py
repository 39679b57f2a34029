"""NaFlex end to end: the step's loss over a varying number of pairs, and `mmcl train --config configs/naflex.yaml`
on the demo data, which trains, checkpoints, evaluates zero-shot, resumes exactly, exports and loads back."""

import contextlib
import functools
import json

import pytest
import torch
from accelerate import Accelerator

import mmcl
from mmcl import models
from mmcl.cli import main
from mmcl.config import LossConfig, ModelConfig
from mmcl.data.naflex import PATCH_KEYS, PatchNormalizer, patch_batch
from mmcl.training.step import backward, forward_loss, objective_from_config

from helpers import final_weights, metrics, naflex_args
from spawned import end_worker, free_port, spawn


def _batch(tokenizer, seed, n, seq_len):
    gen = torch.Generator().manual_seed(seed)
    images = [torch.randint(0, 255, (3, 8 * (1 + i % 2), 8 * (1 + i % 3)), generator=gen, dtype=torch.uint8)
              for i in range(n)]
    return dict(patch_batch(images, seq_len, 8), text=tokenizer([f"caption {seed} {i}" for i in range(n)]),
                label=torch.arange(n))


def _model_and_objective(term):
    torch.manual_seed(0)
    model, _, _, _, _, tokenizer = models.build(ModelConfig(name="tiny", vision_cfg={
        "timm_model_name": "naflexvit_base_patch16_siglip",
        "timm_model_kwargs": {"embed_dim": 16, "depth": 1, "num_heads": 2, "patch_size": 8}}, init_logit_bias=-5.0))
    weights = {"clip": float(term == "clip"), "siglip": float(term == "siglip")}
    return model, tokenizer, objective_from_config(LossConfig(**weights))


@pytest.mark.parametrize("term", ["clip", "siglip"])
def test_padding_to_the_capacity_gives_the_loss_and_gradients_of_the_real_pairs(term):
    model, tokenizer, objective = _model_and_objective(term)
    acc, finish = Accelerator(cpu=True), PatchNormalizer((0.5,) * 3, (0.5,) * 3)
    batches = [_batch(tokenizer, 0, 5, 6), _batch(tokenizer, 1, 3, 9)]  # two micro-batches of 5 and 3 pairs
    results = []
    for capacity in (None, 7):  # unpadded (the fixed-size path) and padded to 7 pairs per micro-batch
        model.zero_grad()
        loss, _, cache = forward_loss(model, objective, batches, acc, finish, capacity=capacity)
        backward(acc, model, loss, batches, cache, finish)
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys() and any(k.startswith("visual.trunk") for k in grads_a)
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], atol=1e-5, rtol=1e-4)  # float32 sums in another order
    assert set(PATCH_KEYS) <= set(batches[0])


class _OneDevice:
    """What forward_loss and backward use of an accelerator, in a worker that set up torch.distributed itself."""

    device = torch.device("cpu")
    autocast = staticmethod(contextlib.nullcontext)
    no_sync = staticmethod(lambda model: contextlib.nullcontext())

    @staticmethod
    def backward(loss):
        loss.backward()


def _ranks_worker(rank, port, term, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, tokenizer, objective = _model_and_objective(term)
    batch = [_batch(tokenizer, 0, 5, 6), _batch(tokenizer, 1, 3, 9)][rank]  # 5 pairs here, 3 there
    finish = PatchNormalizer((0.5,) * 3, (0.5,) * 3)
    loss, _, _ = forward_loss(model, objective, [batch], _OneDevice, finish, capacity=6)
    backward(_OneDevice, model, loss, [batch], None, finish)
    losses = [torch.zeros(()) for _ in range(2)]
    dist.all_gather(losses, loss.detach())
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():  # DDP's average
        dist.all_reduce(g)
        g /= 2
    if rank == 0:
        torch.save({"loss": torch.stack(losses).mean(), "grads": grads}, out)
    end_worker()


@pytest.mark.slow
@pytest.mark.parametrize("term", ["clip", "siglip"])
def test_two_processes_holding_5_and_3_pairs_train_as_one_holding_8(term, tmp_path):
    model, tokenizer, objective = _model_and_objective(term)
    batches = [_batch(tokenizer, 0, 5, 6), _batch(tokenizer, 1, 3, 9)]
    finish = PatchNormalizer((0.5,) * 3, (0.5,) * 3)
    acc = Accelerator(cpu=True)
    loss, _, cache = forward_loss(model, objective, batches, acc, finish)  # one process, the 8 pairs
    backward(acc, model, loss, batches, cache, finish)
    out = tmp_path / "ranks.pt"
    spawn(_ranks_worker, args=(free_port(), term, str(out)))
    got = torch.load(out, weights_only=True)
    torch.testing.assert_close(got["loss"], loss.detach(), atol=1e-6, rtol=1e-5)
    assert any(k.startswith("visual.trunk") for k in got["grads"])
    for k, p in model.named_parameters():
        if p.grad is not None:  # the reference's zero-weighted terms (GradCache) give unused parameters zeros
            expected = got["grads"].get(k, torch.zeros_like(p.grad))
            torch.testing.assert_close(expected, p.grad, atol=1e-5, rtol=1e-4)


def _args(demo, out, *extra):
    return naflex_args(demo["train"], out, *extra)


@pytest.mark.slow
def test_naflex_demo_trains_evaluates_resumes_exactly_exports_and_reloads(demo, tmp_path, capsys):
    zeroshot = f"eval.zeroshot={demo['zeroshot_colour']}"
    assert main(_args(demo, tmp_path / "whole", "train.steps=4", zeroshot)) == 0
    said = capsys.readouterr().out.splitlines()  # the start lines speak of NaFlex batches, never data.batch_size's
    assert any("; NaFlex batches of varying pairs (below); " in ln for ln in said), said
    assert not any("global batch" in ln for ln in said), said
    assert "mmcl: train.steps=4: 4 steps of NaFlex batches (each one's pairs set by data.naflex.max_tokens_per_batch)" \
        in said
    assert main(_args(demo, tmp_path / "parts", "train.steps=2", zeroshot)) == 0
    assert main(_args(demo, tmp_path / "parts", "train.steps=4", zeroshot)) == 0  # resumed from step 2
    whole, parts = final_weights(tmp_path / "whole"), final_weights(tmp_path / "parts")
    assert whole.keys() == parts.keys()
    for k in whole:
        torch.testing.assert_close(whole[k], parts[k], atol=0, rtol=0)
    records = metrics(tmp_path / "whole")
    assert [r["data/naflex_seq_len"] for r in records] == [r["data/naflex_seq_len"] for r in metrics(
        tmp_path / "parts")][-4:]
    for r in records:  # each batch filled to the budget: pairs * length <= max_tokens_per_batch
        assert r["data/naflex_pairs"] * r["data/naflex_seq_len"] <= 2048 and 0 <= r["data/naflex_padding_waste"] < 1
    assert records[-1]["samples"] == sum(r["data/naflex_pairs"] for r in records)
    # the pairs of a step follow from the seed and its place in the run (what a step the device skipped takes off)
    from types import SimpleNamespace

    from mmcl.data import NaflexPlan
    from mmcl.training.loop import step_samples

    plan = NaflexPlan.build([16, 36, 64], None, 2048, 8, seed=0)
    run = SimpleNamespace(stream=SimpleNamespace(naflex=plan), rt=SimpleNamespace(accum_steps=1, processes=1))
    assert [step_samples(run, r["step"]) for r in records] == [r["data/naflex_pairs"] for r in records]
    assert "eval/zeroshot_classification/colour/acc1" in records[-1]
    assert (tmp_path / "whole" / "checkpoints").is_dir()
    export = tmp_path / "export"
    assert main(["export", "--model", str(tmp_path / "whole"), "--format", "safetensors", "--out", str(export)]) == 0
    assert main(["export", "--model", str(tmp_path / "whole"), "--format", "hf", "--out",
                 str(tmp_path / "hf")]) != 0
    assert "cannot carry a NaFlex image tower" in capsys.readouterr().err
    from PIL import Image

    ref_model, ref_pre, tok = mmcl.load(str(tmp_path / "whole"))
    model, pre, _ = mmcl.load(str(export))
    img = Image.new("RGB", (40, 24), (200, 30, 30))
    x = {k: v[None] for k, v in pre(img).items()}
    assert x["patches"].shape[1] == 64  # eval.naflex_seq_len of configs/naflex.yaml
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(x), ref_model.encode_image(x))
        torch.testing.assert_close(model.encode_text(tok(["red"])), ref_model.encode_text(tok(["red"])))
    assert json.loads((export / "mmcl_export.json").read_text())["min_cosine_vs_source"] > 0.9999
    # an index of the export's embeddings, searched by text and by an image (patchified like the indexed ones)
    assert main(["index", "--model", str(export), "--data", demo["val"], "--out", str(tmp_path / "index")]) == 0
    img.save(tmp_path / "query.png")
    capsys.readouterr()
    assert main(["search", "--index", str(tmp_path / "index"), "--image", str(tmp_path / "query.png"), "-k", "2"]) == 0
    assert len([ln for ln in capsys.readouterr().out.splitlines() if ".tar" in ln]) == 2
    from mmcl.errors import ConfigError
    from mmcl.evaluation.embed import ClipEncoder

    with pytest.raises(ConfigError, match="has a NaFlex image tower, which this command does not take"):
        ClipEncoder.load(str(export))
    from mmcl.evaluation.teacher import Teacher

    with pytest.raises(ConfigError, match="has a NaFlex image tower; a teacher takes fixed-size images"):
        Teacher.load(str(export))


@pytest.mark.slow
def test_a_compiled_naflex_run_with_accumulation_gives_the_eager_losses(demo, tmp_path, monkeypatch):
    """train.compile with NaFlex batches (a new sequence length is a new shape) and accumulation (the micro-batches
    hold different numbers of pairs) gives the eager run's losses. The backend is aot_eager: dynamo's and
    AOTAutograd's tracing, without inductor's code generation (tests/training/test_compile_inductor.py has that)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert main(_args(demo, eager, "train.steps=3", "train.accum_steps=2")) == 0
    assert main(_args(demo, compiled, "train.steps=3", "train.accum_steps=2", "train.compile=true")) == 0
    a, b = metrics(eager), metrics(compiled)
    assert [r["data/naflex_seq_len"] for r in a] == [r["data/naflex_seq_len"] for r in b]
    assert len(a) == 3 and all(abs(x["loss"] - y["loss"]) < 1e-4 * max(1.0, abs(x["loss"])) for x, y in zip(a, b)), \
        ([x["loss"] for x in a], [y["loss"] for y in b])


def _with_negatives(batch, tokenizer, seed, k=2):
    """A NaFlex batch with up to `k` negative captions per pair (0..k, as the loader gives them)."""
    n = batch["text"].shape[0]
    valid = torch.arange(k)[None, :] < (torch.arange(n) % (k + 1))[:, None]
    texts = [f"negative {seed} {i} {j}" for i in range(n) for j in range(k) if valid[i, j]]
    return dict(batch, negatives_valid=valid, negatives=tokenizer(texts))


@pytest.mark.parametrize("term", ["clip", "siglip"])
def test_padding_to_the_capacity_with_data_negatives_gives_the_loss_and_gradients_of_the_real_pairs(term):
    """NaFlex pads each micro-batch's pairs to the capacity; its padded rows carry no negative, and the real rows'
    negatives are scored as without padding."""
    model, tokenizer, objective = _model_and_objective(term)
    acc, finish = Accelerator(cpu=True), PatchNormalizer((0.5,) * 3, (0.5,) * 3)
    batches = [_with_negatives(_batch(tokenizer, 0, 5, 6), tokenizer, 0),
               _with_negatives(_batch(tokenizer, 1, 3, 9), tokenizer, 1)]
    results = []
    for capacity, negatives in ((None, True), (7, True), (7, False)):
        model.zero_grad()
        given = batches if negatives else [{k: v for k, v in b.items() if not k.startswith("negatives")}
                                           for b in batches]
        loss, _, cache = forward_loss(model, objective, given, acc, finish, capacity=capacity)
        backward(acc, model, loss, given, cache, finish)
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b), (loss_c, _) = results
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-5)
    assert loss_b > loss_c + 1e-4  # the negatives are in the loss
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_naflex_run_trains_on_the_negatives_mmcl_negatives_wrote(demo, tmp_path, capsys):
    """configs/naflex.yaml on demo shards that `mmcl negatives` gave negative captions, with data.negatives: the
    run trains and its first loss is above the same run's without them (the same weights and batch; SigLIP, the
    config's loss, adds a term per negative: log(1 + exp(s x.n + b)), small at the initial bias of -10)."""
    out = tmp_path / "neg-shards"
    assert main(["negatives", "--input", demo["train"], "--out", str(out), "--no-progress"]) == 0
    for name, extra in (("with", "data.negatives=2"), ("without", "data.negatives=0")):
        assert main(naflex_args(str(out / "*.tar"), tmp_path / name, "train.steps=2", "train.save_every=0",
                                "eval.zeroshot=null", extra)) == 0
    capsys.readouterr()
    with_neg, without = ([m for m in metrics(tmp_path / name) if "loss" in m] for name in ("with", "without"))
    assert len(with_neg) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in with_neg)
    assert with_neg[0]["loss"] > without[0]["loss"] + 5e-5
    assert (tmp_path / "with" / "model" / "open_clip_model.safetensors").is_file()
