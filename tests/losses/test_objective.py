"""The weighted objective (`ContrastiveObjective`, built by `objective_from_config`): its terms and metrics, the
config keys it reads, its state (MoCHi's queues and generator) and a training step through it; and what every loss
shares: the `Gathered` keyword, the input checks and their errors, float32 logits for half inputs, imports of torch
and nothing else of mmcl."""

import dataclasses
import math

import pytest
import torch

from mmcl import losses
from mmcl.config import LossConfig, MochiConfig
from mmcl.errors import ConfigError
from mmcl.losses import (
    Gathered,
    LossInputError,
    align_loss,
    clip_loss,
    debiased_clip_loss,
    hard_negative_clip_loss,
    mochi_loss,
    siglip_loss,
    supcon_loss,
    uniform_loss,
)
from mmcl.training.step import objective_from_config

from helpers import fresh_leaves, pair_features


def test_objective_clip_terms_and_metrics():
    img, txt = pair_features(32, 16, torch.float32, seed=8)
    s = torch.tensor(14.0, requires_grad=True)
    obj = objective_from_config(LossConfig(clip=1.0, align=0.5))
    total, terms = obj(img, txt, s)
    expected_clip = clip_loss(img, txt, s)
    expected_align = align_loss(img, txt)
    torch.testing.assert_close(total, expected_clip + 0.5 * expected_align, rtol=1e-6, atol=0)  # float32 sum
    assert set(terms) == {"loss", "loss/clip", "loss/align", "align", "uniform_image", "uniform_text"}
    assert all(isinstance(v, float) for v in terms.values())
    assert terms["loss/clip"] == pytest.approx(expected_clip.item(), rel=1e-6)
    assert terms["align"] == pytest.approx(expected_align.item(), rel=1e-6)
    assert terms["uniform_image"] == pytest.approx(uniform_loss(img.double()).item(), rel=1e-5)
    assert terms["uniform_text"] == pytest.approx(uniform_loss(txt.double()).item(), rel=1e-5)
    total.backward()
    assert s.grad is not None and torch.isfinite(s.grad)


def test_objective_without_metrics_skips_them_and_keeps_the_loss():
    """``with_metrics=False`` (steps that are not logged) leaves out the pairwise metrics and the host read of the
    terms; loss and terms agree."""
    img, txt = pair_features(32, 16, torch.float32, seed=9)
    s = torch.tensor(14.0)
    obj = objective_from_config(LossConfig(clip=1.0, align=0.5))
    full_total, full = obj(img, txt, s, with_metrics=True)
    total, terms = obj(img, txt, s, with_metrics=False)
    assert set(terms) == {"loss", "loss/clip", "loss/align"}
    assert "uniform_image" in full
    assert total.item() == full_total.item()
    # Left on the device (no host read on the steps a trainer does not log), equal to the logged numbers.
    assert all(isinstance(terms[k], torch.Tensor) and terms[k].dim() == 0 for k in terms)
    assert all(terms[k].item() == pytest.approx(full[k], rel=1e-6, abs=0) for k in terms)


def test_objective_tiled_matches_dense_and_uses_the_scale_as_given():
    """The objective applies no limit of its own to the scale (the model's parameter is clamped after each
    optimiser step, `models.clamp_logit_scale`, by ``model.max_logit_scale``, 100): a scale of 150 is used as 150."""
    assert "max_logit_scale" not in {f.name for f in dataclasses.fields(LossConfig)}  # the model's key, not a loss's
    img, txt = pair_features(40, 8, torch.float32, seed=9)
    dense = objective_from_config(LossConfig(chunk_size=None))
    tiled = objective_from_config(LossConfig(chunk_size=16))
    s = torch.tensor(150.0)
    ld, _ = dense(img, txt, s)
    lt, _ = tiled(img, txt, s)
    torch.testing.assert_close(ld, clip_loss(img, txt, torch.tensor(150.0)), rtol=0, atol=0)
    assert ld.item() != clip_loss(img, txt, torch.tensor(100.0)).item()
    torch.testing.assert_close(lt, ld, rtol=1e-5, atol=0)  # float32 tiled vs dense


def test_objective_state_dict_resumes_mochi_exactly():
    cfg = LossConfig(clip=1.0, mochi=MochiConfig(weight=0.5, n_hard=4, s=3, s_prime=2, queue_size=16))
    batches = [pair_features(8, 6, torch.float32, seed=30 + i) for i in range(4)]
    s = torch.tensor(10.0)
    run = objective_from_config(cfg)
    run.reseed(7)
    losses = [run(*b, s)[1]["loss/mochi"] for b in batches]
    half = objective_from_config(cfg)
    half.reseed(7)
    for b in batches[:2]:
        half(*b, s)
    state = half.state_dict()
    assert "image_queue.features" in state and "text_queue.features" in state and len(half.text_queue) == 16
    resumed = objective_from_config(cfg)
    resumed.load_state_dict(state)
    after = [resumed(*b, s)[1]["loss/mochi"] for b in batches[2:]]
    assert after == losses[2:]  # queue and generator both restored: bit-identical continuation
    assert losses[2] != objective_from_config(cfg)(*batches[2], s)[1]["loss/mochi"]  # the queue mattered


