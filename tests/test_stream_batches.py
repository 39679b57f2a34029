"""Every tensor a training stream yields is contiguous (a cut token batch is otherwise a view with the full
context's row stride, which pinning and the copy to the device carry as strided memory); tests/test_gpu.py checks
that they are pinned on CUDA."""

import pytest
import torch


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from mmcl.data.demo import make_demo_data

    root = tmp_path_factory.mktemp("stream")
    return make_demo_data(str(root), n_train=64, n_val=1, n_zeroshot=1, shard_size=16, progress=False)["train"]


def stream_batch(shards, workers, pin_memory=False):
    import open_clip

    from mmcl.config import DataConfig
    from mmcl.data import build_train_stream
    from mmcl.data.transforms import ImageSpec
    from mmcl.models import TrimmedTokenizer

    # The tokenizer training gives open_clip's text transformer: batches cut after the longest caption.
    tokenizer = TrimmedTokenizer(open_clip.get_tokenizer("ViT-B-32"))
    cut = tokenizer(["a short caption", "another"])
    assert cut.shape[1] < 77 and not cut.is_contiguous()  # the view this test is about
    spec = ImageSpec(size=64, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    cfg = DataConfig(train=shards, batch_size=8, workers=workers, shuffle_buffer=16)
    stream = build_train_stream(cfg, spec, tokenizer, seed=0, pin_memory=pin_memory)
    it = iter(stream)
    batch = next(it)
    if hasattr(it, "close"):
        it.close()
    return batch


@pytest.mark.parametrize("workers", [0, 1])
def test_every_tensor_of_a_stream_batch_is_contiguous(shards, workers):
    batch = stream_batch(shards, workers)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert {"image", "text", "label"} <= set(tensors)
    assert batch["text"].shape[1] < 77  # cut, as training cuts it
    strided = {k: tuple(v.stride()) for k, v in tensors.items() if not v.is_contiguous()}
    assert not strided, f"non-contiguous tensors in a stream batch: {strided}"
