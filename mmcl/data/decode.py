"""Decoding one raw sample: image bytes to 8-bit RGB, caption and label bytes to text and int.

Every image mmcl reads, in training shards, evaluation shards and folders and `mmcl shards` input, goes through
`decode_image` and its one pixel conversion `to_rgb`; every sample's files are read by `parse_sample`. A bad
sample raises `SkipSample` with one of `SKIP_REASONS`, which the callers count.
"""

from __future__ import annotations

import io
import warnings
from typing import Dict, Optional, Tuple

import numpy as np
from PIL import Image, UnidentifiedImageError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SKIP_REASONS = (
    "decode", "missing_image", "missing_caption", "bad_caption", "bad_label", "too_large", "truncated_tar",
    "shard_open",
    "unsupported_mode",
)


def zero_skips() -> Dict[str, int]:
    """A fresh count of zero per skip reason."""
    return {reason: 0 for reason in SKIP_REASONS}


class SkipSample(Exception):
    """Raised for a bad sample (by `parse_sample`, `decode_image`, ...); ``reason`` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# Pixel modes: what `to_rgb` does with each mode Pillow can open. Alpha is composited on white, as
# transformers' CLIP image processor and img2dataset do: the colour under a fully transparent pixel is undefined
# (often black), so dropping alpha, as a bare ``convert("RGB")`` does, would show a transparent logo on black.
_CONVERTED_MODES = ("1", "L", "P", "CMYK", "YCbCr", "LAB", "HSV", "RGBX")
_ALPHA_MODES = ("LA", "PA", "RGBA")
_PREMULTIPLIED_MODES = ("La", "RGBa")
_WHITE = 255


def _composite_on_white(rgba: Image.Image) -> Image.Image:
    background = Image.new("RGBA", rgba.size, (_WHITE, _WHITE, _WHITE, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _to_uint8(values: np.ndarray, mode: str) -> np.ndarray:
    """Integer or float pixel values (H, W) -> uint8 (H, W), by the value range the mode or the data implies."""
    if mode.startswith("I;16"):
        # 16-bit: 0..65535 onto 0..255, rounded (v * 255 / 65535); Pillow's convert would clip at 255.
        return ((values.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    if mode == "F" and not np.isfinite(values).all():
        raise SkipSample("unsupported_mode", "F (32-bit float) image with NaN or infinite pixel values")
    lo, hi = (values.min(), values.max()) if values.size else (0, 0)
    if mode == "I" and lo >= 0 and hi <= 255:
        return values.astype(np.uint8)  # 8-bit values in a 32-bit container
    if mode == "I" and lo >= 0 and hi <= 65535:
        return ((values.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)
    if mode == "F" and lo >= 0 and hi <= 1:
        return np.rint(values.astype(np.float64) * 255).astype(np.uint8)
    # Any other range (signed or > 16-bit integers, floats outside [0, 1]): the image's own min..max onto 0..255,
    # as image viewers show scientific data; a constant image becomes black.
    span = float(hi) - float(lo)
    if span <= 0:
        return np.zeros(values.shape, dtype=np.uint8)
    return np.rint((values.astype(np.float64) - float(lo)) * (255.0 / span)).astype(np.uint8)


def to_rgb(img: Image.Image) -> Image.Image:
    """A decoded PIL image of any mode Pillow opens -> 8-bit RGB, the one pixel conversion of mmcl.

    - RGB as it is; 1, L, P, CMYK, YCbCr, LAB, HSV, RGBX by Pillow's conversion.
    - Alpha (LA, PA, RGBA, and P with a transparent colour) composited on white; premultiplied La / RGBa likewise
      (colour + 255 - alpha).
    - 16-bit grey (I;16, I;16B, I;16L, I;16N) scaled 0..65535 -> 0..255. Pillow reads 48-bit RGB PNGs as 8-bit
      RGB itself (the high byte of each value).
    - I (32-bit integer): values in 0..255 as they are; in 0..65535 as 16-bit; otherwise stretched.
    - F (32-bit float): values in [0, 1] times 255; otherwise stretched. Stretched means the image's own
      min..max mapped onto 0..255 (a constant image becomes black).
    Grey results are repeated over the three channels.

    Raises `SkipSample` ``unsupported_mode`` for a mode not listed (or an F image holding NaN or infinity).
    """
    mode = img.mode
    if mode == "RGB":
        return img
    if mode == "P" and "transparency" in img.info:
        return _composite_on_white(img.convert("RGBA"))
    if mode in _CONVERTED_MODES:
        return img.convert("RGB")
    if mode in _ALPHA_MODES:
        return _composite_on_white(img.convert("RGBA"))
    if mode in _PREMULTIPLIED_MODES:
        values = np.asarray(img, dtype=np.int32)  # (H, W, C) with alpha last, colour already times alpha
        colour = values[..., :-1] + (_WHITE - values[..., -1:])
        colour = np.clip(colour, 0, 255).astype(np.uint8)
        if colour.shape[-1] == 1:
            colour = np.repeat(colour, 3, axis=-1)
        return Image.fromarray(np.ascontiguousarray(colour))  # (H, W, 3) uint8 is RGB
    if mode.startswith("I;16") or mode in ("I", "F"):
        grey = _to_uint8(np.asarray(img), mode)  # (H, W)
        return Image.fromarray(np.repeat(grey[..., None], 3, axis=-1))  # (H, W, 3) uint8 is RGB
    raise SkipSample("unsupported_mode", f"pixel mode {mode} has no RGB conversion")


def decode_image(data: bytes, max_pixels: int, draft_size: Optional[Tuple[int, int]] = None) -> Image.Image:
    """Decode encoded image bytes to an RGB PIL image (pixel modes converted by `to_rgb`).

    Raises `SkipSample` with reason ``too_large`` when width*height > max_pixels (checked from the header,
    before any pixel is decoded), ``unsupported_mode`` for pixels `to_rgb` cannot map and ``decode`` for anything
    pillow cannot read. JPEGs are decoded at a reduced DCT scale when `draft_size` (w, h) is given and the image
    is at least twice as large.
    """
    with warnings.catch_warnings():
        # Pillow warns above its own global limit; ours is cfg.max_image_pixels and is counted instead.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as err:
            raise SkipSample("too_large", str(err))
        except UnidentifiedImageError:
            raise SkipSample("decode", "not an image format Pillow can identify")
        except Exception as err:  # pillow raises several types for unreadable data
            raise SkipSample("decode", f"{type(err).__name__}: {err}")
        width, height = img.size
        if width * height > max_pixels:
            raise SkipSample("too_large", f"{width}x{height} pixels > {max_pixels}")
        try:
            if draft_size is not None and img.format == "JPEG":
                img.draft("RGB", draft_size)
            img.load()  # decode now, so a cut-off file is reported here and not by a later conversion
        except Exception as err:
            raise SkipSample("decode", f"{type(err).__name__}: {err}")
        try:
            return to_rgb(img)
        except SkipSample:
            raise
        except Exception as err:
            raise SkipSample("decode", f"{type(err).__name__}: {err}")


def parse_caption(data: Optional[bytes]) -> str:
    """UTF-8 caption bytes -> stripped text; `SkipSample` when missing, empty or not UTF-8."""
    if data is None:
        raise SkipSample("missing_caption")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise SkipSample("bad_caption", f"not UTF-8 ({err})")
    if not text:
        raise SkipSample("bad_caption", "empty caption")
    return text


def parse_label(data: Optional[bytes]) -> int:
    """``.cls`` bytes -> non-negative int; -1 when absent; `SkipSample` ``bad_label`` otherwise."""
    if data is None:
        return -1
    try:
        label = int(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise SkipSample("bad_label", f"not an integer: {data[:32]!r}")
    if label < 0:
        raise SkipSample("bad_label", f"negative label {label}")
    return label


def image_bytes(files: Dict[str, bytes]) -> Optional[bytes]:
    """The encoded image of a raw sample (first of jpg, jpeg, png, webp), or None when it has none."""
    for ext in IMAGE_EXTS:
        if ext in files:
            return files[ext]
    return None


def parse_sample(files: Dict[str, bytes], caption_required: bool = True) -> Tuple[bytes, str, int]:
    """The fields of one raw sample: (encoded image bytes, caption str, label int (-1 when there is no ``.cls``)).

    Raises `SkipSample` ``missing_image``, ``missing_caption``, ``bad_caption`` or ``bad_label``. Without
    `caption_required` (evaluation sets, which may have labels only) a missing or unreadable caption is "".
    These checks are cheap, so callers run them before decoding the image.
    """
    data = image_bytes(files)
    if data is None:
        raise SkipSample("missing_image")
    try:
        caption = parse_caption(files.get("txt"))
    except SkipSample:
        if caption_required:
            raise
        caption = ""
    return data, caption, parse_label(files.get("cls"))
