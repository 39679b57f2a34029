"""Tests for mmcl.data: URL expansion, shard writing, the training stream (splitting, bad data, resume),
evaluation datasets and conversion of folders/tables to shards. Everything runs on tiny images."""

import io
import json
import os
import tarfile
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from mmcl import data
from mmcl.config import DataConfig
from mmcl.errors import ConfigError, DataError
from mmcl.shards import writer as shard_writer

from helpers import PREPROCESS, SIDE, bad_samples, cfg_for, encode, good_members, image_for, tokenizer, write_tar

AUGMENT = T.Compose([T.RandomResizedCrop(SIDE, scale=(0.3, 1.0)), T.ToTensor()])


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


def test_remote_shards_that_do_not_divide_among_slots_warn(corpus):
    local = os.path.join(os.path.dirname(corpus[0]), "part-0{0,1,2}.tar")  # 3 local shards for 2 slots
    with pytest.warns(UserWarning, match="1 of 5 shards do not divide among the 2 rank x worker slots"):
        data.build_train_stream(cfg_for("pipe:cat /nonexistent/s-{0..4}.tar", workers=2), PREPROCESS, tokenizer,
                                seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # divisible, resampled, or local: nothing to say
        quiet = [("pipe:cat /nonexistent/s-{0..3}.tar", {}),
                 ("pipe:cat /nonexistent/s-{0..4}.tar", {"resampled": True}),
                 (local, {})]
        for spec, kw in quiet:
            data.build_train_stream(cfg_for(spec, workers=2, **kw), PREPROCESS, tokenizer, seed=0)


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


NORMALIZED_AUGMENT = T.Compose([T.RandomResizedCrop(SIDE, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                                T.ToTensor(), T.Normalize((0.48, 0.45, 0.40), (0.27, 0.26, 0.28))])


@pytest.mark.parametrize("workers", [0, 2])
def test_uint8_transfer_is_bitwise_equal_to_transforming_in_the_worker(corpus, workers):
    spec, _, _ = corpus
    batches = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for uint8 in (True, False):
            stream = data.build_train_stream(cfg_for(spec, batch_size=4, workers=workers, uint8_transfer=uint8),
                                             NORMALIZED_AUGMENT, tokenizer, seed=3)
            it = iter(stream)
            batches[uint8] = [(b, stream.finish_images(b["image"])) for b in (next(it) for _ in range(12))]
            it.close()
    for (raw, fast), (ref, slow) in zip(batches[True], batches[False]):
        assert raw["image"].dtype == torch.uint8 and ref["image"].dtype == torch.float32
        assert raw["key"] == ref["key"]
        assert torch.equal(fast, slow)  # bitwise: same float32 operations in the same order
        assert torch.equal(slow, ref["image"])  # the float path's finish is the identity


@pytest.mark.parametrize("pp", [
    {"size": 40, "mean": (0.48145466, 0.4578275, 0.40821073), "std": (0.26862954, 0.26130258, 0.27577711),
     "interpolation": "bicubic", "resize_mode": "shortest"},  # open_clip's defaults (CLIP)
    {"size": (36, 44), "mean": 0.5, "std": 0.5, "interpolation": "bilinear", "resize_mode": "squash"},  # SigLIP-like
])
def test_stream_from_image_numbers_gives_open_clip_train_pixels(corpus, pp):
    """The training stream built from a model's image numbers (`ImageSpec`) yields bitwise the batches of the
    same stream given open_clip's train transform for that preprocess config, with uint8 transfer and without."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    spec, _, _ = corpus
    oc_transform = image_transform_v2(PreprocessCfg(**pp), is_train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for uint8 in (True, False):
            got = {}
            for name, preprocess in (("numbers", data.ImageSpec.from_config(pp)), ("open_clip", oc_transform)):
                stream = data.build_train_stream(cfg_for(spec, batch_size=4, workers=0, uint8_transfer=uint8),
                                                 preprocess, tokenizer, seed=4)
                it = iter(stream)
                got[name] = (stream.draft_size, stream.uint8,
                             [(b["key"], stream.finish_images(b["image"])) for b in (next(it) for _ in range(5))])
                it.close()
            (d1, u1, b1), (d2, u2, b2) = got["numbers"], got["open_clip"]
            assert (d1, u1) == (d2, u2) and u1 == uint8
            for (k1, x1), (k2, x2) in zip(b1, b2):
                assert k1 == k2 and x1.dtype == torch.float32 and torch.equal(x1, x2)


def test_split_transform_recognises_open_clip_transforms_and_leaves_others_whole():
    import open_clip

    _, train_tf, eval_tf = open_clip.create_model_and_transforms("ViT-B-32", pretrained=None)
    img = image_for(0, size=300)
    for tf in (train_tf, eval_tf):
        pil_stage, finish = data.split_transform(tf)
        assert finish is not None and finish.mean == [float(m) for m in tf.transforms[-1].mean]
        torch.manual_seed(0)
        want = tf(img)
        torch.manual_seed(0)
        got = finish(data.pil_to_uint8(pil_stage(img))[None])[0]
        assert torch.equal(got, want)
    odd = T.Compose([T.Resize(SIDE), T.ToTensor(), T.Lambda(lambda x: x * 2)])
    assert data.split_transform(odd) == (odd, None)
    assert data.split_transform(T.ToTensor())[1] is None  # not a Compose


def _ks_statistic(a, b):
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    grid = np.union1d(a, b)
    cdf = lambda x: np.searchsorted(np.sort(x), grid, side="right") / len(x)  # noqa: E731
    return float(np.abs(cdf(a) - cdf(b)).max())


@pytest.mark.parametrize("size,scale,ratio", [((300, 200), (0.08, 1.0), (3 / 4, 4 / 3)),
                                              ((64, 64), (0.9, 1.0), (3 / 4, 4 / 3)),
                                              ((400, 40), (0.3, 1.0), (3 / 4, 4 / 3))])  # often falls back
def test_random_crop_box_has_torchvisions_distribution(size, scale, ratio):
    import random

    n = 20_000
    img = Image.new("RGB", size)
    torch.manual_seed(0)
    ref = np.array([T.RandomResizedCrop.get_params(img, list(scale), list(ratio)) for _ in range(n)])
    rng = random.Random(0)
    ours = np.array([data.random_crop_box(size[0], size[1], scale, ratio, rng) for _ in range(n)])
    w, h = size
    assert (ours[:, 2] > 0).all() and (ours[:, 3] > 0).all()
    assert (ours[:, 0] + ours[:, 2] <= h).all() and (ours[:, 1] + ours[:, 3] <= w).all() and (ours >= 0).all()
    # top, left, height, width and area each follow the same law: KS distance below the 0.1 % critical value
    # for two samples of 20000 (1.95 * sqrt(2 / n) = 0.0195).
    for k in range(4):
        assert _ks_statistic(ours[:, k], ref[:, k]) < 0.0195, k
    assert _ks_statistic(ours[:, 2] * ours[:, 3], ref[:, 2] * ref[:, 3]) < 0.0195


@pytest.mark.parametrize("size,ratio", [((100, 100), (2.0, 3.0)), ((100, 100), (0.2, 0.4)), ((90, 110), (0.5, 2.0))])
def test_random_crop_box_falls_back_to_torchvisions_centre_crop(size, ratio):
    img = Image.new("RGB", size)
    # With the whole area required, no box of these aspect ratios fits, so both take the deterministic fallback
    # (for the last case the image's own ratio is inside `ratio`, and the fallback is the whole image).
    scale = (1.0, 1.0) if size == (100, 100) else (1.5, 1.5)
    want = T.RandomResizedCrop.get_params(img, list(scale), list(ratio))
    assert data.random_crop_box(size[0], size[1], scale, ratio) == tuple(want)


def test_training_transform_draws_crops_from_python_rng_and_keeps_the_rest():
    import random

    tf = T.Compose([T.RandomResizedCrop(SIDE, scale=(0.3, 1.0)), T.ToTensor()])
    fast = data.training_sample_transform(tf)
    assert type(fast.transforms[0]).__name__ == "PyRandomResizedCrop" and fast.transforms[1] is tf.transforms[1]
    img = image_for(3, size=40)
    random.seed(11)
    top, left, h, w = data.random_crop_box(40, 40, (0.3, 1.0), (3 / 4, 4 / 3))
    want = T.ToTensor()(T.functional.resized_crop(img, top, left, h, w, [SIDE, SIDE],
                                                  T.InterpolationMode.BILINEAR, antialias=True))
    random.seed(11)
    assert torch.equal(fast(img), want)  # torchvision's own crop and resize: open_clip_train's pixels
    assert data.training_sample_transform(T.ToTensor()).__class__ is T.ToTensor  # not a Compose: as it is


def test_uint8_transfer_with_a_transform_that_drops_rgb_is_one_clear_error(corpus):
    spec, _, _ = corpus
    gray = T.Compose([T.Resize(SIDE), T.CenterCrop(SIDE), T.Grayscale(1), T.ToTensor()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream = data.build_train_stream(cfg_for(spec, batch_size=4, workers=0), gray, tokenizer, seed=0)
        with pytest.raises(DataError, match="uint8_transfer=false"):
            next(iter(stream))
        # Without the uint8 path the transform's own output (one channel) is what the batch holds.
        stream = data.build_train_stream(cfg_for(spec, batch_size=4, workers=0, uint8_transfer=False), gray,
                                         tokenizer, seed=0)
        assert next(iter(stream))["image"].shape == (4, 1, SIDE, SIDE)


@pytest.mark.parametrize("resampled", [False, True])
def test_resume_yields_identical_batches(corpus, resampled):
    spec, _, _ = corpus
    cfg = cfg_for(spec, batch_size=4, workers=2, shuffle_buffer=7, resampled=resampled)
    # K + 1 = 11 batches consumed before saving: the next is due from worker 1; 22 batches of 4 = 88 samples
    # cross the end of epoch 0 (66 good samples).
    K, M = 10, 12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_stream = data.build_train_stream(cfg, AUGMENT, tokenizer, seed=5)
        ref_it = iter(ref_stream)
        reference = [next(ref_it) for _ in range(K + M)]
        ref_it.close()
        first = data.build_train_stream(cfg, AUGMENT, tokenizer, seed=5)
        it = iter(first)
        for _ in range(K):
            next(it)
        next(it)  # prefetched/consumed-after-save batches must not leak into the saved state
        state = first.state_dict()
        it.close()
        state = json.loads(json.dumps(state))  # plain types only: survives any checkpoint format
        resumed = data.build_train_stream(cfg, AUGMENT, tokenizer, seed=5)
        resumed.load_state_dict(state)
        it = iter(resumed)
        after = [next(it) for _ in range(M - 1)]
        it.close()
    for ref, got in zip(reference[K + 1:], after):
        assert ref["key"] == got["key"]
        assert torch.equal(ref["image"], got["image"])
        assert torch.equal(ref["text"], got["text"])
        assert torch.equal(ref["label"], got["label"])
    # Both consumed K + M batches, so both passed the same bad samples.
    assert resumed.skipped == ref_stream.skipped
    assert resumed.state_dict()["positions"] == ref_stream.state_dict()["positions"]


def test_resume_restores_skip_counts_and_seeds_change_order(corpus):
    spec, _, _ = corpus
    cfg = cfg_for(spec, batch_size=4, workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = data.build_train_stream(cfg, PREPROCESS, tokenizer, seed=0)
        it = iter(s)
        keys0 = [k for _ in range(6) for k in next(it)["key"]]
        it.close()
        restored = data.build_train_stream(cfg, PREPROCESS, tokenizer, seed=0)
        restored.load_state_dict(s.state_dict())
        assert restored.skipped == s.skipped
        other = data.build_train_stream(cfg, PREPROCESS, tokenizer, seed=1)
        it = iter(other)
        keys1 = [k for _ in range(6) for k in next(it)["key"]]
        it.close()
    assert keys0 != keys1


def test_state_layout_change_warns_and_restarts_epoch(corpus):
    spec, _, _ = corpus
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = data.build_train_stream(cfg_for(spec, workers=2), PREPROCESS, tokenizer, seed=0)
        state = s.state_dict()
    other = data.build_train_stream(cfg_for(spec, workers=1), PREPROCESS, tokenizer, seed=0)
    with pytest.warns(UserWarning, match="workers: 2 -> 1"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="unrecognised data stream state"):
        other.load_state_dict({"version": 99})


def test_resampled_weights_pick_sources(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, tag in ((a, "a"), (b, "b")):
        folder.mkdir()
        for s in range(2):
            write_tar(folder / f"{s}.tar", [m for j in range(5) for m in good_members(f"{tag}{s}_{j}", j)])
    spec = f"{a}/{{0..1}}.tar::{b}/{{0..1}}.tar"
    cfg = DataConfig(train=spec, batch_size=10, workers=0, shuffle_buffer=10, resampled=True, weights=[1.0, 0.0])
    it = iter(data.build_train_stream(cfg, PREPROCESS, tokenizer, seed=0))
    keys = [k for _ in range(8) for k in next(it)["key"]]
    assert all(k.startswith("a") for k in keys)
    with pytest.raises(ConfigError, match="one weight per"):
        data.build_train_stream(DataConfig(train=spec, resampled=True, weights=[1.0]), PREPROCESS, tokenizer, seed=0)
    with pytest.raises(ConfigError, match="resampled"):
        data.build_train_stream(DataConfig(train=spec, weights=[1.0, 1.0]), PREPROCESS, tokenizer, seed=0)


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


# ----------------------------------------------------------------------------------------------------------
# stages


def test_decode_image_limits_and_draft():
    big = encode(Image.new("RGB", (800, 600), (200, 10, 10)), "JPEG")
    assert data.decode_image(big, 10**7).size == (800, 600)
    # Draft decoding picks the smallest DCT scale (1/2, 1/4, 1/8) that keeps both sides >= the request.
    assert data.decode_image(big, 10**7, draft_size=(224, 224)).size == (400, 300)
    assert data.decode_image(big, 10**7, draft_size=(64, 64)).size == (100, 75)
    png = encode(Image.new("RGB", (800, 600)), "PNG")
    assert data.decode_image(png, 10**7, draft_size=(64, 64)).size == (800, 600)  # draft is JPEG-only
    with pytest.raises(data.SkipSample) as info:
        data.decode_image(big, 800 * 600 - 1)
    assert info.value.reason == "too_large"
    with pytest.raises(data.SkipSample) as info:
        data.decode_image(big[:500], 10**7)
    assert info.value.reason == "decode"


def test_draft_size_of_open_clip_transforms():
    import open_clip

    assert data.draft_size_of(open_clip.image_transform(224, is_train=False)) == (224, 224)
    # RandomResizedCrop keeps >= 90% of the area, so a side may be 0.9 of the image's: 224 / 0.9 = 248.9.
    assert data.draft_size_of(open_clip.image_transform(224, is_train=True)) == (249, 249)
    assert data.draft_size_of(T.ToTensor()) is None


def test_parse_caption_and_label():
    assert data.parse_caption(" a cat \n".encode()) == "a cat"
    assert data.parse_label(b" 7\n") == 7 and data.parse_label(None) == -1
    for raw, fn, reason in ((None, data.parse_caption, "missing_caption"), (b"", data.parse_caption, "bad_caption"),
                            (b"\xff\xfe", data.parse_caption, "bad_caption"), (b"1.5", data.parse_label, "bad_label"),
                            (b"-2", data.parse_label, "bad_label")):
        with pytest.raises(data.SkipSample) as info:
            fn(raw)
        assert info.value.reason == reason


def test_parse_sample_reads_the_fields_for_training_and_evaluation_alike():
    good = {"png": b"P", "jpg": b"J", "txt": b" a dog \n", "cls": b"3"}
    for required in (True, False):
        assert data.parse_sample(good, caption_required=required) == (b"J", "a dog", 3)  # jpg before png
        assert data.parse_sample({"webp": b"W", "txt": b"x"}, caption_required=required) == (b"W", "x", -1)
        for files, reason in (({"txt": b"no image"}, "missing_image"),
                              ({"png": b"P", "txt": b"x", "cls": b"-1"}, "bad_label")):
            with pytest.raises(data.SkipSample) as info:
                data.parse_sample(files, caption_required=required)
            assert info.value.reason == reason
    for files, reason in (({"png": b"P", "cls": b"1"}, "missing_caption"),
                          ({"png": b"P", "txt": b"\xff"}, "bad_caption"), ({"png": b"P", "txt": b"  "}, "bad_caption")):
        with pytest.raises(data.SkipSample) as info:
            data.parse_sample(files)
        assert info.value.reason == reason
        assert data.parse_sample(files, caption_required=False)[1] == ""
    with pytest.raises(data.SkipSample) as info:  # without a caption to check first, evaluation checks the label
        data.parse_sample({"png": b"P", "cls": b"seven"}, caption_required=False)
    assert info.value.reason == "bad_label"


def test_a_labelled_sample_without_caption_is_kept_for_evaluation_and_skipped_in_training(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(buf, format="PNG")
    shard = tmp_path / "shard-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for name, payload in (("a.png", buf.getvalue()), ("a.cls", b"4"), ("b.png", buf.getvalue()),
                              ("b.txt", b"a red box"), ("b.cls", b"2")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    items = list(data.build_eval_dataset(str(shard), T.ToTensor()))
    assert [(label, caption, key) for _, label, caption, key in items] == [(4, "", "a"), (2, "a red box", "b")]
    assert items[0][0].shape == (3, 6, 8)
    raw = list(data.read_raw_samples([(str(shard), None)]))
    with pytest.raises(data.SkipSample) as info:
        data.decode_sample(raw[0].files, T.ToTensor(), 10**6)
    assert info.value.reason == "missing_caption"
    image, caption, label = data.decode_sample(raw[1].files, T.ToTensor(), 10**6)
    assert torch.equal(image, items[1][0]) and (caption, label) == ("a red box", 2)


# The mmcl modules the data package may use: plain values and errors, and storage's two file-system leaves (atomic
# writes, and the manifest that tells a command's files from the user's), which import only errors
# (tests/test_layout.py).
BELOW_DATA = ("config", "errors", "storage.fsutil", "storage.manifest")


def test_data_modules_import_only_the_modules_before_them():
    import ast

    order = ["limits", "sources", "sizes", "reading", "decode", "skips", "transforms", "naflex", "pipeline",
             "batching", "stream", "eval_data", "shard_inputs", "writer", "demo"]
    folder = os.path.dirname(data.__file__)
    assert sorted(order + ["__init__"]) == sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py"))
    for i, name in enumerate(order):
        tree = ast.parse(open(os.path.join(folder, name + ".py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert node.module in order[:i], f"{name}.py imports .{node.module}"
            elif isinstance(node, ast.ImportFrom) and node.level == 2:
                assert node.module in BELOW_DATA, f"{name}.py imports ..{node.module}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(m.split(".")[0] == "mmcl" for m in modules), f"{name}.py imports {modules}"


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


def test_read_raw_samples_positions_and_pipe(tmp_path):
    path = tmp_path / "p.tar"
    write_tar(path, [m for j in range(5) for m in good_members(f"k{j}", j)])
    items = list(data.read_raw_samples([(str(path), None)]))
    assert [i.key for i in items] == [f"k{j}" for j in range(5)]
    assert [i.pos for i in items] == [(0, j + 1) for j in range(5)]
    assert set(items[0].files) == {"png", "txt", "cls"}
    resumed = list(data.read_raw_samples([(str(path), None)], start=(0, 3)))
    assert [i.key for i in resumed] == ["k3", "k4"]
    piped = list(data.read_raw_samples([(f"pipe:cat {path}", None)]))
    assert [i.files for i in piped] == [i.files for i in items]


def test_expand_urls(tmp_path):
    for name in ("a-000.tar", "a-001.tar", "a-002.tar", "b-000.tar"):
        (tmp_path / name).write_bytes(b"")
    d = str(tmp_path)
    assert data.expand_urls(f"{d}/a-{{000..002}}.tar") == [f"{d}/a-00{i}.tar" for i in range(3)]
    assert data.expand_urls(f"{d}/a-*.tar") == [f"{d}/a-00{i}.tar" for i in range(3)]
    assert data.expand_urls(f"{d}/a-000.tar::{d}/b-000.tar") == [f"{d}/a-000.tar", f"{d}/b-000.tar"]
    assert data.expand_sources(f"{d}/a-00[01].tar::{d}/b-*.tar") == [[f"{d}/a-000.tar", f"{d}/a-001.tar"],
                                                                    [f"{d}/b-000.tar"]]
    assert data.expand_urls(f"[{d}/a-000.tar, {d}/b-000.tar]") == [f"{d}/a-000.tar", f"{d}/b-000.tar"]
    assert data.expand_urls([f"{d}/b-000.tar", f"{d}/a-00{{1..2}}.tar"]) == [f"{d}/b-000.tar", f"{d}/a-001.tar",
                                                                             f"{d}/a-002.tar"]
    (tmp_path / "list.yaml").write_text(f"- {d}/a-000.tar\n- {d}/b-*.tar\n")
    assert data.expand_urls(str(tmp_path / "list.yaml")) == [f"{d}/a-000.tar", f"{d}/b-000.tar"]
    assert len(data.expand_urls(d)) == 4  # a directory means its shards
    assert data.expand_urls(f"file://{d}/b-000.tar") == [f"{d}/b-000.tar"]
    assert data.expand_urls("pipe:curl -s https://host/s-{0..1}.tar") == [
        "pipe:curl -s https://host/s-0.tar", "pipe:curl -s https://host/s-1.tar"]
    assert data.expand_urls("https://host/x-{0..2}.tar")[2] == "https://host/x-2.tar"
    with pytest.warns(UserWarning, match="1 of 4 shards"):
        assert len(data.expand_urls(f"{d}/a-{{000..003}}.tar")) == 3
    with pytest.raises(DataError, match="no shards match '.*/zz-\\*.tar'"):
        data.expand_urls(f"{d}/a-000.tar::{d}/zz-*.tar")
    with pytest.raises(DataError, match="no training data"):
        data.expand_urls(None)


def test_write_shards_roundtrip(tmp_path):
    samples = [{"key": f"k{i}", "image": image_for(i), "caption": f"cap {i}", "label": i,
                "json": {"i": i}} for i in range(5)]
    samples.append({"key": "raw", "image": encode(image_for(9), "JPEG"), "ext": "jpg", "caption": "raw bytes"})
    summary = shard_writer.write_shards(samples, str(tmp_path / "out"), shard_size=4, prefix="x")
    assert summary["n_samples"] == 6 and summary["n_shards"] == 2
    assert [os.path.basename(p) for p in summary["shards"]] == ["x-000000.tar", "x-000001.tar"]
    items = list(data.read_raw_samples([(p, None) for p in summary["shards"]]))
    assert [i.key for i in items] == ["k0", "k1", "k2", "k3", "k4", "raw"]
    assert items[2].files["txt"] == b"cap 2" and items[2].files["cls"] == b"2"
    assert json.loads(items[2].files["json"]) == {"i": 2}
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(items[2].files["png"]))), np.asarray(image_for(2)))
    assert set(items[5].files) == {"jpg", "txt"}
    again = shard_writer.write_shards(samples, str(tmp_path / "again"), shard_size=4, prefix="x")
    assert open(again["shards"][0], "rb").read() == open(summary["shards"][0], "rb").read()
    with pytest.raises(DataError, match="no '.'"):
        shard_writer.write_shards([{"key": "a.b", "image": image_for(0), "caption": "c"}], str(tmp_path / "bad"))
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path / "bad"))


# ----------------------------------------------------------------------------------------------------------
# evaluation datasets and conversion


@pytest.fixture()
def image_folder(tmp_path):
    root = tmp_path / "folder"
    for c, name in enumerate(("dog", "cat_face")):
        (root / name).mkdir(parents=True)
        for i in range(3):
            image_for(10 * c + i).save(root / name / f"{i}.png")
    (root / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not really")
    (root / "dog" / "notes.md").write_text("not an image")
    return root


def test_shards_from_image_folder_and_eval(image_folder, tmp_path, capsys):
    out = tmp_path / "shards"
    summary = shard_writer.shards_from_input(str(image_folder), str(out), shard_size=4, progress=False)
    assert summary["n_samples"] == 6 and summary["n_shards"] == 2
    assert summary["skipped"] == {"decode": 1, "not_image": 1}
    assert "wrote 6 samples in 2 shards" in capsys.readouterr().out
    ds = data.build_eval_dataset(str(out / "shard-{000000..000001}.tar"), PREPROCESS)
    assert ds.classnames == ["cat face", "dog"]
    items = list(ds)
    expected = [(0, "a photo of a cat face.")] * 3 + [(1, "a photo of a dog.")] * 3
    assert [(lab, cap) for _, lab, cap, _ in items] == expected
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2)
    keys = [k for batch in loader for k in batch[3]]
    assert sorted(keys) == sorted(k for *_, k in items)
    folder = data.build_eval_dataset(str(image_folder), PREPROCESS)
    assert folder.classnames == ["cat_face", "dog"] and len(folder) == 7
    image, label, caption, key = folder[0]
    assert image.shape == (3, SIDE, SIDE) and label == 0 and caption == "" and key == os.path.join("cat_face", "0.png")
    skips = [item for item in (folder[i] for i in range(len(folder))) if isinstance(item, data.EvalSkip)]
    assert [(s.reason, s.where) for s in skips] == [("decode", os.path.join("dog", "broken.jpg"))]


def test_shards_from_csv_and_jsonl(image_folder, tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("image,caption,label\n"
                     "folder/dog/0.png,a dog,1\n"
                     "folder/dog/missing.png,gone,1\n"
                     "folder/cat_face/1.png,,0\n"
                     "folder/cat_face/2.png,a cat,x\n"
                     "folder/dog/broken.jpg,broken,1\n"
                     "folder/cat_face/0.png,a cat,\n")
    summary = shard_writer.shards_from_input(str(table), str(tmp_path / "csv"), progress=False)
    assert summary["n_samples"] == 2
    assert summary["skipped"] == {"missing_file": 1, "bad_caption": 1, "bad_label": 1, "decode": 1}
    items = list(data.build_eval_dataset(str(tmp_path / "csv"), PREPROCESS))
    assert [(lab, cap) for _, lab, cap, _ in items] == [(1, "a dog"), (-1, "a cat")]
    lines = [json.dumps({"image": "folder/dog/1.png", "caption": "one dog", "label": 1}), "{not json",
             json.dumps({"caption": "no image"}), json.dumps({"image": "folder/dog/2.png", "caption": "two"})]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    summary = shard_writer.shards_from_input(str(tmp_path / "t.jsonl"), str(tmp_path / "jl"), progress=False)
    assert summary["n_samples"] == 2 and summary["skipped"] == {"bad_row": 1, "missing_image": 1}
    assert summary["skipped_examples"][0] == "t.jsonl:2: bad_row"
    with pytest.raises(DataError, match="needs columns 'image' and 'caption'"):
        (tmp_path / "bad.csv").write_text("path,text\nx,y\n")
        shard_writer.shards_from_input(str(tmp_path / "bad.csv"), str(tmp_path / "b"), progress=False)
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported input"):
        shard_writer.shards_from_input(str(tmp_path / "t.txt"), str(tmp_path / "c"), progress=False)


# ---------------------------------------------------------------------------------------------- tar reader
def _tar_bytes(members, fmt=tarfile.USTAR_FORMAT, compression=""):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:" + compression, format=fmt) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        d = tarfile.TarInfo("a-folder")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
    return buf.getvalue()


class _Pipe(io.RawIOBase):
    """A non-seekable stream that returns short reads, like a pipe."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def readable(self):
        return True

    def readinto(self, buf):
        n = min(len(buf), 700, len(self.data) - self.pos)
        buf[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def _read_all(stream, keep=lambda name: True):
    reader = data.TarReader(stream)
    return [(name, reader.read()) for name in reader if keep(name)]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("compression", ["", "gz", "bz2", "xz"])
def test_tar_reader_matches_tarfile(fmt, compression):
    long_dir = "d" * 120 if fmt != tarfile.USTAR_FORMAT else "d" * 90  # ustar splits paths <= 255 into prefix/name
    members = [(f"{long_dir}/k{i:03d}.{ext}", os.urandom(int(n)))
               for i, n in enumerate(np.random.default_rng(0).integers(0, 3000, 12)) for ext in ("jpg", "txt")]
    members.append(("ünïcode/naïve.txt", b"x"))
    raw = _tar_bytes(members, fmt, compression)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        want = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    assert want == members
    assert _read_all(io.BytesIO(raw)) == want
    assert _read_all(io.BufferedReader(_Pipe(raw))) == want
    # Members that are not read are passed over, on seekable streams and pipes alike.
    txt_only = [m for m in want if m[0].endswith(".txt")]
    assert _read_all(io.BytesIO(raw), lambda n: n.endswith(".txt")) == txt_only
    assert _read_all(io.BufferedReader(_Pipe(raw)), lambda n: n.endswith(".txt")) == txt_only


def test_tar_reader_reports_damage_that_tarfile_would_hide():
    members = [(f"k{i}.txt", bytes([i]) * 600) for i in range(5)]
    raw = bytearray(_tar_bytes(members))
    with tarfile.open(fileobj=io.BytesIO(bytes(raw))) as tar:
        third = [m for m in tar.getmembers() if m.name == "k2.txt"][0]
    raw[third.offset + 10] ^= 0xFF  # a damaged header in the middle of the archive
    with tarfile.open(fileobj=io.BytesIO(bytes(raw)), mode="r|") as tar:
        assert [m.name for m in tar] == ["k0.txt", "k1.txt"]  # tarfile silently stops here
    reader = data.TarReader(io.BytesIO(bytes(raw)))
    got = []
    with pytest.raises(data.TarFormatError, match="bad header checksum"):
        for name in reader:
            got.append(name)
    assert got == ["k0.txt", "k1.txt"]
    # Cut inside a member that is skipped (not read): still an error, seekable or not.
    cut = bytes(_tar_bytes(members))[:third.offset_data + 100]
    for stream in (io.BytesIO(cut), io.BufferedReader(_Pipe(cut))):
        with pytest.raises(data.TarFormatError, match="unexpected end of data"):
            for _ in data.TarReader(stream):
                pass
    for bad, why in ((b"", "empty file"), (b"not a tar" * 100, "not a tar file")):
        with pytest.raises(data.TarFormatError, match=why):
            data.TarReader(io.BytesIO(bad))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_tar_cut_anywhere_is_an_error_unless_cut_between_members(fmt):
    sizes = [0, 1, 511, 512, 513, 1500, 7]
    members = [(f"k{i}.{'p' * 120 if fmt == tarfile.PAX_FORMAT else 'bin'}", os.urandom(n))
               for i, n in enumerate(sizes)]
    raw = _tar_bytes(members, fmt)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        every = tar.getmembers()  # the files and a folder
        ends = {m.offset_data + m.size + (-m.size) % 512 for m in every}
    starts = [m.offset for m in every if m.isfile()]  # where a member's first header (pax: extended header) begins
    last = max(ends)
    for cut in sorted(set(range(0, last + 1024, 97)) | {m.offset for m in every} | ends):
        # Clean: the archive ends between two members (as if written without end-of-archive blocks) or after its
        # first end-of-archive block.
        clean = cut in ends or cut >= last + 512
        for stream in (io.BytesIO(raw[:cut]), io.BufferedReader(_Pipe(raw[:cut]))):
            got = []
            try:
                reader = data.TarReader(stream)
                for name in reader:
                    got.append((name, reader.read()))
            except data.TarFormatError:
                assert not clean or cut == 0, cut  # a 0-byte stream is no archive
                continue
            assert clean, f"cut at byte {cut} of {len(raw)} went unnoticed"
            assert got == [m for m, start in zip(members, starts) if start < cut], cut


def niceness_tokenizer(texts):
    """Records the niceness of the process that tokenizes (a DataLoader worker) in every token."""
    return torch.full((len(texts), 4), os.nice(0), dtype=torch.long)


@pytest.mark.parametrize("nice", [0, 7])
def test_workers_take_the_configured_niceness(corpus, nice):
    spec, _, _ = corpus
    base = os.nice(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream = data.build_train_stream(cfg_for(spec, batch_size=2, workers=2, worker_nice=nice), PREPROCESS,
                                         niceness_tokenizer, seed=0)
        it = iter(stream)
        got = {int(next(it)["text"][0, 0]) for _ in range(4)}
        it.close()
    assert got == {min(19, base + nice)}
    assert os.nice(0) == base  # the training process itself is untouched


def _empty_tars(root):
    """Archives without members, as tarfile (ustar, pax, GNU; plain and gzip) and GNU tar's CLI write them."""
    import shutil
    import subprocess

    paths = []
    for fmt, name in ((tarfile.USTAR_FORMAT, "ustar"), (tarfile.PAX_FORMAT, "pax"), (tarfile.GNU_FORMAT, "gnu")):
        for mode, ext in (("w", "tar"), ("w:gz", "tar.gz")):
            path = root / f"empty-{name}.{ext}"
            with tarfile.open(path, mode, format=fmt):
                pass
            paths.append(path)
    assert shutil.which("tar"), "GNU tar is needed to write the CLI's empty archive"
    cli = root / "empty-cli.tar"
    subprocess.run(["tar", "-cf", str(cli), "-T", "/dev/null"], check=True)
    paths.append(cli)
    one_block = root / "empty-one-block.tar"  # only the first end-of-archive block
    one_block.write_bytes(bytes(512))
    paths.append(one_block)
    return paths


def test_empty_tar_archives_yield_nothing_and_count_nothing(tmp_path):
    paths = _empty_tars(tmp_path)
    for path in paths:
        with tarfile.open(path) as tar:  # the standard library's reading: a valid archive with no members
            assert tar.getmembers() == [], path
        with open(path, "rb") as f:
            assert list(data.TarReader(f)) == [], path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(data.read_raw_samples([(str(p), None) for p in paths]))
    assert items == [] and caught == []
    # A 0-byte file is no archive: tarfile refuses it ("empty file"), and so does the reader (a lost shard).
    zero = tmp_path / "zero.tar"
    zero.write_bytes(b"")
    with pytest.raises(tarfile.ReadError, match="empty file"):
        tarfile.open(zero)
    with pytest.warns(UserWarning, match="cannot open shard .*zero.tar.*empty file"):
        items = list(data.read_raw_samples([(str(zero), None)]))
    assert [(i.error, i.url) for i in items] == [("shard_open", str(zero))]


def test_empty_tars_among_good_shards_skip_nothing(tmp_path):
    good = []
    for s in range(2):
        members = []
        for j in range(5):
            members += good_members(f"g{s}_{j}", 10 * s + j)
            good.append(f"g{s}_{j}")
        write_tar(tmp_path / f"good-{s}.tar", members)
    (tmp_path / "empty").mkdir()
    empties = [str(p) for p in _empty_tars(tmp_path / "empty")]
    spec = [str(tmp_path / "good-*.tar"), *empties]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = data.build_train_stream(cfg_for(spec, workers=2), PREPROCESS, tokenizer, seed=0)
        keys, skips = one_epoch(stream)
    assert sorted(keys) == sorted(good)
    assert skips == {r: 0 for r in data.SKIP_REASONS}
    assert stream.skipped["total"] == 0
    assert [str(w.message) for w in caught] == []


def test_worker_warnings_reach_the_training_process_once(tmp_path):
    """Each of 2 workers reads the non-tar shard in every epoch; its warning is shown once, by the main process."""
    for s in range(2):
        write_tar(tmp_path / f"good-{s}.tar", [m for j in range(3) for m in good_members(f"g{s}_{j}", j)])
    (tmp_path / "bad.tar").write_bytes(b"no tar here" * 20)
    stream = data.build_train_stream(cfg_for(str(tmp_path / "*.tar"), workers=2), PREPROCESS, tokenizer, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default: once per message and place
        it = iter(stream)
        for _ in range(6 * 4):  # 6 samples per epoch
            next(it)
        it.close()
    assert stream.epoch >= 2 and stream.skipped["shard_open"] >= 2  # the bad shard was read again and again
    assert [(w.category, str(w.message)) for w in caught] == [
        (UserWarning, f"cannot open shard {tmp_path / 'bad.tar'}: TarFormatError: not a tar file; skipping it")]


# ------------------------------------------------------------------------------------- img2dataset's layouts
def _img2dataset_files_layout(root, n_shards=2, per_shard=3, no_caption=(), with_parquet=True):
    """A folder as img2dataset's FilesSampleWriter writes it: ``{shard:05d}/{key}.jpg|.txt|.json`` with the
    key ``{shard:05d}{index:04d}``, the metadata JSON indented by 4, and ``{shard:05d}.parquet`` /
    ``{shard:05d}_stats.json`` beside the folders. Returns {key: (caption, url)} of the samples written."""
    root.mkdir(parents=True)
    expected = {}
    for shard in range(n_shards):
        folder = root / f"{shard:05d}"
        folder.mkdir()
        rows = []
        for i in range(per_shard):
            key = f"{shard:05d}{i:04d}"
            url = f"http://127.0.0.1:8000/img/{shard}-{i}.jpg"
            caption = f"picture {shard}-{i} of a {'red' if i % 2 else 'blue'} thing"
            buf = io.BytesIO()
            image_for(10 * shard + i, size=20).convert("RGB").save(buf, format="JPEG", quality=90)
            (folder / f"{key}.jpg").write_bytes(buf.getvalue())
            meta = {"url": url, "caption": caption, "key": key, "status": "success", "error_message": None,
                    "width": 20, "height": 20, "original_width": 20, "original_height": 20, "exif": "{}",
                    "sha256": "0" * 64}
            if key not in no_caption:
                (folder / f"{key}.txt").write_text(caption)
                expected[key] = (caption, url)
            (folder / f"{key}.json").write_text(json.dumps(meta, indent=4))
            rows.append(meta)
        if with_parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), str(root / f"{shard:05d}.parquet"))
        (root / f"{shard:05d}_stats.json").write_text(json.dumps({"count": per_shard, "successes": per_shard}))
    return expected


def _shard_samples(out):
    samples = {}
    for tar_path in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return samples


def test_shards_from_img2dataset_files_layout_reads_captions_and_keeps_metadata(tmp_path, capsys):
    """Numbered folders of KEY.jpg/KEY.txt/KEY.json (img2dataset's `files` output) give the .txt captions, the
    .json fields (url included) and img2dataset's keys; they are not read as an ImageFolder of classes 00000..."""
    root = tmp_path / "i2d"
    expected = _img2dataset_files_layout(root, no_caption=("000010001",))
    (root / "00001" / "000019999.txt").write_text("a caption whose image failed to download")
    out = tmp_path / "shards"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = shard_writer.shards_from_input(str(root) + os.sep, str(out), shard_size=4, progress=False)
    assert summary["n_samples"] == 5 and summary["skipped"] == {"missing_caption": 1, "missing_image": 1}
    assert summary["skipped_examples"] == [f"{os.path.join('00001', '000010001.jpg')}: missing_caption",
                                           f"{os.path.join('00001', '000019999.txt')}: missing_image"]
    notes = [str(w.message) for w in caught if "caption file" in str(w.message)]
    assert len(notes) == 1 and "000010001.jpg" in notes[0] and "\n" not in notes[0]
    assert not (out / "classnames.txt").exists()
    samples = _shard_samples(out)
    assert sorted(samples) == sorted(expected)
    for key, (caption, url) in expected.items():
        assert samples[key]["txt"].decode() == caption
        meta = json.loads(samples[key]["json"])
        assert meta["url"] == url and meta["key"] == key and meta["status"] == "success"
        assert "cls" not in samples[key]
    items = list(data.build_eval_dataset(str(out), PREPROCESS))
    assert sorted((key, cap) for _, _, cap, key in items) == sorted((k, c) for k, (c, _) in expected.items())


def test_caption_files_beside_class_folders_are_not_read_as_an_image_folder(image_folder, tmp_path):
    """One caption file beside an image makes the folder a caption folder: the images without one are skipped and
    counted, never given the folder name as caption."""
    (image_folder / "dog" / "0.txt").write_text("a brown dog on grass")
    with pytest.warns(UserWarning, match="6 images .* have no caption file"):
        summary = shard_writer.shards_from_input(str(image_folder), str(tmp_path / "out"), progress=False)
    samples = _shard_samples(tmp_path / "out")
    assert [s["txt"].decode() for s in samples.values()] == ["a brown dog on grass"]
    assert summary["skipped"]["missing_caption"] == 6  # the other 5 images and the broken one
    assert summary["skipped"]["not_image"] == 1  # notes.md


def test_shards_cli_on_img2dataset_files_layout_warns_once_and_exits_0(tmp_path, capsys):
    from mmcl import cli

    root = tmp_path / "i2d"
    _img2dataset_files_layout(root, n_shards=1, per_shard=3, no_caption=("000000000", "000000002"),
                              with_parquet=False)
    assert cli.main(["shards", "--input", str(root), "--out", str(tmp_path / "s")]) == 0
    err = capsys.readouterr().err
    assert err.count("mmcl: warning:") == 1 and "2 images" in err and "no caption file" in err
    # no caption anywhere (img2dataset without a caption column writes no .txt): an error, nothing invented
    bare = tmp_path / "bare"
    _img2dataset_files_layout(bare, n_shards=1, per_shard=2, no_caption=("000000000", "000000001"),
                              with_parquet=False)
    assert cli.main(["shards", "--input", str(bare), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "mmcl: error: no valid sample" in err and "missing_caption=2" in err and "a photo of" not in err
    # img2dataset's webdataset output is trained on as it is; converting it again is pointed there
    (tmp_path / "wds").mkdir()
    write_tar(tmp_path / "wds" / "00000.tar", [("000000000.txt", b"x")])
    assert cli.main(["shards", "--input", str(tmp_path / "wds"), "--out", str(tmp_path / "w")]) == 2
    assert "already holds WebDataset shards" in capsys.readouterr().err


def test_url_tables_name_img2dataset_and_local_urls_are_read(image_folder, tmp_path):
    web = tmp_path / "urls.csv"
    web.write_text("url,caption\nhttps://example.com/a.jpg,a dog\n")
    with pytest.raises(DataError, match=r"img2dataset --url_list .*urls.csv --input_format csv --url_col url "
                                        r"--caption_col caption --output_format webdataset"):
        shard_writer.shards_from_input(str(web), str(tmp_path / "w"), progress=False)
    laion = tmp_path / "laion.csv"
    laion.write_text("URL,TEXT\nhttps://example.com/a.jpg,a dog\n")
    with pytest.raises(DataError, match="needs columns 'image' and 'caption'.*img2dataset --url_list .* "
                                        "--url_col URL --caption_col TEXT"):
        shard_writer.shards_from_input(str(laion), str(tmp_path / "l"), progress=False)
    (tmp_path / "urls.jsonl").write_text(json.dumps({"url": "https://example.com/a.jpg", "caption": "x"}) + "\n")
    with pytest.raises(DataError, match=r"read_json\(.*urls.jsonl', lines=True\).to_parquet\(.*urls.parquet'\).*"
                                        r"--input_format parquet"):
        shard_writer.shards_from_input(str(tmp_path / "urls.jsonl"), str(tmp_path / "j"), progress=False)
    dog0 = image_folder / "dog" / "0.png"
    local = tmp_path / "local.csv"
    local.write_text(f"url,caption\n{dog0.as_uri()},a dog by URI\nfolder/dog/1.png,a dog by path\n"
                     f"file://{tmp_path}/folder/dog/missing.png,gone\n")
    summary = shard_writer.shards_from_input(str(local), str(tmp_path / "loc"), progress=False)
    assert summary["n_samples"] == 2 and summary["skipped"] == {"missing_file": 1}
    samples = list(_shard_samples(tmp_path / "loc").values())
    assert [s["txt"].decode() for s in samples] == ["a dog by URI", "a dog by path"]
    assert json.loads(samples[0]["json"])["url"] == dog0.as_uri()
    assert samples[0]["png"] == dog0.read_bytes()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"url": dog0.as_uri(), "caption": "from parquet"},
                                         {"url": "http://example.com/x.jpg", "caption": "web"}]),
                   str(tmp_path / "t.parquet"))
    with pytest.raises(DataError, match="--input_format parquet"):
        shard_writer.shards_from_input(str(tmp_path / "t.parquet"), str(tmp_path / "p"), progress=False)
    pq.write_table(pa.Table.from_pylist([{"url": dog0.as_uri(), "caption": "from parquet"}]),
                   str(tmp_path / "ok.parquet"))
    summary = shard_writer.shards_from_input(str(tmp_path / "ok.parquet"), str(tmp_path / "p2"), progress=False)
    assert [s["txt"].decode() for s in _shard_samples(tmp_path / "p2").values()] == ["from parquet"]
