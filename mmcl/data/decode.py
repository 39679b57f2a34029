"""Decoding one raw sample: image bytes to 8-bit RGB, caption and label bytes to text and int.

Every image mmcl reads, in training shards, evaluation shards and folders and `mmcl shards` input, goes through
`decode_image` and its one pixel conversion `to_rgb`; every sample's files are read by `parse_sample`. A bad
sample raises `SkipSample` with one of `SKIP_REASONS`, which the callers count.

`decode_sample` runs one training sample through `parse_sample`, `decode_image` and the image transform, with
augmentation drawn from a per-sample seed so a replayed sample is augmented the same way after a resume;
`pil_to_uint8` gives the uint8 pixels a data worker ships when the transform's float tail runs on the device.
"""

from __future__ import annotations

import io
import random
import warnings
import zlib
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ..errors import ConfigError
from .limits import MAX_NEGATIVE_CANDIDATES, load_json

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SKIP_REASONS = (
    "decode", "missing_image", "missing_caption", "bad_caption", "bad_label", "too_large", "truncated_tar",
    "shard_open",
    "unsupported_mode", "no_teacher_features",
)
# The members `mmcl reinforce` adds to each sample: the teacher's L2-normalised image embedding (float16, (D,)),
# its caption embeddings (float16, (K, D), one row per candidate caption in `candidate_captions` order) and
# {"scale", "teacher", "dim"}.
TEACHER_IMAGE, TEACHER_TEXT, TEACHER_META = "teacher_image.npy", "teacher_text.npy", "teacher.json"
# Where a sample's negative captions (NegCLIP) are: a member with one caption a line, and a list in its JSON member.
NEGATIVES_MEMBER, NEGATIVES_JSON, NEGATIVES_FIELD = "neg.txt", "json", "negatives"


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
        except MemoryError:
            raise SkipSample("too_large", f"{width}x{height} pixels: out of memory decoding them")
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


