"""Distillation: the KL term against a float64 formula (dense and tiled, scales 1-100, aligned and random features,
half precision), its distributed and GradCache forms, and a teacher in the training loop (its own preprocessing,
never saved, exact resume, one-line errors)."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmcl.config import LossConfig, load_config
from mmcl.losses import ContrastiveObjective, TeacherFeatures, distill_loss
from mmcl.training.step import backward, forward_loss, objective_from_config

from helpers import fake_batch, final_weights, grads_of, metrics, micro_model, run_args
from preempt import sigterm_during_step
from spawned import end_worker, spawn
from spawned import free_port as _free_port


def reference(img, txt, scale, t_img, t_txt, t_scale):
    """The definition in float64: mean over rows of sum_j p_t (log p_t - log p_s), both directions averaged."""
    s = scale * img.double() @ txt.double().T
    t = t_scale * t_img.double() @ t_txt.double().T

    def kl(s, t):
        return (F.softmax(t, 1) * (F.log_softmax(t, 1) - F.log_softmax(s, 1))).sum(1).mean()

    return (kl(s, t) + kl(s.T, t.T)) / 2


def features(n, d, align, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    a = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    noise = {"random": None, "aligned": 0.3, "duplicate": 1e-3}[align]
    b = (F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1) if noise is None
         else F.normalize(a + noise * torch.randn(n, d, generator=g, dtype=torch.float64), dim=1))
    return a.to(dtype), b.to(dtype)


def check_against_reference(n, d, dt, chunk, scale, t_scale, align, t_align, dtype, seed):
    img, txt = features(n, d, align, seed, dtype)
    t_img, t_txt = features(n, dt, t_align, seed + 1, torch.float32)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    s = torch.tensor(scale, dtype=torch.float32 if dtype != torch.float64 else dtype, requires_grad=True)
    value = distill_loss(img, txt, s, t_img, t_txt, torch.tensor(t_scale), chunk)
    value.backward()
    ref_img, ref_txt = img.detach().double().requires_grad_(True), txt.detach().double().requires_grad_(True)
    ref_s = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    ref = reference(ref_img, ref_txt, ref_s, t_img, t_txt, t_scale)
    ref.backward()
    # float32 logits at scale s carry ~s * 6e-8 error each (the teacher's at its own scale); KL and its gradients
    # inherit that, relative to 1
    worst = max(scale, t_scale)
    tol = {torch.float64: 1e-10, torch.float32: 4e-6 * worst, torch.bfloat16: 4e-6 * worst,
           torch.float16: 4e-6 * worst}[dtype]
    assert value.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert abs(value.item() - ref.item()) <= tol * max(1.0, abs(ref.item()))
    grad_tol = tol if dtype in (torch.float64, torch.float32) else 1e-2  # gradients rounded to the input's dtype
    for got, want in ((img.grad, ref_img.grad), (txt.grad, ref_txt.grad)):
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max().item() <= grad_tol * max(1.0, want.abs().max().item())
    assert abs(s.grad.item() - ref_s.grad.item()) <= tol * max(1.0, abs(ref_s.grad.item())) * (100 if dtype in (
        torch.bfloat16, torch.float16) else 1)


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("scale,t_scale,align", [(100.0, 100.0, "aligned"), (100.0, 30.0, "duplicate"),
                                                 (14.3, 100.0, "random"), (1.0, 1.0, "random")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_dense_and_tiled_kl_equal_the_float64_definition(chunk, scale, t_scale, align, dtype):
    """Including logit scale 100 with aligned and near-duplicate pairs (a trained model's regime), teacher and
    student of different widths and scales, and half-precision student features (computed in float32)."""
    check_against_reference(45, 16, 24, chunk, scale, t_scale, align, "aligned", dtype, seed=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 80), d=st.integers(2, 24), dt=st.integers(2, 24),
       chunk=st.one_of(st.none(), st.integers(1, 33)),
       scale=st.floats(1.0, 100.0), t_scale=st.floats(1.0, 100.0),
       align=st.sampled_from(["random", "aligned", "duplicate"]), t_align=st.sampled_from(["random", "aligned"]),
       seed=st.integers(0, 2**16))
def test_kl_property_any_shape_chunk_and_scale(n, d, dt, chunk, scale, t_scale, align, t_align, seed):
    check_against_reference(n, d, dt, chunk, scale, t_scale, align, t_align, torch.float32, seed)


def test_kl_is_zero_for_the_teacher_itself_and_gradcheck():
    img, txt = features(20, 8, "aligned", 0)
    s = torch.tensor(50.0, dtype=torch.float64)
    for chunk in (None, 6):
        assert distill_loss(img, txt, s, img, txt, s, chunk).item() == pytest.approx(0.0, abs=1e-12)
    img, txt = features(9, 5, "random", 1)
    t_img, t_txt = features(9, 7, "aligned", 2)
    for chunk in (None, 4):
        args = (img.clone().requires_grad_(True), txt.clone().requires_grad_(True),
                torch.tensor(7.0, dtype=torch.float64, requires_grad=True))
        assert torch.autograd.gradcheck(lambda a, b, s: distill_loss(a, b, s, t_img, t_txt, torch.tensor(20.0), chunk),
                                        args)


def test_tiled_kl_never_forms_the_n_by_n_matrix():
    """Memory linear in N: with chunk 64 at N = 1024, no tensor of N x N elements is allocated in forward or
    backward (the dense path allocates several)."""
    img, txt = features(1024, 16, "aligned", 0, torch.float32)
    t_img, t_txt = features(1024, 16, "aligned", 1, torch.float32)
    sizes = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    sizes.append(t.numel())
            return out

    for chunk in (None, 64):
        sizes.clear()
        a, b = img.clone().requires_grad_(True), txt.clone().requires_grad_(True)
        with Spy():
            distill_loss(a, b, torch.tensor(100.0), t_img, t_txt, torch.tensor(50.0), chunk).backward()
        if chunk is None:
            assert max(sizes) >= 1024 * 1024
        else:
            assert max(sizes) < 1024 * 1024 // 2, max(sizes)


def test_the_objective_needs_the_teacher_for_the_term():
    from mmcl.losses import LossInputError

    img, txt = features(6, 4, "aligned", 0, torch.float32)
    obj = ContrastiveObjective({"clip": 1.0, "distill": 0.5})
    with pytest.raises(LossInputError, match="distill term needs the teacher"):
        obj(img, txt, torch.tensor(10.0))
    total, terms = obj(img, txt, torch.tensor(10.0), teacher=TeacherFeatures(img, txt, torch.tensor(10.0)))
    assert terms["loss/distill"] == pytest.approx(0.0, abs=1e-6)
    assert total.item() == pytest.approx(terms["loss/clip"], rel=1e-6)


# ------------------------------------------------------------------------------------- distributed
def _kl_worker(rank, world, port, out_path, chunk):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from mmcl.losses import gather_batch

    img, txt = features(12, 8, "aligned", 0, torch.float32)
    t_img, t_txt = features(12, 6, "aligned", 1, torch.float32)
    n = 12 // world
    rows = slice(rank * n, (rank + 1) * n)
    a, b = img[rows].clone().requires_grad_(True), txt[rows].clone().requires_grad_(True)
    s = torch.tensor(60.0, requires_grad=True)
    teacher = TeacherFeatures(t_img[rows], t_txt[rows], torch.tensor(80.0))
    obj = ContrastiveObjective({"distill": 1.0}, chunk_size=chunk)
    gathered = gather_batch(a, b, None, teacher=teacher)
    loss, terms = obj(a, b, s, gathered=gathered, teacher=teacher)
    loss.backward()
    # DDP would average the scale's gradient over ranks; the features' gradients are each rank's own rows.
    grads = [torch.empty(12, 8) for _ in range(2)]
    for g, x in zip(grads, (a.grad, b.grad)):
        parts = [torch.empty_like(x) for _ in range(world)]
        torch.distributed.all_gather(parts, x.contiguous())
        g.copy_(torch.cat(parts) / world)
    s_grad = s.grad.clone()
    torch.distributed.all_reduce(s_grad)
    if rank == 0:
        torch.save({"loss": terms["loss/distill"], "img": grads[0], "txt": grads[1], "s": s_grad / world}, out_path)
    end_worker()


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 4])
def test_two_processes_give_the_single_process_loss_and_gradients(tmp_path, chunk):
    out = tmp_path / "kl.pt"
    spawn(_kl_worker, args=(2, _free_port(), str(out), chunk), nprocs=2)
    got = torch.load(out)
    img, txt = features(12, 8, "aligned", 0, torch.float32)
    t_img, t_txt = features(12, 6, "aligned", 1, torch.float32)
    a, b = img.clone().requires_grad_(True), txt.clone().requires_grad_(True)
    s = torch.tensor(60.0, requires_grad=True)
    value = distill_loss(a, b, s, t_img, t_txt, torch.tensor(80.0), chunk)
    value.backward()
    assert got["loss"] == pytest.approx(value.item(), rel=1e-5)
    torch.testing.assert_close(got["img"], a.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got["txt"], b.grad, rtol=1e-4, atol=1e-6)
    assert got["s"].item() == pytest.approx(s.grad.item(), rel=1e-4, abs=1e-7)


# ----------------------------------------------------------------------------------- in the loop
class _FakeTeacher:
    """A teacher of another width and scale for the unit-level GradCache check: a fixed linear map of the
    teacher-view pixels and tokens."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.wi, self.wt = torch.randn(3 * 8 * 8, 12, generator=g), torch.randn(40, 12, generator=g)

    def embed(self, images, tokens):
        image = F.normalize(F.adaptive_avg_pool2d(images.float(), 8).flatten(1) @ self.wi, dim=1)
        text = F.normalize(F.one_hot(tokens[:, :4] % 10, 10).float().flatten(1) @ self.wt, dim=1)
        return TeacherFeatures(image, text, torch.tensor(40.0))


def test_accumulation_with_a_teacher_equals_the_large_batch():
    """GradCache with distillation: 2 micro-batches of 6 give the loss and gradients of one batch of 12, the
    teacher's logits over all 12 included."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    objective = objective_from_config(LossConfig(clip=1.0, distill=2.0))
    big = _teacher_batch()
    halves = [{k: v[:6] for k, v in big.items()}, {k: v[6:] for k, v in big.items()}]
    teacher = _FakeTeacher()
    results = []
    for batches in ([big], halves):
        model = micro_model()
        loss, terms, cache = forward_loss(model, objective, batches, acc, None, True, teacher)
        backward(acc, model, loss, batches, cache)
        results.append((loss.item(), terms, grads_of(model)))
    (l1, t1, g1), (l2, t2, g2) = results
    assert t1["loss/distill"] > 0.01 and t2["loss/distill"] == pytest.approx(t1["loss/distill"], rel=1e-5)
    assert l2 == pytest.approx(l1, rel=1e-5)
    for name in g1:
        # float32 sums in another order: the token embedding's gradient adds up every occurrence of a token (up
        # to |g| ~ 30 here), so its absolute noise follows the tensor's scale, not 1
        atol = 1e-6 * max(1.0, g1[name].abs().max().item())
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=atol, msg=name)


@pytest.fixture(scope="module")
def teacher_run(demo, tmp_path_factory):
    """A small teacher trained on the demo data with another image size and context length than the student."""
    from mmcl.cli import main

    out = tmp_path_factory.mktemp("teacher") / "run"
    args = run_args(demo, out, "train.steps=6", "data.batch_size=16", "train.save_every=0", "data.workers=0",
                    "model.image_size=48", "model.context_length=24", "model.embed_dim=24")
    assert main(["train", *args]) == 0
    return out


def _student_args(demo, out, teacher, *extra):
    return ["train", *run_args(demo, out, "train.steps=6", "data.batch_size=8", "train.save_every=3",
                               "data.workers=0", "train.log_every=1", f"distill.teacher={teacher}",
                               "loss.distill=1.0", *extra)]


def test_a_teacher_in_the_loop_trains_and_is_never_saved(demo, teacher_run, tmp_path):
    from safetensors.torch import load_file

    from mmcl.cli import main

    before = load_file(str(teacher_run / "model" / "open_clip_model.safetensors"))
    out = tmp_path / "student"
    assert main(_student_args(demo, out, teacher_run)) == 0
    rows = metrics(out)
    assert all(r["loss/distill"] > 0 for r in rows) and len(rows) == 6
    assert all(r["loss"] == pytest.approx(r["loss/clip"] + r["loss/distill"], rel=1e-6) for r in rows)
    after = load_file(str(teacher_run / "model" / "open_clip_model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the teacher never trains
    student = final_weights(out)
    assert student["visual.conv1.weight"].shape != before["visual.conv1.weight"].shape or \
        student["positional_embedding"].shape != before["positional_embedding"].shape
    # nothing of the teacher in the checkpoint or the model: the student's keys only, at the student's shapes
    ckpt = sorted((out / "checkpoints").glob("step-*"))[-1]
    saved = load_file(str(next(ckpt.rglob("*.safetensors"))))
    assert set(saved) == set(student) and not any("teacher" in k for k in saved)


@pytest.mark.slow
def test_resume_with_a_teacher_is_exact(demo, teacher_run, tmp_path, monkeypatch):
    import mmcl.training.step as step_mod
    from mmcl.cli import main

    ref = tmp_path / "ref"
    assert main(_student_args(demo, ref, teacher_run)) == 0
    real = sigterm_during_step(4, monkeypatch)
    out = tmp_path / "run"
    assert main(_student_args(demo, out, teacher_run)) == 75
    monkeypatch.setattr(step_mod, "forward_loss", real)
    assert main(_student_args(demo, out, teacher_run)) == 0
    a, b = final_weights(ref), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss/distill"] for r in metrics(out)] == [r["loss/distill"] for r in metrics(ref)]


def test_a_missing_or_unreadable_teacher_is_one_line_before_step_one(demo, tmp_path, capsys):
    from mmcl.cli import main

    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "notes.txt").write_text("no weights here")
    for teacher, message in ((tmp_path / "nowhere", "distill.teacher: "),
                             (not_a_model, "distill.teacher: cannot load")):
        out = tmp_path / "student"
        start = time.perf_counter()
        assert main(_student_args(demo, out, teacher)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mmcl: error:") and message in err and "\n" not in err, err
        assert time.perf_counter() - start < 60
        assert not (out / "metrics.jsonl").exists() or metrics(out) == []
    with pytest.raises(Exception, match="loss.distill > 0 needs a teacher"):
        load_config(None, ["loss.distill=1.0"])
    with pytest.raises(Exception, match="loss.distill is 0"):
        load_config(None, [f"distill.teacher={tmp_path}"])


# ------------------------------------------------------------------------------- reinforced shards
def _two_shards(demo):
    from mmcl.data import expand_urls

    return expand_urls(demo["train"])[:2]


def _members(path):
    import tarfile

    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.fixture(scope="module")
def reinforced(demo, teacher_run, tmp_path_factory):
    from mmcl.curation.reinforce import reinforce

    out = tmp_path_factory.mktemp("reinforced") / "shards"
    summary = reinforce(str(teacher_run), "::".join(_two_shards(demo)), str(out), batch_size=16, progress=False)
    return out, summary


def test_reinforce_keeps_every_member_and_stores_the_teachers_embeddings(demo, teacher_run, reinforced):
    import io

    import numpy as np
    from PIL import Image

    from mmcl.evaluation.teacher import Teacher

    out, summary = reinforced
    assert summary["shards"] == 2 and summary["samples"] == 192 and summary["without_teacher"] == 0
    teacher = Teacher.load(str(teacher_run))
    for src in _two_shards(demo):
        before, after = _members(src), _members(out / Path(src).name)
        assert {k: after[k] for k in before} == before  # every original member, byte for byte
        added = sorted(set(after) - set(before))
        keys = sorted({k.split(".")[0] for k in before})
        assert added == sorted(f"{k}.{m}" for k in keys for m in ("teacher.json", "teacher_image.npy",
                                                                  "teacher_text.npy"))
        for key in keys[:4]:
            image = np.load(io.BytesIO(after[f"{key}.teacher_image.npy"]))
            text = np.load(io.BytesIO(after[f"{key}.teacher_text.npy"]))
            meta = json.loads(after[f"{key}.teacher.json"])
            assert image.dtype == np.float16 and text.shape == (1, image.shape[0]) == (1, meta["dim"])
            assert meta["scale"] == pytest.approx(float(teacher.scale))
            pil = Image.open(io.BytesIO(before[f"{key}.jpg"])).convert("RGB")
            online = teacher.embed(teacher.view.image(pil)[None], teacher.view.tokenize([before[f"{key}.txt"]
                                                                                         .decode()]))
            assert np.abs(image.astype(np.float32) - online.image[0].numpy()).max() < 2e-3  # float16 rounding
            assert np.abs(text[0].astype(np.float32) - online.text[0].numpy()).max() < 2e-3


def test_reinforce_resumes_shard_by_shard_and_refuses_another_teacher(demo, teacher_run, tmp_path, monkeypatch,
                                                                      capsys):
    import mmcl.curation.reinforce as rf
    from mmcl.cli import main

    out = tmp_path / "out"
    (tmp_path / "out").mkdir()
    real, calls = rf._reinforce_shard, [0]

    def failing(url, dest, *a, **k):
        calls[0] += 1
        if calls[0] == 2:
            with open(dest.with_name(dest.name + rf._TEMP_SUFFIX), "wb") as f:
                f.write(b"half a shard")
            raise KeyboardInterrupt  # interrupted while writing the second shard
        return real(url, dest, *a, **k)

    monkeypatch.setattr(rf, "_reinforce_shard", failing)
    args = ["reinforce", "--teacher", str(teacher_run), "--data", "::".join(_two_shards(demo)), "--out", str(out),
            "--no-progress"]
    assert main(args) == 130  # "mmcl: interrupted", as Ctrl-C
    first = out / Path(_two_shards(demo)[0]).name
    stamp = first.stat().st_mtime_ns
    assert first.is_file() and not (out / Path(_two_shards(demo)[1]).name).exists()
    (out / "notes.txt").write_text("mine")  # added by the user to reinforce's folder: kept by the resumed run
    monkeypatch.setattr(rf, "_reinforce_shard", real)
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["already_done"] == 1 and summary["samples"] == 96
    assert first.stat().st_mtime_ns == stamp
    assert not list(out.glob(f"*{rf._TEMP_SUFFIX}")) and (out / "notes.txt").read_text() == "mine"
    other = tmp_path / "other-teacher"
    import shutil

    shutil.copytree(teacher_run / "model", other)
    assert main(["reinforce", "--teacher", str(other), "--data", _two_shards(demo)[0], "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmcl: error:") and "another teacher" in err and "\n" not in err


def test_stored_and_online_teacher_give_the_same_term(demo, teacher_run, reinforced):
    """The same samples in the same order through the training stream: the teacher run online on its view, and
    its embeddings read from the reinforced shards, give the same distillation loss (to float16 rounding)."""
    from mmcl.config import load_config
    from mmcl.data import ImageSpec, build_train_stream
    from mmcl.evaluation.teacher import Teacher
    from mmcl.training.step import teacher_targets

    out, _ = reinforced
    cfg = load_config(None, [f"data.train={out}/*.tar", "data.batch_size=24", "data.workers=0"])
    model, _, pp, _, _, tokenizer = __import__("mmcl.models", fromlist=["build"]).build(cfg.model)
    teacher = Teacher.load(str(teacher_run))
    online = build_train_stream(cfg.data, ImageSpec.from_config(pp), tokenizer, seed=0, teacher_view=teacher.view)
    stored = build_train_stream(cfg.data, ImageSpec.from_config(pp), tokenizer, seed=0, stored_teacher=True)
    b_online, b_stored = next(iter(online)), next(iter(stored))
    assert b_online["key"] == b_stored["key"] and torch.equal(b_online["text"], b_stored["text"])
    t_online = teacher_targets(teacher, [b_online], torch.device("cpu"))
    t_stored = teacher_targets(None, [b_stored], torch.device("cpu"))
    assert (t_online.image - t_stored.image).abs().max() < 2e-3
    assert float(t_stored.scale) == pytest.approx(float(t_online.scale), rel=1e-6)
    with torch.no_grad():
        out_model = model(online.finish_images(b_online["image"]), b_online["text"])
    args = (out_model["image_features"], out_model["text_features"], out_model["logit_scale"].exp())
    a = distill_loss(*args, *t_online)
    b = distill_loss(*args, *t_stored)
    assert a.item() > 0.01 and b.item() == pytest.approx(a.item(), rel=2e-3)


@pytest.mark.slow
def test_training_from_reinforced_shards_never_loads_a_teacher(demo, reinforced, tmp_path, monkeypatch):
    import mmcl.evaluation.teacher as teacher_mod
    from mmcl.cli import main

    def no_teacher(*a, **k):
        raise AssertionError("a teacher was loaded")

    monkeypatch.setattr(teacher_mod.Teacher, "load", no_teacher)
    out = tmp_path / "student"
    shards, _ = reinforced
    args = run_args(demo, out, "train.steps=4", "data.batch_size=8", "train.save_every=0", "data.workers=0",
                    "train.log_every=1", "distill.from_shards=true", "loss.distill=1.0")
    args = [a for a in args if not a.startswith("data.train=")] + [f"data.train={shards}/*.tar"]
    assert main(["train", *args]) == 0
    rows = metrics(out)
    assert len(rows) == 4 and all(r["loss/distill"] > 0 for r in rows)
    # plain shards with from_shards on: every sample lacks the members, one line, exit 2
    other = tmp_path / "plain"
    plain = run_args(demo, other, "train.steps=2", "data.batch_size=8", "data.workers=0",
                     "distill.from_shards=true", "loss.distill=1.0")
    assert main(["train", *plain]) == 2


def _ddp_teacher_worker(rank, world, port, out_path, micro_batches):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    objective = objective_from_config(LossConfig(clip=1.0, distill=2.0, chunk_size=4))
    model = acc.prepare(micro_model())
    big = _teacher_batch()
    n = 12 // world
    local = {k: v[rank * n:(rank + 1) * n] for k, v in big.items()}
    m = n // micro_batches
    parts = [{k: v[i * m:(i + 1) * m] for k, v in local.items()} for i in range(micro_batches)]
    loss, terms, cache = forward_loss(model, objective, parts, acc, None, True, _FakeTeacher())
    backward(acc, model, loss, parts, cache)
    if rank == 0:
        torch.save({"terms": terms, "grads": grads_of(acc.unwrap_model(model))}, out_path)
    end_worker()


def _teacher_batch():
    big = fake_batch(12, seed=1)
    g = torch.Generator().manual_seed(2)
    big["teacher_image"] = torch.randint(0, 256, (12, 3, 16, 16), generator=g, dtype=torch.uint8)
    big["teacher_text"] = torch.randint(1, 100, (12, 20), generator=g)
    return big


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_two_training_processes_with_a_teacher_equal_one(tmp_path, micro_batches):
    """DDP with a teacher (its features gathered like the student's), with and without GradCache accumulation:
    the loss terms and parameter gradients of one process holding the global batch, tiled KL included."""
    from accelerate import Accelerator

    out = tmp_path / "ddp.pt"
    spawn(_ddp_teacher_worker, args=(2, _free_port(), str(out), micro_batches), nprocs=2)
    got = torch.load(out)
    acc = Accelerator(cpu=True)
    model = micro_model()
    objective = objective_from_config(LossConfig(clip=1.0, distill=2.0, chunk_size=4))
    batches = [_teacher_batch()]
    loss, terms, cache = forward_loss(model, objective, batches, acc, None, True, _FakeTeacher())
    backward(acc, model, loss, batches, cache)
    single = grads_of(model)
    assert terms["loss/distill"] > 0.01
    for key in ("loss/clip", "loss/distill", "loss"):
        assert got["terms"][key] == pytest.approx(terms[key], rel=1e-5), key
    for name in single:
        atol = max(1e-6, 1e-5 * single[name].abs().max().item())
        torch.testing.assert_close(got["grads"][name], single[name], rtol=1e-4, atol=atol, msg=name)
