"""A CoCa model (`model.name coca_*`: open_clip's CoCa, mmcl's `CaptionCoCa`) through the training step: the
captioning term against open_clip's CoCaLoss on the same batch (loss and gradients), micro-batches (GradCache)
against the one large batch, negative captions from the data left out of the decoder, bf16 autocast against fp32,
two gloo processes against one, and the towers the decoder refuses."""

import os

import pytest
import torch
from open_clip.loss import CoCaLoss

from mmcl import models
from mmcl.config import LossConfig, load_config
from mmcl.errors import ConfigError
from mmcl.training.step import Step, forward_loss, objective_from_config

from spawned import end_worker, free_port, spawn

# coca_tiny with a 1000-token vocabulary: the decoder's logits stay small (fake batches' tokens are below 1000).
COCA = ["model.name=coca_tiny", "model.text_cfg={vocab_size: 1000}"]


def coca_model(seed=0, *extra):
    torch.manual_seed(seed)
    cfg = load_config(None, [*COCA, *extra]).model
    model, *_ = models.build(cfg)
    models.apply_locks(model, cfg)
    return model


def coca_batch(n, seed, context=32):
    """Images and captions of different lengths (zero padding after each), as the tokenizer gives them."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, 1000, (n, context), generator=g)
    for i in range(n):
        text[i, 3 + (5 * i) % (context - 4):] = 0
    return {"image": torch.randn(n, 3, 64, 64, generator=g), "text": text,
            "label": torch.full((n,), -1, dtype=torch.long)}


def _loss_cfg(**weights):
    return LossConfig(**{"clip": 1.0, **weights})


def _model_for(weights, seed=0):
    """SigLIP needs the model's logit bias (model.init_logit_bias)."""
    return coca_model(seed, "model.init_logit_bias=-10") if weights.get("siglip") else coca_model(seed)


def _accelerator(precision="no"):
    from accelerate import Accelerator

    return Accelerator(cpu=True, mixed_precision=precision)


def open_clip_coca(model, *extra):
    """open_clip's own CoCa class with `model`'s weights."""
    from open_clip.coca_model import CoCa

    cfg = load_config(None, [*COCA, *extra]).model
    model_cfg = dict(models.resolve_model_config(cfg))
    model_cfg.pop("custom_text")
    ref = CoCa(**model_cfg)
    ref.load_state_dict(model.state_dict())
    return ref


# coca_* (the decoder reads the attentional pooler's tokens) and a plain ViT's un-pooled patch tokens
@pytest.mark.parametrize("extra", [[], ["model.vision_cfg={attentional_pool: false}"]], ids=["coca", "plain_vit"])
def test_the_step_caption_term_equals_open_clip_coca_loss_with_its_gradients(extra):
    model = coca_model(0, *extra)
    ref_model = open_clip_coca(model, *extra)
    batch = coca_batch(6, seed=1)
    objective = objective_from_config(_loss_cfg(caption=2.0))
    loss, terms, _ = forward_loss(model, objective, [batch], _accelerator(), with_metrics=True)
    loss.backward()
    out = ref_model(batch["image"], batch["text"])  # open_clip's CoCa.forward
    clip_ref, caption_ref = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0)(
        out["image_features"], out["text_features"], out["logits"], out["labels"], out["logit_scale"])
    (clip_ref + caption_ref).backward()
    assert terms["loss/caption"] * 2.0 == pytest.approx(float(caption_ref.detach()), rel=1e-5)
    torch.testing.assert_close(loss, clip_ref + caption_ref, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in ref_model.named_parameters()}
    assert any(n.startswith("text_decoder.") for n in grads)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _step(model, loss_cfg, precision="no"):
    acc = _accelerator(precision)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    return Step(acc, model, acc.unwrap_model(model), optimizer, objective_from_config(loss_cfg), grad_clip=None,
                max_logit_scale=4.6052)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("weights", [{"caption": 1.0}, {"clip": 0.0, "siglip": 1.0, "caption": 0.5}])