class SampleKeys:
    """Which members of a sample are its image and its captions (``data.image_key``, ``data.caption_key``).

    `image_key` is a member extension (``jpg``, ``png``, ...) or None for the first of jpg, jpeg, png, webp.
    `caption_keys` are one or more caption sources, each a member (``txt``) or a field of a JSON member
    (``json:caption``, ``json:meta.captions``) holding a string or a list of strings. `weights` (one per source,
    optional) choose between the sources that a sample has (a weight of 0 never chooses its source; without
    weights the choice is uniform).
    """

    def __init__(self, image_key: Optional[str] = None, caption_keys: Any = "txt",
                 weights: Optional[Sequence[float]] = None):
        keys = [caption_keys] if isinstance(caption_keys, str) else list(caption_keys or [])
        if not keys or not all(isinstance(k, str) and k.strip() for k in keys):
            raise ValueError(f"caption keys must be one or more non-empty names (got {caption_keys!r})")
        if weights is not None and (len(weights) != len(keys) or any(w < 0 for w in weights) or sum(weights) <= 0):
            raise ValueError(f"caption key weights need one non-negative weight per key, not all zero (got "
                             f"{list(weights)} for {keys})")
        self.image_key = image_key
        self.caption_keys = keys
        self.weights = None if weights is None else [float(w) for w in weights]
        self.sources = [tuple(k.split(":", 1)) if ":" in k else (k, None) for k in keys]

    def image(self, files: Dict[str, bytes]) -> Optional[bytes]:
        return image_bytes(files) if self.image_key is None else files.get(self.image_key)

    def captions(self, files: Dict[str, bytes]) -> List[List[str]]:
        """The captions of each source (an empty list where the sample has none); `SkipSample` ``bad_caption``
        for a JSON member that is not JSON or a field that is not text."""
        out, parsed = [], {}
        for member, path in self.sources:
            if path is None:
                data = files.get(member)
                try:
                    out.append([] if data is None else [parse_caption(data)])
                except SkipSample as skip:
                    if skip.reason == "bad_caption" and "empty" in str(skip):
                        out.append([])
                        continue
                    raise
                continue
            if member not in parsed:
                data = files.get(member)
                try:
                    parsed[member] = None if data is None else load_json(data.decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as err:
                    raise SkipSample("bad_caption", f".{member} is not UTF-8 JSON ({err})")
            value = parsed[member]
            for part in path.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is None:
                out.append([])
                continue
            items = value if isinstance(value, list) else [value]
            if not all(isinstance(v, str) for v in items):
                raise SkipSample("bad_caption", f"{member}:{path} holds {type(value).__name__}, not text")
            out.append([" ".join(v.split()) for v in items if v.strip()])
        return out

    def choose(self, per_source: List[List[str]], draw: int) -> str:
        """One caption, drawn by `draw` (an integer seed): a source by weight among those with captions, then a
        caption of it uniformly. `SkipSample` ``missing_caption`` when no source has one."""
        avail = [i for i, caps in enumerate(per_source) if caps]
        if self.weights is not None:
            avail = [i for i in avail if self.weights[i] > 0]
        if not avail:
            raise SkipSample("missing_caption", f"none of {', '.join(self.caption_keys)}")
        if len(avail) == 1 and len(per_source[avail[0]]) == 1:
            return per_source[avail[0]][0]
        rng = np.random.default_rng(draw & 0xFFFFFFFFFFFFFFFF)
        if len(avail) == 1:
            i = avail[0]
        else:
            w = np.array([1.0 if self.weights is None else self.weights[i] for i in avail])
            i = avail[int(rng.choice(len(avail), p=w / w.sum()))]
        return per_source[i][int(rng.integers(len(per_source[i])))]


DEFAULT_KEYS = SampleKeys()


def sample_keys(cfg=None, image_key: Optional[str] = None, caption_key: Any = "txt",
                weights: Optional[Sequence[float]] = None) -> Optional[SampleKeys]:
    """The `SampleKeys` of a DataConfig (``data.image_key``, ``data.caption_key``, ``data.caption_key_weights``) or
    of the given values; None for the default (the first image extension, ``txt``). ConfigError when invalid."""
    if cfg is not None:
        image_key, caption_key, weights = cfg.image_key, cfg.caption_key, cfg.caption_key_weights
    if image_key is None and caption_key in ("txt", ["txt"]) and weights is None:
        return None
    try:
        return SampleKeys(image_key, caption_key, weights)
    except ValueError as err:

        raise ConfigError(str(err)) from None


def needed_members(keys: Optional[SampleKeys] = None, stored_teacher: bool = False,
                   extra: Sequence[str] = (), negatives: bool = False) -> FrozenSet[str]:
    """The member extensions a sample's reading needs (`read_raw_samples` passes over the others unread): the
    image (``data.image_key``, else every image extension), the caption members, ``cls``, the teacher members of
    reinforced shards when `stored_teacher`, the negative captions' members with `negatives`, and `extra` (e.g.
    ``json`` for an index's source URLs)."""
    keys = keys or DEFAULT_KEYS
    out = set(IMAGE_EXTS) if keys.image_key is None else {keys.image_key, keys.image_key.lower()}
    out.update(member for member, _ in keys.sources)
    out.add("cls")
    if stored_teacher:
        out.update((TEACHER_IMAGE, TEACHER_TEXT, TEACHER_META))
    if negatives:
        out.update((NEGATIVES_MEMBER, NEGATIVES_JSON))
    out.update(extra)
    return frozenset(out)


def caption_draw(seed: int, epoch: int, key: str) -> int:
    """The integer that draws a sample's caption in an epoch: a function of the run's seed, the epoch and the
    sample's key only, so a resumed run (or another process, worker or shuffle) draws the same caption."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, zlib.crc32(key.encode("utf-8"))]).generate_state(
        2, np.uint64)[0])


def parse_sample(files: Dict[str, bytes], caption_required: bool = True, keys: Optional[SampleKeys] = None,
                 draw: int = 0, all_captions: bool = False) -> Tuple[bytes, str, int]:
    """The fields of one raw sample: (encoded image bytes, caption str, label int (-1 when there is no ``.cls``)).

    `keys` chooses the image and caption members (default: the first image extension, ``txt``). With several
    captions (a list, or several sources) one is drawn with `draw` (`caption_draw`), or, with `all_captions`
    (retrieval), all are returned, one per line. Raises `SkipSample` ``missing_image``, ``missing_caption``,
    ``bad_caption`` or ``bad_label``. Without `caption_required` (evaluation sets, which may have labels only) a
    missing or unreadable caption is "". These checks are cheap, so callers run them before decoding the image.
    """
    keys = keys or DEFAULT_KEYS
    data = keys.image(files)
    if data is None:
        raise SkipSample("missing_image")
    try:
        if keys is DEFAULT_KEYS:
            caption = parse_caption(files.get("txt"))
        else:
            per_source = keys.captions(files)
            if all_captions:
                caption = "\n".join(" ".join(c.split()) for caps in per_source for c in caps)
                if not caption:
                    raise SkipSample("missing_caption", f"none of {', '.join(keys.caption_keys)}")
            else:
                caption = keys.choose(per_source, draw)
    except SkipSample:
        if caption_required:
            raise
        caption = ""
    return data, caption, parse_label(files.get("cls"))


def parse_negatives(files: Dict[str, bytes], limit: int, draw: int = 0) -> List[str]:
    """A sample's negative captions (NegCLIP): the lines of its ``neg.txt`` member, then the strings of the
    ``negatives`` list of its ``json`` member, whitespace collapsed, empty ones dropped, at most
    `MAX_NEGATIVE_CANDIDATES` in all; when there are more than `limit`, `limit` of them drawn by `draw` (an integer
    seed, `caption_draw`), in their order. None is fine (an empty list). `SkipSample` ``bad_caption`` for a member
    that is not UTF-8 (JSON), or a ``negatives`` field that is not text or a list of texts."""
    found: List[str] = []
    data = files.get(NEGATIVES_MEMBER)
    if data is not None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SkipSample("bad_caption", f".{NEGATIVES_MEMBER} is not UTF-8 ({err})")
        for line in text.splitlines():
            if len(found) == MAX_NEGATIVE_CANDIDATES:
                break
            if line.strip():
                found.append(" ".join(line.split()))
    data = files.get(NEGATIVES_JSON)
    if data is not None and len(found) < MAX_NEGATIVE_CANDIDATES:
        try:
            meta = load_json(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise SkipSample("bad_caption", f".{NEGATIVES_JSON} is not UTF-8 JSON ({err})")
        value = meta.get(NEGATIVES_FIELD) if isinstance(meta, dict) else None
        items = [] if value is None else value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in items):
            raise SkipSample("bad_caption", f"{NEGATIVES_JSON}:{NEGATIVES_FIELD} holds {type(value).__name__}, "
                                            "not text or a list of texts")
        found += [" ".join(v.split()) for v in items[:MAX_NEGATIVE_CANDIDATES - len(found)] if v.strip()]
    if len(found) <= limit:
        return found
    rng = np.random.default_rng(draw & 0xFFFFFFFFFFFFFFFF)
    return [found[i] for i in sorted(rng.choice(len(found), size=limit, replace=False))]


def candidate_captions(files: Dict[str, bytes], keys: Optional[SampleKeys] = None) -> List[str]:
    """Every caption a sample offers, in a fixed order (sources in `keys` order, each source's list in order): the
    rows of its stored teacher text embeddings."""
    keys = keys or DEFAULT_KEYS
    if keys is DEFAULT_KEYS:
        return [parse_caption(files.get("txt"))]
    return [c for caps in keys.captions(files) for c in caps]


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def stored_teacher_features(files: Dict[str, bytes], caption: str, keys: Optional[SampleKeys] = None
                            ) -> Tuple[np.ndarray, np.ndarray, float]:
    """The teacher's stored (image (D,), text (D,) of `caption`, scale) of a reinforced sample, float32.

    Raises `SkipSample` ``no_teacher_features`` when the members are missing, unreadable or do not fit (another
    caption set than the one they were computed for)."""
    if TEACHER_IMAGE not in files or TEACHER_TEXT not in files or TEACHER_META not in files:
        raise SkipSample("no_teacher_features", "no teacher members (shards not written by mmcl reinforce?)")
    try:
        image, text = _npy(files[TEACHER_IMAGE]), _npy(files[TEACHER_TEXT])
        scale = float(load_json(files[TEACHER_META].decode("utf-8"))["scale"])
        row = candidate_captions(files, keys).index(caption)
    except (ValueError, KeyError, TypeError, OSError, UnicodeDecodeError) as err:
        raise SkipSample("no_teacher_features", f"unreadable teacher members ({type(err).__name__}: {err})")
    if image.ndim != 1 or text.ndim != 2 or text.shape[1] != image.shape[0] or row >= text.shape[0]:
        raise SkipSample("no_teacher_features", f"teacher members of shapes {image.shape} and {text.shape}")
    return image.astype(np.float32), text[row].astype(np.float32), scale


class TransformOutputError(Exception):
    """The PIL stage of a split transform returned something other than an RGB PIL image."""


def pil_to_uint8(img: Any) -> torch.Tensor:
    """RGB PIL image -> uint8 tensor (3, H, W), the pixels `ToTensor` would scale by 1/255."""
    if not isinstance(img, Image.Image) or img.mode != "RGB":
        what = f"a PIL image of mode {img.mode}" if isinstance(img, Image.Image) else type(img).__name__
        raise TransformOutputError(
            f"the image transform before ToTensor gave {what}, not an RGB PIL image, so images cannot travel as "
            f"uint8; set data.uint8_transfer=false")
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)


def decode_sample(files: Dict[str, bytes], preprocess: Callable, max_pixels: int,
                  draft_size: Optional[Tuple[int, int]] = None,
                  aug_seed: Optional[int] = None, as_uint8: bool = False, keys=None,
                  caption_draw: int = 0, teacher_view=None, stored_teacher: bool = False, negatives: int = 0):
    """Raw files of one sample -> (image tensor (3, H, W), caption str, label int (-1 if none)).

    Cheap checks (image/caption present, caption and label valid) run before the image is decoded. When `aug_seed` is
    given, random transforms in `preprocess` draw from torch's RNG seeded with it, so a sample gets the same
    augmentation when it is replayed after a resume; outside a DataLoader worker the caller's RNG state is restored (a
    worker's RNG serves nothing else). With `as_uint8`, `preprocess` is the PIL stage of a split transform
    (`split_transform`) and the image comes back as uint8 RGB. Raises `SkipSample` for bad samples and
    `TransformOutputError` when the PIL stage gives no RGB image. `keys` (a `SampleKeys`) and `caption_draw` choose the
    members and the caption (`parse_sample`). With `teacher_view` (a `mmcl.evaluation.teacher.TeacherView`) a fourth
    element is the teacher's uint8 view of the same decoded image, before any augmentation. With `stored_teacher`
    (``distill.from_shards``) it is the sample's stored teacher embeddings (image, drawn caption, scale), or
    `SkipSample` ``no_teacher_features``. With `negatives` > 0 (``data.negatives``) a last element is the list of
    the sample's negative captions, at most that many (`parse_negatives`, drawn with `caption_draw`).
    """
    data, caption, label = parse_sample(files, keys=keys, draw=caption_draw)  # keys: data.image_key/caption_key
    negs = (parse_negatives(files, negatives, caption_draw),) if negatives > 0 else ()
    stored = stored_teacher_features(files, caption, keys) if stored_teacher else None
    img = decode_image(data, max_pixels, draft_size)
    if aug_seed is None:
        out = preprocess(img)
    elif torch.utils.data.get_worker_info() is not None:
        torch.default_generator.manual_seed(aug_seed)
        random.seed(aug_seed)
        out = preprocess(img)
    else:
        # Only the CPU generator and Python's `random` (used by some open_clip transforms) are reseeded, and
        # both are restored, so the caller's RNG streams (including CUDA's) are untouched.
        py_state, torch_state = random.getstate(), torch.get_rng_state()
        try:
            torch.default_generator.manual_seed(aug_seed)
            random.seed(aug_seed)
            out = preprocess(img)
        finally:
            random.setstate(py_state)
            torch.set_rng_state(torch_state)
    image = pil_to_uint8(out) if as_uint8 else out
    if teacher_view is not None:
        return (image, caption, label, teacher_view.image(img)) + negs
    if stored is not None:
        return (image, caption, label, stored) + negs
    return (image, caption, label) + negs