def test_objective_eval_mode_does_not_enqueue():
    cfg = LossConfig(mochi=MochiConfig(weight=1.0, n_hard=2, s=1, s_prime=1, queue_size=8))
    obj = objective_from_config(cfg).eval()
    obj(*pair_features(4, 3), torch.tensor(5.0))
    assert len(obj.image_queue) == 0


def test_objective_all_terms():
    cfg = LossConfig(clip=1.0, supcon=0.5, siglip=0.25, align=0.1, uniform=0.2, debiased=0.3, tau_plus=0.1,
                     hard_negative=0.4, hn_beta=0.5, chunk_size=5,
                     mochi=MochiConfig(weight=0.7, n_hard=4, s=2, s_prime=2, queue_size=0))
    img, txt = pair_features(12, 8, torch.float64, seed=40)
    s, b = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-5.0, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, -1, 2, 2, 2, 3, -1, 4, 5, 1])
    obj = objective_from_config(cfg)
    obj.reseed(1)
    total, terms = obj(img, txt, s, b, labels)
    expected = {
        "clip": clip_loss(img, txt, s),
        "supcon": supcon_loss(img, txt, labels, s),
        "siglip": siglip_loss(img, txt, s, b),
        "align": align_loss(img, txt),
        "uniform": (uniform_loss(img) + uniform_loss(txt)) / 2,
        "debiased": debiased_clip_loss(img, txt, s, 0.1),
        "hard_negative": hard_negative_clip_loss(img, txt, s, 0.1, 0.5),
        "mochi": mochi_loss(img, txt, s, 4, 2, 2, 0.5, torch.Generator().manual_seed(1)),
    }
    weights = {"clip": 1.0, "supcon": 0.5, "siglip": 0.25, "align": 0.1, "uniform": 0.2, "debiased": 0.3,
               "hard_negative": 0.4, "mochi": 0.7}
    for name, value in expected.items():
        assert terms[f"loss/{name}"] == pytest.approx(value.item(), rel=1e-10), name  # float64, tiled vs dense
    torch.testing.assert_close(total, sum(weights[k] * v for k, v in expected.items()), rtol=1e-10, atol=0)
    assert terms["loss"] == pytest.approx(total.item(), rel=1e-12)


def test_objective_terms_are_one_table_read_through_the_config_keys():
    """The objective's terms are one table (a row per term: name, needed inputs, computation), the one home of the
    term list; training reads each weight through its config key and a term's own section (``loss.mochi``) as the
    objective's keywords."""
    from mmcl.config import term_keys
    from mmcl.losses.objective import TABLE

    assert tuple(row.name for row in TABLE) == losses.TERMS == tuple(term_keys())
    assert term_keys()["mochi"] == "loss.mochi.weight"
    obj = objective_from_config(LossConfig(clip=0.0, mochi=MochiConfig(weight=0.5, n_hard=7, s=3, s_prime=2,
                                                                       mix_max=0.25, queue_size=12)))
    assert obj.weights["mochi"] == 0.5 and obj.active_terms() == ["mochi"]
    assert (obj.n_hard, obj.s, obj.s_prime, obj.mix_max, obj.image_queue.size) == (7, 3, 2, 0.25, 12)


def test_objective_input_errors_and_config_checks():
    """The objective rejects inputs it cannot take (LossInputError); loss settings are checked by the config's
    validation, every problem at once."""
    from mmcl.config import TrainConfig, validate

    with pytest.raises(LossInputError, match="logit bias"):
        objective_from_config(LossConfig(clip=0.0, siglip=1.0))(*pair_features(4, 3), torch.tensor(1.0))
    with pytest.raises(LossInputError, match="unknown loss terms"):
        losses.ContrastiveObjective({"clip": 1.0, "clap": 1.0})
    problems = validate(TrainConfig(loss=LossConfig(clip=0.0, siglip=1.0, debiased=1.0, tau_plus=1.0)))
    assert any("logit bias" in p for p in problems) and any("tau_plus" in p for p in problems)
    assert any("no loss term" in p for p in validate(TrainConfig(loss=LossConfig(clip=0.0))))
    problems = validate(TrainConfig(loss=LossConfig(mochi=MochiConfig(weight=1.0, n_hard=0)), ))
    assert any("loss.mochi needs" in p for p in problems)
    with pytest.raises(ConfigError, match="tau_plus.*hn_beta|hn_beta.*tau_plus"):
        from mmcl.config import load_config

        load_config(None, ["loss.hard_negative=1.0", "loss.tau_plus=1.5", "loss.hn_beta=-1"])


