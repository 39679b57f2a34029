"""What travels beside a training batch: a data worker sends each batch in a `WorkerOutput` with its position, its
skips, the warnings it caught and any user error, so the batches training receives hold data keys only, while the
positions, skip records, warnings and errors still reach the training process. Then the epoch's shard plan and the
seeded shuffle blocks."""

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory as loader_pin_memory

from mmcl import data
from mmcl.errors import DataError

from helpers import PREPROCESS, cfg_for, good_members, tokenizer, write_tar

DATA_KEYS = {"image", "text", "label", "key", "sample_id"}


class _Log:
    """A stand-in for `mmcl.data.skips.SkipLog`: the records written to it."""

    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def _warning_transform(img):
    """PREPROCESS, warning on every image (module level: a spawned or forked worker finds it)."""
    warnings.warn("an image in an unusual colour space", RuntimeWarning)
    return PREPROCESS(img)


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_hold_data_keys_only_and_positions_and_skips_still_arrive(corpus, workers):
    spec, _, _ = corpus
    stream = data.build_train_stream(cfg_for(spec, workers=workers, batch_size=2), PREPROCESS, tokenizer, seed=0)
    stream.skip_log = _Log()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the corpus's truncated and non-tar shards warn
        it = iter(stream)
        batches = [next(it) for _ in range(40)]
        it.close()
    for batch in batches:
        assert set(batch) == DATA_KEYS and not any(k.startswith("__") for k in batch)
    assert stream.batches == 40
    state = stream.state_dict()
    assert state["next_role"] == 40 % stream.n_roles
    assert all(set(p) >= {"epoch", "shard", "sample", "emitted", "skipped"} and "role" not in p
               for p in state["positions"])
    # Every skip counted in the positions has its record in the skip log (the corpus's bad samples come early).
    assert stream.skipped["total"] > 0
    assert len(stream.skip_log.records) == stream.skipped["total"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_worker_side_error_is_one_data_error_after_its_skips(tmp_path, workers):
    bad = tmp_path / "bad.tar"
    write_tar(bad, [("x.txt", b"caption without image"), ("y.jpg", b"not a jpeg"), ("y.txt", b"y")])
    stream = data.build_train_stream(cfg_for(str(bad), workers=workers), PREPROCESS, tokenizer, seed=0)
    stream.skip_log = _Log()
    expected = "decode=1, missing_image=1" if workers == 0 else "missing_image=1"
    with pytest.raises(DataError) as err:
        next(iter(stream))
    assert str(err.value) == (f"no valid sample in any of the 1 shards (skipped so far: {expected}); the first sample "
                              f"(x in {bad}) holds members txt, where this run reads its image from the first of "
                              f"jpg/jpeg/png/webp (data.image_key) and its caption from txt (data.caption_key)")
    assert stream.skip_log.records  # the skips of the failed epoch travelled with the error


def test_a_warning_in_a_worker_is_shown_in_the_training_process(tmp_path):
    shard = tmp_path / "shard.tar"
    write_tar(shard, [m for j in range(8) for m in good_members(f"k{j}", j)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # building the stream may try the transform here
        stream = data.build_train_stream(cfg_for(str(shard), workers=2, batch_size=2), _warning_transform,
                                         tokenizer, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # each warning once per place, as Python shows them by default
        it = iter(stream)
        batches = [next(it) for _ in range(4)]
        it.close()
    assert all(set(b) == DATA_KEYS for b in batches)
    shown = [w for w in caught if str(w.message) == "an image in an unusual colour space"]
    # Both workers warned; the training process shows it once, with its own category and place.
    assert len(shown) == 1
    assert all(w.category is RuntimeWarning and w.filename == __file__ for w in shown)


@pytest.fixture
def fake_pinning(monkeypatch):
    """`Tensor.pin_memory` as a copy that is remembered (pinning needs an accelerator): the tensors it returned."""
    pinned = []

    def pin(self, *args, **kwargs):
        copy = self.clone()
        pinned.append(copy)
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return pinned


def _is_one_of(tensor, tensors):
    return any(tensor is t for t in tensors)


def test_the_loaders_pinning_pins_the_batch_inside_a_worker_output(fake_pinning):
    """The DataLoader's pinning thread pins what a worker sent with torch's own `pin_memory`: for a `WorkerOutput`
    that is its batch's tensors, the rest passed on as it was."""
    batch = {"image": torch.zeros(2, 3, 4, 4), "text": torch.ones(2, 5, dtype=torch.long), "key": ["a", "b"]}
    state = {"epoch": 0, "shard": 0, "sample": 2, "emitted": 2}
    out = data.WorkerOutput(batch, role=1, state=state, skips=({"reason": "decode"},),
                            warnings=(("w", UserWarning, "f.py", 3),))
    got = loader_pin_memory(out)
    assert isinstance(got, data.WorkerOutput)
    assert _is_one_of(got.batch["image"], fake_pinning) and _is_one_of(got.batch["text"], fake_pinning)
    assert got.batch["key"] == ["a", "b"] and list(got.batch) == list(batch)
    assert (got.role, got.state, got.skips, got.warnings, got.error) == (1, state, out.skips, out.warnings, None)
    failed = data.WorkerOutput(None, error="no valid sample")
    assert loader_pin_memory(failed) is failed


def test_a_stream_without_workers_pins_its_batches_as_the_loader_would(tmp_path, fake_pinning):
    shard = tmp_path / "shard.tar"
    write_tar(shard, [m for j in range(4) for m in good_members(f"k{j}", j)])
    stream = data.build_train_stream(cfg_for(str(shard), workers=0, batch_size=2), PREPROCESS, tokenizer, seed=0,
                                     pin_memory=True)
    batch = next(iter(stream))
    assert set(batch) == DATA_KEYS
    assert all(_is_one_of(v, fake_pinning) for v in batch.values() if isinstance(v, torch.Tensor))


def test_epoch_shard_plan_partitions_and_reshuffles():
    sources = [[f"s{i}" for i in range(10)]]
    for epoch in range(3):
        plans = [data.epoch_shard_plan(sources, epoch, 0, slot, 4) for slot in range(4)]
        # 8 shards are dealt whole, 2 each; the other 2 are read by all 4 slots, each taking index k mod 4.
        whole = [u for p in plans for u, m in p if m is None]
        split = [(u, m) for p in plans for u, m in p if m is not None]
        assert len(whole) == 8 and len(set(whole)) == 8 and all(sum(m is None for _, m in p) == 2 for p in plans)
        split_urls = sorted({u for u, _ in split})
        assert len(split_urls) == 2 and not set(split_urls) & set(whole)
        assert sorted(split) == sorted((u, (k, 4)) for u in split_urls for k in range(4))
        assert sorted(whole + split_urls) == sorted(sources[0])
    orders = [[u for u, _ in data.epoch_shard_plan(sources, e, 0, 0, 1)] for e in range(3)]
    assert orders[0] != orders[1] != orders[2]
    assert orders[0] == [u for u, _ in data.epoch_shard_plan(sources, 0, 0, 0, 1)]


def test_shuffle_block_is_a_seeded_permutation():
    a = data.shuffle_block(50, 0, 1, 2, (3, 4))
    assert sorted(a.tolist()) == list(range(50))
    assert np.array_equal(a, data.shuffle_block(50, 0, 1, 2, (3, 4)))
    others = [data.shuffle_block(50, *args) for args in ((1, 1, 2, (3, 4)), (0, 2, 2, (3, 4)), (0, 1, 3, (3, 4)),
                                                        (0, 1, 2, (3, 5)))]
    assert all(not np.array_equal(a, o) for o in others)


def test_a_caption_key_no_sample_has_names_the_members_the_samples_do_have(tmp_path):
    shard = tmp_path / "s.tar"
    write_tar(shard, [m for j in range(4) for m in good_members(f"k{j}", j) + [(f"k{j}.json", b'{"a": 1}')]])
    stream = data.build_train_stream(cfg_for(str(shard), workers=0, caption_key="caption"), PREPROCESS, tokenizer,
                                     seed=0)
    stream.skip_log = _Log()
    with pytest.raises(DataError) as err:
        next(iter(stream))
    assert str(err.value) == (f"no valid sample in any of the 1 shards (skipped so far: missing_caption=4); the "
                              f"first sample (k0 in {shard}) holds members cls, json, png, txt, where this run reads "
                              f"its image from the first of jpg/jpeg/png/webp (data.image_key) and its caption from "
                              f"caption (data.caption_key)")
