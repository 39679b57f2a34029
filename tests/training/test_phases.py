"""Token-reduction phases (train.phases, CLIPA): the position-embedding resize against open_clip's and a float64
reference, the towers at a phase's size, the workers' batches at each phase's size, exact resume in each phase and at
the boundary, accumulation, EMA, 2 processes = 1, and the saved model at the last phase's size."""

import math

import numpy as np
import pytest
import torch

from mmcl import models
from mmcl.config import load_config
from mmcl.errors import ConfigError
from mmcl.models.resize import at_size, follow_input_size, resize_grid_embedding

from helpers import TRAINING_TOWERS, fake_batch, final_weights, grads_of, metrics, micro_model, run_args
from preempt import sigterm_during_step
from spawned import end_worker, free_port, spawn

PHASES = "train.phases=[{steps: 4, image_size: 32, context_length: 12, patch_dropout: 0.5}, {steps: 4}]"


# ------------------------------------------------------------------------------------------ the resize
def _cubic(x: float, a: float = -0.5) -> float:
    x = abs(x)
    if x < 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def _aa_bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) float64 weights of antialiased bicubic resampling (Keys a=-0.5, the kernel widened by the
    downscale factor, weights normalised per output; PIL's and torch's antialias=True rule), written from the
    definition."""
    scale = n_in / n_out
    width = max(scale, 1.0)
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        center = (i + 0.5) * scale
        lo, hi = max(int(center - 2 * width + 0.5), 0), min(int(center + 2 * width + 0.5), n_in)
        w = np.array([_cubic((j - center + 0.5) / width) for j in range(lo, hi)])
        m[i, lo:hi] = w / w.sum()
    return m


@pytest.mark.parametrize("grid", [(4, 4), (6, 6), (3, 5), (10, 10)])
def test_grid_resize_equals_open_clip_and_a_float64_reference(grid):
    from open_clip.model import resize_pos_embed

    g = torch.Generator().manual_seed(0)
    pos = torch.randn(1 + 8 * 8, 16, generator=g)
    out = resize_grid_embedding(pos, grid)
    assert out.shape == (1 + grid[0] * grid[1], 16)
    torch.testing.assert_close(out[0], pos[0], rtol=0, atol=0)  # the class token is kept
    # float64, separable: rows then columns of the 8x8 grid
    img = pos[1:].double().reshape(8, 8, 16).numpy()
    ref = np.einsum("ai,bj,ijd->abd", _aa_bicubic_matrix(8, grid[0]), _aa_bicubic_matrix(8, grid[1]), img)
    np.testing.assert_allclose(out[1:].double().numpy(), ref.reshape(-1, 16), rtol=1e-5, atol=1e-5)
    if grid[0] == grid[1]:  # open_clip resizes to its model's square grid, as it loads a state dict

        class Target:
            class visual:
                grid_size = grid

        state = {"visual.positional_embedding": pos.clone()}
        resize_pos_embed(state, Target)
        torch.testing.assert_close(out, state["visual.positional_embedding"], rtol=0, atol=0)


def test_a_tower_following_its_input_equals_a_tower_built_at_that_size():
    """At 32 px the full-size tower, its embedding resized in the forward, gives the features of a model built at
    32 px (`at_size`); its parameters keep their shapes, the gradient reaches the full-size embedding, and at 64 px
    it is the tower as built."""
    model = micro_model()
    full = {k: v.shape for k, v in model.state_dict().items()}
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    before = model.encode_image(images)
    follow_input_size(model)
    follow_input_size(model)  # idempotent
    assert {k: v.shape for k, v in model.state_dict().items()} == full
    torch.testing.assert_close(model.encode_image(images), before, rtol=0, atol=0)
    cfg = load_config(None, TRAINING_TOWERS).model
    _, model_cfg, *_ = models.build(cfg)
    small, small_cfg = at_size(model, model_cfg, 32, 12)
    assert small_cfg["vision_cfg"]["image_size"] == 32 and small_cfg["text_cfg"]["context_length"] == 12
    assert small.visual.positional_embedding.shape == (1 + 4 * 4, 64) and small.positional_embedding.shape[0] == 12
    x = torch.nn.functional.interpolate(images, size=32, mode="bilinear", antialias=True)
    torch.testing.assert_close(model.encode_image(x), small.encode_image(x), rtol=1e-5, atol=1e-6)
    tokens = torch.randint(1, 1000, (3, 12), generator=torch.Generator().manual_seed(2))
    model.train()
    small.train()
    torch.testing.assert_close(model.encode_text(tokens), small.encode_text(tokens), rtol=1e-5, atol=1e-6)
    model.encode_image(x).sum().backward()
    assert model.visual.positional_embedding.grad.shape == full["visual.positional_embedding"]
    assert model.visual.positional_embedding.grad[1:].abs().sum() > 0


def test_cut_tokens_equal_open_clip_tokenizer_at_the_shorter_length():
    from open_clip.tokenizer import SimpleTokenizer

    from mmcl.data.batching import cut_tokens

    tok = SimpleTokenizer(context_length=32)
    texts = ["a photo of a small red square on a large blue field with a green border around it", "a cat", ""]
    for n in (4, 8, 12):
        torch.testing.assert_close(cut_tokens(tok(texts), n), tok(texts, context_length=n), rtol=0, atol=0)
    assert cut_tokens(tok(texts), None).shape == (3, 32)


# ------------------------------------------------------------------------------------------ config
def test_phases_config_from_the_command_line_and_its_errors():
    cfg = load_config(None, ["train.steps=40", "train.phases=[{steps: 30, image_size: 32, context_length: 16, "
                                               "patch_dropout: 0.5}, {steps: 10}]"])
    assert [(p.steps, p.image_size, p.context_length, p.patch_dropout) for p in cfg.train.phases] == [
        (30, 32, 16, 0.5), (10, None, None, None)]
    with pytest.raises(ConfigError, match=r"^train.phases' steps are 30 \+ 10 = 40, not the run's 41 with at least "
                                          r"one step each: give the last phase no steps and no fraction to take "):
        load_config(None, ["train.steps=41", "train.phases=[{steps: 30}, {steps: 10}]"])
    with pytest.raises(ConfigError, match=r"patch_dropout must be in \[0, 1\)"):
        load_config(None, ["train.steps=10", "train.phases=[{steps: 10, patch_dropout: 1.0}]"])

    from mmcl.training import phases

    bad = load_config(None, [*TRAINING_TOWERS, "train.steps=10", "train.phases=[{steps: 5, image_size: 36}, "
                                                       "{steps: 5, context_length: 40}]"])
    model, model_cfg, *_ = models.build(bad.model)
    with pytest.raises(ConfigError, match=r"image_size=36 is not a multiple of the patch size 8.*context_length=40 "
                                          r"exceeds the model's context length 32"):
        phases.plan(bad.train, model, model_cfg, 10)


def test_phases_as_fractions_or_the_rest_follow_the_run_length(demo):
    """A phase given as a fraction of the run, or a last phase that takes the rest, keeps the schedule when the
    run's length changes, whichever key sets it (train.steps, train.samples, train.epochs)."""
    from mmcl.config import phase_lengths
    from mmcl.training import phases
    from mmcl.training import plan as runtime

    spec = "train.phases=[{fraction: 0.9, image_size: 32}, {}]"
    for steps, lengths in ((150, [135, 15]), (4, [3, 1]), (2, [1, 1]), (10, [9, 1])):
        cfg = load_config(None, [f"train.steps={steps}", spec])
        assert phase_lengths(cfg.train.phases, steps) == lengths
    thirds = load_config(None, ["train.phases=[{fraction: 0.3}, {fraction: 0.4}, {fraction: 0.3}]"]).train.phases
    assert phase_lengths(thirds, 100) == [30, 40, 30] and phase_lengths(thirds, 10) == [3, 4, 3]
    assert phase_lengths(load_config(None, ["train.phases=[{steps: 5}, {}]"]).train.phases, 12) == [5, 7]
    with pytest.raises(ConfigError, match=r"steps are 0 \+ 1 = 1, not the run's 1 with at least one step each: a "
                                          r"longer run$"):
        load_config(None, ["train.steps=1", spec])
    with pytest.raises(ConfigError, match=r"train.phases\[0\] has neither steps nor fraction: only the last phase"):
        load_config(None, ["train.phases=[{}, {steps: 3}]"])
    with pytest.raises(ConfigError, match=r"train.phases\[0\] has both steps and fraction"):
        load_config(None, ["train.phases=[{steps: 3, fraction: 0.5}, {}]"])

    # train.samples and train.epochs set the length at the start of the run: the phases follow it
    model, model_cfg, *_ = models.build(load_config(None, TRAINING_TOWERS).model)
    for length in ("train.samples=800", "train.epochs=2"):
        cfg = load_config(None, [*TRAINING_TOWERS, f"data.train={demo['train']}", "data.batch_size=8", length, spec])
        total = runtime.total_steps(cfg.data, cfg.train, 1)
        plan = phases.plan(cfg.train, model, model_cfg, total)
        assert [(p.start, p.steps, p.image_size) for p in plan] == [
            (0, math.floor(0.9 * total), 32), (math.floor(0.9 * total), total - math.floor(0.9 * total), 64)]


