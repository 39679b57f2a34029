"""Every tensor a training stream yields is contiguous (a cut token batch is otherwise a view with the full
context's row stride, which pinning and the copy to the device carry as strided memory); tests/e2e/test_gpu.py checks
that they are pinned on CUDA."""

import pytest
import torch

from helpers import stream_batch


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from mmcl.shards.demo import make_demo_data

    root = tmp_path_factory.mktemp("stream")
    return make_demo_data(str(root), n_train=64, n_val=1, n_zeroshot=1, shard_size=16, progress=False)["train"]


@pytest.mark.parametrize("workers", [0, 1])
def test_every_tensor_of_a_stream_batch_is_contiguous(shards, workers):
    batch = stream_batch(shards, workers)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert {"image", "text", "label"} <= set(tensors)
    assert batch["text"].shape[1] < 77  # cut, as training cuts it
    strided = {k: tuple(v.stride()) for k, v in tensors.items() if not v.is_contiguous()}
    assert not strided, f"non-contiguous tensors in a stream batch: {strided}"