def test_two_micro_batches_make_the_loss_and_update_of_the_one_large_batch(weights):
    big = coca_batch(10, seed=3)
    parts = [{k: v[:4] for k, v in big.items()}, {k: v[4:] for k, v in big.items()}]  # unequal token counts
    weights = {k: v for k, v in weights.items() if k != "bias"}
    one, two = _step(_model_for(weights), _loss_cfg(**weights)), _step(_model_for(weights), _loss_cfg(**weights))
    a, b = one([big], 1, True), two(parts, 1, True)
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-5)
    assert b.terms["loss/caption"] == pytest.approx(a.terms["loss/caption"], rel=1e-5)
    wa, wb = _weights(one.raw_model), _weights(two.raw_model)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-6, msg=k)


def test_negative_captions_from_the_data_are_not_decoded():
    """With data.negatives the text rows after the pairs are negative captions: the decoder reads only the pairs'
    rows, so the caption term is the one of the batch without negatives, and the decoder's logits have n rows."""
    model = coca_model()
    batch = coca_batch(6, seed=4)
    valid = torch.arange(2)[None, :] < (torch.arange(6) % 3)[:, None]
    with_neg = dict(batch, negatives_valid=valid, negatives=coca_batch(int(valid.sum()), seed=5)["text"])
    objective = objective_from_config(_loss_cfg(caption=1.0))
    _, terms, _ = forward_loss(model, objective, [with_neg], _accelerator(), with_metrics=True)
    _, plain, _ = forward_loss(model, objective, [batch], _accelerator(), with_metrics=True)
    assert terms["loss/caption"] == pytest.approx(plain["loss/caption"], rel=1e-6)
    assert terms["loss/clip"] > plain["loss/clip"] + 1e-4  # the negatives are in the contrastive term
    with torch.no_grad():
        out = model(batch["image"], torch.cat([batch["text"], with_neg["negatives"]]))
    assert out["logits"].shape[0] == out["labels"].shape[0] == 6


def test_bf16_autocast_is_within_tolerance_of_fp32(fresh_accelerate_state):
    model = coca_model()
    batch = coca_batch(6, seed=6)
    objective = objective_from_config(_loss_cfg(caption=1.0))
    _, full, _ = forward_loss(model, objective, [batch], _accelerator(), with_metrics=True)
    fresh_accelerate_state()
    _, low, _ = forward_loss(model, objective, [batch], _accelerator("bf16"), with_metrics=True)
    # bf16 keeps 8 bits of mantissa: the towers' and decoder's matmuls move the logits by ~1e-2 relative.
    assert float(low["loss/caption"]) == pytest.approx(float(full["loss/caption"]), rel=2e-2)
    assert float(low["loss/caption"]) != float(full["loss/caption"])


def _ddp_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    step = _step(coca_model(), _loss_cfg(caption=1.0))
    big = coca_batch(8, seed=7)
    rows = slice(0, 4) if rank == 0 else slice(4, 8)  # the ranks' captions count different numbers of tokens
    result = step([{k: v[rows] for k, v in big.items()}], 1, True)
    if rank == 0:
        torch.save({"loss": result.loss.detach(), "terms": result.terms, "weights": _weights(step.raw_model)},
                   out_path)
    end_worker()


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    out = tmp_path / "ddp.pt"
    spawn(_ddp_worker, args=(2, free_port(), str(out)), nprocs=2)
    got = torch.load(out, weights_only=True)
    one = _step(coca_model(), _loss_cfg(caption=1.0))
    want = one([coca_batch(8, seed=7)], 1, True)
    assert float(got["terms"]["loss/caption"]) == pytest.approx(want.terms["loss/caption"], rel=1e-5)
    wa = _weights(one.raw_model)
    for k, v in got["weights"].items():
        torch.testing.assert_close(v, wa[k], rtol=1e-4, atol=2e-6, msg=k)


@pytest.mark.parametrize("override, match", [
    ("model.text.hf=sentence-transformers/all-MiniLM-L6-v2", "not on a Hugging Face text tower"),
    ("model.vision_cfg={timm_model_name: naflexvit_base_patch16_siglip}", "not on a timm/NaFlex image tower"),
    ("model.embed_dim=32", r"needs embed_dim and text_cfg.width equal to it \(got embed_dim 32\)"),
    ("model.vision_cfg={attentional_pool: false, width: 96}",
     r"needs vision_cfg.width and text_cfg.width equal to it \(got vision_cfg.width 96\)"),
])
def test_a_decoder_on_another_tower_is_one_config_error(override, match):
    with pytest.raises(ConfigError, match=match):
        models.build(load_config(None, [*COCA, override]).model)


