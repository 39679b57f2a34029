"""Sample transforms: from a decoded image to the tensor a batch holds.

- `training_sample_transform` makes a torchvision ``Compose`` cheaper without changing its output distribution
  (`PyRandomResizedCrop` draws its `random_crop_box` from Python's RNG; an RGB conversion of an RGB image is
  skipped).
- `split_transform` cuts a transform ending in ToTensor [+ Normalize] into a PIL stage for the data workers
  (`mmcl.data.decode.pil_to_uint8` then ships uint8 pixels) and `ImageFinish`, the float tail run on the batch
  where the model is.
- `draft_size_of` reads from a transform how small a JPEG may be draft-decoded.
- `ImageSpec` holds the numbers of a model's image input (size, mean, std, ...), read once from its preprocess
  config, and the training augmentation (``data.aug``: open_clip's AugmentationCfg); `train_image_stages` builds
  the training transform from them as a PIL stage for the workers and the `ImageFinish` for the device, with no
  transform taken apart (the path training takes; `train_image_input` picks it, or timm's transform).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from open_clip.transform import PreprocessCfg, color_jitter, gray_scale, image_transform_v2

try:
    from open_clip.transform import MaybeToTensor
except ImportError:  # an older open_clip without it
    MaybeToTensor = None
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as F

# What turns a PIL image into a tensor in a torchvision pipeline (open_clip's MaybeToTensor where it has one).
TO_TENSOR_TYPES: Tuple[type, ...] = (T.ToTensor,) + ((MaybeToTensor,) if MaybeToTensor is not None else ())


def crop_draft_size(width: int, height: int, min_scale: float) -> Tuple[int, int]:
    """The draft size of a random resized crop to `width` x `height` whose area fraction is at least `min_scale`:
    ``(ceil(width / min_scale), ceil(height / min_scale))``.

    Pillow's ``draft`` decodes a JPEG at the largest DCT reduction k in {1, 2, 4, 8} that keeps both sides of
    the image at least this size. Every crop `random_crop_box` can then draw on the reduced image is still at least
    `width` x `height` pixels, so no crop is ever enlarged (at full size it would be reduced anyway):

    - a box from one of its tries fits the image (w <= W, h <= H) and has area s * W * H with s >= min_scale, so
      w = s * W * H / h >= s * W >= min_scale * W, and likewise h >= min_scale * H;
    - the fallback box (no try fitted, or an image outside the ratio range) spans the whole short side and at least
      the short side along the other, so each of its sides is at least min(W, H).

    The first bound is tight: on a square image a crop of area fraction min_scale and aspect ratio min_scale has
    width min_scale * W. The sides of the crop's area root (``1 / sqrt(min_scale)``) are not enough: such crops
    would be enlarged by up to ``sqrt(min_scale)`` - about 5 % for open_clip's scale of (0.9, 1.0)."""
    grow = 1.0 / max(float(min_scale), 1e-3)
    # A hair under, so that a bound that is an integer in exact arithmetic (224 / 0.9 * 0.9) stays that integer.
    return int(math.ceil(width * grow - 1e-9)), int(math.ceil(height * grow - 1e-9))


def draft_size_of(preprocess: Any) -> Optional[Tuple[int, int]]:
    """The (width, height) a JPEG may be draft-decoded to without losing what `preprocess` keeps.

    Reads the first resizing step of a torchvision ``Compose`` (Resize, CenterCrop, RandomResizedCrop,
    open_clip's ResizeKeepRatio); returns None when the output size cannot be inferred.
    """

    steps = getattr(preprocess, "transforms", [preprocess])
    for step in steps:
        if isinstance(step, T.RandomResizedCrop):
            h, w = step.size
            return crop_draft_size(w, h, step.scale[0])
        size = getattr(step, "size", None)
        if isinstance(step, (T.Resize, T.CenterCrop)) or type(step).__name__ in ("ResizeKeepRatio", "CenterCropOrPad"):
            if isinstance(size, int):
                return size, size
            if isinstance(size, (list, tuple)) and len(size) == 1:
                return int(size[0]), int(size[0])
            if isinstance(size, (list, tuple)) and len(size) == 2:
                side = max(size)  # aspect-keeping resizes fit one side; the larger bound is the safe one
                return int(side), int(side)
    return None


class ImageFinish:
    """The tail of an image transform, ToTensor [+ Normalize], applied to a batch of uint8 images (B, 3, H, W)
    where the model runs. Elementwise the same float32 operations in the same order as torchvision's, so the
    result is bitwise equal to transforming each image in the data worker. Float input is returned unchanged.
    """

    def __init__(self, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None):
        self.mean = None if mean is None else [float(m) for m in mean]
        self.std = None if std is None else [float(s) for s in std]
        self._cache: Dict[Tuple[Any, Any], Tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images
        x = images.to(torch.get_default_dtype()).div_(255)
        if self.mean is not None:
            key = (x.device, x.dtype)
            if key not in self._cache:
                self._cache[key] = (torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1),
                                    torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1))
            mean, std = self._cache[key]
            x.sub_(mean).div_(std)
        return x

    def __repr__(self) -> str:
        return f"ImageFinish(mean={self.mean}, std={self.std})"


