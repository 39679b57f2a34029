"""A worker's side of the training stream (mmcl/data/batching.py): every good sample once per epoch across ranks
and workers, slots' equal shares, splits within shards, the batch contract, and what bad or empty data gives."""

import os
import tarfile
import warnings

import pytest
import torch
from PIL import Image

from mmcl import data
from mmcl.config import DataConfig
from mmcl.errors import DataError
from mmcl.shards import writer as shard_writer

from helpers import PREPROCESS, SIDE, bad_samples, cfg_for, empty_tars, good_members, tokenizer, write_tar


def one_epoch(stream):
    """Consume batches of size 1 until every worker has finished epoch 0; return keys and epoch-0 skips."""
    keys, skips = [], {}
    n_roles = stream.n_roles
    it = iter(stream)
    while len(skips) < n_roles:
        batch = next(it)
        role = (stream.state_dict()["next_role"] - 1) % n_roles
        pos = stream.state_dict()["positions"][role]
        if pos["epoch"] == 0:
            keys += batch["key"]
        elif role not in skips:
            skips[role] = pos["skipped_before_epoch"]
    it.close()
    total = {r: sum(s[r] for s in skips.values()) for r in data.SKIP_REASONS}
    return keys, total


def check_epoch(spec, good, expected, workers, seed=0):
    keys, skips = [], {r: 0 for r in data.SKIP_REASONS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank in range(2):
            stream = data.build_train_stream(cfg_for(spec, workers=workers), PREPROCESS, tokenizer, seed=seed,
                                             rank=rank, world_size=2)
            k, s = one_epoch(stream)
            keys += k
            for r in skips:
                skips[r] += s[r]
    assert len(keys) == len(set(keys)), "a sample was delivered twice in one epoch"
    assert sorted(keys) == sorted(good)
    assert skips == expected


def test_every_good_sample_once_per_epoch_across_ranks_and_workers(corpus):
    spec, good, expected = corpus
    check_epoch(spec, good, expected, workers=2)


def test_slots_get_equal_shares_when_shards_do_not_divide_evenly(tmp_path):
    """5 shards of 8 samples for 2 workers: 20 samples each per epoch (2 whole shards + half of the fifth),
    not 24 and 16, which would make the smaller worker wrap sooner and repeat its samples more often."""
    img = Image.new("RGB", (SIDE, SIDE), (10, 200, 30))
    shard_writer.write_shards(
        ({"key": f"k{i:02d}", "image": img, "caption": f"c{i}"} for i in range(40)), str(tmp_path),
                      shard_size=8)
    spec = str(tmp_path / "shard-*.tar")
    for epoch_seed in (0, 1):
        stream = data.build_train_stream(cfg_for(spec, workers=2, batch_size=1), PREPROCESS, tokenizer,
                                         seed=epoch_seed)
        per_role, seen = {0: 0, 1: 0}, []
        it = iter(stream)
        for _ in range(40):
            batch = next(it)
            role = (stream.state_dict()["next_role"] - 1) % 2
            assert stream.state_dict()["positions"][role]["epoch"] == 0
            per_role[role] += 1
            seen += batch["key"]
        it.close()
        assert per_role == {0: 20, 1: 20}
        assert sorted(seen) == [f"k{i:02d}" for i in range(40)]  # 40 batches of 1: the whole epoch, once
    # A position whose layout names no shard-split rule (no "shard_split") is not resumed into the plan as if it
    # were exact (a warning says so); where every rule gives the same plan (1 worker) it resumes without one.
    for workers, warns in ((2, True), (1, False)):
        stream = data.build_train_stream(cfg_for(spec, workers=workers, batch_size=1), PREPROCESS, tokenizer, seed=0)
        state = stream.state_dict()
        del state["layout"]["shard_split"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data.build_train_stream(cfg_for(spec, workers=workers, batch_size=1), PREPROCESS, tokenizer,
                                    seed=0).load_state_dict(state)
        messages = [str(w.message) for w in caught]
        assert any("shard_split: whole -> balanced" in m for m in messages) == warns, messages


def test_fewer_shards_than_slots_splits_within_shards(corpus, tmp_path):
    spec, good, expected = corpus
    folder = os.path.dirname(spec)
    # Two shards for 2 ranks x 2 workers: samples are split by index modulo 4, counts stay exact.
    two = [os.path.join(folder, "part-00.tar"), os.path.join(folder, "part-98.tar")]
    keep = [k for k in good if k.startswith(("s0_", "t_"))]
    exp = {r: 0 for r in data.SKIP_REASONS}
    exp["truncated_tar"] = 1
    for name, (members, reason) in bad_samples().items():
        with tarfile.open(two[0]) as tar:
            if members[0][0] in tar.getnames():
                exp[reason] += 1
    check_epoch(two, keep, exp, workers=2, seed=3)


def test_stream_batches_have_contract_shapes_and_skip_totals(corpus):
    spec, good, expected = corpus
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream = data.build_train_stream(cfg_for(spec, batch_size=4, workers=0), PREPROCESS, tokenizer, seed=1)
        it = iter(stream)
        # One process, one worker: an epoch is 66 good samples; 20 batches of 4 run into epoch 1.
        batches = [next(it) for _ in range(20)]
    b = batches[0]
    # Images travel as uint8 (data.uint8_transfer) and become the float model input in finish_images.
    assert b["image"].shape == (4, 3, SIDE, SIDE) and b["image"].dtype == torch.uint8
    assert stream.finish_images(b["image"]).dtype == torch.float32
    assert b["text"].shape == (4, 24) and b["text"].dtype == torch.long
    assert b["label"].dtype == torch.long and b["label"].shape == (4,)
    labels = {k: int(lab) for bt in batches for k, lab in zip(bt["key"], bt["label"])}
    assert labels["s0_03"] == -1  # no .cls member
    assert labels["s1_07"] == (10 + 7) % 5
    assert stream.epoch == 1
    assert stream.state_dict()["positions"][0]["skipped_before_epoch"] == expected
    skipped = stream.skipped
    assert skipped["total"] == sum(v for k, v in skipped.items() if k != "total")
    assert all(skipped[r] >= n for r, n in expected.items())
    # Captions reach the tokenizer intact.
    first = batches[0]["text"][0]
    text = bytes(int(c) for c in first if c).decode()
    assert text == ("a big one" if batches[0]["key"][0] == "s0_03" else f"caption {batches[0]['key'][0]}")


def test_empty_data_raises_instead_of_hanging(tmp_path):
    with pytest.raises(DataError, match="no shards match"):
        data.build_train_stream(DataConfig(train=str(tmp_path / "nothing-{0..3}.tar")), PREPROCESS, tokenizer,
                                seed=0)
    bad = tmp_path / "bad.tar"
    write_tar(bad, [("x.txt", b"caption without image"), ("y.jpg", b"not a jpeg"), ("y.txt", b"y")])
    for workers in (0, 2):
        stream = data.build_train_stream(DataConfig(train=str(bad), workers=workers), PREPROCESS, tokenizer, seed=0)
        # With 2 workers the 2 samples are split between them; worker 0 holds the image-less one.
        expected = "decode=1, missing_image=1" if workers == 0 else "missing_image=1"
        with pytest.raises(DataError, match=rf"no valid sample in any of the 1 shards \(skipped so far: {expected}\)"):
            next(iter(stream))
    # 2 samples for 2 ranks x 2 workers: two slots would never get a sample.
    tiny = tmp_path / "tiny.tar"
    write_tar(tiny, good_members("k0", 0) + good_members("k1", 1))
    stream = data.build_train_stream(DataConfig(train=str(tiny), workers=2), PREPROCESS, tokenizer, seed=0, rank=1,
                                     world_size=2)
    with pytest.raises(DataError, match="no samples reach rank 1"):
        next(iter(stream))


def test_unreadable_shard_is_counted_and_training_goes_on(tmp_path):
    good, junk = tmp_path / "good.tar", tmp_path / "junk.tar"
    write_tar(good, [m for j in range(4) for m in good_members(f"g{j}", j)])
    junk.write_bytes(b"not a tar" * 100)
    # One shard per rank and epoch: whichever rank draws the junk shard must move on to later epochs.
    opened = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rank in range(2):
            stream = data.build_train_stream(DataConfig(train=[str(good), str(junk)], batch_size=2, workers=0),
                                             PREPROCESS, tokenizer, seed=0, rank=rank, world_size=2)
            it = iter(stream)
            batches = [next(it) for _ in range(6)]  # 3 epochs of this rank's good samples
            assert all(k.startswith("g") for b in batches for k in b["key"])
            opened += stream.skipped["shard_open"]
    assert opened >= 1
    assert any("cannot open shard" in str(w.message) and "junk.tar" in str(w.message) for w in caught)


def test_empty_tars_among_good_shards_skip_nothing(tmp_path):
    good = []
    for s in range(2):
        members = []
        for j in range(5):
            members += good_members(f"g{s}_{j}", 10 * s + j)
            good.append(f"g{s}_{j}")
        write_tar(tmp_path / f"good-{s}.tar", members)
    (tmp_path / "empty").mkdir()
    empties = [str(p) for p in empty_tars(tmp_path / "empty")]
    spec = [str(tmp_path / "good-*.tar"), *empties]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = data.build_train_stream(cfg_for(spec, workers=2), PREPROCESS, tokenizer, seed=0)
        keys, skips = one_epoch(stream)
    assert sorted(keys) == sorted(good)
    assert skips == {r: 0 for r in data.SKIP_REASONS}
    assert stream.skipped["total"] == 0
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("caption,short", [
    ("a handwritten seven. It is drawn in red ink. The ink is thick.", "a handwritten seven"),
    ("A dog on a beach", "A dog on a beach"),  # no sentence break: the caption itself
    ("A dog on a beach.", "A dog on a beach"),
    ("St. Mary's church at dusk. Two people walk by.", "St"),  # Long-CLIP's rule, abbreviations and all
    ("  spaced out . second", "spaced out"),
])
def test_the_short_caption_is_the_first_sentence(caption, short):
    assert data.short_caption(caption) == short


@pytest.mark.parametrize("workers", [0, 1])
def test_batches_carry_each_captions_short_form_when_asked(tmp_path, workers):
    """loss.short_caption: every batch holds short_text, the first sentence of each sample's caption, tokenized at
    the captions' width; captions longer than the context are counted, the short ones are not."""
    captions = {f"s{i}": f"caption number {i}. more words about it. and more" for i in range(4)}
    members = []
    for i, (key, caption) in enumerate(captions.items()):
        members += [(f"{key}.png", good_members(key, i)[0][1]), (f"{key}.txt", caption.encode())]
    write_tar(tmp_path / "a.tar", members)
    cfg = cfg_for(str(tmp_path / "a.tar"), batch_size=4, workers=workers, shuffle_buffer=1)
    stream = data.build_train_stream(cfg, PREPROCESS, tokenizer, seed=0, short_captions=True)
    batch = next(iter(stream))
    assert batch["short_text"].shape == batch["text"].shape and batch["short_text"].dtype == torch.long
    want = tokenizer([captions[k].split(". ")[0] for k in batch["key"]])
    assert torch.equal(batch["short_text"], want)
    plain = next(iter(data.build_train_stream(cfg, PREPROCESS, tokenizer, seed=0)))
    assert "short_text" not in plain
