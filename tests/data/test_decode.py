"""DCT-scaled (draft) JPEG decoding: evaluation's resize + centre crop sees the same pixels as from a full decode,
and the training crop keeps its scale and ratio ranges and is never enlarged. Then the decoding limits and the
parsing of captions, labels and samples, with the skip reason of each bad field."""

import math
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision import transforms as T

from mmcl import data
from mmcl.data import decode_image, draft_size_of, random_crop_box
from mmcl.data.transforms import PyRandomResizedCrop, crop_draft_size

from helpers import encode

MAX_PIXELS = 10**8
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def photos():
    """The LAION-like photos bench/bench_data.py measures the loader on."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from bench_data import LaionLike
    finally:
        sys.path.remove(str(ROOT / "bench"))
    make = LaionLike(np.random.default_rng(7))
    return [make() for _ in range(12)]


def test_eval_transform_draft_matches_full_decode(photos):
    import open_clip

    evaluate = open_clip.image_transform(224, is_train=False)
    pil_stage = T.Compose(evaluate.transforms[:-2])  # resize, centre crop, RGB: up to the pixels
    draft = draft_size_of(evaluate)
    assert draft == (224, 224)
    reduced, diffs = 0, []
    for jpeg in photos:
        full = decode_image(jpeg, MAX_PIXELS)
        small = decode_image(jpeg, MAX_PIXELS, draft)
        assert min(small.size) >= 224  # the resize to 224 on the short side is still a reduction
        reduced += small.size != full.size
        a = np.asarray(pil_stage(full), dtype=np.float32)
        b = np.asarray(pil_stage(small), dtype=np.float32)
        assert a.shape == b.shape == (224, 224, 3)
        diffs.append(float(np.abs(a - b).mean()))
    # Under 2/255 on average over the photos. A photo decoded at 1/4 scale differs most (up to ~4/255 on these
    # noise-heavy synthetic photos: the 1/4-scale inverse DCT keeps more of the pixel noise); at 1/2, under 1.5/255.
    assert np.mean(diffs) < 2.0, diffs
    assert max(diffs) < 5.0, diffs
    assert reduced >= len(photos) // 2  # most of these photos are decoded at a reduced DCT scale


def test_train_draft_size_keeps_every_crop_at_least_the_output():
    assert crop_draft_size(224, 224, 0.9) == (249, 249)
    assert crop_draft_size(224, 224, 1.0) == (224, 224)
    rnd = random.Random(0)
    for _ in range(3000):
        # A drafted image: both sides at least the draft size (what Pillow's draft keeps), any aspect.
        w, h = rnd.randint(249, 900), rnd.randint(249, 900)
        top, left, ch, cw = random_crop_box(w, h, (0.9, 1.0), (3 / 4, 4 / 3), rnd)
        assert cw >= 224 and ch >= 224, (w, h, cw, ch)


def test_train_crop_covers_the_same_scale_and_ratio_ranges(photos):
    """The crop drawn on the draft-decoded image covers the same area fractions and aspect ratios as on the full
    image: the box is drawn relative to the image, whatever its decoded size."""

    rnd = random.Random(1)
    draft = crop_draft_size(224, 224, 0.9)
    for jpeg in photos[:4]:
        full = decode_image(jpeg, MAX_PIXELS)
        small = decode_image(jpeg, MAX_PIXELS, draft)
        for img in (full, small):
            scales, ratios = [], []
            for _ in range(400):
                top, left, h, w = random_crop_box(img.width, img.height, (0.9, 1.0), (3 / 4, 4 / 3), rnd)
                scales.append(w * h / (img.width * img.height))
                ratios.append(w / h)
            image_ratio = img.width / img.height
            if 3 / 4 <= image_ratio <= 4 / 3:
                assert min(scales) >= 0.89 and max(scales) <= 1.0 + 1e-9
            assert min(ratios) >= 3 / 4 - 0.02 and max(ratios) <= 4 / 3 + 0.02
        # Same distribution: mean area fraction of the tries on both decoded sizes agree.
        def mean_scale(img):
            r = random.Random(2)
            boxes = [random_crop_box(img.width, img.height, (0.9, 1.0), (3 / 4, 4 / 3), r) for _ in range(400)]
            return float(np.mean([b[2] * b[3] / (img.width * img.height) for b in boxes]))

        assert math.isclose(mean_scale(full), mean_scale(small), abs_tol=0.01)
    crop = T.RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=T.InterpolationMode.BICUBIC)
    assert PyRandomResizedCrop(crop)(decode_image(photos[0], MAX_PIXELS, draft)).size == (224, 224)


def test_the_crop_after_a_draft_decode_is_torchvisions_crop_then_resize(photos):
    """PyRandomResizedCrop draws the box from Python's RNG, then crops and resizes as torchvision does: the same
    pixels, on a draft-decoded photo too."""
    from torchvision.transforms import functional as F

    crop = T.RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=T.InterpolationMode.BICUBIC)
    ours = PyRandomResizedCrop(crop)
    for jpeg in photos[:6]:
        img = decode_image(jpeg, MAX_PIXELS, crop_draft_size(224, 224, 0.9))
        random.seed(3)
        a = np.asarray(ours(img), dtype=np.float32)
        random.seed(3)
        top, left, h, w = random_crop_box(img.width, img.height, crop.scale, crop.ratio)
        b = np.asarray(F.resized_crop(img, top, left, h, w, crop.size, crop.interpolation), dtype=np.float32)
        assert np.array_equal(a, b)


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
