"""data.decode=device on the CPU (the same torchvision call decodes on CUDA): the workers send encoded JPEGs with
crop boxes drawn from the run's seed, the epoch and the sample alone; the training side decodes, crops and finishes.
Pixels against the worker path, the same crops on 1 and 2 processes, exact resume, the fallbacks (PNG, CMYK,
cut-off files), and the start line."""

import io
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from mmcl import data
from mmcl.config import DataConfig
from mmcl.data.decode import decode_image
from mmcl.data.device_decode import DeviceFinish, jpeg_header
from mmcl.data.transforms import ImageSpec

from helpers import tokenizer

SPEC = ImageSpec(size=48, mean=(0.48, 0.46, 0.41), std=(0.27, 0.26, 0.28))
N = 40


def _photo(i, rng):
    """A photo-like image: smooth colour gradients, a few shapes, mild noise; sizes 60-140 px, aspect 0.6-1.7."""
    w, h = int(rng.integers(60, 141)), int(rng.integers(60, 141))
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * x + i), np.cos(5 * y - i), np.sin(4 * (x + y) + 0.3 * i)], -1) * 90 + 128
    base += rng.normal(0, 6, base.shape)
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def _jpeg(img, **kw):
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """N samples in 4 shards: JPEGs (one grey, one progressive), a PNG, a CMYK JPEG and a cut-off JPEG."""
    from mmcl.shards.writer import write_shards

    rng = np.random.default_rng(0)
    samples = []
    for i in range(N):
        img = _photo(i, rng)
        if i == 3:
            image, ext = _jpeg(img.convert("L")), "jpg"
        elif i == 4:
            image, ext = _jpeg(img, progressive=True), "jpg"
        elif i == 5:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            image, ext = buf.getvalue(), "png"
        elif i == 6:
            image, ext = _jpeg(img.convert("CMYK")), "jpg"
        elif i == 7:
            image, ext = _jpeg(img)[:300], "jpg"  # cut off: skipped and named, as on the worker path
        else:
            image, ext = _jpeg(img), "jpg"
        samples.append({"key": f"s{i:03d}", "image": image, "ext": ext, "caption": f"a photo number {i}"})
    root = tmp_path_factory.mktemp("device-decode")
    info = write_shards(samples, str(root), shard_size=N // 4)
    return str(root / ("shard-{000000..%06d}.tar" % (info["n_shards"] - 1)))


def _cfg(spec, **kw):
    return DataConfig(train=spec, **{"batch_size": 6, "workers": 0, "shuffle_buffer": 5, "decode": "device", **kw})


def _batches(stream, n):
    it = iter(stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = [next(it) for _ in range(n)]
    if hasattr(it, "close"):
        it.close()
    return out


def _finished(stream, b):
    return stream.finish_images.batch(b, torch.device("cpu"))


def _boxes(b):
    return {b["key"][at]: tuple(box) for at, box in zip(b["jpeg_at"].tolist(), b["jpeg_box"].tolist())}


def test_the_headers_the_device_takes():
    img = _photo(0, np.random.default_rng(1))
    assert jpeg_header(_jpeg(img), 10 ** 6) == img.size
    assert jpeg_header(_jpeg(img.convert("L")), 10 ** 6) == img.size
    assert jpeg_header(_jpeg(img.convert("CMYK")), 10 ** 6) is None  # Pillow's conversion, in the worker
    assert jpeg_header(_jpeg(img)[:300], 10 ** 6) is None  # cut off: the worker path names it
    assert jpeg_header(_jpeg(img), 100) is None  # over data.max_image_pixels: the worker path skips it as too_large
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    assert jpeg_header(buf.getvalue(), 10 ** 6) is None


def test_pixels_match_the_worker_path_within_the_resize_kernels_difference(shards):
    """Each JPEG's crop box, decoded and resized on the worker path (Pillow decode, torchvision's PIL bicubic with
    antialias) against the device path (torchvision.io.decode_jpeg, torch's antialiased bicubic on tensors): the
    same boxes, pixels within a few levels; the PNG and CMYK samples are the worker path's own pixels."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    stream = data.build_train_stream(_cfg(shards, fast_decode=False), SPEC, tokenizer, seed=3)
    assert stream.device_decode is SPEC and "decoded on the training device" in stream.decode_line
    batches = _batches(stream, 7)  # past epoch 0's 39 readable samples
    raw = _raw_images(shards)
    mean, std = torch.tensor(SPEC.mean).view(3, 1, 1), torch.tensor(SPEC.std).view(3, 1, 1)
    diffs, fallbacks = [], 0
    for b in batches:
        x = _finished(stream, b)
        assert x.shape == (6, 3, 48, 48) and x.dtype == torch.float32
        levels = (x * std + mean) * 255  # back to 0..255
        boxes = _boxes(b)
        for i, key in enumerate(b["key"]):
            if key not in boxes:
                fallbacks += 1
                assert key in ("s005", "s006")  # the PNG and the CMYK JPEG, decoded in the worker
                continue
            top, left, h, w = boxes[key]
            ref = F.resized_crop(decode_image(raw[key], 10 ** 8), top, left, h, w, [48, 48],
                                 InterpolationMode.BICUBIC, antialias=True)
            ref = torch.from_numpy(np.array(ref)).permute(2, 0, 1).float()
            diffs.append((levels[i] - ref).abs())
    assert "s007" not in {k for b in batches for k in b["key"]}  # the cut-off JPEG is skipped and counted
    assert stream.skipped["decode"] >= 1
    d = torch.stack(diffs)
    print(f"device - worker pixels: mean {d.mean():.3f}, p99.9 {torch.quantile(d.flatten()[::7], 0.999):.2f}, "
          f"max {d.max():.1f} levels of 255 over {len(diffs)} crops")
    # Measured: mean 0.17 levels of 255, at most 1 level (torch's antialiased bicubic on float tensors, rounded,
    # against Pillow's fixed-point one; both decoders are libjpeg-turbo on the CPU, nvJPEG on CUDA is not).
    assert d.mean() < 0.5 and d.max() <= 2, (d.mean(), d.max())
    assert len(diffs) >= 25


def _raw_images(shards):
    from mmcl.data.reading import read_raw_samples
    from mmcl.data.sources import expand_sources

    urls = [(u, None) for src in expand_sources(shards) for u in src]
    return {item.key: item.files.get("jpg", item.files.get("png")) for item in read_raw_samples(urls)
            if item.error is None}


def _epoch_boxes(shards, world_size, workers):
    """Every JPEG's crop box and finished pixels, by key, over epoch 0 on `world_size` processes."""
    boxes, pixels = {}, {}
    for rank in range(world_size):
        stream = data.build_train_stream(_cfg(shards, workers=workers, batch_size=4), SPEC, tokenizer, seed=11,
                                         rank=rank, world_size=world_size)
        for b in _batches(stream, 32 // (4 * world_size)):
            x = _finished(stream, b)
            for key, box in _boxes(b).items():
                assert boxes.setdefault(key, box) == box  # within one epoch a sample is read once
                pixels[key] = x[b["key"].index(key)]
    return boxes, pixels


@pytest.mark.slow
def test_the_same_seed_gives_the_same_crops_on_one_and_two_processes(shards):
    one, one_px = _epoch_boxes(shards, 1, 0)
    two, two_px = _epoch_boxes(shards, 2, 1)
    common = set(one) & set(two)
    assert len(common) >= 20
    assert {k: one[k] for k in common} == {k: two[k] for k in common}
    assert all(torch.equal(one_px[k], two_px[k]) for k in common)
    # Another seed draws other boxes.
    other = data.build_train_stream(_cfg(shards), SPEC, tokenizer, seed=12)
    drawn = _boxes(_batches(other, 1)[0])
    assert any(one.get(k) != box for k, box in drawn.items())


def test_resume_yields_identical_batches(shards):
    cfg = _cfg(shards, workers=2, batch_size=3)
    K, M = 5, 6
    reference = _batches(data.build_train_stream(cfg, SPEC, tokenizer, seed=5), K + M)
    first = data.build_train_stream(cfg, SPEC, tokenizer, seed=5)
    it = iter(first)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(K + 1):
            next(it)
    state = json.loads(json.dumps(first.state_dict()))
    it.close()
    resumed = data.build_train_stream(cfg, SPEC, tokenizer, seed=5)
    resumed.load_state_dict(state)
    after = _batches(resumed, M - 1)
    for ref, got in zip(reference[K + 1:], after):
        assert ref["key"] == got["key"]
        for k in ("jpeg", "jpeg_offsets", "jpeg_box", "jpeg_at", "image", "image_at", "text"):
            assert torch.equal(ref[k], got[k]), k
        assert torch.equal(_finished(first, ref), _finished(resumed, got))


def test_the_stream_says_which_path_and_why(shards):
    worker = data.build_train_stream(_cfg(shards, decode="worker"), SPEC, tokenizer, seed=0)
    assert worker.device_decode is None and worker.decode_line == "images decoded in the data workers " \
                                                                  "(data.decode=worker)"
    assert "image" in _batches(worker, 1)[0] and "jpeg" not in _batches(worker, 1)[0]
    jitter = ImageSpec(size=48, mean=SPEC.mean, std=SPEC.std, color_jitter=(0.4, 0.4, 0.4, 0.1),
                       color_jitter_prob=0.8)
    s = data.build_train_stream(_cfg(shards), jitter, tokenizer, seed=0)
    assert s.device_decode is None and s.decode_line == (
        "images decoded in the data workers: data.decode=device is not in effect (data.aug's colour jitter and "
        "grayscale run on PIL images in the workers)")
    s = data.build_train_stream(_cfg(shards, uint8_transfer=False), SPEC, tokenizer, seed=0)
    assert s.device_decode is None and "data.uint8_transfer=false" in s.decode_line


def test_a_run_decodes_on_the_device_and_says_so(small_demo, tmp_path, capsys):
    from mmcl.cli import main

    from helpers import FOLDER_TOWERS, metrics, short_run

    out = tmp_path / "run"
    assert main(short_run(small_demo, out, "data.decode=device", towers=FOLDER_TOWERS)) == 0
    printed = capsys.readouterr().out
    assert "mmcl: images decoded on the training device (data.decode=device)" in printed
    assert len(metrics(out)) == 2 and all(np.isfinite(r["loss"]) for r in metrics(out))
    assert main(short_run(small_demo, tmp_path / "bad", "data.decode=gpu", towers=FOLDER_TOWERS)) == 2
    err = capsys.readouterr().err
    assert "data.decode must be one of worker, device (got 'gpu')" in err and "Traceback" not in err


def test_a_jpeg_that_fails_on_the_device_is_named():
    """A file whose header and end marker pass the workers' checks but whose Huffman table is bogus: one DataError
    naming the sample and the way out, never a silent gap."""
    from mmcl.data.device_decode import Encoded, collate_images
    from mmcl.errors import DataError

    good = _jpeg(_photo(1, np.random.default_rng(2)))
    at = good.index(b"\xff\xc4")  # the first Huffman table: its code counts made impossible
    bad = good[:at + 5] + b"\xff" * 16 + good[at + 21:]
    assert jpeg_header(bad, 10 ** 6) is not None  # the worker's checks pass it
    b = collate_images([Encoded(good, (0, 0, 40, 40)), Encoded(bad, (0, 0, 40, 40))], (48, 48))
    b["key"] = ["fine", "broken"]
    with pytest.raises(DataError, match="sample broken: its JPEG passed the workers' checks but did not decode on "
                                        "cpu .*Bogus Huffman table.*data.decode=worker"):
        DeviceFinish(SPEC).batch(b, torch.device("cpu"))
