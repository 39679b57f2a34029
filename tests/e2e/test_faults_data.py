"""Faults on the data and model-file side: every pixel mode, damaged model files, exports over user files,
bad images and user errors inside evaluation workers. Each fault ends in correct pixels, a counted skip, or one
`mmcl: error:` line with a non-zero exit, and nothing the user had is gone."""

import colorsys
import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmcl import data, models
from mmcl.errors import CheckpointError, ConfigError, DataError
from mmcl.evaluation import evaluate
from mmcl.shards import writer as shard_writer
from mmcl.storage import export as export_mod
from mmcl.storage import fsutil, weights
from mmcl.storage.weights import CONFIG_FILE, WEIGHTS_FILE

W = 256  # gradient width: one column per 8-bit level


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _decoded(img: Image.Image, fmt=None) -> np.ndarray:
    """RGB uint8 (H, W, 3) of `img` through the shared decoder: from `fmt` bytes, or `to_rgb` when fmt is None."""
    if fmt is None:
        out = data.to_rgb(img)
    else:
        encoded = _encode(img, fmt)
        same = {"I;16L": "I;16"}  # two names of little-endian 16-bit
        assert Image.open(io.BytesIO(encoded)).mode == same.get(img.mode, img.mode)  # the file holds this mode
        out = data.decode_image(encoded, 10**8)
    assert out.mode == "RGB" and out.size == img.size
    return np.asarray(out)


def _grey_row(rgb: np.ndarray) -> np.ndarray:
    """The first row as grey levels, checking R == G == B."""
    row = rgb[0].astype(int)
    assert (row[:, 0] == row[:, 1]).all() and (row[:, 1] == row[:, 2]).all()
    return row[:, 0]


RAMP8 = np.arange(W, dtype=np.uint8)  # 0..255
RAMP16 = np.rint(np.linspace(0, 65535, W)).astype(np.uint16)  # 0..65535 in 256 steps, ends included


def _expected_16(values) -> np.ndarray:
    return np.rint(np.asarray(values, dtype=np.float64) * 255 / 65535).astype(int)  # float64 reference


# ------------------------------------------------------------------------------------------------------------
# Pixel modes against known gradients


@pytest.mark.parametrize("mode, fmt", [("I;16", "PNG"), ("I;16B", "PNG"), ("I;16", "TIFF"), ("I;16B", "TIFF"),
                                       ("I;16L", "TIFF"), ("I;16N", None)])
def test_16_bit_grey_keeps_its_range(mode, fmt):
    dtype = {"I;16": "<u2", "I;16L": "<u2", "I;16B": ">u2", "I;16N": "=u2"}[mode]
    img = Image.frombuffer(mode, (W, 2), np.tile(RAMP16, 2).astype(dtype).tobytes(), "raw", mode, 0, 1)
    if fmt == "PNG":  # PNG stores 16-bit big-endian; Pillow reads either source mode back as I;16
        png = _encode(img, "PNG")
        assert Image.open(io.BytesIO(png)).mode == "I;16"
        grey = _grey_row(np.asarray(data.decode_image(png, 10**8)))
    else:
        grey = _grey_row(_decoded(img, fmt))
    assert grey[0] == 0 and grey[-1] == 255  # 0..65535 -> 0..255, not clipped to white
    assert (np.diff(grey) >= 0).all() and len(np.unique(grey)) == W
    np.testing.assert_array_equal(grey, _expected_16(RAMP16))


def test_16_bit_png_gradient_is_not_flat_white():
    """The reported case: a 0..65535 gradient PNG read as mean 255, std 0."""
    png = _encode(Image.fromarray(np.tile(RAMP16, (16, 1))), "PNG")
    pixels = np.asarray(data.decode_image(png, 10**8)).astype(float)
    assert abs(pixels.mean() - 127.5) < 0.01 and pixels.std() > 70