def split_transform(preprocess: Callable) -> Tuple[Callable, Optional[ImageFinish]]:
    """Split a torchvision ``Compose`` ending in ToTensor [+ Normalize] into (PIL stage, `ImageFinish`).

    Workers then run only the PIL stage and send uint8 images; the float conversion and normalisation run on
    the batch where the model is. Returns ``(preprocess, None)`` for transforms of any other shape.
    """

    to_tensor_types: Tuple[type, ...] = TO_TENSOR_TYPES
    if not isinstance(preprocess, T.Compose):
        return preprocess, None
    steps = list(preprocess.transforms)
    normalize = steps.pop() if steps and type(steps[-1]) is T.Normalize else None
    if not steps or type(steps[-1]) not in to_tensor_types:
        return preprocess, None
    steps.pop()
    if normalize is not None and any(float(s) == 0 for s in normalize.std):
        return preprocess, None  # torchvision raises on a zero std; keep its error
    finish = ImageFinish(normalize.mean, normalize.std) if normalize is not None else ImageFinish()
    return T.Compose(steps), finish


class _ConvertIfNeeded:
    """PIL ``convert(mode)`` that returns an image already in `mode` as it is (convert would only copy it)."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, img: Any) -> Any:
        if isinstance(img, Image.Image) and img.mode != self.mode:
            return img.convert(self.mode)
        return img

    def __repr__(self) -> str:
        return f"ConvertIfNeeded({self.mode!r})"


def _skip_same_mode_convert(step: Callable) -> Callable:
    """open_clip's RGB conversion steps (MaybeConvertMode, _convert_to_rgb) as `_ConvertIfNeeded`."""
    if type(step).__name__ == "MaybeConvertMode" and isinstance(getattr(step, "mode", None), str):
        return _ConvertIfNeeded(step.mode)
    if getattr(step, "__name__", "") == "_convert_to_rgb" and getattr(step, "__module__", "") == "open_clip.transform":
        return _ConvertIfNeeded("RGB")
    return step


def random_crop_box(width: int, height: int, scale: Sequence[float], ratio: Sequence[float],
                    rng: Any = random) -> Tuple[int, int, int, int]:
    """A random-resized-crop box (top, left, height, width) for a `width` x `height` image.

    The distribution of torchvision's ``RandomResizedCrop``: up to ten tries of an area fraction uniform in
    `scale` and an aspect ratio log-uniform in `ratio`, the first box that fits placed uniformly; when none
    fits, the largest centred box whose aspect ratio is clamped into `ratio`. Draws come from `rng` (Python's
    `random` by default): a few float operations instead of torchvision's tiny torch tensors, which cost
    45-80 us per image in a data worker.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    image_ratio = width / height
    if image_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif image_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _python_rng_crop(step: Callable) -> Callable:
    """torchvision's RandomResizedCrop as `PyRandomResizedCrop` (same distribution, cheaper draws)."""

    return PyRandomResizedCrop(step) if type(step) is T.RandomResizedCrop else step


class PyRandomResizedCrop:
    """A torchvision ``RandomResizedCrop`` whose box is drawn by `random_crop_box` from Python's RNG (seeded
    per sample in the training stream, as torch's is); cropping and resizing are torchvision's own, so the pixels
    are open_clip_train's (one Pillow resize over the box is about 7 % cheaper on a LAION-sized image, but its
    filter reads the pixels beyond the box's edges: 0.01/255 on average, no longer open_clip's pixels)."""

    def __init__(self, crop: Any):
        self.crop = crop

    def __call__(self, img: Any) -> Any:

        c = self.crop
        _, height, width = F.get_dimensions(img)
        top, left, h, w = random_crop_box(width, height, c.scale, c.ratio)
        return F.resized_crop(img, top, left, h, w, c.size, c.interpolation, antialias=c.antialias)

    def __repr__(self) -> str:
        return f"Py{self.crop!r}"


def training_sample_transform(preprocess: Callable) -> Callable:
    """The per-sample transform the training stream runs: `preprocess` with its steps made cheaper where that
    changes no output distribution (RGB conversion of an RGB image skipped; RandomResizedCrop's box drawn
    with Python's RNG). Anything but a torchvision ``Compose`` is returned as it is."""

    if not isinstance(preprocess, T.Compose):
        return preprocess
    return T.Compose([_python_rng_crop(_skip_same_mode_convert(step)) for step in preprocess.transforms])


# open_clip's training crop keeps 90-100 % of the image's area (its AugmentationCfg default), at bicubic
# interpolation whatever the model's eval interpolation; mmcl trains with the same augmentation (data.aug.scale).
TRAIN_CROP_SCALE = (0.9, 1.0)


