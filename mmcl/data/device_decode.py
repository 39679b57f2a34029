"""Decoding on the training device (``data.decode=device``): the data workers read each sample, check it and draw
its crop box, and send the encoded JPEG bytes; the training process decodes the batch where the model runs
(``torchvision.io.decode_jpeg`` on a list of tensors: nvJPEG, batched, on CUDA; libjpeg-turbo on a CPU, the same
call), then crops, resizes (bicubic, antialiased, on tensors) and normalises it.

- `device_decode_problem` says why a run cannot decode on the device (a transform that is not the model's own
  crop, colour augmentation, a teacher's view, NaFlex or phases), so that it decodes in the workers and says why.
- `encoded_sample` is the worker's part for one sample: the cheap checks of `parse_sample`, the JPEG's header
  (its size against ``data.max_image_pixels``, its colour mode), and the crop box. A sample that is not a JPEG of
  RGB or grey pixels (a PNG, a CMYK JPEG, a cut-off file) gets None and takes the worker path, decoded and cropped
  in the worker as without this option, or skipped and named as there.
- The crop box is `random_crop_box`'s distribution (open_clip's RandomResizedCrop) drawn from a seed of the run's
  seed, the epoch and the sample's id (`mmcl.data.batching`): the same sample gets the same crop on any number of
  processes and workers, and after a resume.
- `collate_images` packs a batch's images: the encoded bytes in one flat uint8 tensor (one shared-memory block, not
  one per sample) with offsets, boxes and places, and the worker-decoded images of the other samples.
- `DeviceFinish` decodes, crops and finishes such a batch on the device (and finishes a plain uint8 batch as
  `ImageFinish` does).

The pixels differ slightly from the worker path's: the resize is torch's antialiased bicubic on float tensors, not
Pillow's, and nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's (tests/data/test_device_decode.py
measures the difference on the CPU).
"""

from __future__ import annotations

import io
import random
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from ..errors import DataError
from .decode import parse_sample
from .transforms import ImageFinish, ImageSpec, random_crop_box

ENCODED = "jpeg"  # the batch key of the flat encoded bytes; "jpeg_offsets", "jpeg_box", "jpeg_at" beside it
_RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's aspect ratios, as `train_image_stages` builds it
_DECODABLE_MODES = ("RGB", "L")


class Encoded(NamedTuple):
    """One sample's encoded JPEG and its crop box (top, left, height, width) on the full-size image."""

    data: bytes
    box: Tuple[int, int, int, int]


def device_decode_problem(preprocess: Any, teacher_view: Any = None, naflex: Any = None,
                          sizes: Sequence[Any] = (), stored_teacher: bool = False) -> Optional[str]:
    """Why ``data.decode=device`` cannot be in effect for this stream (words), or None when it can."""
    if not isinstance(preprocess, ImageSpec):
        return "the training transform is not the model's own crop (data.aug.use_timm or a transform of the caller's)"
    if preprocess.color_jitter_prob or preprocess.gray_scale_prob:
        return "data.aug's colour jitter and grayscale run on PIL images in the workers"
    if teacher_view is not None or stored_teacher:
        return "distillation's teacher inputs are made in the workers"
    if naflex is not None:
        return "NaFlex batches are patchified in the workers"
    if any(size is not None for _, size, _ in sizes):
        return "train.phases change the image size from batch to batch"
    return None


def jpeg_header(data: bytes, max_pixels: int) -> Optional[Tuple[int, int]]:
    """(width, height) of a JPEG that the device can decode as it is (baseline or progressive, RGB or grey pixels,
    complete: it ends with its end-of-image marker, within `max_pixels`); None for anything else, which takes the
    worker path (and is skipped and named there if it is bad)."""
    if not (data[:3] == b"\xff\xd8\xff" and data.rstrip(b"\x00")[-2:] == b"\xff\xd9"):
        return None
    try:
        img = Image.open(io.BytesIO(data))  # the header only: no pixel is decoded
        width, height = img.size
        ok = img.format == "JPEG" and img.mode in _DECODABLE_MODES and width * height <= max_pixels
    except Exception:  # noqa: BLE001 - whatever Pillow cannot read goes the worker path, which names it
        return None
    return (width, height) if ok else None


def encoded_sample(files: Dict[str, bytes], spec: ImageSpec, max_pixels: int, seed: int, keys: Any = None,
                   caption_draw: int = 0) -> Optional[Tuple[Encoded, str, int]]:
    """(encoded image with its crop box, caption, label) of a raw sample whose image the device can decode; None
    when it cannot (the caller decodes it in the worker). The caption and label checks raise `SkipSample` as
    `parse_sample` does."""
    data, caption, label = parse_sample(files, keys=keys, draw=caption_draw)
    size = jpeg_header(data, max_pixels)
    if size is None:
        return None
    box = random_crop_box(size[0], size[1], spec.scale, _RATIO, random.Random(seed))
    return Encoded(data, box), caption, label


