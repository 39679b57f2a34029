"""A model's image preprocessing and open_clip's augmentation config reach training, evaluation and export alike.

The reference is open_clip's own ``image_transform_v2(PreprocessCfg(...), is_train, aug_cfg)``; the preprocessing
under test is a SigLIP-like one (mean/std 0.5, squash resize) that differs from open_clip's defaults at every pixel.
A custom architecture file (``model.name=/path/arch.json``) carries it, so the same run also tests that feature.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from mmcl import data
from mmcl.cli import main
from mmcl.config import load_config
from mmcl.errors import ConfigError

from helpers import SIDE, cfg_for, image_for, tokenizer

ROOT = Path(__file__).resolve().parents[2]
SIGLIP_PP = {"size": 32, "mode": "RGB", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
             "interpolation": "bicubic", "resize_mode": "squash", "fill_color": 0}
# A small ViT + text transformer in open_clip's model-config format, with the SigLIP-like preprocessing beside it.
ARCH = {"embed_dim": 32,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "head_width": 32, "patch_size": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
        "preprocess_cfg": {k: SIGLIP_PP[k] for k in ("mean", "std", "interpolation", "resize_mode")}}
AUGS = [
    {},  # open_clip's defaults: crop scale (0.9, 1)
    {"scale": [0.4, 1.0], "color_jitter": [0.4, 0.4, 0.4, 0.1], "color_jitter_prob": 0.8, "gray_scale_prob": 0.3},
]


def _overrides(aug):
    return [f"data.aug.{k}={json.dumps(v)}" for k, v in aug.items()]


def _open_clip_tf(pp, is_train, aug=None):
    from open_clip.transform import AugmentationCfg, PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(**pp), is_train=is_train, aug_cfg=AugmentationCfg(**(aug or {})))


def _image(i, w, h):
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")  # open_clip's warning names items it uses
@pytest.mark.parametrize("aug", AUGS)
@pytest.mark.parametrize("pp", [SIGLIP_PP, {**SIGLIP_PP, "size": (24, 40), "interpolation": "bilinear",
                                            "mean": [0.48, 0.45, 0.4], "std": [0.26, 0.26, 0.27]}])
def test_train_stages_give_open_clip_train_pixels(monkeypatch, pp, aug):
    """The training transform mmcl builds from a preprocess config and ``data.aug`` (PIL stage in the workers,
    `ImageFinish` on the batch) equals open_clip's train transform pixel for pixel, seeded identically. mmcl draws
    the crop box from Python's RNG with torchvision's law (a test below checks the law); here open_clip's crop
    draws it the same way, so the two consume the same random numbers in the same order."""
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), _overrides(aug))
    spec = data.train_image_input(pp, cfg.data.aug)
    assert isinstance(spec, data.ImageSpec) and spec.scale == tuple(cfg.data.aug.scale)
    stage, finish = data.train_image_stages(spec)
    monkeypatch.setattr(T.RandomResizedCrop, "get_params", staticmethod(
        lambda img, scale, ratio: data.random_crop_box(*img.size, scale, ratio)))
    reference = _open_clip_tf(pp, True, aug)
    grays = 0
    for seed in range(24):
        img = _image(seed, 30 + seed % 5 * 9, 50 - seed % 3 * 8)
        random.seed(seed), torch.manual_seed(seed)
        want = reference(img)
        random.seed(seed), torch.manual_seed(seed)
        pixels = data.pil_to_uint8(stage(img))
        got = finish(pixels[None])[0]
        assert got.shape == want.shape and torch.equal(got, want), seed
        grays += bool(torch.equal(pixels[0], pixels[1]) and torch.equal(pixels[1], pixels[2]))
    assert (grays > 0) == bool(aug)  # the grayscale step was drawn (and only where it is configured)


@pytest.mark.parametrize("aug", AUGS)
def test_training_stream_with_data_aug_gives_open_clip_train_batches(corpus, aug):
    """The stream built as training builds it (`train_image_input` of the preprocess config and ``data.aug``) yields
    bitwise the batches of the same stream given open_clip's ``image_transform_v2(..., is_train=True, aug_cfg)``."""
    spec, _, _ = corpus
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), _overrides(aug))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = {}
        for name, preprocess in (("mmcl", data.train_image_input(SIGLIP_PP, cfg.data.aug)),
                                 ("open_clip", _open_clip_tf(SIGLIP_PP, True, aug))):
            stream = data.build_train_stream(cfg_for(spec, batch_size=4, workers=0), preprocess, tokenizer, seed=7)
            it = iter(stream)
            got[name] = [(b["key"], stream.finish_images(b["image"])) for b in (next(it) for _ in range(4))]
            it.close()
    for (k1, x1), (k2, x2) in zip(got["mmcl"], got["open_clip"]):
        assert k1 == k2 and x1.dtype == torch.float32 and torch.equal(x1, x2)


