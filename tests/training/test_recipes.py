"""Training recipes: EMA of the weights, per-tower and layer-wise learning rates, FLIP patch dropout."""

import os

import pytest
import torch

from mmcl import models
from mmcl.config import LossConfig, OptimConfig, load_config
from mmcl.training.ema import WeightEMA
from mmcl.training.step import objective_from_config as build_objective
from mmcl.training.step import apply_update, backward, forward_loss
from mmcl.training.optim import build_optimizer

from helpers import TRAINING_TOWERS, fake_batch, metrics, run_args
from preempt import sigterm_during_step
from spawned import end_worker, free_port as _free_port


def micro_model(seed=0, *extra):
    torch.manual_seed(seed)
    cfg = load_config(None, [*TRAINING_TOWERS, *extra]).model
    model, *_ = models.build(cfg)
    models.apply_locks(model, cfg)
    return model


def train_steps(model, acc, batches, ema=None, optim=None):
    """Plain optimiser steps (AdamW, the run's groups) over `batches`; the weights after each step (float64)."""
    objective = build_objective(LossConfig())
    optimizer = build_optimizer(acc.unwrap_model(model), optim or OptimConfig(lr=1e-2, warmup_steps=0))
    raw = acc.unwrap_model(model)
    seen = []
    for b in batches:
        loss, _, cache = forward_loss(model, objective, [b], acc)
        backward(acc, model, loss, [b], cache)
        apply_update(acc, model, raw, optimizer, 1.0, 4.6)
        if ema is not None:
            ema.update(raw)
        seen.append({n: p.detach().double().clone() for n, p in raw.named_parameters()})
    return seen


# ----------------------------------------------------------------------------------------------- EMA
def test_ema_matches_the_hand_computed_average_over_three_steps():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = micro_model(0, "model.lock_text=true")
    w0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    d = 0.7
    ema = WeightEMA(model, d)
    # Locked parameters get no average.
    assert "token_embedding.weight" not in ema.shadow and "visual.conv1.weight" in ema.shadow
    assert all(t.dtype == torch.float32 for t in ema.shadow.values())
    w1, w2, w3 = train_steps(model, acc, [fake_batch(8, seed=s) for s in (1, 2, 3)], ema)
    assert ema.updates == 3
    for n, avg in ema.shadow.items():
        expected = d ** 3 * w0[n] + d ** 2 * (1 - d) * w1[n] + d * (1 - d) * w2[n] + (1 - d) * w3[n]
        torch.testing.assert_close(avg.double(), expected, rtol=0, atol=2e-7, msg=n)
    moved = max((w3[n] - w0[n]).abs().max().item() for n in ema.shadow)
    assert moved > 1e-3  # the steps did change the weights, so the check above is not vacuous

    # swapped_in puts the average into the model and gives the trained weights back bit for bit.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped_in(model) as m:
        for n, p in m.named_parameters():
            want = ema.shadow[n] if n in ema.shadow else before[n]
            assert torch.equal(p, want), n
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_ema_state_round_trips_and_refuses_other_parameters():
    a = WeightEMA(micro_model(0), 0.9)
    a.shadow["visual.proj"].add_(1.0)
    a.updates = 5
    b = WeightEMA(micro_model(1), 0.9)
    b.load_state_dict(a.state_dict())
    assert b.updates == 5 and all(torch.equal(a.shadow[n], b.shadow[n]) for n in a.shadow)
    locked = WeightEMA(micro_model(0, "model.lock_image=true"), 0.9)
    with pytest.raises(ValueError, match="locked differently"):
        locked.load_state_dict(a.state_dict())


def test_ema_decay_is_validated():
    from mmcl.errors import ConfigError

    for bad in ("1.0", "0", "-0.5"):
        with pytest.raises(ConfigError, match="train.ema_decay must be in"):
            load_config(None, [f"train.ema_decay={bad}"])
    assert load_config(None, ["train.ema_decay=0.999"]).train.ema_decay == 0.999


# Adam divides by the gradient's running scale: a parameter whose gradient is zero in exact arithmetic (the key
# bias of attention) moves by about lr on float32 summation noise, which differs between 1 and 2 processes. A
# larger eps keeps such noise from being amplified, so the comparison below can be tight.
ADAM_DDP = OptimConfig(lr=1e-2, warmup_steps=0, eps=1e-3)


