"""A model's FLOPs per sample and the share of a device's peak a run reaches (MFU).

`sample_flops` counts, once, the forward and backward FLOPs of one image-text pair through a model as it is built
(its locked towers' weights take no weight gradients, so they count less), at a run's image size and text length,
with torch's `FlopCounterMode` on meta copies of the parameters and buffers: nothing is computed or allocated on the
device, no random number is drawn and no gradient is touched. The loss's FLOPs (a few B x D per pair) are not
counted. Attention is counted as the math kernel computes it (the fused kernels' FLOPs are the same products; on a
CPU torch has no FLOP formula for its fused attention kernel and would count none).

`PEAKS` holds the dense (no structured sparsity) tensor-core peaks of the usual data-centre GPUs from NVIDIA's data
sheets, by precision; `peak_tflops` finds a device's by the name torch gives it. `mfu` is the share of that peak a
rate of samples per second means: None where the peak is not known (a CPU, an unlisted GPU), which a run prints as
"n/a".
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

# (pattern on torch.cuda.get_device_name, {precision: dense TFLOP/s}); the first match wins, so the variants with
# their own figures (NVL, PCIe) come before the SXM parts that share the family's name.
PEAKS: Tuple[Tuple[str, Dict[str, float]], ...] = (
    (r"\bB200\b", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    (r"\bH200 NVL\b", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (r"\bH200\b", {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0}),
    (r"\bH100 NVL\b", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (r"\bH100 PCIe\b", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"\bH100\b", {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0}),  # SXM ("H100 80GB HBM3")
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL40S\b", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)


def peak_tflops(device_name: Optional[str], precision: str, tf32: bool = False) -> Optional[float]:
    """The dense peak in TFLOP/s of the GPU named `device_name` (as ``torch.cuda.get_device_name`` says it) in
    `precision` (bf16, fp16 or fp32; fp32 with `tf32` allowed counts the TF32 tensor-core peak); None for a CPU
    (`device_name` None) or a GPU not in `PEAKS`."""
    if not device_name:
        return None
    key = "tf32" if precision == "fp32" and tf32 else precision
    for pattern, peaks in PEAKS:
        if re.search(pattern, device_name):
            return peaks.get(key)
    return None


def device_peak(device: torch.device, precision: str, tf32: bool = False) -> Optional[float]:
    """`peak_tflops` of `device`: None on anything but a CUDA device."""
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device), precision, tf32)


def mfu(samples_per_s: float, flops_per_sample: Optional[float], peak: Optional[float]) -> Optional[float]:
    """The share (0-1) of `peak` TFLOP/s that `samples_per_s` pairs of `flops_per_sample` each amount to; None when
    either is unknown."""
    if not flops_per_sample or not peak:
        return None
    return samples_per_s * flops_per_sample / (peak * 1e12)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)


def _tensors(out: Any):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _tensors(v)


def sample_flops(model: nn.Module, image_size: Union[int, Sequence[int]], text_len: int, batch: int = 2,
                 channels: int = 3) -> float:
    """Forward + backward FLOPs of one pair through `model` (``model(images, texts)``, open_clip's interface) at
    `image_size` (an int or (H, W)) and `text_len` tokens, counted on a meta batch of `batch` pairs and divided by it.
    Raises what the model's forward raises on meta tensors (one that reads values, e.g.)."""
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    state = {n: _meta(p) for n, p in model.named_parameters()}
    state.update({n: _meta(b) for n, b in model.named_buffers()})
    images = torch.empty(batch, channels, h, w, device="meta")
    texts = torch.zeros(batch, text_len, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        out = functional_call(model, state, (images, texts))
        outputs = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
        if outputs:
            sum(t.float().sum() for t in outputs).backward()
    return counter.get_total_flops() / batch