def test_use_timm_trains_with_open_clips_timm_transform():
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"),
                      ["data.aug.use_timm=true", "data.aug.re_prob=0.5", "data.aug.ratio=[0.5,2.0]"])
    tf = data.train_image_input(SIGLIP_PP, cfg.data.aug)
    names = [type(t).__name__ for t in tf.transforms]
    assert names[0] == "RandomResizedCropAndInterpolation" and names[-1] == "RandomErasing"
    assert tf.transforms[0].ratio == (0.5, 2.0) and tf.transforms[-1].probability == 0.5
    img = _image(0, 40, 30)
    random.seed(1), torch.manual_seed(1)
    want = _open_clip_tf(SIGLIP_PP, True, {"use_timm": True, "re_prob": 0.5, "ratio": (0.5, 2.0)})(img)
    random.seed(1), torch.manual_seed(1)
    assert torch.equal(tf(img), want)


@pytest.mark.parametrize("overrides,message", [
    (["data.aug.scale=[0.5]"], "data.aug.scale must be two area fractions"),
    (["data.aug.scale=[0.9,0.5]"], "data.aug.scale must be two area fractions"),
    (["data.aug.color_jitter=[0.4,0.4,0.4]", "data.aug.color_jitter_prob=0.8"], "data.aug.color_jitter needs 4"),
    (["data.aug.color_jitter=[0.4,0.4,0.4,0.1]"], "color_jitter_prob > 0"),  # open_clip would drop it silently
    (["data.aug.color_jitter_prob=0.5"], "data.aug.color_jitter_prob needs data.aug.color_jitter"),
    (["data.aug.gray_scale_prob=1.5"], "data.aug.gray_scale_prob must be a probability"),
    (["data.aug.re_prob=0.25"], "data.aug.re_prob needs data.aug.use_timm=true"),
    (["data.aug.ratio=[0.5,2]"], "data.aug.ratio needs data.aug.use_timm=true"),
    (["data.aug.use_timm=true", "data.aug.gray_scale_prob=0.2"], "not used by timm's transform"),
])
def test_augmentation_open_clip_would_ignore_or_assert_on_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        load_config(str(ROOT / "configs" / "tiny.yaml"), overrides)


# ---------------------------------------------------------------------------------------------------------------
# One run from a custom architecture file with the SigLIP-like preprocessing: evaluation and export use it.


@pytest.fixture(scope="module")
def arch_run(tmp_path_factory):
    from mmcl.shards.demo import make_demo_data

    root = tmp_path_factory.mktemp("arch")
    demo = make_demo_data(str(root / "demo"), n_train=16, n_val=4, n_zeroshot=2, image_size=32, shard_size=16,
                          progress=False)
    arch = root / "arch.json"
    arch.write_text(json.dumps(ARCH))
    out = root / "run"
    given = []  # what training hands its data stream for the images
    real = data.build_train_stream
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "build_train_stream", lambda cfg, pre, *a, **k: given.append(pre) or real(cfg, pre, *a, **k))
        code = main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"model.name={arch}",
                     f"data.train={demo['train']}", f"train.output_dir={out}", "train.steps=2", "data.batch_size=8",
                     "data.workers=0", "data.shuffle_buffer=8", "train.progress=false", "train.plot=false",
                     "train.save_every=0", "optim.warmup_steps=0", "train.log_with=[]",
                     *_overrides(AUGS[1])])
    assert code == 0
    folder = root / "folder"  # images of several aspect ratios: squash and shortest-side resizing differ on them
    for c, name in enumerate(("red", "blue")):
        (folder / name).mkdir(parents=True)
        for i in range(3):
            _image(10 * c + i, 20 + 17 * i, 48 - 9 * i).save(folder / name / f"{i}.png")
    return {"arch": arch, "run": out, "folder": folder, "root": root, "stream_input": given}


def _folder_images(folder):
    return [Image.open(p).convert("RGB") for p in sorted(Path(folder).glob("*/*.png"))]


