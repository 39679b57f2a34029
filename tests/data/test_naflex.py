"""NaFlex batches (mmcl.data.naflex): the per-batch sequence length and pairs, aspect-kept resizing, patches padded to
the length, and the training stream filled to the token budget, resuming exactly."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.naflex_transforms import get_image_size_for_seq

from mmcl.config import DataConfig, NaflexConfig
from mmcl.data import NaflexPlan, build_train_stream
from mmcl.data.decode import pil_to_uint8
from mmcl.data.naflex import EvalPatchify, PatchNormalizer, SeqResize, padding_waste, patch_batch
from mmcl.data.transforms import ImageSpec

PLAN = NaflexPlan.build([16, 36, 64], [1, 1, 2], 512, 8, seed=3)


def test_plan_draws_lengths_from_seed_and_batch_with_the_given_weights():
    lengths = [PLAN.seq_len_at(b) for b in range(4000)]
    assert lengths == [NaflexPlan.build([16, 36, 64], [1, 1, 2], 512, 8, seed=3).seq_len_at(b) for b in range(4000)]
    assert lengths != [NaflexPlan.build([16, 36, 64], [1, 1, 2], 512, 8, seed=4).seq_len_at(b) for b in range(4000)]
    share = {n: lengths.count(n) / len(lengths) for n in (16, 36, 64)}
    assert share == pytest.approx({16: 0.25, 36: 0.25, 64: 0.5}, abs=0.03)
    assert [PLAN.pairs_at(b) for b in range(3)] == [512 // n for n in lengths[:3]]
    assert PLAN.capacity == 32 and max(PLAN.pairs_at(b) for b in range(200)) == 32


def _varied_images(n, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        ratio = math.exp(rng.uniform(math.log(1 / 3), math.log(3)))
        h = int(rng.integers(60, 500))
        yield Image.new("RGB", (max(8, int(h * ratio)), h), tuple(int(c) for c in rng.integers(0, 255, 3)))


@pytest.mark.parametrize("seq_len,patch", [(64, 8), (256, 16), (576, 16)])
def test_resized_images_fit_the_length_and_keep_their_aspect_ratio_within_a_patch(seq_len, patch):
    for img in _varied_images(40):
        out = SeqResize(seq_len, patch)(img)
        w, h = out.size
        assert w % patch == 0 and h % patch == 0 and (w // patch) * (h // patch) <= seq_len
        # each side within one patch of the image scaled by one factor r (the aspect ratio kept), r the largest
        # that fits (timm's search): a slightly larger r would need more patches
        r, _ = get_image_size_for_seq((img.height, img.width), patch, seq_len)
        assert 0 <= h - r * img.height < patch and 0 <= w - r * img.width < patch
        bigger = (math.ceil(r * 1.01 * img.height / patch), math.ceil(r * 1.01 * img.width / patch))
        assert bigger[0] * bigger[1] > seq_len or r * 1.01 * img.height < patch


def test_patch_batch_pads_to_the_length_and_padding_waste_is_small_on_varied_images():
    images = [pil_to_uint8(SeqResize(256, 16)(img)) for img in _varied_images(64, seed=1)]
    batch = patch_batch(images, 256, 16)
    assert batch["patches"].shape == (64, 256, 16 * 16 * 3) and batch["patches"].dtype == torch.uint8
    counts = batch["patch_valid"].sum(1)
    for i, img in enumerate(images):
        h, w = img.shape[1] // 16, img.shape[2] // 16
        assert counts[i] == h * w and not batch["patch_valid"][i, h * w:].any()
        assert batch["patch_coord"][i, h * w - 1].tolist() == [h - 1, w - 1]
        # channels last within a patch: the first patch's first pixel
        assert batch["patches"][i, 0, :3].tolist() == img[:, 0, 0].tolist()
    waste = padding_waste(batch["patch_valid"])
    assert waste == pytest.approx(1 - float(counts.sum()) / (64 * 256))
    assert waste < 0.05


def test_normaliser_and_eval_transform_match_torchvision_on_the_real_patches():
    img = next(_varied_images(1, seed=2))
    mean, std = (0.48, 0.45, 0.4), (0.26, 0.26, 0.27)
    one = EvalPatchify(64, 8, mean, std)(img)
    resized = pil_to_uint8(SeqResize(64, 8)(img)).double() / 255
    m, s = (torch.tensor(v, dtype=torch.float64)[:, None, None] for v in (mean, std))
    ref = (resized - m) / s
    n = int(one["patch_valid"].sum())
    from timm.data.naflex_transforms import patchify_image

    torch.testing.assert_close(one["patches"][:n].double(), patchify_image(ref, (8, 8))[0], atol=1e-5, rtol=1e-5)
    assert one["patches"][n:].abs().sum() == 0
    batch = PatchNormalizer(mean, std)(patch_batch([pil_to_uint8(SeqResize(64, 8)(img))], 64, 8))
    torch.testing.assert_close(batch["patches"][0], one["patches"])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from mmcl.shards.demo import make_demo_data

    root = tmp_path_factory.mktemp("naflex")
    return make_demo_data(str(root), n_train=160, n_val=1, n_zeroshot=1, image_size=32, shard_size=40,
                          progress=False)["train"]


def _stream(shards, workers=0):
    import open_clip

    cfg = DataConfig(train=shards, workers=workers, shuffle_buffer=16,
                     naflex=NaflexConfig(seq_lens=[4, 9, 16], max_tokens_per_batch=96))
    plan = NaflexPlan.build([4, 9, 16], None, 96, 8, seed=5)
    spec = ImageSpec(size=32, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    return build_train_stream(cfg, spec, open_clip.get_tokenizer("ViT-B-32"), seed=5, naflex=plan), plan


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_stream_fills_each_batch_to_the_budget_and_resumes_exactly(shards):
    stream, plan = _stream(shards)
    it = iter(stream)
    first = _take(it, 3)
    state = stream.state_dict()
    rest = _take(it, 4)
    for b, batch in enumerate(first + rest):
        n, length = batch["patches"].shape[:2]
        assert (n, length) == (plan.pairs_at(b), plan.seq_len_at(b)) and n * length <= 96
        assert batch["text"].shape[0] == n and "image" not in batch
    assert len({b["patches"].shape[0] for b in first + rest}) > 1  # the pairs per batch vary with the length
    resumed, _ = _stream(shards)
    resumed.load_state_dict(state)
    again = _take(iter(resumed), 4)
    for a, b in zip(rest, again):
        assert a["key"] == b["key"]
        for k in ("patches", "patch_coord", "patch_valid", "text"):
            assert torch.equal(a[k], b[k]), k
    normalised = stream.finish_images({k: first[0][k] for k in ("patches", "patch_coord", "patch_valid")})
    assert normalised["patches"].dtype == torch.float32 and normalised["patches"].abs().max() <= 1.0


def test_stream_with_a_worker_gives_the_batches_of_the_inline_stream(shards):
    inline = _take(iter(_stream(shards)[0]), 3)
    worker = _stream(shards, workers=1)[0]
    it = iter(worker)
    batches = _take(it, 3)
    it.close()
    for a, b in zip(inline, batches):
        assert a["key"] == b["key"] and torch.equal(a["patches"], b["patches"])


@pytest.mark.parametrize("override,named", [
    ("loss.mochi.weight=1.0",
     "data.naflex does not work with loss terms loss.mochi.weight (NaFlex takes clip, siglip)"),
    ("model.patch_dropout=0.5", "data.naflex does not work with model.patch_dropout"),
    ("train.epochs=2", "data.naflex does not work with train.samples / train.epochs"),
    ("data.naflex.seq_len_probs=[1.0]", "data.naflex.seq_len_probs needs one weight >= 0 per length"),
    ("data.naflex.max_tokens_per_batch=32", "must hold at least one sequence of the longest length (64)"),
])
def test_config_refuses_what_does_not_work_with_naflex_in_one_line(override, named, capsys):
    from mmcl.cli import main

    from helpers import ROOT

    code = main(["train", "--config", str(ROOT / "configs" / "naflex.yaml"), "data.train=none.tar", override])
    err = capsys.readouterr().err
    assert code != 0 and named in err and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("mmcl: error:")]


def test_a_naflex_tower_without_seq_lens_is_refused_when_the_run_is_built():
    from mmcl.config import load_config
    from mmcl.errors import ConfigError
    from mmcl.models import build
    from mmcl.training.setup import naflex_preprocess

    from helpers import ROOT

    cfg = load_config(str(ROOT / "configs" / "naflex.yaml"), ["data.naflex.seq_lens=[]", "eval.naflex_seq_len=[]"])
    model, _, pp, *_ = build(cfg.model)
    with pytest.raises(ConfigError, match="data.naflex.seq_lens .* is needed with a NaFlex image tower"):
        naflex_preprocess(cfg, model, pp)
    ok = load_config(str(ROOT / "configs" / "naflex.yaml"), ["eval.naflex_seq_len=[36, 64]"])
    assert naflex_preprocess(ok, model, pp)["naflex_seq_len"] == 36
