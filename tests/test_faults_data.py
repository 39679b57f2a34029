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

from mmcl import data

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
    expected = _expected_16(RAMP16)
    image, caption, _ = data.decode_sample({"png": (folder / "a.png").read_bytes(), "txt": b"x"},
                                           lambda im: im, 10**8)
    np.testing.assert_array_equal(_grey_row(np.asarray(image)), expected)
    ds = data.build_eval_dataset(str(tmp_path / "folder"), lambda im: np.asarray(im))
    for i in range(len(ds)):
        np.testing.assert_array_equal(_grey_row(ds[i][0]), expected)
    summary = data.shards_from_input(str(tmp_path / "folder"), str(tmp_path / "shards"), progress=False)
    assert summary["n_samples"] == 2 and summary["n_skipped"] == 0
    shards = data.build_eval_dataset(str(tmp_path / "shards" / "shard-000000.tar"), lambda im: np.asarray(im))
    items = list(shards)
    assert len(items) == 2
    for item in items:
        np.testing.assert_array_equal(_grey_row(item[0]), expected)


# ------------------------------------------------------------------------------------------------------------
# Evaluation: bad images are skipped and counted, hidden entries ignored, worker errors come out as one line

from mmcl import evaluate, models  # noqa: E402
from mmcl.errors import CheckpointError, ConfigError, DataError  # noqa: E402

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
    loader = torch.utils.data.DataLoader(_RaisingDataset(), batch_size=1, num_workers=2)
    with pytest.raises(DataError) as err:
        list(evaluate._batches(loader))
    assert str(err.value) == "sample 2 is unusable (got X, expected Y)"


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