def test_objective_chunk_size_reaches_every_tiled_term():
    """loss.chunk_size tiles clip, siglip and MoCHi inside the objective without changing the numbers."""
    img, txt = pair_features(24, 8, torch.float64, seed=31, correlated=False)
    s, b = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-5.0, dtype=torch.float64)
    kw = dict(clip=1.0, siglip=0.5, mochi=MochiConfig(weight=0.5, n_hard=4, s=3, s_prime=2, queue_size=0))
    dense, tiled = objective_from_config(LossConfig(**kw)), objective_from_config(LossConfig(chunk_size=5, **kw))
    dense.reseed(0)
    tiled.reseed(0)
    (a_loss, a_terms), (c_loss, c_terms) = dense(img, txt, s, b), tiled(img, txt, s, b)
    torch.testing.assert_close(c_loss, a_loss, rtol=1e-12, atol=1e-12)
    for name in ("clip", "siglip", "mochi"):
        torch.testing.assert_close(c_terms[f"loss/{name}"], a_terms[f"loss/{name}"], rtol=1e-12, atol=1e-12)


def _mochi_cfg(chunk):
    return LossConfig(clip=0.0, chunk_size=chunk,
                      mochi=MochiConfig(weight=1.0, n_hard=8, s=4, s_prime=2, mix_max=0.5, queue_size=12))


@pytest.mark.parametrize("chunk", [None, 5])
def test_objective_with_queue_backward_after_enqueue(chunk):
    """forward (which enqueues the batch) then backward: the queue tensor the loss used must be left intact, and
    the gradient equals that of the loss against a copy of the queue taken before the step."""
    obj = objective_from_config(_mochi_cfg(chunk)).train()
    s = torch.tensor(10.0)
    for step in range(3):  # the queue fills (8 of 12), then wraps around
        img, txt = fresh_leaves(*pair_features(8, 6, torch.float32, seed=60 + step), s)[:2]
        iq, tq = (None if q is None else q.clone() for q in (obj.image_queue.get(), obj.text_queue.get()))
        state = obj.generator.get_state()
        total, _ = obj(img, txt, s)
        total.backward()
        a = fresh_leaves(img, txt)
        ref = mochi_loss(a[0], a[1], s, 8, 4, 2, 0.5, torch.Generator().set_state(state), iq, tq, chunk_size=chunk)
        ref.backward()
        torch.testing.assert_close(total, ref, rtol=0, atol=0)
        torch.testing.assert_close(img.grad, a[0].grad, rtol=0, atol=0)
        torch.testing.assert_close(txt.grad, a[1].grad, rtol=0, atol=0)
    assert len(obj.image_queue) == 12


