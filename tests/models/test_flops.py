"""mmcl.models.flops: the FLOPs per pair counted on meta tensors equal torch's counter on the real model doing a real
forward and backward, for open_clip's ViT towers and a timm image tower; the GPU peaks by device name; MFU."""

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mmcl import models
from mmcl.models import flops


def _counted_for_real(model, size, text_len, batch=3):
    """torch's FlopCounterMode around a real forward and backward of `batch` pairs on the CPU (the math attention
    kernel, whose products torch has formulas for), per pair."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=g)
    texts = torch.randint(1, 1000, (batch, text_len), generator=g)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(images, texts)
        (out["image_features"].sum() + out["text_features"].sum()).backward()
    return counter.get_total_flops() / batch


def _tiny(**vision):
    cfg = models.named_config("tiny")
    cfg["vision_cfg"] = vision or cfg["vision_cfg"]
    return models.create(cfg), cfg


def test_open_clip_vit_towers_count_as_torch_counts_them():
    model, cfg = _tiny()
    size, text_len = cfg["vision_cfg"]["image_size"], cfg["text_cfg"]["context_length"]
    counted = flops.sample_flops(model, size, text_len)
    assert counted == _counted_for_real(model, size, text_len)
    assert counted > 0
    # A shorter text (mmcl's towers take texts cut to a batch's longest): the count follows the length asked for.
    short = flops.sample_flops(model, size, 16)
    assert short == _counted_for_real(model, size, 16) and short < counted
    # Nothing of the model is touched: no gradient, weights where they were.
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())


def test_a_locked_tower_takes_no_weight_gradients_and_counts_less():
    model, cfg = _tiny()
    size, text_len = cfg["vision_cfg"]["image_size"], cfg["text_cfg"]["context_length"]
    full = flops.sample_flops(model, size, text_len)
    for p in model.visual.parameters():
        p.requires_grad_(False)
    locked = flops.sample_flops(model, size, text_len)
    assert locked == _counted_for_real(model, size, text_len) and locked < full


def test_a_timm_image_tower_counts_as_torch_counts_it():
    model, cfg = _tiny(timm_model_name="resnet18", timm_model_pretrained=False, timm_pool="avg",
                       timm_proj="linear", image_size=64)
    counted = flops.sample_flops(model, 64, cfg["text_cfg"]["context_length"])
    assert counted == _counted_for_real(model, 64, cfg["text_cfg"]["context_length"])
    # resnet18's forward at 64 px is 1.82 GFLOPs x (64/224)^2 multiply-adds... at least its convolutions' share.
    assert counted > 3 * 2 * 1.8e9 * (64 / 224) ** 2 * 0.9


@pytest.mark.slow
def test_vit_b_32_at_224_px_and_77_tokens():
    """open_clip's ViT-B-32 without weights: 44.10 GFLOPs per pair forward and backward (43.39 without the
    attention products, which torch does not count in the CPU's fused attention kernel)."""
    import open_clip

    model = open_clip.create_model("ViT-B-32", pretrained=None)
    model.output_dict = True
    counted = flops.sample_flops(model, 224, 77)
    assert counted == _counted_for_real(model, 224, 77, batch=2)
    assert round(counted / 1e9, 2) == 44.10


@pytest.mark.parametrize("name,precision,tf32,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.0),
    ("NVIDIA H100 80GB HBM3", "fp32", True, 495.0),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 67.0),
    ("NVIDIA H100 PCIe", "bf16", False, 756.0),
    ("NVIDIA H100 NVL", "fp16", False, 835.0),
    ("NVIDIA H200", "bf16", False, 989.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
    ("NVIDIA A100 80GB PCIe", "fp32", True, 156.0),
    ("NVIDIA L4", "bf16", False, 121.0),
    ("NVIDIA L40S", "bf16", False, 362.0),
    ("NVIDIA B200", "bf16", False, 2250.0),
    ("NVIDIA GeForce RTX 4090", "bf16", False, None),
    (None, "bf16", False, None),
])
def test_peaks_by_device_name(name, precision, tf32, peak):
    assert flops.peak_tflops(name, precision, tf32) == peak


def test_mfu_and_its_unknowns():
    assert flops.mfu(4196, 43.4e9, 989.0) == pytest.approx(4196 * 43.4e9 / 989e12)
    assert round(flops.mfu(4196, 43.4e9, 989.0), 3) == 0.184  # BENCHMARKS.md, GPU
    assert flops.mfu(4196, 43.4e9, None) is None and flops.mfu(4196, None, 989.0) is None
    assert flops.device_peak(torch.device("cpu"), "bf16") is None