# ------------------------------------------------------------------------------------------ data
def _stream(demo, workers, batch_size=4, accum=1):
    from mmcl import data
    from mmcl.config import DataConfig

    cfg = load_config(None, TRAINING_TOWERS).model
    model, model_cfg, pp_cfg, _, _, tokenizer = models.build(cfg)
    dc = DataConfig(train=demo["train"], batch_size=batch_size, workers=workers, shuffle_buffer=64)
    # phases: steps 0-2 at 32 px and 6 tokens, then steps 3-5 at 48 px, then the model's own 64 px and 32 tokens
    plan = [(0, 32, 6), (3 * accum, 48, None), (6 * accum, None, None)]
    return data.build_train_stream(dc, data.ImageSpec.from_config(pp_cfg), models.training_tokenizer(model, tokenizer),
                                   seed=0, sizes=plan)


def test_the_stream_settings_are_a_frozen_picklable_dataclass(demo):
    """What each data worker receives: a read-only `StreamSpec` that survives pickling (spawned workers), the
    phases' input sizes included, each batch's sizes looked up by its process batch."""
    import dataclasses
    import pickle

    from mmcl.data.pipeline import StreamSpec

    spec = _stream(demo, 0, accum=2)._spec()
    copy = pickle.loads(pickle.dumps(spec))
    assert isinstance(copy, StreamSpec) and copy.seed == spec.seed and len(copy.sizes) == 3
    assert [copy.sizes_at(b).context_length for b in (0, 5, 6, 11, 12, 99)] == [6, 6, None, None, None, None]
    assert [copy.sizes_at(b).start for b in (0, 5, 6, 11, 12, 99)] == [0, 0, 6, 6, 12, 12]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1