def test_loss_caption_on_a_model_without_a_decoder_is_one_config_error(small_demo, tmp_path, capsys):
    from mmcl.cli import main

    from helpers import short_run

    code = main(short_run(small_demo, tmp_path / "run", "loss.caption=1.0"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("mmcl: error: loss.caption needs a model with a captioning decoder (model.name coca_*")
    assert "Traceback" not in "\n".join(err)


def test_without_loss_caption_the_decoder_neither_runs_nor_trains(small_demo, tmp_path, capsys, monkeypatch):
    """A coca_* model trained with loss.caption 0 (its towers alone): no step runs the decoder, whose weights end
    as they started, and the run says so once."""
    from open_clip.transformer import MultimodalTransformer

    import mmcl
    from mmcl.cli import main

    from helpers import short_run

    calls = []
    forward = MultimodalTransformer.forward
    monkeypatch.setattr(MultimodalTransformer, "forward", lambda self, *a, **k: calls.append(1) or forward(
        self, *a, **k))
    assert main(short_run(small_demo, tmp_path / "run", "model.name=coca_tiny", "loss.caption=0",
                          "train.steps=3", towers=[])) == 0
    said = capsys.readouterr().out
    assert calls == []
    assert "loss.caption is 0: the captioning decoder (" in said and "does not run and is not trained" in said
    trained, *_ = mmcl.load(tmp_path / "run")
    torch.manual_seed(0)  # the run's seed: the model as it was built
    fresh, *_ = models.build(load_config(None, ["model.name=coca_tiny"]).model)
    for (name, got), want in zip(trained.text_decoder.state_dict().items(), fresh.text_decoder.state_dict().values()):
        assert torch.equal(got, want), name
    assert not torch.equal(trained.visual.conv1.weight, fresh.visual.conv1.weight)  # the towers did train


def test_a_model_that_stops_decoding_gives_the_same_features_loss_and_tower_gradients():
    from mmcl.models import stop_decoding

    batch = coca_batch(6, seed=2)
    objective = objective_from_config(_loss_cfg(clip=1.0))
    runs = []
    for decode in (True, False):
        model = coca_model(0)
        if not decode:
            assert stop_decoding(model) == sum(p.numel() for p in model.text_decoder.parameters())
        loss, _, _ = forward_loss(model, objective, [batch], _accelerator(), with_metrics=False)
        loss.backward()
        runs.append((loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b)
    assert not any(k.startswith("text_decoder.") for k in gb) and set(gb) == {k for k in ga if
                                                                              not k.startswith("text_decoder.")}
    for k, g in gb.items():
        torch.testing.assert_close(g, ga[k], rtol=0, atol=0, msg=k)


# ------------------------------------------------------------------ parallel prediction (loss.caption_parallel)
PARALLEL = torch.tensor([False, True, False, True, True, False])


def test_parallel_rows_are_open_clips_decoder_unmasked_on_the_mask_queries_and_the_others_unchanged():
    """CapPa's parallel prediction, in float64: a marked row's logits are open_clip's decoder run with no causal mask
    on the mask queries (the text tower's outputs of a padding row), the other rows open_clip's CoCa forward."""
    from mmcl.models.clip_classes import mask_queries

    model = coca_model().double().eval()
    batch = coca_batch(6, seed=7)
    image, text = batch["image"].double(), batch["text"]
    with torch.no_grad():
        got = model(image, text, caption_parallel=PARALLEL)
        plain = model(image, text)
        torch.testing.assert_close(got["logits"][~PARALLEL], plain["logits"][~PARALLEL], rtol=0, atol=0)
        assert torch.equal(got["labels"], plain["labels"])
        decoder = model.text_decoder
        causal = decoder.attn_mask.clone()
        decoder.attn_mask.zero_()  # open_clip's decoder, self-attention not causal
        _, embs = model._encode_image(image)
        queries = mask_queries(model, text.shape[1], text.shape[1] - 1, embs).expand(int(PARALLEL.sum()), -1, -1)
        want = decoder(embs[PARALLEL], queries)
        decoder.attn_mask.copy_(causal)
    torch.testing.assert_close(got["logits"][PARALLEL], want, rtol=1e-12, atol=1e-12)


def test_a_parallel_row_is_predicted_from_the_image_alone():
    """Changing a marked row's caption changes its labels but not its logits (no word of it reaches the decoder);
    changing its image does."""
    model = coca_model().eval()
    batch = coca_batch(6, seed=8)
    other = coca_batch(6, seed=9)
    with torch.no_grad():
        a = model(batch["image"], batch["text"], caption_parallel=PARALLEL)["logits"]
        b = model(batch["image"], other["text"], caption_parallel=PARALLEL)["logits"]
        c = model(other["image"], batch["text"], caption_parallel=PARALLEL)["logits"]
    assert torch.equal(a[PARALLEL], b[PARALLEL]) and not torch.equal(a[~PARALLEL], b[~PARALLEL])
    assert (a[PARALLEL] - c[PARALLEL]).abs().max() > 1e-4


def test_two_micro_batches_with_parallel_rows_make_the_update_of_the_one_large_batch():
    big = dict(coca_batch(10, seed=3), caption_parallel=torch.arange(10) % 3 == 0)
    parts = [{k: v[:4] for k, v in big.items()}, {k: v[4:] for k, v in big.items()}]
    weights = {"clip": 1.0, "caption": 1.0}
    one, two = _step(_model_for(weights), _loss_cfg(**weights)), _step(_model_for(weights), _loss_cfg(**weights))
    a, b = one([big], 1, True), two(parts, 1, True)
    plain = _step(_model_for(weights), _loss_cfg(**weights))([coca_batch(10, seed=3)], 1, True)
    assert b.terms["loss/caption"] == pytest.approx(a.terms["loss/caption"], rel=1e-5)
    assert abs(a.terms["loss/caption"] - plain.terms["loss/caption"]) > 1e-3  # the marks are in it
    wa, wb = _weights(one.raw_model), _weights(two.raw_model)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-6, msg=k)


def test_the_parallel_draw_is_a_function_of_seed_epoch_and_sample():
    from mmcl.data.batching import parallel_draw

    draws = [parallel_draw(0, 0, sid) for sid in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert sum(u < 0.75 for u in draws) / len(draws) == pytest.approx(0.75, abs=0.01)
    assert draws[:50] == [parallel_draw(0, 0, sid) for sid in range(50)]
    assert [parallel_draw(0, 1, sid) for sid in range(50)] != draws[:50]  # afresh each epoch
    assert [parallel_draw(1, 0, sid) for sid in range(50)] != draws[:50]


@pytest.mark.parametrize("extra,match", [
    (["loss.caption=1.0", "loss.caption_parallel=1.5"], r"loss.caption_parallel must be in \[0, 1\]"),
    (["loss.caption_parallel=0.5"], "set loss.caption > 0"),
])
def test_a_wrong_parallel_share_is_one_config_error(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*COCA, *extra])


def test_a_run_with_parallel_prediction_marks_its_batches_and_trains(small_demo, tmp_path, capsys, monkeypatch):
    """loss.caption_parallel=0.5 end to end: the batches carry the marks (about half), the decoder runs with them,
    and the losses are finite."""
    import json
    import math

    from mmcl.cli import main
    from mmcl.models import clip_classes

    from helpers import short_run

    seen = []
    decode = clip_classes.parallel_decode
    monkeypatch.setattr(clip_classes, "parallel_decode", lambda m, e, t, p, w: seen.append(p.clone()) or decode(
        m, e, t, p, w))
    assert main(short_run(small_demo, tmp_path / "run", "model.name=coca_tiny", "loss.caption=1.0",
                          "loss.caption_parallel=0.5", "train.steps=4", towers=[])) == 0
    capsys.readouterr()
    marks = torch.cat(seen)
    assert len(seen) == 4 and 0.2 < marks.float().mean() < 0.8
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss/caption"]) for r in rows if "loss/caption" in r)