def _ema_ddp_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    raw = micro_model(0)
    ema = WeightEMA(raw, 0.6)
    model = acc.prepare(raw)
    n = 12 // world
    batches = [{k: v[rank * n:(rank + 1) * n] for k, v in fake_batch(12, seed=s).items()} for s in (1, 2, 3)]
    train_steps(model, acc, batches, ema, ADAM_DDP)
    if rank == 0:
        torch.save(ema.state_dict(), out_path)
    end_worker()


@pytest.mark.slow
def test_ema_two_processes_equal_one_process(tmp_path):
    from accelerate import Accelerator

    out = tmp_path / "ema.pt"
    torch.multiprocessing.spawn(_ema_ddp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    ddp = torch.load(out)["shadow"]

    acc = Accelerator(cpu=True)
    model = micro_model(0)
    ema = WeightEMA(model, 0.6)
    train_steps(model, acc, [fake_batch(12, seed=s) for s in (1, 2, 3)], ema, ADAM_DDP)
    assert ddp.keys() == ema.shadow.keys()
    for n in ddp:  # float32 summation order differs across the all-gather and all-reduce
        torch.testing.assert_close(ddp[n], ema.shadow[n], rtol=1e-4, atol=2e-6, msg=n)


# ------------------------------------------------------------------------------ per-tower and layer-wise rates
def test_learning_rates_per_group_match_hand_computed_ones():
    from mmcl.training.optim import param_groups, set_lr
    from mmcl.training.optim import lr_at

    model = micro_model(0)  # 2 image blocks, 2 text blocks: layer ids 0 (embeddings), 1-2 (blocks), 3 (head)
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2, image_lr_mult=0.5, image_layer_decay=0.8,
                      text_lr_mult=2.0, text_layer_decay=0.5)
    groups = param_groups(model, cfg)
    optimizer = build_optimizer(model, cfg, groups)
    expected = {  # tower multiplier x decay ** (3 - layer id)
        "visual.conv1.weight": 0.5 * 0.8 ** 3, "visual.class_embedding": 0.5 * 0.8 ** 3,
        "visual.positional_embedding": 0.5 * 0.8 ** 3, "visual.ln_pre.weight": 0.5 * 0.8 ** 3,
        "visual.transformer.resblocks.0.attn.in_proj_weight": 0.5 * 0.8 ** 2,
        "visual.transformer.resblocks.1.mlp.c_fc.bias": 0.5 * 0.8,
        "visual.ln_post.weight": 0.5, "visual.proj": 0.5,
        "token_embedding.weight": 2.0 * 0.5 ** 3, "positional_embedding": 2.0 * 0.5 ** 3,
        "transformer.resblocks.0.ln_1.weight": 2.0 * 0.5 ** 2, "transformer.resblocks.1.attn.out_proj.weight": 1.0,
        "ln_final.bias": 2.0, "text_projection": 2.0, "logit_scale": 1.0,
    }
    # The weight-decay split is kept: 1-d tensors (gains, biases, the class embedding) and the logit scale are
    # not decayed; matrices (positional embeddings included) are.
    no_decay = {"visual.class_embedding", "visual.ln_pre.weight", "logit_scale", "visual.ln_post.weight",
                "visual.transformer.resblocks.1.mlp.c_fc.bias", "transformer.resblocks.0.ln_1.weight", "ln_final.bias"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(n for g in groups for n in g["names"]) == sorted(trainable)  # each parameter in one group
    by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    for step in (0, 1, 5, 9):  # warmup, peak, cosine decay: every group follows the schedule proportionally
        set_lr(optimizer, lr_at(step, cfg, 10))
        for name, scale in expected.items():
            g = by_param[id(named[name])]
            assert g["lr"] == pytest.approx(lr_at(step, cfg, 10) * scale, rel=1e-12), (step, name)
            assert g["weight_decay"] == (0.0 if name in no_decay else 0.1), name
    # One group per (scale, weight decay). Scales: image 0.256, 0.32, 0.4, 0.5; text 0.25, 0.5 (shared with the
    # image head), 1.0 (shared with the logit scale), 2.0: 7 scales, each with and without decay except the text
    # embeddings' 0.25 (token and positional embeddings are matrices): 13 groups.
    assert len(groups) == len({(g["lr_scale"], g["weight_decay"]) for g in groups}) == 13


def test_default_rates_keep_the_two_weight_decay_groups():
    from mmcl.training.optim import param_groups

    model = micro_model(0, "model.lock_text=true")
    groups = param_groups(model, OptimConfig(weight_decay=0.2))
    assert [(g["lr_scale"], g["weight_decay"]) for g in groups] == [(1.0, 0.2), (1.0, 0.0)]
    names = {n for g in groups for n in g["names"]}
    assert names == {n for n, p in model.named_parameters() if p.requires_grad}
    assert "token_embedding.weight" not in names and "transformer.resblocks.0.attn.in_proj_weight" not in names


def test_layer_decay_is_validated():
    from mmcl.errors import ConfigError

    with pytest.raises(ConfigError, match="optim.image_layer_decay must be in"):
        load_config(None, ["optim.image_layer_decay=0"])
    with pytest.raises(ConfigError, match="optim.text_lr_mult must be >= 0"):
        load_config(None, ["optim.text_lr_mult=-1"])


# ------------------------------------------------------------------------------------- FLIP patch dropout
def tokens_seen(model, images):
    """The number of tokens the image transformer runs on for `images` (a forward hook on its first block)."""
    seen = []
    block = model.visual.transformer.resblocks[0]
    handle = block.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        feats = model.encode_image(images, normalize=True)
    finally:
        handle.remove()
    return feats, seen[0]


def test_unmasked_evaluation_equals_the_same_weights_without_masking():
    masked = micro_model(0)
    modules = models.set_patch_dropout(masked, 0.5, seed=3)
    images = fake_batch(4, seed=7)["image"]
    masked.train()
    modules[0].begin_step(0)
    train_feats, n_train = tokens_seen(masked, images)
    assert n_train == 1 + 32  # 64 patches at 64 px / 8, half kept, and the class token
    with torch.no_grad():  # the weights move a little, masked, so the comparison below is on trained weights
        for p in masked.parameters():
            p.add_(0.01 * torch.randn_like(p))

    plain = micro_model(1)
    plain.load_state_dict(masked.state_dict())  # same weights: the dropout module holds no state
    masked.eval(), plain.eval()
    with torch.no_grad():
        a, n_eval = tokens_seen(masked, images)
        b, n_plain = tokens_seen(plain, images)
        masked.train()
        c, _ = tokens_seen(masked, images)
    assert n_eval == n_plain == 1 + 64
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3  # training mode is masked


def test_patch_masks_are_a_function_of_seed_step_and_global_row():
    from mmcl.models.flip import SeededPatchDropout

    x = torch.randn(6, 1 + 16, 8)
    one = SeededPatchDropout(0.5, seed=5)
    one.begin_step(3)
    full = one(x)
    halves = []
    for rank in (0, 1):  # 2 processes, each with its 3 rows, drop the patches one process drops for them
        m = SeededPatchDropout(0.5, seed=5, rank=rank, world_size=2)
        m.begin_step(3)
        halves.append(m(x[rank * 3:(rank + 1) * 3]))
    assert torch.equal(torch.cat(halves), full)
    assert full.shape == (6, 1 + 8, 8) and torch.equal(full[:, 0], x[:, 0])  # the class token is always kept
    kept = [{tuple(t.tolist()) for t in row} for row in full[:, 1:]]
    assert all(k <= {tuple(t.tolist()) for t in row} for k, row in zip(kept, x[:, 1:]))  # a subset of the patches
    one.begin_step(3)
    assert torch.equal(one(x), full)  # the same step again (a resumed run): the same masks
    one.begin_step(4)
    assert not torch.equal(one(x), full)
    other = SeededPatchDropout(0.5, seed=6)
    other.begin_step(3)
    assert not torch.equal(other(x), full)
    one.begin_step(4, masked=False)
    assert torch.equal(one(x), x)


def test_accumulation_with_patch_dropout_equals_its_reference():
    """GradCache runs each micro-batch twice (without and with autograd): both passes must drop the same patches;
    the gradients then equal those of one differentiable pass over the same masked micro-batches."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    objective = build_objective(LossConfig())
    big = fake_batch(12, seed=1)
    halves = [{k: v[:6] for k, v in big.items()}, {k: v[6:] for k, v in big.items()}]

    model = micro_model(0)
    mods = models.set_patch_dropout(model, 0.5, seed=2, accum_steps=2)
    mods[0].begin_step(4)
    loss_acc, _, cache = forward_loss(model, objective, halves, acc)
    backward(acc, model, loss_acc, halves, cache)
    g_acc = {n: p.grad.clone() for n, p in model.named_parameters()}

    model = micro_model(0)
    mods = models.set_patch_dropout(model, 0.5, seed=2, accum_steps=2)
    mods[0].begin_step(4)
    outs = [model(h["image"], h["text"]) for h in halves]  # micro-batch 0, then 1: the masks of the steps above
    img = torch.cat([o["image_features"] for o in outs])
    txt = torch.cat([o["text_features"] for o in outs])
    loss_ref, _ = objective(img, txt, outs[0]["logit_scale"], None, big["label"])
    loss_ref.backward()
    assert loss_acc.item() == pytest.approx(loss_ref.item(), rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(g_acc[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_patch_dropout_needs_a_tower_with_patches():
    from mmcl.errors import ConfigError

    resnet = micro_model(0, "model.vision_cfg={layers: [1, 1, 1, 1], width: 16, head_width: 16}")
    with pytest.raises(ConfigError, match="model.patch_dropout=0.5 needs an open_clip ViT image tower"):
        models.set_patch_dropout(resnet, 0.5)
    with pytest.raises(ConfigError, match=r"model.patch_dropout must be in \[0, 1\)"):
        load_config(None, ["model.patch_dropout=1.0"])


# ------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_recipes_train_end_to_end(demo, tmp_path, monkeypatch):
    """FLIP masking with an unmasked final phase, EMA and layer-wise rates in one run: it learns, the last
    train.unmasked_steps steps run on every patch, the groups are written, model/ holds the average."""
    import json

    from mmcl.models import flip
    from mmcl.cli import main

    masked_at = {}  # step -> whether the image transformer ran on masked tokens in training
    forward = flip.SeededPatchDropout.forward

    def watch(self, x):
        out = forward(self, x)
        if self.training:
            masked_at[self.step] = out.shape[1] < x.shape[1]
        return out

    monkeypatch.setattr(flip.SeededPatchDropout, "forward", watch)
    out = tmp_path / "run"
    args = run_args(demo, out, "train.steps=100", "data.batch_size=32", "train.log_every=5", "optim.lr=2e-3",
                    "optim.warmup_steps=5", f"eval.zeroshot={demo['zeroshot_colour']}", "train.save_every=0",
                    "eval.every=30", "model.patch_dropout=0.5", "train.unmasked_steps=10", "train.ema_decay=0.9",
                    "optim.image_layer_decay=0.95", "optim.text_lr_mult=0.9")
    assert main(["train", *args]) == 0
    assert masked_at == {s: s < 90 for s in range(100)}
    rows = metrics(out)
    # ln(32) = 3.47 is chance; half the patches and a lower rate for most layers learn more slowly than the plain
    # run of test_train, so the loss is averaged over the first and the last two logged steps.
    first = (rows[0]["loss"] + rows[1]["loss"]) / 2
    last = (rows[-2]["loss"] + rows[-1]["loss"]) / 2
    acc = rows[-1]["eval/zeroshot_classification/colour/acc1"]
    # The drop depends on the seed (masks, draws): over 100 steps, train.seed 0-3 measured 3.63 -> 2.50, 3.62 -> 3.03,
    # 3.49 -> 2.55, 3.50 -> 3.41 (this seed learns late); the test runs seed 0.
    assert first > 3.0 and last < first - 0.3, (first, last, acc)
    assert "eval/zeroshot_classification/colour/acc1" in rows[5]  # the in-loop evaluation (EMA weights)
    assert acc > 0.125, acc  # above chance (8 colours; measured 0.41)
    groups = json.loads((out / "param_groups.json").read_text())
    scale = {n: g["lr_scale"] for g in groups for n in g["names"]}
    assert scale["visual.conv1.weight"] == pytest.approx(0.95 ** 3) and scale["token_embedding.weight"] == 0.9
    assert scale["visual.proj"] == 1.0 and scale["logit_scale"] == 1.0
    assert groups[0]["lr"] == pytest.approx(2e-3 * groups[0]["lr_scale"])


# ------------------------------------------------------------------------------------- several captions
def write_shards(root, samples, per_shard=4):
    """Shards of (key, {ext: bytes}) samples; returns the brace spec."""
    import io
    import tarfile

    root.mkdir(parents=True, exist_ok=True)
    n = 0
    for n, start in enumerate(range(0, len(samples), per_shard)):
        with tarfile.open(root / f"s-{n:03d}.tar", "w") as tar:
            for key, files in samples[start:start + per_shard]:
                for ext, data in files.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(root / f"s-{{000..{n:03d}}}.tar")


def png(seed, size=16):
    import io

    import numpy as np
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def captioned(n, with_txt=True):
    import json

    out = []
    for i in range(n):
        caps = [f"image {i} caption {c}" for c in range(1 + i % 4)]
        files = {"png": png(i), "json": json.dumps({"captions": caps, "meta": {"alt": f"alt {i}"}}).encode()}
        if with_txt:
            files["txt"] = f"synthetic {i}".encode()
        out.append((f"k{i:04d}", files))
    return out


def test_caption_keys_parse_and_draw_deterministically():
    from mmcl.data import SampleKeys, SkipSample, caption_draw, parse_sample

    _, files = captioned(8)[7]  # 4 captions in json:captions
    keys = SampleKeys(caption_keys="json:captions")
    draws = {parse_sample(files, keys=keys, draw=caption_draw(0, e, "k0007"))[1] for e in range(40)}
    assert draws == {f"image 7 caption {c}" for c in range(4)}  # epochs draw every caption, only those
    again = [parse_sample(files, keys=keys, draw=caption_draw(0, e, "k0007"))[1] for e in range(5)]
    assert again == [parse_sample(files, keys=keys, draw=caption_draw(0, e, "k0007"))[1] for e in range(5)]
    assert parse_sample(files, keys=SampleKeys(caption_keys="json:meta.alt"))[1] == "alt 7"
    # all captions, one per line (retrieval)
    assert parse_sample(files, keys=SampleKeys(caption_keys=["txt", "json:captions"]), all_captions=True)[1] == \
        "synthetic 7\n" + "\n".join(f"image 7 caption {c}" for c in range(4))
    # weights between sources: 0 never draws a source; 3:1 draws it about 3/4 of the time
    both = SampleKeys(caption_keys=["txt", "json:captions"], weights=[0.0, 1.0])
    assert all(parse_sample(files, keys=both, draw=caption_draw(1, e, "k")).__getitem__(1) != "synthetic 7"
               for e in range(30))
    mix = SampleKeys(caption_keys=["txt", "json:captions"], weights=[3.0, 1.0])
    picked = [parse_sample(files, keys=mix, draw=caption_draw(2, e, "k"))[1] == "synthetic 7" for e in range(2000)]
    assert 0.72 < sum(picked) / len(picked) < 0.78
    with pytest.raises(SkipSample, match="missing_caption"):
        parse_sample({"png": files["png"]}, keys=keys)
    with pytest.raises(SkipSample, match="bad_caption"):
        parse_sample({"png": files["png"], "json": b"{not json"}, keys=keys)
    with pytest.raises(SkipSample, match="missing_image"):
        parse_sample(files, keys=SampleKeys(image_key="jpg", caption_keys="txt"))


def _stream(spec, **extra):
    import zlib

    from mmcl.config import DataConfig
    from mmcl.data import build_train_stream

    cfg = DataConfig(train=spec, batch_size=4, workers=0, shuffle_buffer=8, caption_key="json:captions", **extra)
    tok = lambda caps: torch.tensor([[zlib.crc32(c.encode())] for c in caps])  # noqa: E731
    return build_train_stream(cfg, lambda img: torch.zeros(3, 8, 8), tok, seed=3)


def _drawn(batches):
    return [(k, int(t)) for b in batches for k, t in zip(b["key"], b["text"][:, 0])]


def test_the_caption_drawn_for_a_key_is_the_same_after_resume(tmp_path):
    import zlib

    samples = captioned(12, with_txt=False)
    spec = write_shards(tmp_path / "shards", samples)
    stream = _stream(spec)
    it = iter(stream)
    ref = _drawn([next(it) for _ in range(9)])  # 3 epochs of 12 samples
    it.close()

    first = _stream(spec)
    it = iter(first)
    head = _drawn([next(it) for _ in range(4)])  # into the second epoch
    state = first.state_dict()
    it.close()
    resumed = _stream(spec)
    resumed.load_state_dict(state)
    it = iter(resumed)
    tail = _drawn([next(it) for _ in range(5)])
    it.close()
    assert head + tail == ref

    captions = {k: {zlib.crc32(c.encode()) for c in json_caps} for k, json_caps in
                ((k, [f"image {int(k[1:])} caption {c}" for c in range(1 + int(k[1:]) % 4)]) for k, _ in samples)}
    assert all(t in captions[k] for k, t in ref)  # each drawn caption is one of the sample's
    per_key = {}
    for k, t in ref:
        per_key.setdefault(k, []).append(t)
    assert any(len(set(v)) > 1 for v in per_key.values())  # another epoch may draw another caption


def test_retrieval_scores_every_caption_of_a_json_list(tmp_path):
    """The same captions as a JSON list or as lines of .txt: the same recalls, over every caption."""
    import json

    from mmcl.evaluation import evaluate
    from mmcl.data import sample_keys

    samples = captioned(10, with_txt=False)
    as_lines = [(k, {"png": f["png"], "txt": "\n".join(json.loads(f["json"])["captions"]).encode()})
                for k, f in samples]
    json_spec = write_shards(tmp_path / "json", samples)
    txt_spec = write_shards(tmp_path / "txt", as_lines)
    model = micro_model(0)
    _, _, pp, _, eval_tf, tok = models.build(load_config(None, TRAINING_TOWERS).model)
    a = evaluate.retrieval(model, eval_tf, tok, json_spec, batch_size=4, progress=False,
                           keys=sample_keys(caption_key="json:captions"))
    b = evaluate.retrieval(model, eval_tf, tok, txt_spec, batch_size=4, progress=False)
    assert a["n_texts"] == b["n_texts"] == sum(1 + i % 4 for i in range(10)) == 23
    assert a["metrics"] == b["metrics"]


def test_caption_keys_are_validated():
    from mmcl.errors import ConfigError

    with pytest.raises(ConfigError, match="data.caption_key_weights needs one non-negative weight per caption key"):
        load_config(None, ["data.caption_key=[txt, 'json:caption']", "data.caption_key_weights=[1.0]"])
    with pytest.raises(ConfigError, match="data.caption_key must be"):
        load_config(None, ["data.caption_key=[]"])
    cfg = load_config(None, ["data.caption_key=[txt, 'json:captions']", "data.caption_key_weights=[1, 3]"])
    assert cfg.data.caption_key == ["txt", "json:captions"]


# ------------------------------------------------------------------------------------------------ trackers
def _run_with(demo, out, trackers, *extra):
    from mmcl.cli import main

    args = run_args(demo, out, "train.steps=4", "data.batch_size=8", "train.log_every=2", "train.save_every=0",
                    "data.workers=0", f"train.log_with=[{', '.join(trackers)}]", *extra)
    assert main(["train", *args]) == 0
    return metrics(out)


def test_tensorboard_tracker_through_accelerate_holds_the_scalars(demo, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    rows = _run_with(demo, out, ["tensorboard"])
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for key in ("loss", "lr", "logit_scale"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows], key
    # the resolved config as hyperparameters
    hparams = list((out / "tensorboard").glob("*/hparams.yml"))
    assert len(hparams) == 1 and "optim.lr: 0.001" in hparams[0].read_text()


def test_unknown_or_missing_tracker_is_one_clear_error():
    from mmcl.errors import ConfigError
    from mmcl.training.tracking import accelerator_kwargs

    with pytest.raises(ConfigError, match="train.log_with: unknown tracker"):
        load_config(None, ["train.log_with=[tensorbored]"])
    import importlib.util

    for name in ("wandb", "mlflow", "aim"):
        if importlib.util.find_spec(name) is None:
            with pytest.raises(ConfigError, match=f"{name} is not installed"):
                accelerator_kwargs([name], ".")


def _wandb_records(path):
    """The protobuf records of an offline run's ``run-*.wandb`` file: a 7-byte header, then LevelDB-log blocks of
    32 KiB holding records with a 7-byte header each (CRC-32, length, type: full, first, middle, last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunks, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        chunks = payload if kind in (1, 2) else chunks + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            out.append(record)
    return out


def test_wandb_offline_run_directory_holds_the_scalars(demo, tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")  # track.project unset: the environment's
    monkeypatch.setenv("WANDB_TAGS", "env-tag")  # track.tags set: the key's
    out = tmp_path / "run"
    rows = _run_with(demo, out, ["wandb"], "track.run_name=tiny-b8", "track.tags=[tiny, demo]",
                     "track.notes='a first try'")
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, sorted(p.name for p in (out / "wandb").iterdir())
    records = _wandb_records(runs[0])
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history.setdefault(r.history.step.num, {}).update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    assert sorted(history) == [r["step"] for r in rows] == [2, 4]
    for r in rows:
        for key in ("loss", "lr", "logit_scale", "samples"):
            assert history[r["step"]].get(key) == pytest.approx(r[key], rel=1e-9), (r["step"], key, history)
    config = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for r in records
              if r.WhichOneof("record_type") == "config"
              for u in r.config.update}
    assert config["optim.lr"] == 0.001 and config["train.log_with"] == "['wandb']"  # the resolved config
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, list(run.tags), run.notes) == (
        "from-the-environment", "tiny-b8", ["tiny", "demo"], "a first try")


def test_mlflow_local_file_store_holds_the_scalars(demo, tmp_path, monkeypatch):
    import yaml

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TAGS"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    rows = _run_with(demo, out, ["mlflow"], "track.project=clip-sweep", "track.run_name=tiny-b8",
                     "track.tags=[tiny]", "track.notes='a first try'")
    files = list((out / "mlruns").glob("*/*/metrics/loss"))
    assert len(files) == 1, list((out / "mlruns").rglob("*"))[:20]
    logged = [(int(ln.split()[2]), float(ln.split()[1])) for ln in files[0].read_text().splitlines()]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    run = files[0].parent.parent
    assert (run / "params" / "optim.lr").read_text() == "0.001"
    assert yaml.safe_load((run.parent / "meta.yaml").read_text())["name"] == "clip-sweep"
    assert yaml.safe_load((run / "meta.yaml").read_text())["run_name"] == "tiny-b8"
    assert [(run / "tags" / t).read_text() for t in ("tiny", "mlflow.note.content")] == ["true", "a first try"]