def _png_48bit(rgb16: np.ndarray) -> bytes:
    """A 16-bit-per-channel RGB PNG written by hand (Pillow cannot write one)."""
    h, w, _ = rgb16.shape
    raw = b"".join(b"\x00" + rgb16[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def test_48_bit_rgb_png_keeps_its_range_per_channel():
    rgb16 = np.stack([RAMP16, RAMP16[::-1], np.full(W, 32768, np.uint16)], axis=-1)[None]  # (1, W, 3)
    out = np.asarray(data.decode_image(_png_48bit(rgb16), 10**8)).astype(int)[0]
    assert out[0, 0] == 0 and out[-1, 0] == 255 and out[0, 1] == 255 and out[-1, 1] == 0
    assert (np.diff(out[:, 0]) >= 0).all() and (np.diff(out[:, 1]) <= 0).all()
    assert np.abs(out - _expected_16(rgb16[0])).max() <= 1  # Pillow keeps the high byte: within 1 level


@pytest.mark.parametrize("fmt", ["TIFF", None])
def test_32_bit_integer_images_by_their_range(fmt):
    def grey(values):
        return _grey_row(_decoded(Image.fromarray(np.tile(values.astype(np.int32), (2, 1))), fmt))

    np.testing.assert_array_equal(grey(RAMP8.astype(np.int32)), RAMP8)  # 8-bit values: as they are
    np.testing.assert_array_equal(grey(RAMP16.astype(np.int32)), _expected_16(RAMP16))  # 16-bit range
    wide = np.linspace(-70000, 1_000_000, W).astype(np.int32)  # anything else: its own min..max
    ref = np.rint((wide.astype(np.float64) - wide.min()) / (wide.max() - wide.min()) * 255).astype(int)
    np.testing.assert_array_equal(grey(wide), ref)


@pytest.mark.parametrize("fmt", ["TIFF", None])
def test_float_images_unit_range_or_stretched(fmt):
    unit = np.linspace(0, 1, W, dtype=np.float32)
    got = _grey_row(_decoded(Image.fromarray(np.tile(unit, (2, 1))), fmt))
    np.testing.assert_array_equal(got, np.rint(unit.astype(np.float64) * 255).astype(int))
    physical = np.linspace(-3.5, 1200.0, W, dtype=np.float32)  # e.g. Hounsfield units
    got = _grey_row(_decoded(Image.fromarray(np.tile(physical, (2, 1))), fmt))
    ref = (physical.astype(np.float64) - physical.min()) / (float(physical.max()) - float(physical.min())) * 255
    np.testing.assert_array_equal(got, np.rint(ref).astype(int))
    assert got[0] == 0 and got[-1] == 255
    constant = Image.fromarray(np.full((2, 4), 7.0, np.float32))
    assert not _decoded(constant, fmt).any()  # a constant out-of-range image is black, documented


def test_float_image_with_nan_is_skipped_as_unsupported_mode():
    values = np.tile(np.linspace(0, 1, W, dtype=np.float32), (2, 1))
    values[0, 3] = np.nan
    tiff = _encode(Image.fromarray(values), "TIFF")
    with pytest.raises(data.SkipSample) as err:
        data.decode_image(tiff, 10**8)
    assert err.value.reason == "unsupported_mode" and "unsupported_mode" in data.SKIP_REASONS
    files = {"tiff": tiff, "png": tiff, "txt": b"a scan"}  # decode_sample reads the png slot
    with pytest.raises(data.SkipSample, match="unsupported_mode"):
        data.decode_sample(files, lambda im: im, 10**8)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF", "JPEG", "BMP", None])
def test_8_bit_grey_and_bilevel(fmt):
    img = Image.fromarray(np.tile(RAMP8, (8, 1)))
    got = _grey_row(_decoded(img, fmt))
    if fmt == "JPEG":
        assert np.abs(got - RAMP8.astype(int)).max() <= 3  # lossy: a few levels
    else:
        np.testing.assert_array_equal(got, RAMP8)
    if fmt in ("PNG", "TIFF", "BMP", None):
        bilevel = img.convert("1", dither=Image.Dither.NONE)
        got = _grey_row(_decoded(bilevel, fmt))
        np.testing.assert_array_equal(got, np.where(RAMP8 >= 128, 255, 0))


def _palette_ramp() -> Image.Image:
    img = Image.fromarray(np.tile(RAMP8, (2, 1)), "L").convert("P")  # index i -> grey i (Pillow's grey palette)
    img.putpalette([v for i in range(256) for v in (i, 255 - i, i // 2)])
    return img


@pytest.mark.parametrize("fmt", ["PNG", "TIFF", "BMP", "GIF", None])
def test_palette_images_map_through_the_palette(fmt):
    img = _palette_ramp()
    got = _decoded(img, fmt)[0].astype(int)
    ref = np.stack([RAMP8, 255 - RAMP8, RAMP8 // 2], axis=-1).astype(int)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("fmt", ["PNG", "GIF", None])
def test_palette_transparency_is_composited_on_white(fmt):
    img = _palette_ramp()
    img.info["transparency"] = 10  # palette index 10 is transparent
    got = _decoded(img, fmt)[0].astype(int)
    ref = np.stack([RAMP8, 255 - RAMP8, RAMP8 // 2], axis=-1).astype(int)
    ref[10] = 255
    np.testing.assert_array_equal(got, ref)


def _alpha_ramp() -> np.ndarray:
    """Alpha along the row: fully transparent, opaque, and every level between."""
    return np.roll(RAMP8, 100)


def _over_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha.astype(np.float64)[:, None] / 255
    return colour.astype(np.float64) * a + 255 * (1 - a)  # float64 reference of compositing on white


@pytest.mark.parametrize("mode, fmt", [("RGBA", "PNG"), ("RGBA", "TIFF"), ("RGBA", "WEBP"), ("LA", "PNG"),
                                       ("LA", "TIFF"), ("PA", "TIFF"), ("RGBa", None), ("La", None)])
def test_alpha_is_composited_on_white(mode, fmt):
    alpha = _alpha_ramp()
    colour = np.stack([RAMP8, 255 - RAMP8, np.full(W, 40, np.uint8)], axis=-1)  # (W, 3)
    if mode in ("LA", "La"):
        colour = np.repeat(RAMP8[:, None], 3, axis=-1)
    if mode == "PA":
        img = _palette_ramp().convert("PA")
        img.putalpha(Image.fromarray(np.tile(alpha, (2, 1)), "L"))
        colour = np.stack([RAMP8, 255 - RAMP8, RAMP8 // 2], axis=-1)
    elif mode == "RGBa":
        premultiplied = np.rint(colour.astype(np.float64) * alpha[:, None] / 255).astype(np.uint8)
        img = Image.frombuffer("RGBa", (W, 1), np.concatenate([premultiplied, alpha[:, None]], -1).tobytes(),
                               "raw", "RGBa", 0, 1)
    elif mode == "La":
        premultiplied = np.rint(RAMP8.astype(np.float64) * alpha / 255).astype(np.uint8)
        img = Image.frombuffer("La", (W, 1), np.stack([premultiplied, alpha], -1).tobytes(), "raw", "La", 0, 1)
    else:
        rgba = np.concatenate([colour, alpha[:, None]], axis=-1)[None]
        img = Image.fromarray(rgba, "RGBA").convert(mode) if mode != "RGBA" else Image.fromarray(rgba, "RGBA")
    if fmt == "WEBP":
        out = data.decode_image(_webp_lossless(img), 10**8)
        got = np.asarray(out)[0].astype(int)
    else:
        got = _decoded(img, fmt)[0].astype(int)
    ref = _over_white(colour, alpha)
    assert np.abs(got - ref).max() <= 1  # integer compositing rounds once
    assert (got[alpha == 0] == 255).all()  # transparent: white, whatever colour sits under it
    opaque = alpha == 255
    assert np.abs(got[opaque] - colour[opaque].astype(int)).max() <= (1 if mode in ("RGBa", "La") else 0)


def _webp_lossless(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="WEBP", lossless=True, exact=True)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["TIFF", "JPEG", None])
def test_cmyk_black_ramp(fmt):
    cmyk = np.zeros((8, W, 4), np.uint8)
    cmyk[..., 3] = RAMP8  # K only
    got = _grey_row(_decoded(Image.fromarray(cmyk, "CMYK"), fmt))
    tol = 3 if fmt == "JPEG" else 0
    assert np.abs(got - (255 - RAMP8.astype(int))).max() <= tol


@pytest.mark.parametrize("fmt", ["TIFF", None])
def test_ycbcr_luma_ramp(fmt):
    ycc = np.zeros((2, W, 3), np.uint8)
    ycc[..., 0], ycc[..., 1:] = RAMP8, 128
    got = _decoded(Image.fromarray(ycc, "YCbCr"), fmt)[0].astype(int)
    assert np.abs(got - RAMP8[:, None].astype(int)).max() <= 1  # neutral chroma: grey = luma


@pytest.mark.parametrize("fmt", ["TIFF", None])
def test_lab_lightness_ramp(fmt):
    lab = np.zeros((2, W, 3), np.uint8)
    lab[..., 0], lab[..., 1:] = RAMP8, 0  # Pillow stores a* and b* as signed bytes: 0, 0 is neutral grey
    got = _decoded(Image.frombuffer("LAB", (W, 2), lab.tobytes(), "raw", "LAB", 0, 1), fmt)[0].astype(int)
    assert np.abs(got - got[:, :1]).max() <= 2  # neutral
    assert got[0].max() <= 2 and got[-1].min() >= 250
    assert (np.diff(got[:, 1]) >= 0).all() and len(np.unique(got[:, 1])) > 200


def test_hsv_ramps_against_colorsys():
    hsv = np.zeros((2, W, 3), np.uint8)
    hsv[0, :, 0], hsv[0, :, 1:] = RAMP8, 255  # hue sweep, full saturation and value
    hsv[1, :, 2] = RAMP8  # value sweep at zero saturation: grey
    got = _decoded(Image.fromarray(hsv, "HSV")).astype(int)
    ref = np.array([colorsys.hsv_to_rgb(h / 255, 1.0, 1.0) for h in RAMP8]) * 255
    assert np.abs(got[0] - ref).max() <= 2  # Pillow's integer HSV
    np.testing.assert_array_equal(_grey_row(got[1:]), RAMP8)


def test_rgbx_drops_the_padding_and_rgb_passes_through():
    rgb = np.stack([RAMP8, 255 - RAMP8, RAMP8 // 3], axis=-1)[None]
    img = Image.fromarray(rgb, "RGB")
    assert data.to_rgb(img) is img
    np.testing.assert_array_equal(_decoded(img.convert("RGBX"))[0], rgb[0])


def test_every_pillow_mode_is_handled():
    """Each mode Pillow knows converts to RGB (no mode is silently clipped or left unhandled)."""
    modes = getattr(Image, "MODES", None) or sorted(Image._MODEINFO)
    for mode in modes:
        out = data.to_rgb(Image.new(mode, (3, 2)))
        assert out.mode == "RGB" and out.size == (3, 2), mode


def test_the_same_conversion_in_training_eval_folders_and_shards(tmp_path):
    """16-bit images reach the model with their range in training decode, the eval folder reader and `mmcl shards`."""
    folder = tmp_path / "folder" / "scan"
    folder.mkdir(parents=True)
    ramp = Image.fromarray(np.tile(RAMP16, (4, 1)))
    ramp.save(folder / "a.png")
    ramp.save(folder / "b.tif")
    (tmp_path / "folder" / ".ipynb_checkpoints").mkdir()  # hidden: neither a class nor samples
    ramp.save(tmp_path / "folder" / ".ipynb_checkpoints" / "c.png")
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    expected = _expected_16(RAMP16)
    image, caption, _ = data.decode_sample({"png": (folder / "a.png").read_bytes(), "txt": b"x"},
                                           lambda im: im, 10**8)
    np.testing.assert_array_equal(_grey_row(np.asarray(image)), expected)
    ds = data.build_eval_dataset(str(tmp_path / "folder"), lambda im: np.asarray(im))
    for i in range(len(ds)):
        np.testing.assert_array_equal(_grey_row(ds[i][0]), expected)
    assert ds.classnames == ["scan"] and len(ds) == 2
    summary = shard_writer.shards_from_input(str(tmp_path / "folder"), str(tmp_path / "shards"), progress=False)
    assert summary["n_samples"] == 2 and summary["n_skipped"] == 0
    assert (tmp_path / "shards" / "classnames.txt").read_text() == "scan\n"
    shards = data.build_eval_dataset(str(tmp_path / "shards" / "shard-000000.tar"), lambda im: np.asarray(im))
    items = list(shards)
    assert len(items) == 2
    for item in items:
        np.testing.assert_array_equal(_grey_row(item[0]), expected)


# ------------------------------------------------------------------------------------------------------------
# Evaluation: bad images are skipped and counted, hidden entries ignored, worker errors come out as one line


COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}


class _MeanColourModel(torch.nn.Module):
    """An image is its mean RGB; a text is the one-hot of the colour word in it (so accuracy is known)."""

    def encode_image(self, images, normalize=False):
        f = images.float().mean(dim=(2, 3))  # (B, 3) in R, G, B order
        return torch.nn.functional.normalize(f, dim=-1) if normalize else f

    def encode_text(self, tokens, normalize=False):
        f = tokens.float()
        return torch.nn.functional.normalize(f, dim=-1) if normalize else f


def _colour_tokenizer(texts):
    words = ("red", "green", "blue")
    return torch.tensor([[float(w in t) for w in words] for t in texts])


def _to_tensor(img):
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255).permute(2, 0, 1)


def _colour_folder(root: Path, bad: bool = True, hidden: bool = True) -> Path:
    """root/<colour>/<i>.png, 2 images per class, one known miss; plus a damaged file and hidden entries."""
    layout = {"blue": [(0, 0, 255), (255, 0, 0)], "green": [(0, 255, 0), (0, 200, 0)],
              "red": [(255, 0, 0), (200, 10, 10)]}
    for cls, colours in layout.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i, rgb in enumerate(colours):
            Image.new("RGB", (8, 8), rgb).save(root / cls / f"{i}.png")
    if bad:
        (root / "green" / "cut.png").write_bytes((root / "green" / "0.png").read_bytes()[:40])  # cut-off file
    if hidden:
        (root / ".ipynb_checkpoints").mkdir()
        Image.new("RGB", (8, 8), (0, 0, 255)).save(root / ".ipynb_checkpoints" / "x.png")
        (root / "red" / ".ipynb_checkpoints").mkdir()
        Image.new("RGB", (8, 8), (0, 0, 255)).save(root / "red" / ".ipynb_checkpoints" / "y.png")
        (root / "red" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
        (root / "blue" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    return root


@pytest.mark.parametrize("workers", [0, 2])
def test_zeroshot_skips_and_counts_bad_images_and_ignores_hidden_entries(tmp_path, workers, capfd):
    root = _colour_folder(tmp_path / "colours")
    clean = _colour_folder(tmp_path / "clean", bad=False, hidden=False)
    kwargs = dict(templates=["a {} thing"], batch_size=2, workers=workers, progress=False)
    res = evaluate.zeroshot(_MeanColourModel(), _to_tensor, _colour_tokenizer, str(root), **kwargs)
    ref = evaluate.zeroshot(_MeanColourModel(), _to_tensor, _colour_tokenizer, str(clean), **kwargs)
    assert res["n_classes"] == 3 and res["n_samples"] == 6  # no '.ipynb_checkpoints' class, no hidden files
    assert res["metrics"] == ref["metrics"] and res["metrics"]["acc1"] == 5 / 6
    assert res["n_skipped"] == 1 and res["skipped"] == {"decode": 1} and ref["n_skipped"] == 0
    err = capfd.readouterr().err
    warnings_ = [ln for ln in err.splitlines() if "warning" in ln.lower()]
    assert len(warnings_) == 1 and "skipped 1 of 7 images" in warnings_[0] and "cut.png" in warnings_[0]
    assert "Traceback" not in err


def test_a_user_error_in_a_worker_is_re_raised_as_it_was(tmp_path, monkeypatch):
    root = _colour_folder(tmp_path / "colours", bad=False)
    message = "cannot read the colour table of green/1.png (expected 3 entries)"

    def preprocess(img):
        if np.asarray(img)[0, 0, 1] == 200:  # the second green image
            raise DataError(message)
        return _to_tensor(img)

    for workers in (0, 2):  # workers are forked: they see this preprocess
        with pytest.raises(DataError) as err:
            evaluate.zeroshot(_MeanColourModel(), preprocess, _colour_tokenizer, str(root), templates=["{}"],
                              batch_size=2, workers=workers, progress=False)
        assert str(err.value) == message


class _RaisingDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            raise DataError("sample 2 is unusable (got X, expected Y)")
        return torch.zeros(3)


def test_worker_tracebacks_are_cut_to_the_original_message():
    """A user error raised by a dataset mmcl does not wrap still comes out as its own one-line message."""
    import gc
    import time

    loader = torch.utils.data.DataLoader(_RaisingDataset(), batch_size=1, num_workers=2)
    start = time.perf_counter()
    with pytest.raises(DataError) as err:
        list(evaluate.eval_batches(loader))
    assert str(err.value) == "sample 2 is unusable (got X, expected Y)"
    assert err.value.__context__ is None and err.value.__cause__ is None  # no worker traceback chained
    del err
    gc.collect()
    # The workers are stopped when the error is raised. Left to the garbage collector, torch would join each with
    # a 5 s timeout (10 s here) before a failed evaluation could exit.
    assert time.perf_counter() - start < 5


def test_all_images_unreadable_is_one_error_naming_the_cause(tmp_path):
    root = tmp_path / "bad"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        (root / cls / "0.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(DataError, match=r"no readable images \(skipped 2: decode=2; first a/0.jpg"):
        evaluate.zeroshot(_MeanColourModel(), _to_tensor, _colour_tokenizer, str(root), templates=["{}"],
                          progress=False)


def test_shard_eval_counts_skips_across_workers(tmp_path):
    import webdataset as wds

    paths = []
    for s in range(2):
        path = tmp_path / f"{s}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i, (name, rgb) in enumerate(COLOURS.items()):
                sink.write({"__key__": f"s{s}k{i}", "png": Image.new("RGB", (8, 8), rgb), "cls": i,
                            "txt": f"a {name} thing"})
            sink.write({"__key__": f"s{s}bad", "png": b"\x89PNG broken", "cls": 0, "txt": "broken"})
        paths.append(str(path))
    (tmp_path / "classnames.txt").write_text("\n".join(COLOURS) + "\n")
    spec = str(tmp_path / "{0..1}.tar")
    results = [evaluate.zeroshot(_MeanColourModel(), _to_tensor, _colour_tokenizer, spec, templates=["a {}"],
                                 batch_size=2, workers=w, progress=False) for w in (0, 2)]
    for res in results:
        assert res["n_samples"] == 6 and res["n_skipped"] == 2 and res["skipped"] == {"decode": 2}
        assert res["metrics"]["acc1"] == 1.0



# ------------------------------------------------------------------------------------------------------------
# Damaged model files: mmcl's own error naming the file and the cause; the CLI prints one line



@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    model = models.create(cfg)
    return weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path_factory.mktemp("m") / "model")


def _copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _snapshot(root: Path) -> dict:
    """{relative path: bytes} of every file under root: what the user had."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _is_progress(line: str) -> bool:
    return any(mark in line for mark in ("it/s]", "batch/s]", "?it/s", "?batch/s"))  # tqdm bars


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not _is_progress(ln)]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("mmcl: error: "), stderr
    return lines[0]


def test_saved_model_records_weights_size_and_sha256(tiny_model):
    import hashlib

    meta = json.loads((tiny_model / CONFIG_FILE).read_text())
    weights = tiny_model / WEIGHTS_FILE
    assert meta["mmcl"]["weights"] == {"file": WEIGHTS_FILE, "size": weights.stat().st_size,
                                       "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    assert meta["mmcl"]["files"] == sorted([CONFIG_FILE, WEIGHTS_FILE])


@pytest.mark.parametrize("damage, match", [
    ("truncate_weights", r"open_clip_model.safetensors is damaged \(\d+ bytes, \d+ were written: truncated\)"),
    ("truncate_weights_unrecorded", r"open_clip_model.safetensors is damaged \(not a readable safetensors file: "
                                    r"Error while deserializing header"),
    ("flip_weights_byte", r"open_clip_model.safetensors is damaged \(its SHA-256 differs"),
    ("truncate_config", r"open_clip_config.json is damaged \(not valid JSON: .* at line \d+ column \d+\)"),
    ("binary_config", r"open_clip_config.json is damaged \(not UTF-8 text\)"),
    ("config_not_a_model", r"open_clip_config.json is damaged \(expected an open_clip model config: no vision_cfg"),
    ("config_bad_values", r"cannot build the model .*open_clip_config.json describes"),
    ("remove_weights", r"has open_clip_config.json but no open_clip_model.safetensors"),
    ("remove_config", r"no model in .*expected open_clip_config.json"),
    ("wrong_shapes", r"do not fit open_clip_config.json: .*of another shape \(e.g. "),
    ("missing_keys", r"do not fit open_clip_config.json: 2 missing \(ln_final.bias, ln_final.weight\)"),
])
def test_damaged_model_files_are_checkpoint_errors(tiny_model, tmp_path, damage, match):
    from safetensors.torch import load_file, save_file

    d = _copy_model(tiny_model, tmp_path / "m")
    weights_file, config = d / WEIGHTS_FILE, d / CONFIG_FILE
    meta = json.loads(config.read_text())
    if damage.startswith("truncate_weights"):
        weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
        if damage.endswith("unrecorded"):  # a model saved before mmcl recorded sizes
            meta.pop("mmcl")
            config.write_text(json.dumps(meta))
    elif damage == "flip_weights_byte":
        raw = bytearray(weights_file.read_bytes())
        raw[-100] ^= 0x40  # inside a tensor: safetensors itself cannot notice
        weights_file.write_bytes(bytes(raw))
    elif damage == "truncate_config":
        config.write_text(config.read_text()[:200])
    elif damage == "binary_config":
        config.write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "config_not_a_model":
        config.write_text(json.dumps({"model_cfg": {"embed_dim": 8, "text_cfg": {}}}))
    elif damage == "config_bad_values":
        meta["model_cfg"]["vision_cfg"]["layers"] = "twelve"
        config.write_text(json.dumps(meta))
    elif damage == "remove_weights":
        weights_file.unlink()
    elif damage == "remove_config":
        config.unlink()
    else:
        state = load_file(str(weights_file))
        if damage == "wrong_shapes":
            state["visual.proj"] = torch.zeros(3, 5)
        else:
            del state["ln_final.weight"], state["ln_final.bias"]
        save_file(state, str(weights_file))
        meta.pop("mmcl")
        config.write_text(json.dumps(meta))
    before = _snapshot(d)
    with pytest.raises(CheckpointError, match=match) as err:
        weights.load(d)
    assert "\n" not in str(err.value)
    assert _snapshot(d) == before  # the damaged files are evidence: nothing is deleted or rewritten


@pytest.mark.slow
def test_cli_damaged_model_is_one_line(tiny_model, tmp_path):
    folder = _colour_folder(tmp_path / "colours", bad=False, hidden=False)
    d = _copy_model(tiny_model, tmp_path / "m")
    (d / WEIGHTS_FILE).write_bytes((d / WEIGHTS_FILE).read_bytes()[:5000])
    p = subprocess.run([sys.executable, "-m", "mmcl", "zeroshot", "--model", str(d), "--data", str(folder)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "truncated" in _one_error_line(p.stderr)
    c = _copy_model(tiny_model, tmp_path / "c")
    (c / CONFIG_FILE).write_text((c / CONFIG_FILE).read_text()[:-30])
    p = subprocess.run([sys.executable, "-m", "mmcl", "export", "--model", str(c), "--format", "safetensors",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "not valid JSON" in _one_error_line(p.stderr)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------------
# Exports and saved models keep what the user put there


@pytest.mark.slow
def test_re_export_refuses_to_overwrite_a_user_file_of_the_same_name(tiny_model, tmp_path):
    out = export_mod.export(tiny_model, "safetensors", tmp_path / "e", verify=False)
    (out / export_mod.ONNX_CONFIG_FILE).write_text("the user's own onnx notes\n")
    (out / "results.json").write_text("{}\n")
    before = _snapshot(out)
    with pytest.raises(ConfigError, match=r"holds files mmcl did not write .*: onnx_config.json \(move them"):
        export_mod.export(tiny_model, "onnx", out, verify=False)
    assert _snapshot(out) == before  # the old export and the user's files, byte for byte
    assert sorted(os.listdir(tmp_path)) == ["e"]  # no temporary directory left beside it


def test_export_through_a_symlink_keeps_the_link(tiny_model, tmp_path):
    target = tmp_path / "disk" / "exports"
    target.mkdir(parents=True)
    (tmp_path / "link").symlink_to(target)
    export_mod.export(tiny_model, "safetensors", tmp_path / "link", verify=False)
    (target / "results.json").write_text("{}\n")
    export_mod.export(tiny_model, "open_clip", tmp_path / "link", verify=False)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == target.resolve()
    assert (target / "results.json").read_text() == "{}\n"
    assert json.loads((target / export_mod.MARKER_FILE).read_text())["format"] == "open_clip"
    assert sorted(os.listdir(tmp_path)) == ["disk", "link"] and sorted(os.listdir(tmp_path / "disk")) == ["exports"]


def test_export_and_model_dirs_get_the_umask_mode(tiny_model, tmp_path):
    old_umask = os.umask(0o027)
    try:
        out = export_mod.export(tiny_model, "safetensors", tmp_path / "e", verify=False)
        assert out.stat().st_mode & 0o777 == 0o750  # not mkdtemp's 0o700
        saved = weights.save_model_dir(weights.load(tiny_model)[0], *weights.load_model_dir(tiny_model)[1:],
                                      tmp_path / "saved")
        assert saved.stat().st_mode & 0o777 == 0o750
    finally:
        os.umask(old_umask)
    out.chmod(0o755)  # a mode the user chose is kept by the next export
    export_mod.export(tiny_model, "safetensors", out, verify=False)
    assert out.stat().st_mode & 0o777 == 0o755


def test_re_saved_model_and_rebuilt_index_keep_the_users_files(tiny_model, tmp_path):
    from mmcl.evaluation import index as index_mod

    model, model_cfg, pp = weights.load_model_dir(tiny_model)
    saved = weights.save_model_dir(model, model_cfg, pp, tmp_path / "run" / "model")
    (saved / "README.md").write_text("my model\n")
    weights.save_model_dir(model, model_cfg, pp, saved)
    assert (saved / "README.md").read_text() == "my model\n" and weights.load(saved)[0] is not None
    folder = _colour_folder(tmp_path / "colours")  # with a cut-off image and hidden entries
    idx = index_mod.build_index(saved, str(folder), tmp_path / "idx", progress=False)
    meta = json.loads((idx / index_mod.META_FILE).read_text())
    assert meta["n"] == 6 and meta["n_skipped"] == 1 and meta["skipped"] == {"decode": 1}
    (idx / "queries.txt").write_text("a red thing\n")
    index_mod.build_index(saved, str(folder), idx, progress=False)
    assert (idx / "queries.txt").read_text() == "a red thing\n"
    assert json.loads((idx / index_mod.META_FILE).read_text())["files"] == [
        index_mod.INDEX_FILE, index_mod.ITEMS_FILE, index_mod.META_FILE]


_KILL_AT = {
    # SIGKILL while the new export's config is being written (files half there in the temporary directory)
    "writing": "mmcl.storage.weights.write_config_with_record = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)",
    # SIGKILL between the two renames of the swap: the old export moved aside, the new one not yet in place
    "swapping": ("import mmcl.storage.fsutil as fs\n"
                 "calls = []\n"
                 "real = os.replace\n"
                 "def replace(a, b, **k):\n"  # the folder's renames go relative to its descriptor (dir_fd)
                 "    calls.append(a)\n"
                 "    if len(calls) == 2:\n"
                 "        os.kill(os.getpid(), signal.SIGKILL)\n"
                 "    return real(a, b, **k)\n"
                 "fs.os.replace = replace"),
}


def _run_export(src, out, fmt, inject="", limit_bytes=None):
    """`mmcl export` in a subprocess, after running `inject` (fault-injection code) in it."""
    code = ["import os, signal, sys, resource", "import mmcl.storage.weights, mmcl.storage.export"]
    if limit_bytes is not None:  # a size-limited file system: writes past the limit fail with EFBIG
        code += ["signal.signal(signal.SIGXFSZ, signal.SIG_IGN)",
                 f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes}))"]
    code += [inject, "from mmcl.cli import main",
             f"sys.exit(main(['export', '--model', {str(src)!r}, '--format', {fmt!r}, '--out', {str(out)!r}]))"]
    return subprocess.run([sys.executable, "-c", "\n".join(code)], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["writing", "swapping"])
def test_export_killed_leaves_the_old_export_and_a_re_run_continues(tiny_model, tmp_path, when):
    out = export_mod.export(tiny_model, "safetensors", tmp_path / "e", verify=False)
    (out / "results.json").write_text('{"acc1": 0.9}\n')
    before = _snapshot(out)
    p = _run_export(tiny_model, out, "open_clip", _KILL_AT[when])
    assert p.returncode == -9, p.stderr
    leftovers = [n for n in os.listdir(tmp_path) if n != "e"]
    assert leftovers  # the killed writer left its temporary (or moved-aside) directory
    if when == "swapping":
        assert not out.exists()  # killed between the renames
        fsutil.recover(out)  # what the next write does first
    assert _snapshot(out) == before and weights.load(out)[0] is not None  # the old export, intact
    export_mod.export(tiny_model, "open_clip", out, verify=False)  # the same export again, as a re-run does
    assert sorted(os.listdir(tmp_path)) == ["e"]  # leftovers of the killed export removed
    assert (out / "results.json").read_text() == '{"acc1": 0.9}\n'
    assert json.loads((out / export_mod.MARKER_FILE).read_text())["format"] == "open_clip"


@pytest.mark.slow
def test_export_to_a_full_or_read_only_disk_is_one_line(tiny_model, tmp_path):
    out = export_mod.export(tiny_model, "safetensors", tmp_path / "e", verify=False)
    (out / "results.json").write_text("{}\n")
    before = _snapshot(out)
    p = _run_export(tiny_model, out, "open_clip", limit_bytes=1 << 20)  # the weights are ~10x larger
    line = _one_error_line(p.stderr)
    assert p.returncode == 2 and f"cannot write the export to {out}" in line and "too large" in line.lower()
    assert _snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["e"]  # nothing lost, nothing left
    # A read-only parent directory (injected: this suite may run as root, which ignores permission bits).
    deny = ("import errno\n"
            "real_mkdir = os.mkdir\n"
            f"def mkdir(path, *a, **k):\n"  # a folder made relative to its parent's descriptor (dir_fd) or by path
            f"    fd = k.get('dir_fd')\n"
            f"    parent = (os.readlink(f'/proc/self/fd/{{fd}}') if fd is not None\n"
            f"              else os.path.dirname(os.path.abspath(path)))\n"
            f"    if parent == {str(tmp_path)!r}:\n"
            f"        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)\n"
            f"    return real_mkdir(path, *a, **k)\n"
            "os.mkdir = mkdir")
    p = _run_export(tiny_model, tmp_path / "new", "open_clip", deny)
    line = _one_error_line(p.stderr)
    assert p.returncode == 2 and "Permission denied" in line and "cannot write the export" in line
    assert sorted(os.listdir(tmp_path)) == ["e"]


# ------------------------------------------------------------------------------------------------------------
# Evaluation through the CLI with workers


@pytest.mark.slow
def test_cli_zeroshot_with_workers_skips_a_bad_image_and_fails_in_one_line(tiny_model, tmp_path, capsys):
    from mmcl import cli

    folder = _colour_folder(tmp_path / "colours")
    before = _snapshot(folder)
    out = tmp_path / "res.json"
    p = subprocess.run([sys.executable, "-m", "mmcl", "zeroshot", "--model", str(tiny_model), "--data",
                        str(folder), "--workers", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    warning_lines = [ln for ln in p.stderr.splitlines() if "warning" in ln.lower()]
    assert len(warning_lines) == 1 and "skipped 1 of 7 images" in warning_lines[0]
    res = json.loads(out.read_text())
    assert res["n_samples"] == 6 and res["n_skipped"] == 1 and res["skipped"] == {"decode": 1}
    bad = tmp_path / "bad"
    for cls in ("a", "b"):
        (bad / cls).mkdir(parents=True)
        (bad / cls / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n cut")
    p = subprocess.run([sys.executable, "-m", "mmcl", "zeroshot", "--model", str(tiny_model), "--data",
                        str(bad), "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    line = _one_error_line(p.stderr)
    capsys.readouterr()
    assert cli.main(["zeroshot", "--model", str(tiny_model), "--data", str(bad), "--workers", "0"]) == 2
    assert line == _one_error_line(capsys.readouterr().err)  # the same line with and without workers
    assert "no readable images" in line
    assert _snapshot(folder) == before


@pytest.mark.parametrize("damage, match", [
    ("index.json", r"index.json is damaged \(not valid JSON"),
    ("index.faiss", r"index.faiss is damaged"),
    ("items.jsonl", r"items.jsonl is damaged \(line \d+: \w"),  # the JSON message depends on where the cut falls
])
def test_damaged_index_files_are_data_errors(tiny_model, tmp_path, damage, match):
    from mmcl.evaluation import index as index_mod

    folder = _colour_folder(tmp_path / "colours", bad=False, hidden=False)
    idx = index_mod.build_index(tiny_model, str(folder), tmp_path / "idx", progress=False)
    path = idx / damage
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2 + 3])
    before = _snapshot(idx)
    with pytest.raises(DataError, match=match) as err:
        index_mod.search(idx, "a red thing")
    assert "\n" not in str(err.value) and _snapshot(idx) == before


def test_damaged_init_from_config_is_a_checkpoint_error(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "cl')
    with pytest.raises(CheckpointError, match=r"config.json is damaged \(not valid JSON"):
        weights.read_checkpoint(hf)


def test_recover_handles_host_names_with_dashes(tmp_path, monkeypatch):
    monkeypatch.setattr(fsutil.socket, "gethostname", lambda: "node-12.cluster")
    out = tmp_path / "export"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has ended
    (tmp_path / f".export.tmp-node-12-{pid}-ab12cd34").mkdir()
    (tmp_path / f".export.old-node-12-{pid}").mkdir()
    alive = tmp_path / f".export.tmp-node-12-{os.getppid()}-ffff0000"  # a running writer's: left alone
    alive.mkdir()
    other_host = tmp_path / f".export.tmp-node-13-{pid}-00000000"  # another host's: its PIDs are not ours
    other_host.mkdir()
    fsutil.recover(out)
    assert sorted(os.listdir(tmp_path)) == sorted(["export", alive.name, other_host.name])