@pytest.mark.slow
def test_architecture_file_trains_and_its_preprocessing_reaches_zeroshot(arch_run, monkeypatch, tmp_path):
    import mmcl
    from mmcl.evaluation import evaluate

    saved = json.loads((arch_run["run"] / "model" / "open_clip_config.json").read_text())
    assert saved["model_cfg"]["vision_cfg"] == ARCH["vision_cfg"] and "preprocess_cfg" not in saved["model_cfg"]
    assert saved["preprocess_cfg"] == SIGLIP_PP
    steps = [json.loads(line)["step"] for line in (arch_run["run"] / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
    # Training's stream got the file's preprocessing and data.aug: the input whose batches equal open_clip's
    # (test_training_stream_with_data_aug_gives_open_clip_train_batches).
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), _overrides(AUGS[1]))
    assert arch_run["stream_input"] == [data.train_image_input(SIGLIP_PP, cfg.data.aug)]
    reference = _open_clip_tf(SIGLIP_PP, False)
    _, preprocess, _ = mmcl.load(arch_run["run"])
    for img in _folder_images(arch_run["folder"]):
        assert torch.equal(preprocess(img), reference(img))
    seen = []  # the transform `mmcl zeroshot` evaluates with
    real = evaluate.eval_loader
    monkeypatch.setattr(evaluate, "eval_loader", lambda d, pre, *a, **k: seen.append(pre) or real(d, pre, *a, **k))
    out = tmp_path / "zs.json"
    assert main(["zeroshot", "--model", str(arch_run["run"]), "--data", str(arch_run["folder"]), "--out",
                 str(out)]) == 0
    assert len(seen) == 1 and json.loads(out.read_text())["metrics"]["acc1"] >= 0
    for img in _folder_images(arch_run["folder"]):
        assert torch.equal(seen[0](img), reference(img))


@pytest.mark.slow
def test_export_records_the_preprocessing_open_clip_reads_back(arch_run):
    import open_clip

    import mmcl

    out = arch_run["root"] / "export"
    assert main(["export", "--model", str(arch_run["run"]), "--format", "open_clip", "--out", str(out)]) == 0
    assert json.loads((out / "open_clip_config.json").read_text())["preprocess_cfg"] == SIGLIP_PP
    model, _, preprocess_val = open_clip.create_model_and_transforms(f"local-dir:{out}")
    assert model.visual.preprocess_cfg == {**SIGLIP_PP, "size": (32, 32)}  # open_clip keeps the size as (H, W)
    reference = _open_clip_tf(SIGLIP_PP, False)
    images = _folder_images(arch_run["folder"])
    for img in images:
        assert torch.equal(preprocess_val(img), reference(img))
    # The exported architecture file's model is the trained one: open_clip's and mmcl's loads embed alike.
    ours, pre, tok = mmcl.load(out)
    pixels = torch.stack([pre(img) for img in images])
    tokens = tok(["a red shape", "a blue shape"])
    model.eval()
    with torch.no_grad():
        assert torch.allclose(ours.encode_image(pixels), model.encode_image(pixels), atol=1e-5)
        assert torch.allclose(ours.encode_text(tokens), model.encode_text(tokens), atol=1e-5)


@pytest.mark.parametrize("content,message", [
    ('{"embed_dim": 32, "vision_cfg": {', "is not valid JSON (Expecting"),
    ('{"embed_dim": 32, "text_cfg": {}}', "is not an open_clip model config (no vision_cfg"),
    ('[1, 2]', "is not an open_clip model config"),
    (None, "cannot read the model-config file"),
])
def test_bad_architecture_file_is_one_error_line(tmp_path, capsys, content, message):
    arch = tmp_path / "arch.json"
    if content is not None:
        arch.write_text(content)
    code = main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"model.name={arch}",
                 f"train.output_dir={tmp_path / 'run'}", f"data.train={tmp_path / 'none.tar'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("mmcl: error:"), err
    assert message in err[0] and str(arch) in err[0]
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


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


def test_draft_size_of_open_clip_transforms():
    import open_clip

    assert data.draft_size_of(open_clip.image_transform(224, is_train=False)) == (224, 224)
    # RandomResizedCrop keeps >= 90% of the area, so a side may be 0.9 of the image's: 224 / 0.9 = 248.9.
    assert data.draft_size_of(open_clip.image_transform(224, is_train=True)) == (249, 249)
    assert data.draft_size_of(T.ToTensor()) is None