@pytest.mark.parametrize("chunk", [None, 4])
def test_train_step_with_mochi_queue_backpropagates(chunk):
    from accelerate import Accelerator

    from mmcl import models
    from mmcl.config import load_config
    from mmcl.training.step import backward, forward_loss

    torch.manual_seed(0)
    model_cfg = load_config(None, ["model.vision_cfg={layers: 1, width: 32, head_width: 16}",
                                   "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]).model
    model, *_ = models.build(model_cfg)
    acc = Accelerator(cpu=True)
    obj = objective_from_config(_mochi_cfg(chunk)).train()
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        batch = {"image": torch.randn(6, 3, 64, 64, generator=g), "text": torch.randint(1, 1000, (6, 32), generator=g),
                 "label": torch.full((6,), -1, dtype=torch.long)}
        model.zero_grad()
        loss, terms, cache = forward_loss(model, obj, [batch], acc)
        # raised "modified by an inplace operation" once the queue held a batch
        backward(acc, model, loss, [batch], cache)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(gr).all() for gr in grads) and math.isfinite(terms["loss/mochi"])
    assert len(obj.text_queue) == 12


# ---------------------------------------------------------------------- what every loss shares


def test_bad_inputs_raise_clear_errors():
    img, txt = pair_features(4, 3)
    with pytest.raises(LossInputError, match="same shape"):
        clip_loss(img, txt[:3], torch.tensor(1.0))
    with pytest.raises(LossInputError, match="chunk_size"):
        clip_loss(img, txt, torch.tensor(1.0), chunk_size=0)
    with pytest.raises(LossInputError, match="offset"):
        clip_loss(img[:2], txt[:2], torch.tensor(1.0), gathered=Gathered(img, txt, offset=3))
    with pytest.raises(LossInputError, match="need both all_image_features and all_text_features"):
        clip_loss(img[:2], txt[:2], torch.tensor(1.0), gathered=Gathered(None, txt))
    with pytest.raises(LossInputError, match=r"gathered features must be \(M, 3\)"):
        clip_loss(img[:2], txt[:2], torch.tensor(1.0), gathered=Gathered(img, txt[:, :2]))


def test_losses_take_the_gathered_batch_as_one_object():
    """Every loss with a distributed layout takes the global batch's columns, their labels, the teacher's columns
    and this rank's offset as one `Gathered` (keyword ``gathered``), not as separate arguments."""
    import inspect

    from mmcl.losses import distill_loss

    separate = {"all_image_features", "all_text_features", "all_labels", "offset", "all_teacher_image",
                "all_teacher_text"}
    for fn in (clip_loss, supcon_loss, siglip_loss, debiased_clip_loss, hard_negative_clip_loss, mochi_loss,
               distill_loss):
        params = inspect.signature(fn).parameters
        assert params["gathered"].kind is inspect.Parameter.KEYWORD_ONLY, fn.__name__
        assert not separate & set(params), fn.__name__


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_losses_build_logits_in_float32_for_half_inputs(dtype):
    img, txt = pair_features(64, 32, dtype, seed=52)
    s = torch.tensor(100.0, dtype=dtype)
    labels = torch.tensor([0, 1, 2, -1] * 16)
    f64 = dict(image_features=img.double(), text_features=txt.double(), logit_scale=s.double())
    half = dict(image_features=img, text_features=txt, logit_scale=s)
    cases = [
        (clip_loss, {}),
        (supcon_loss, {"labels": labels}),
        (hard_negative_clip_loss, {"tau_plus": 0.1, "beta": 1.0}),
        (debiased_clip_loss, {"tau_plus": 0.1}),
    ]
    for fn, kw in cases:
        for chunk in (None, 16):
            got = fn(**half, **kw, chunk_size=chunk)
            ref = fn(**f64, **kw)
            assert got.dtype == torch.float32
            # Same rounded inputs: float32 logits of size <= 100 carry ~100 * 2^-24 each.
            assert abs(got.item() - ref.item()) <= 2e-5 * max(1.0, abs(ref.item())), (fn.__name__, chunk)
    got = mochi_loss(img, txt, s, 8, 4, 2, 0.5, torch.Generator().manual_seed(0))
    ref = mochi_loss(img.double(), txt.double(), s.double(), 8, 4, 2, 0.5, torch.Generator().manual_seed(0))
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 2e-5 * max(1.0, abs(ref.item()))
    for fn in (uniform_loss, lambda x: align_loss(x, txt)):
        got, ref = fn(img), fn(img.double()) if fn is uniform_loss else align_loss(img.double(), txt.double())
        assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))


def test_the_losses_import_torch_and_nothing_else_of_mmcl():
    """Layering: every module of mmcl/losses imports only the standard library, torch and its own package."""
    import ast
    import sys
    from pathlib import Path

    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    for path in sorted((Path(losses.__file__).parent).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:  # from .x import ...: inside mmcl.losses
                    continue
                assert node.level == 0, f"{path.name} imports from outside mmcl.losses: {ast.unparse(node)}"
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_a_new_term_is_one_row_of_the_table(monkeypatch):
    """A toy term registered the way a new one is (its function and one row of `objective.TABLE`) is computed, weighted
    and logged by the objective like the others; the config side is its weight in `LossConfig` (not needed here,
    where the objective is built from numbers)."""
    from mmcl.losses import objective as objective_mod

    def toy_loss(image, text):  # mean squared distance of the pairs, float64 reference below
        return (image.float() - text.float()).pow(2).sum(1).mean()

    row = objective_mod.Term("toy", (), lambda o, x: toy_loss(x.image, x.text))
    monkeypatch.setattr(objective_mod, "TABLE", objective_mod.TABLE + (row,))
    monkeypatch.setattr(objective_mod, "TERMS", objective_mod.TERMS + ("toy",))
    img, txt = pair_features(8, 16, seed=3)
    scale = torch.tensor(10.0)
    obj = objective_mod.ContrastiveObjective({"clip": 1.0, "toy": 0.5})
    total, terms = obj(img, txt, scale)
    expected_toy = (img.double() - txt.double()).pow(2).sum(1).mean()
    assert terms["loss/toy"] == pytest.approx(float(expected_toy), rel=1e-6)
    assert float(total) == pytest.approx(terms["loss/clip"] + 0.5 * float(expected_toy), rel=1e-6)


def test_the_configs_term_names_are_the_tables():
    """The config reads the terms' names without importing torch (`mmcl.config.LOSS_TERMS`): they are the table's, in
    its order, and the terms that score a varying number of pairs are the same two."""
    from mmcl.config import schema

    assert schema.LOSS_TERMS == losses.TERMS
    assert schema.VARIABLE_PAIR_TERMS == losses.VARIABLE_PAIR_TERMS