def collate_images(images: List[Any], spec_size: Tuple[int, int]) -> Dict[str, torch.Tensor]:
    """A batch's images, some `Encoded` and the others uint8 (3, H, W) tensors decoded in the worker: ``jpeg``
    (all encoded bytes, flat uint8), ``jpeg_offsets`` (n + 1), ``jpeg_box`` (n, 4), ``jpeg_at`` (n: each one's place
    in the batch), and ``image`` (the worker-decoded ones, (m, 3, H, W) uint8) with ``image_at``."""
    enc = [(i, x) for i, x in enumerate(images) if isinstance(x, Encoded)]
    dec = [(i, x) for i, x in enumerate(images) if not isinstance(x, Encoded)]
    sizes = [len(x.data) for _, x in enc]
    offsets = torch.zeros(len(enc) + 1, dtype=torch.long)
    if sizes:
        offsets[1:] = torch.tensor(sizes, dtype=torch.long).cumsum(0)
    flat = torch.empty(int(offsets[-1]), dtype=torch.uint8)
    for (_, x), start in zip(enc, offsets[:-1].tolist()):
        flat[start:start + len(x.data)] = torch.frombuffer(bytearray(x.data), dtype=torch.uint8)
    h, w = spec_size
    return {ENCODED: flat, "jpeg_offsets": offsets,
            "jpeg_box": torch.tensor([x.box for _, x in enc], dtype=torch.long).reshape(-1, 4),
            "jpeg_at": torch.tensor([i for i, _ in enc], dtype=torch.long),
            "image": torch.stack([x for _, x in dec]) if dec else torch.empty(0, 3, h, w, dtype=torch.uint8),
            "image_at": torch.tensor([i for i, _ in dec], dtype=torch.long)}


class DeviceFinish(ImageFinish):
    """`ImageFinish` that also takes a batch of encoded JPEGs (`collate_images`) and returns it decoded, cropped,
    resized and normalised on a device (`batch`)."""

    def __init__(self, spec: ImageSpec):
        super().__init__(spec.mean, spec.std)
        self.size = (spec.size, spec.size) if isinstance(spec.size, int) else tuple(spec.size)

    def batch(self, b: Dict[str, Any], device: torch.device) -> torch.Tensor:
        """The float model input (B, 3, H, W) on `device` of a batch with encoded images."""
        offsets = b["jpeg_offsets"].tolist()
        flat = b[ENCODED]
        encoded = [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        n = len(encoded) + int(b["image_at"].numel())
        out = torch.empty(n, 3, *self.size, dtype=torch.uint8, device=device)
        if b["image_at"].numel():
            out[b["image_at"].to(device)] = b["image"].to(device, non_blocking=True)
        if encoded:
            try:
                pixels = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
            except RuntimeError:  # one bad file fails the batched call: decode each to name it
                pixels = [self._one(x, key, device) for x, key in zip(encoded, self._keys(b))]
            for x, (top, left, h, w), at in zip(pixels, b["jpeg_box"].tolist(), b["jpeg_at"].tolist()):
                out[at] = self._crop(x, top, left, h, w)
        return self(out)

    def _crop(self, x: torch.Tensor, top: int, left: int, h: int, w: int) -> torch.Tensor:
        """uint8 (3, H, W) -> the box resized to the model's size, uint8 (bicubic, antialiased, rounded)."""
        box = x[:, top:top + h, left:left + w].unsqueeze(0).float()
        resized = torch.nn.functional.interpolate(box, size=self.size, mode="bicubic", antialias=True,
                                                  align_corners=False)
        return resized.round_().clamp_(0, 255).to(torch.uint8)[0]

    @staticmethod
    def _keys(b: Dict[str, Any]) -> List[str]:
        keys = b.get("key") or []
        return [keys[i] if i < len(keys) else "?" for i in b["jpeg_at"].tolist()]

    @staticmethod
    def _one(x: torch.Tensor, key: str, device: torch.device) -> torch.Tensor:
        try:
            return decode_jpeg(x, mode=ImageReadMode.RGB, device=device)
        except RuntimeError as err:
            raise DataError(f"sample {key}: its JPEG passed the workers' checks but did not decode on {device} "
                            f"({str(err).splitlines()[0]}); train with data.decode=worker, which skips and names "
                            f"such samples") from None
