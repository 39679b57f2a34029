"""On a CUDA device: the losses under bf16 autocast against float32, tiled against dense, stream batches pinned,
and a few training steps with a kill and a resume. Skipped, with the reason, where torch sees no CUDA device;
bench/gpu/run.sh runs them on a GPU machine (``pytest -m gpu``)."""

import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]


def _pairs(n, dim, seed):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n, dim, generator=g), dim=1)
    txt = F.normalize(img + 0.5 * torch.randn(n, dim, generator=g) / dim ** 0.5, dim=1)
    return img.cuda().requires_grad_(True), txt.cuda().requires_grad_(True)


def _loss_and_grads(fn, img, txt, scale, autocast):
    img.grad = txt.grad = scale.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(img, txt, scale)
    loss.backward()
    return loss.detach().double(), img.grad.double(), txt.grad.double(), scale.grad.double()


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("chunk", [None, 256])
def test_losses_under_bf16_autocast_give_the_float32_loss_and_gradients(kind, chunk):
    from mmcl.losses import clip_loss, siglip_loss

    bias = torch.tensor(-10.0, device="cuda", requires_grad=True)
    fn = ((lambda i, t, s: clip_loss(i, t, s, chunk_size=chunk)) if kind == "clip"
          else (lambda i, t, s: siglip_loss(i, t, s, bias, chunk_size=chunk)))
    img, txt = _pairs(1024, 128, seed=1)
    scale = torch.tensor(14.3, device="cuda", requires_grad=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = _loss_and_grads(fn, img, txt, scale, autocast=False)
    got = _loss_and_grads(fn, img, txt, scale, autocast=True)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        assert _rel(a, b) < 1e-5  # the losses run in float32 under autocast


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_tiled_equals_dense_on_cuda(kind):
    from mmcl.losses import clip_loss, siglip_loss

    from helpers import assert_float32_close

    bias = torch.tensor(-10.0, device="cuda", requires_grad=True)
    img, txt = _pairs(3000, 64, seed=2)  # not a multiple of the chunk
    scale = torch.tensor(30.0, device="cuda", requires_grad=True)
    torch.backends.cuda.matmul.allow_tf32 = False

    def fn(chunk):
        if kind == "clip":
            return lambda i, t, s: clip_loss(i, t, s, chunk_size=chunk)
        return lambda i, t, s: siglip_loss(i, t, s, bias, chunk_size=chunk)

    dense = _loss_and_grads(fn(None), img, txt, scale, autocast=False)
    tiled = _loss_and_grads(fn(512), img, txt, scale, autocast=False)
    # At scale 30 every positive dominates (the loss is ~5e-6): relative agreement alone would ask float32 for
    # more than its logits carry, so the rule is the CPU tests' (1e-5 relative plus scale * 2^-23).
    for a, b in zip(tiled, dense):
        assert_float32_close(a, b, 30.0)


def test_stream_batches_are_pinned_and_contiguous_on_cuda(tmp_path):
    from mmcl.shards.demo import make_demo_data

    from helpers import stream_batch

    shards = make_demo_data(str(tmp_path), n_train=32, n_val=1, n_zeroshot=1, shard_size=16, progress=False)["train"]
    for workers in (0, 1):
        batch = stream_batch(shards, workers, pin_memory=True)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                assert value.is_contiguous() and value.is_pinned(), (workers, key)


def _mmcl(args):
    return subprocess.Popen([sys.executable, "-m", "mmcl", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_training_on_cuda_killed_and_resumed_gives_the_uninterrupted_weights(demo, tmp_path):
    from mmcl.storage.checkpoints import latest_checkpoint

    from helpers import final_weights, run_args

    common = ["train.steps=8", "train.save_every=2", "train.keep_checkpoints=2", "data.batch_size=16",
              "data.workers=2", "train.log_every=2", "train.precision=bf16"]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    p = _mmcl(run_args(demo, ref, *common))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out

    p = _mmcl(run_args(demo, killed, *common))
    deadline = time.time() + 600
    while latest_checkpoint(killed / "checkpoints") is None and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (killed / "model").exists(), "the run finished before it could be killed"
    ckpt = latest_checkpoint(killed / "checkpoints")
    # The checkpoint holds the CUDA generator's state (accelerate's random states), which the resume restores.
    states = list(ckpt.glob("random_states_*.pkl"))
    assert states, sorted(p.name for p in ckpt.iterdir())
    saved = torch.load(states[0], weights_only=False)
    assert saved.get("torch_cuda_manual_seed"), sorted(saved)

    p = _mmcl(run_args(demo, killed, *common))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert sum("resuming from" in ln for ln in out.splitlines()) == 1, out
    a, b = final_weights(ref), final_weights(killed)
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-4, worst


def test_device_decode_on_cuda_is_close_to_the_same_call_on_the_cpu():
    """data.decode=device on CUDA (nvJPEG, one batched call) against the same batch decoded on the CPU
    (libjpeg-turbo): the same boxes, pixels within the decoders' IDCT and chroma-upsampling differences."""
    import io

    import numpy as np
    from PIL import Image

    from mmcl.data.device_decode import DeviceFinish, Encoded, collate_images
    from mmcl.data.transforms import ImageSpec

    rng = np.random.default_rng(0)
    encoded = []
    for i in range(8):
        w, h = int(rng.integers(200, 400)), int(rng.integers(200, 400))
        y, x = np.mgrid[0:h, 0:w] / max(h, w)
        px = np.stack([np.sin(6 * x + i), np.cos(5 * y - i), np.sin(4 * (x + y))], -1) * 90 + 128
        buf = io.BytesIO()
        Image.fromarray(np.clip(px + rng.normal(0, 6, px.shape), 0, 255).astype(np.uint8)).save(buf, "JPEG",
                                                                                               quality=90)
        encoded.append(Encoded(buf.getvalue(), (10, 20, h - 30, w - 40)))
    spec = ImageSpec(size=224, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    b = collate_images(encoded, (224, 224))
    finish = DeviceFinish(spec)
    gpu = finish.batch({k: v.pin_memory() for k, v in b.items()}, torch.device("cuda")).cpu()
    cpu = finish.batch(b, torch.device("cpu"))
    levels = (gpu - cpu).abs() * 0.5 * 255
    assert gpu.shape == cpu.shape == (8, 3, 224, 224)
    assert levels.mean() < 1.5 and levels.max() < 48, (levels.mean(), levels.max())