@pytest.mark.parametrize("workers", [0, 2])
def test_the_workers_make_each_batch_at_its_phase_size_also_after_a_resume(demo, workers):
    accum = 2
    stream = _stream(demo, workers, accum=accum)
    it = iter(stream)
    batches = [next(it) for _ in range(16)]
    sizes = [b["image"].shape[-1] for b in batches]
    assert sizes == [32] * 6 + [48] * 6 + [64] * 4  # batch b is step b // accum
    assert all(b["text"].shape[1] <= 6 for b in batches[:6])
    assert max(b["text"].shape[1] for b in batches[6:]) > 6
    eot = 49407
    assert all((b["text"] == eot).sum(dim=1).eq(1).all() for b in batches)  # every caption keeps its end-of-text
    # A stream resumed after 5 batches (in the first phase) gives the uninterrupted stream's next batches.
    again = _stream(demo, workers, accum=accum)
    it2 = iter(again)
    for _ in range(5):
        next(it2)
    state = again.state_dict()
    del it2
    resumed = _stream(demo, workers, accum=accum)
    resumed.load_state_dict(state)
    rest = [b for b, _ in zip(iter(resumed), range(11))]
    for a, b in zip(batches[5:], rest):
        assert a["key"] == b["key"]
        torch.testing.assert_close(a["image"], b["image"], rtol=0, atol=0)
        torch.testing.assert_close(a["text"], b["text"], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ runs
def _train(demo, out, *extra):
    from mmcl.cli import main

    args = run_args(demo, out, "train.steps=8", "data.batch_size=8", "train.log_every=1", "train.save_every=1",
                    "train.keep_checkpoints=1", PHASES, *extra)
    return main(["train", *args])


@pytest.fixture(scope="module")
def reference(demo, tmp_path_factory):
    """An uninterrupted 8-step phase run (4 steps at 32 px, 12 tokens, patch dropout 0.5, then 4 at full size),
    with accumulation, an EMA and data workers."""
    out = tmp_path_factory.mktemp("phases") / "ref"
    assert _train(demo, out, *RECIPE) == 0
    return out


RECIPE = ["train.accum_steps=2", "data.batch_size=4", "train.ema_decay=0.7", "data.workers=2"]


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [2, 4, 6], ids=["first-phase", "boundary", "second-phase"])
def test_a_run_stopped_in_either_phase_or_at_the_boundary_resumes_exactly(demo, reference, tmp_path, monkeypatch,
                                                                          stop_at, capsys):
    import mmcl.training.step as step_mod

    out = tmp_path / "run"
    real = sigterm_during_step(stop_at, monkeypatch)
    assert _train(demo, out, *RECIPE) == 75
    assert f"preempted (SIGTERM) at step {stop_at}" in capsys.readouterr().err
    monkeypatch.setattr(step_mod, "forward_loss", real)
    assert _train(demo, out, *RECIPE) == 0
    a, b = final_weights(reference), final_weights(out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["step"] for r in metrics(out) if "loss" in r] == list(range(1, 9))