def test_a_run_stopped_by_a_signal_closes_its_trackers(demo, tmp_path, monkeypatch, capsys):
    """SIGTERM at step 3 (a preemption): the trackers are closed before the run stops. TensorBoard's events hold
    every logged step, and the MLflow run is marked KILLED with an end time instead of staying RUNNING forever;
    the resumed run finishes and its own MLflow run is FINISHED."""
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import mmcl.training.step as step_mod
    from mmcl.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    real = sigterm_during_step(3, monkeypatch)
    out = tmp_path / "run"
    args = run_args(demo, out, "train.steps=5", "data.batch_size=8", "train.log_every=1", "train.save_every=0",
                    "data.workers=0", "train.log_with=[tensorboard, mlflow]")
    assert main(["train", *args]) == 75
    assert "preempted (SIGTERM) at step 3" in capsys.readouterr().err
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [r["step"] for r in metrics(out)] == [1, 2, 3]

    def statuses():
        metas = [yaml.safe_load(p.read_text()) for p in (out / "mlruns").glob("*/*/meta.yaml")]
        return sorted((m["status"], m["end_time"] is not None) for m in metas)

    from mlflow.entities import RunStatus

    assert statuses() == [(RunStatus.KILLED, True)]
    monkeypatch.setattr(step_mod, "forward_loss", real)
    assert main(["train", *args]) == 0
    assert statuses() == sorted([(RunStatus.KILLED, True), (RunStatus.FINISHED, True)])
