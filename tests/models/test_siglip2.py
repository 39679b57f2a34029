"""The model's side of SigLIP 2's second stage (`mmcl.models.siglip2`): the token path against open_clip's own
forward, crops against slices of the image, the schedule (nothing before the start, the teacher a copy of the student
at it), the teacher's average and centres, its state, GradCache against the one large batch, and two gloo processes
against one."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mmcl.config.schema import MaskedConfig, SelfDistillConfig
from mmcl.errors import ConfigError
from mmcl.models import siglip2
from mmcl.training.ema import WeightEMA

from helpers import fake_batch, micro_model
from spawned import end_worker, free_port, spawn


def _sections(start=0.5):
    sd = SelfDistillConfig(weight=1.0, start_fraction=start, prototypes=16, head_hidden=8, head_bottleneck=4,
                           local_crops=2, local_size=32, teacher_ema_decay=0.9)
    mk = MaskedConfig(weight=1.0, start_fraction=start, prototypes=12)
    return sd, mk


def _attach(model, total=4, world=1, rank=0, accum=1, start=0.5):
    sd, mk = _sections(start)
    return siglip2.attach(model, sd, mk, total, seed=3, rank=rank, world_size=world, accum_steps=accum,
                          make_ema=WeightEMA)


def test_the_token_path_is_open_clips_forward_and_a_mask_of_the_same_embedding_changes_nothing():
    model = micro_model().eval()
    x = torch.randn(3, 3, 64, 64)
    visual = model.visual
    visual.output_tokens = True
    pooled_ref, tokens_ref = visual(x)
    pooled, tokens = siglip2.vit_tokens(visual, x)
    torch.testing.assert_close(pooled, pooled_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tokens, tokens_ref, rtol=1e-5, atol=1e-6)
    # the mask token equal to the patch embedding at the masked place: the same output as no mask
    emb = visual.conv1(x[:1]).flatten(2).transpose(1, 2)[0]  # (P, width)
    same = siglip2.vit_tokens(visual, x[:1], torch.tensor([[5]]), emb[5])[1]
    torch.testing.assert_close(same, tokens_ref[:1], rtol=1e-5, atol=1e-5)
    differs = siglip2.vit_tokens(visual, x[:1], torch.tensor([[5, 9, 40]]), torch.zeros_like(emb[0]))[1]
    assert not torch.allclose(differs[0, 9], tokens_ref[0, 9], atol=1e-3)


def test_crops_are_the_boxes_of_their_draws():
    images = torch.randn(2, 3, 16, 16)
    whole = torch.tensor([[[0.3, 0.5, 0.2, 0.7, 0.9]], [[0.3, 0.5, 0.2, 0.7, 0.1]]])  # area 1, ratio 1; 2nd flipped
    crops = siglip2.local_crops(images, whole, 16, (1.0, 1.0))
    torch.testing.assert_close(crops[0], images[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(crops[1], images[1].flip(-1), rtol=0, atol=1e-5)
    corner = torch.tensor([[[0.0, 0.5, 0.0, 0.0, 0.9]]])  # a quarter of the area in the top-left corner
    crop = siglip2.local_crops(images[:1], corner, 8, (0.25, 0.25))
    torch.testing.assert_close(crop[0], images[0, :, :8, :8], rtol=0, atol=1e-5)


def test_before_the_start_the_forward_is_unchanged_and_nothing_runs():
    plain, model = micro_model(), micro_model()
    second = _attach(model, total=4, start=0.5)  # starts at step 2
    b = fake_batch(4, seed=1)
    second.begin_step(1, torch.device("cpu"))
    assert second.teacher is None
    out, ref = model(b["image"], b["text"]), plain(b["image"], b["text"])
    assert torch.equal(out["image_features"], ref["image_features"])
    assert out["self_distill_student"].shape == (4, 0, 0) and out["masked_teacher"].numel() == 0
    # the heads get a zero gradient, not none: DDP finds one for each, and AdamW counts their steps as in DDP
    out["image_features"].sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in second.heads.parameters())


def test_at_the_start_the_heads_are_fresh_the_teacher_is_the_student_and_the_draws_repeat():
    model = micro_model()
    second = _attach(model, total=4, start=0.5)
    with torch.no_grad():
        for p in second.heads.parameters():
            p.add_(1.0)  # moved by weight decay before the start, say
    second.begin_step(2, torch.device("cpu"))
    fresh = copy.deepcopy(second.heads)
    fresh.reset(3)
    for (name, p), q in zip(second.heads.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    student = dict(second.student.named_parameters())
    for name, p in second.teacher.named_parameters():
        assert torch.equal(p, student[name]) and not p.requires_grad, name
    b = fake_batch(4, seed=2)
    first = model(b["image"], b["text"])
    assert first["self_distill_student"].shape == (4, 2, 16) and first["masked_student"].shape == (4, 32, 12)
    second.begin_step(2, torch.device("cpu"))
    again = model(b["image"], b["text"])
    assert torch.equal(first["self_distill_student"], again["self_distill_student"])
    second.begin_step(3, torch.device("cpu"))
    other = model(b["image"], b["text"])
    assert not torch.equal(first["masked_student"], other["masked_student"])  # another step, other masks


def test_after_a_step_the_teacher_averages_and_the_centres_move_by_the_batch_mean():
    model = micro_model()
    second = _attach(model, total=2, start=0.0)
    second.begin_step(0, torch.device("cpu"))
    b = fake_batch(4, seed=3)
    out = model(b["image"], b["text"])
    with torch.no_grad():
        t_pooled, _ = siglip2.vit_tokens(second.teacher.visual, b["image"])
        t_logits = second.teacher.heads.image(t_pooled)
        for p in model.visual.parameters():
            p.add_(0.5)
    before = {n: p.clone() for n, p in second.teacher.named_parameters()}
    second.after_step()
    student = dict(second.student.named_parameters())
    for name, p in second.teacher.named_parameters():
        torch.testing.assert_close(p, 0.9 * before[name] + 0.1 * student[name])
    torch.testing.assert_close(second.centers["self_distill"], 0.1 * t_logits.mean(0), rtol=1e-5, atol=1e-7)
    assert out["self_distill_teacher"].sum(-1).allclose(torch.ones(4, 1))


def test_the_state_resumes_the_teacher_and_centres_exactly():
    model = micro_model()
    second = _attach(model, total=2, start=0.0)
    second.begin_step(0, torch.device("cpu"))
    b = fake_batch(4, seed=4)
    model(b["image"], b["text"])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    second.after_step()
    state = second.state_dict()
    copy_model = copy.deepcopy(model)
    copy_model._forward_hooks.clear()
    delattr(copy_model, siglip2.HEADS)
    again = _attach(copy_model, total=2, start=0.0)
    again.heads.load_state_dict(second.heads.state_dict())
    again.load_state_dict(state)
    for (n, p), q in zip(second.teacher.named_parameters(), again.teacher.parameters()):
        assert torch.equal(p, q), n
    for name in second.centers:
        assert torch.equal(second.centers[name], again.centers[name])
    second.begin_step(1, torch.device("cpu"))
    again.begin_step(1, torch.device("cpu"))
    x, y = model(b["image"], b["text"]), copy_model(b["image"], b["text"])
    for key in ("self_distill_teacher", "masked_teacher", "masked_student"):
        assert torch.equal(x[key], y[key]), key


def test_detach_leaves_the_students_clip():
    model = micro_model()
    keys = set(model.state_dict())
    second = _attach(model)
    assert any(k.startswith(siglip2.HEADS + ".") for k in model.state_dict())
    second.detach()
    assert set(model.state_dict()) == keys
    b = fake_batch(2, seed=5)
    assert "self_distill_student" not in model(b["image"], b["text"])


def test_a_tower_without_patch_tokens_is_refused_in_one_line():
    model = micro_model()
    model.visual = torch.nn.Linear(3, 3)
    with pytest.raises(ConfigError, match="need an open_clip ViT image tower"):
        _attach(model)


# ------------------------------------------------------------------------------------------------------ in a step
def _step(model, accum, world=1, rank=0):
    from accelerate import Accelerator

    from mmcl.config import LossConfig
    from mmcl.training.step import Step, objective_from_config

    second = _attach(model, total=2, start=0.0, accum=accum, world=world, rank=rank)
    acc = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = acc.prepare(model, optimizer)
    if world > 1:  # the gradients averaged over the gloo processes (this test's group, not accelerate's)
        prepared = DistributedDataParallel(model)
    sd, mk = _sections()
    cfg = LossConfig(clip=0.0, siglip=1.0, self_distill=sd, masked=mk)
    step = Step(acc, prepared, acc.unwrap_model(prepared), optimizer, objective_from_config(cfg), grad_clip=None,
                max_logit_scale=100.0, siglip2=second)
    return step, second


def _siglip_model():
    return micro_model(0, "model.init_logit_bias=-10.0")


def test_two_micro_batches_make_the_update_teacher_and_centres_of_the_one_large_batch():
    big = fake_batch(8, seed=6)
    halves = [{k: v[:4] for k, v in big.items()}, {k: v[4:] for k, v in big.items()}]
    (one, s1), (two, s2) = _step(_siglip_model(), 1), _step(_siglip_model(), 2)
    s1.begin_step(0, torch.device("cpu"))
    s2.begin_step(0, torch.device("cpu"))
    a, b = one([big], 1, True), two(halves, 1, True)
    assert a.terms["loss/self_distill"] > 0 and a.terms["loss/masked"] > 0
    for key in ("loss", "loss/self_distill", "loss/masked"):
        assert b.terms[key] == pytest.approx(a.terms[key], rel=1e-5), key
    wa, wb = one.raw_model.state_dict(), two.raw_model.state_dict()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-6)
    for name in s1.centers:
        torch.testing.assert_close(s2.centers[name], s1.centers[name], rtol=1e-5, atol=1e-7)
    for (n, p), q in zip(s1.teacher.named_parameters(), s2.teacher.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-6)


WORLD = 2


def _ddp_worker(rank, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    step, second = _step(_siglip_model(), 1, world=WORLD, rank=rank)
    big = fake_batch(8, seed=7)
    for s in range(2):  # step 0 before the terms start (step 1), step 1 at it: both paths under DDP
        second.starts = {k: 1 for k in second.starts}
        second.begin_step(s, torch.device("cpu"))
        step([{k: v[rank * 4:(rank + 1) * 4] for k, v in big.items()}], s + 1, False)
    torch.save({"weights": step.raw_model.state_dict(), "centers": second.centers,
                "teacher": dict(second.teacher.named_parameters())}, f"{path}/r{rank}.pt")
    end_worker()


@pytest.mark.slow
def test_two_processes_train_heads_teacher_and_centres_as_one(tmp_path):
    spawn(_ddp_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    step, second = _step(_siglip_model(), 1)
    big = fake_batch(8, seed=7)
    for s in range(2):
        second.starts = {k: 1 for k in second.starts}
        second.begin_step(s, torch.device("cpu"))
        step([big], s + 1, False)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"r{rank}.pt")
        for k, v in step.raw_model.state_dict().items():
            torch.testing.assert_close(got["weights"][k], v, rtol=1e-4, atol=2e-6)
        for k, v in second.centers.items():
            torch.testing.assert_close(got["centers"][k], v, rtol=1e-5, atol=1e-6)
        for k, v in second.teacher.named_parameters():
            torch.testing.assert_close(got["teacher"][k], v, rtol=1e-4, atol=2e-6)


# ------------------------------------------------------------------------------------------------------ in a run
SECOND_STAGE = ["loss.clip=0", "loss.siglip=1.0", "model.init_logit_bias=-10.0", "loss.self_distill.weight=1.0",
                "loss.self_distill.start_fraction=0.5", "loss.self_distill.prototypes=32",
                "loss.self_distill.head_hidden=16", "loss.self_distill.head_bottleneck=8",
                "loss.self_distill.local_crops=2", "loss.self_distill.teacher_ema_decay=0.8", "loss.masked.weight=1.0",
                "loss.masked.start_fraction=0.75", "loss.masked.prototypes=24"]
RECIPE = ["train.accum_steps=2", "data.batch_size=4", "train.ema_decay=0.7", "data.workers=2"]


def _train(demo, out, *extra):
    from mmcl.cli import main

    from helpers import run_args

    args = run_args(demo, out, "train.steps=8", "train.log_every=1", "train.save_every=1",
                    "train.keep_checkpoints=1", *SECOND_STAGE, *RECIPE, *extra)
    return main(["train", *args])


def _assert_same_end(reference, out):
    """The two runs end with bitwise the same weights, teacher average and centres."""
    from helpers import final_weights

    a, b = final_weights(reference), final_weights(out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ta, tb = _teacher_of(reference), _teacher_of(out)
    for k, v in ta["ema"]["shadow"].items():
        assert torch.equal(v, tb["ema"]["shadow"][k]), k
    for k, v in ta["centers"].items():
        assert torch.equal(v, tb["centers"][k]), k


def _teacher_of(run):
    from mmcl.run.resume import TEACHER
    from mmcl.storage.checkpoints import latest_checkpoint, load_plain, rank_state_file

    return load_plain(rank_state_file(latest_checkpoint(run / "checkpoints"), 0))[TEACHER]


@pytest.fixture(scope="module")
def reference(demo, tmp_path_factory):
    """An uninterrupted 8-step run: SigLIP alone for 4 steps, then self-distillation, from step 6 masked prediction
    too; with accumulation, a weight average and data workers."""
    out = tmp_path_factory.mktemp("second_stage") / "ref"
    assert _train(demo, out) == 0
    return out


@pytest.mark.slow
def test_a_run_logs_each_term_from_its_start_and_saves_the_students_clip(reference):
    from helpers import final_weights, metrics

    rows = [r for r in metrics(reference) if "loss" in r]
    assert [r["loss/self_distill"] > 0 for r in rows] == [False] * 4 + [True] * 4
    assert [r["loss/masked"] > 0 for r in rows] == [False] * 6 + [True] * 2
    assert not any(k.startswith(siglip2.HEADS) for k in final_weights(reference))
    import mmcl

    model, _, _ = mmcl.load(str(reference))  # the student's CLIP, loadable without training code
    assert not hasattr(model, siglip2.HEADS)


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [2, 4, 6], ids=["before", "boundary", "after"])
def test_a_run_stopped_before_at_or_after_the_start_resumes_exactly_teacher_included(demo, reference, tmp_path,
                                                                                      monkeypatch, stop_at, capsys):
    import mmcl.training.step as step_mod

    from preempt import sigterm_during_step

    out = tmp_path / "run"
    real = sigterm_during_step(stop_at, monkeypatch)
    assert _train(demo, out) == 75
    assert f"preempted (SIGTERM) at step {stop_at}" in capsys.readouterr().err
    monkeypatch.setattr(step_mod, "forward_loss", real)
    assert _train(demo, out) == 0
    _assert_same_end(reference, out)


def test_masked_prediction_alone_takes_the_head_sizes_and_decay_of_loss_self_distill():
    model = micro_model()
    sd, mk = _sections(start=0.0)
    sd = SelfDistillConfig(weight=0.0, head_hidden=8, head_bottleneck=4, teacher_ema_decay=0.5)
    second = siglip2.attach(model, sd, mk, 2, seed=0, make_ema=WeightEMA)
    assert second.heads.image is None and second.heads.patch.prototypes.weight.shape == (12, 4)
    second.begin_step(0, torch.device("cpu"))
    assert second.ema.decay == 0.5
    b = fake_batch(2, seed=8)
    out = model(b["image"], b["text"])
    assert out["masked_student"].shape == (2, 32, 12) and "self_distill_student" not in out


@pytest.mark.slow
def test_the_whole_recipe_with_the_decoder_resumes_exactly_across_the_start(demo, tmp_path, monkeypatch, capsys):
    """SigLIP 2's three terms on a CoCa (configs/siglip2.yaml's shape): captioning throughout, the second stage from
    step 5; a run stopped at its start (step 4) and resumed ends bit for bit as the uninterrupted one, decoder,
    teacher and centres included."""
    import mmcl.training.step as step_mod

    from helpers import final_weights
    from preempt import sigterm_during_step

    coca = ("model.name=coca_tiny", "model.embed_dim=64", "loss.caption=1.0")
    reference, out = tmp_path / "ref", tmp_path / "run"
    assert _train(demo, reference, *coca) == 0
    real = sigterm_during_step(4, monkeypatch)
    assert _train(demo, out, *coca) == 75
    assert "preempted (SIGTERM) at step 4" in capsys.readouterr().err
    monkeypatch.setattr(step_mod, "forward_loss", real)
    assert _train(demo, out, *coca) == 0
    assert any(k.startswith("text_decoder.") for k in final_weights(reference))
    _assert_same_end(reference, out)


@pytest.mark.slow
def test_a_compiled_run_across_the_start_gives_the_eager_runs_losses(demo, reference, tmp_path, monkeypatch):
    """``train.compile`` with the second stage's forward hook (its Python state: which terms run, the step's draws,
    the micro-batch turn): dynamo traces the hooked model (the eager backend, so the numbers are eager kernels' and
    any difference is what tracing got wrong), and every step's losses, before and after each term's start, are the
    uncompiled reference run's."""
    from helpers import metrics

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda module, **kw: real_compile(module, backend="eager"))
    assert _train(demo, tmp_path / "compiled", "train.compile=true") == 0
    want = [r for r in metrics(reference) if "loss" in r]
    got = [r for r in metrics(tmp_path / "compiled") if "loss" in r]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        for key in ("loss", "loss/siglip", "loss/self_distill", "loss/masked"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert [r["loss/masked"] > 0 for r in got] == [False] * 6 + [True] * 2