@dataclass(frozen=True)
class ImageSpec:
    """The numbers of a model's image input, from its preprocess config (`mmcl.models.preprocess_config`):
    ``size`` (int or (H, W)), per-channel ``mean`` and ``std``, and the eval-time ``interpolation`` and
    ``resize_mode``; and the training augmentation of open_clip's ``AugmentationCfg`` that its own (non-timm)
    train transform applies: the crop's area ``scale``, SimCLR-style ``color_jitter`` (brightness, contrast,
    saturation, hue) with ``color_jitter_prob``, and ``gray_scale_prob``. `train_image_stages` builds the
    training transform from them."""

    size: Union[int, Tuple[int, int]]
    mean: Tuple[float, float, float]
    std: Tuple[float, float, float]
    interpolation: str = "bicubic"
    resize_mode: str = "shortest"
    scale: Tuple[float, float] = TRAIN_CROP_SCALE
    color_jitter: Optional[Tuple[float, float, float, float]] = None
    color_jitter_prob: Optional[float] = None
    gray_scale_prob: Optional[float] = None

    @classmethod
    def from_config(cls, preprocess_cfg: Mapping[str, Any], aug: Optional[Any] = None) -> "ImageSpec":
        """From a preprocess-config dict (size, mean, std, interpolation, resize_mode; other keys ignored) and
        an augmentation config (`aug_dict`'s input: ``data.aug``, a dict or open_clip's AugmentationCfg)."""
        def three(v):
            return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else (float(v),) * 3

        a = aug_dict(aug)
        size = preprocess_cfg["size"]
        jitter = a.get("color_jitter")
        return cls(size=tuple(int(x) for x in size) if isinstance(size, (list, tuple)) else int(size),
                   mean=three(preprocess_cfg["mean"]), std=three(preprocess_cfg["std"]),
                   interpolation=str(preprocess_cfg.get("interpolation", "bicubic")),
                   resize_mode=str(preprocess_cfg.get("resize_mode", "shortest")),
                   scale=tuple(float(x) for x in a.get("scale", TRAIN_CROP_SCALE)),
                   color_jitter=None if jitter is None else tuple(float(x) for x in jitter),
                   color_jitter_prob=a.get("color_jitter_prob"), gray_scale_prob=a.get("gray_scale_prob"))


def aug_dict(aug: Optional[Any]) -> Dict[str, Any]:
    """open_clip ``AugmentationCfg`` keyword arguments from ``data.aug`` (a config section, a dict, or an
    AugmentationCfg): unset (None) entries and a false ``use_timm`` left out, sequences as tuples."""

    if aug is None:
        return {}
    items = dataclasses.asdict(aug).items() if dataclasses.is_dataclass(aug) else dict(aug).items()
    out = {}
    for key, value in items:
        if key.startswith("_") or value is None or (key == "use_timm" and not value):
            continue
        out[key] = tuple(value) if isinstance(value, (list, tuple)) else value
    return out


def train_image_input(preprocess_cfg: Mapping[str, Any], aug: Optional[Any] = None) -> Union[ImageSpec, Callable]:
    """What the training stream is given for a model's preprocess config and ``data.aug``: an `ImageSpec` (the
    stream builds open_clip's train transform from it, cheaper and exactly), or with ``use_timm`` open_clip's own
    transform built through timm (random erasing acts on the normalised tensor, so it is run whole in the workers)."""
    a = aug_dict(aug)
    if not a.get("use_timm"):
        return ImageSpec.from_config(preprocess_cfg, a)

    pp = PreprocessCfg(**{k: v for k, v in preprocess_cfg.items() if k in PreprocessCfg.__dataclass_fields__})
    return image_transform_v2(pp, is_train=True, aug_cfg=a)


def train_image_stages(spec: ImageSpec) -> Tuple[Callable, "ImageFinish"]:
    """The training transform of a model with image input `spec`, as (PIL stage, `ImageFinish`): a random
    resized crop (``spec.scale``, bicubic; the box drawn by `PyRandomResizedCrop`), an RGB conversion, and
    open_clip's own colour-jitter and grayscale steps where ``spec`` sets them, in the data workers; then ToTensor
    and Normalize(mean, std) on the uint8 batch where the model runs. Composed, the two give the pixels of
    open_clip's train transform (``image_transform_v2``) for the same preprocess and augmentation config."""

    crop = T.RandomResizedCrop(spec.size, scale=spec.scale, interpolation=T.InterpolationMode.BICUBIC)
    steps: list = [PyRandomResizedCrop(crop), _ConvertIfNeeded("RGB")]
    if spec.color_jitter_prob:
        steps.append(color_jitter(*spec.color_jitter, p=spec.color_jitter_prob))
    if spec.gray_scale_prob:
        steps.append(gray_scale(spec.gray_scale_prob))
    return T.Compose(steps), ImageFinish(spec.mean, spec.std)


def train_draft_size(spec: ImageSpec) -> Tuple[int, int]:
    """The (width, height) a JPEG may be draft-decoded to for `train_image_stages(spec)` (`crop_draft_size`)."""
    h, w = (spec.size, spec.size) if isinstance(spec.size, int) else spec.size
    return crop_draft_size(w, h, spec.scale[0])