def test_a_phase_run_equals_itself_without_accumulation_and_saves_the_last_phase_size(demo, tmp_path):
    """Accumulation (2 x 4) gives the weights of the same run with batches of 8: the phase of each micro-batch
    follows its step. A run ending in a smaller phase saves a model at that size, which loads and encodes."""
    import mmcl

    phases = "train.phases=[{steps: 2, context_length: 12}, {steps: 2, image_size: 32, context_length: 8}]"
    common = ["train.steps=4", "data.workers=0", "train.save_every=0", phases]
    from mmcl.cli import main

    assert main(["train", *run_args(demo, tmp_path / "a", "data.batch_size=8", *common)]) == 0
    assert main(["train", *run_args(demo, tmp_path / "b", "data.batch_size=4", "train.accum_steps=2", *common)]) == 0
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    model, preprocess, tokenizer = mmcl.load(str(tmp_path / "a"))
    assert a["visual.positional_embedding"].shape == (1 + 4 * 4, 64) and a["positional_embedding"].shape[0] == 8
    assert tokenizer(["a red square"]).shape == (1, 8)
    assert preprocess.transforms[1].size == (32, 32)
    with torch.no_grad():
        features = model.encode_image(torch.randn(2, 3, 32, 32))
    assert features.shape == (2, 32) and torch.isfinite(features).all()


# ------------------------------------------------------------------------------------------ 2 processes = 1
def _phase_step(model, acc, rank, world, batch):
    from mmcl.config import LossConfig
    from mmcl.models import flip
    from mmcl.training.step import backward, forward_loss, objective_from_config

    follow_input_size(model)
    modules = models.set_patch_dropout(model, 0.0, seed=3, rank=rank, world_size=world)
    flip.begin_step(modules, 5, True, 0.5)  # a phase's rate, set by the step hook
    model = acc.prepare(model)
    loss, terms, cache = forward_loss(model, objective_from_config(LossConfig()), [batch], acc)
    backward(acc, model, loss, [batch], cache)
    return terms["loss/clip"], grads_of(acc.unwrap_model(model))


def _ddp_worker(rank, world, port, out_path):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    big = fake_batch(12, seed=1, image_size=32, context=12)
    n = 12 // world
    loss, grads = _phase_step(micro_model(), Accelerator(cpu=True), rank, world,
                              {k: v[rank * n:(rank + 1) * n] for k, v in big.items()})
    if rank == 0:
        torch.save({"loss": loss, "grads": grads}, out_path)
    end_worker()


@pytest.mark.slow
def test_two_processes_equal_one_at_a_phase_size(tmp_path):
    """A step at a phase's size (32 px, 12 tokens, patch dropout 0.5) on 2 processes gives the gradients of one
    process with the global batch: the resized embedding and the masks are the same on every process."""
    from accelerate import Accelerator

    out = tmp_path / "ddp.pt"
    spawn(_ddp_worker, args=(2, free_port(), str(out)), nprocs=2)
    ddp = torch.load(out)
    loss, single = _phase_step(micro_model(), Accelerator(cpu=True), 0, 1, fake_batch(12, seed=1, image_size=32,
                                                                                      context=12))
    assert ddp["loss"] == pytest.approx(loss, rel=1e-5)
    assert single.keys() == ddp["grads"].keys() and "visual.positional_embedding" in single
    for name in single:
        torch.testing.assert_close(ddp["grads"][name], single[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not math.isclose(float(single["visual.positional_embedding"].abs().sum()), 0.0)
