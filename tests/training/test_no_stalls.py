"""No host sync on ordinary training steps, counted by torch's dispatcher (`syncwatch.SyncWatch`).

Every op of a step passes through the dispatcher on a CPU exactly as on a GPU, so a dispatch mode held from the
start of `Step.__call__` (forward, loss, the finite-loss decision, backward, all-reduces, the optimiser, the EMA)
to the end of the loop's `after_step` (progress, logging, saving, stopping) sees each read of a device value, each
data-dependent op and each blocking copy the step would make on a GPU. Ordinary steps are those neither logged
nor saved; the first step (optimiser state, DDP's buckets) and the logged ones read on purpose and are left out.
Each recipe runs end to end through `mmcl.training.loop.train`, in one process and (slow) in two gloo processes.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmcl.config import load_config
from mmcl.training.loop import train

from helpers import run_args
from spawned import end_worker, free_port, spawn
from syncwatch import SyncWatch

STEPS, LOG_EVERY = 7, 3  # logged steps 3, 6, 7; steps 2, 4, 5 are ordinary (1 is the first)
ORDINARY = {2, 4, 5}

# Each recipe of the list, as config overrides; "long caption" fills the context of one caption per batch.
RECIPES = {
    "chunked": ["loss.chunk_size=4"],
    "siglip_chunked": ["loss.clip=0", "loss.siglip=1.0", "loss.chunk_size=4", "model.init_logit_bias=-10"],
    "flip": ["model.patch_dropout=0.5"],
    "mochi_queue": ["loss.mochi.weight=1.0", "loss.mochi.queue_size=16", "loss.mochi.n_hard=4", "loss.mochi.s=2",
                    "loss.mochi.s_prime=2"],
    "supcon": ["loss.clip=0", "loss.supcon=1.0", "loss.chunk_size=4"],  # tiled: its positives per tile
    "long_caption": [],
    "caption": ["model.name=coca_tiny", "model.embed_dim=64", "loss.caption=1.0"],  # CoCa's decoder
    "accumulation": ["train.accum_steps=2", "train.ema_decay=0.9"],
    # SigLIP 2's second stage: step 2 before its terms start (at step 3, which is logged), steps 4 and 5 with them
    "siglip2": ["loss.clip=0", "loss.siglip=1.0", "model.init_logit_bias=-10", "train.accum_steps=2",
                "loss.self_distill.weight=1.0", "loss.self_distill.start_fraction=0.4",
                "loss.self_distill.prototypes=32", "loss.self_distill.head_hidden=16",
                "loss.self_distill.head_bottleneck=8", "loss.self_distill.local_crops=2", "loss.masked.weight=1.0",
                "loss.masked.start_fraction=0.4", "loss.masked.prototypes=16"],
    "naflex": ["model.vision_cfg={timm_model_name: naflexvit_base_patch16_siglip, timm_model_kwargs: {embed_dim: 16, "
               "depth: 1, num_heads: 2, patch_size: 8, pos_embed_use_grid_sample: true}}",
               "data.naflex.seq_lens=[4, 16]", "data.naflex.max_tokens_per_batch=64"],
}


def watched_train(cfg, long_caption: bool = False):
    """Train `cfg` with a `SyncWatch` over each ordinary step; returns {step: [(op, where), ...]}."""
    import mmcl.training.loop as loop_mod
    from mmcl.training.step import Step

    real_step, real_after, real_next = Step.__call__, loop_mod.after_step, loop_mod.next_batches
    events, current, watch = {}, [0], [None]

    def next_batches(parts, state, data_iter):
        batches = real_next(parts, state, data_iter)
        if long_caption:  # the batch as the data loader gives it when one caption fills the context
            full = parts.tokenizer(["word " * 200])
            for b in batches:
                text = F.pad(b["text"], (0, full.shape[1] - b["text"].shape[1]))
                text[0] = full[0]
                b["text"] = text
        return batches

    def step(self, *a, **k):
        current[0] += 1
        if current[0] in ORDINARY:
            watch[0] = SyncWatch()
            watch[0].__enter__()
        return real_step(self, *a, **k)

    def after_step(*a, **k):
        try:
            return real_after(*a, **k)
        finally:
            if watch[0] is not None:
                watch[0].__exit__(None, None, None)
                events[current[0]] = list(watch[0].events)
                watch[0] = None

    patches = [(Step, "__call__", step, real_step), (loop_mod, "after_step", after_step, real_after),
               (loop_mod, "next_batches", next_batches, real_next)]
    for owner, name, fn, _ in patches:
        setattr(owner, name, fn)
    try:
        train(cfg)
    finally:
        for owner, name, _, fn in patches:
            setattr(owner, name, fn)
    return events


def recipe_config(demo, out, recipe, *extra):
    # data.workers=1: samples are decoded in a worker process; only the training process's ops are counted.
    args = run_args(demo, out, f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.save_every=0",
                    "data.batch_size=8", "data.workers=1", *RECIPES[recipe], *extra)
    return load_config(None, args[2:])


def report(events) -> str:
    return "\n".join(f"step {s}: {op} at {where}" for s, evs in sorted(events.items()) for op, where in evs)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_ordinary_steps_make_no_host_sync_in_one_process(demo, tmp_path, recipe):
    events = watched_train(recipe_config(demo, tmp_path / "run", recipe), long_caption=recipe == "long_caption")
    assert sorted(events) == sorted(ORDINARY)  # every ordinary step was watched
    assert all(not evs for evs in events.values()), report(events)


def test_the_watch_sees_a_sync_in_the_step(demo, tmp_path, monkeypatch):
    """The same harness catches a device read in the model's forward (the text tower's former read of the longest
    caption, put back here), so an empty report above is not an unwatched step."""
    from mmcl.models.clip_classes import ShortTextCLIP as cls

    real = cls._encode_text

    def reading(self, text, normalize):
        int(text.argmax(dim=-1).max())
        return real(self, text, normalize)

    monkeypatch.setattr(cls, "_encode_text", reading)
    events = watched_train(recipe_config(demo, tmp_path / "run", "flip"))
    assert {s: [op for op, _ in evs] for s, evs in events.items()} == {
        s: ["aten._local_scalar_dense.default"] for s in ORDINARY}


def test_flip_masks_are_drawn_on_the_images_device():
    """On a CPU every tensor shares the host, so a copy from the host is invisible end to end; with the images on
    the ``meta`` device a mask drawn on the host would show up as a blocking copy. The step's seeds reach the
    device in `begin_step`, outside the forward."""
    from mmcl.models.flip import SeededPatchDropout

    dropout = SeededPatchDropout(0.5, seed=3, rank=1, world_size=2, accum_steps=2).to("meta").train()
    dropout.begin_step(5)
    with SyncWatch() as watch:
        for _ in range(2):  # both micro-batches of the step
            out = dropout(torch.empty(4, 17, 8, device="meta"))
    assert out.shape == (4, 9, 8) and out.device.type == "meta"
    assert watch.count == 0, watch.summary()


def _gloo_worker(rank, world, port, cfg_args, long_caption, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    events = watched_train(load_config(None, cfg_args), long_caption)
    Path(out_dir, f"events-{rank}.json").write_text(json.dumps({str(k): v for k, v in events.items()}))
    end_worker()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_ordinary_steps_make_no_host_sync_in_two_processes(demo, tmp_path, recipe):
    args = run_args(demo, tmp_path / "run", f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}",
                    "train.save_every=0", "data.batch_size=4", "data.workers=1", *RECIPES[recipe])[2:]
    spawn(_gloo_worker, args=(2, free_port(), args, recipe == "long_caption", str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        events = {int(k): v for k, v in json.loads((tmp_path / f"events-{rank}.json").read_text()).items()}
        assert sorted(events) == sorted(ORDINARY), rank
        assert all(not evs for evs in events.values()), f"rank {rank}:\n" + report(events)
