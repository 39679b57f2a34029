"""Every tensor a training stream yields is contiguous (a cut token batch is otherwise a view with the full
context's row stride, which pinning and the copy to the device carry as strided memory); tests/e2e/test_gpu.py checks
that they are pinned on CUDA. Then the training stream (mmcl/data/stream.py) as training uses it: uint8 transfer,
resume to the same batches, a changed layout, weighted sources, workers' niceness and warnings."""

import json
import os
import warnings

import pytest
import torch
from torchvision import transforms as T

from mmcl import data
from mmcl.config import DataConfig
from mmcl.errors import ConfigError, DataError

from helpers import PREPROCESS, SIDE, cfg_for, good_members, stream_batch, tokenizer, write_tar


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from mmcl.shards.demo import make_demo_data

    root = tmp_path_factory.mktemp("stream")
    return make_demo_data(str(root), n_train=64, n_val=1, n_zeroshot=1, shard_size=16, progress=False)["train"]


@pytest.mark.parametrize("workers", [0, 1])
def test_every_tensor_of_a_stream_batch_is_contiguous(shards, workers):
    batch = stream_batch(shards, workers)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert {"image", "text", "label"} <= set(tensors)
    assert batch["text"].shape[1] < 77  # cut, as training cuts it
    strided = {k: tuple(v.stride()) for k, v in tensors.items() if not v.is_contiguous()}
    assert not strided, f"non-contiguous tensors in a stream batch: {strided}"


AUGMENT = T.Compose([T.RandomResizedCrop(SIDE, scale=(0.3, 1.0)), T.ToTensor()])


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
