"""Evaluation datasets (mmcl/data/eval_data.py): shards and image folders read as labelled, captioned samples."""

import io
import tarfile

import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from mmcl import data


def test_a_labelled_sample_without_caption_is_kept_for_evaluation_and_skipped_in_training(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(buf, format="PNG")
    shard = tmp_path / "shard-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for name, payload in (("a.png", buf.getvalue()), ("a.cls", b"4"), ("b.png", buf.getvalue()),
                              ("b.txt", b"a red box"), ("b.cls", b"2")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    items = list(data.build_eval_dataset(str(shard), T.ToTensor()))
    assert [(label, caption, key) for _, label, caption, key in items] == [(4, "", "a"), (2, "a red box", "b")]
    assert items[0][0].shape == (3, 6, 8)
    raw = list(data.read_raw_samples([(str(shard), None)]))
    with pytest.raises(data.SkipSample) as info:
        data.decode_sample(raw[0].files, T.ToTensor(), 10**6)
    assert info.value.reason == "missing_caption"
    image, caption, label = data.decode_sample(raw[1].files, T.ToTensor(), 10**6)
    assert torch.equal(image, items[1][0]) and (caption, label) == ("a red box", 2)


def test_the_images_of_a_folder_are_every_image_file_at_any_depth_keyed_by_relative_path(tmp_path):
    from mmcl.errors import DataError

    (tmp_path / "imgs" / "b").mkdir(parents=True)
    Image.new("RGB", (9, 9), (1, 2, 3)).save(tmp_path / "imgs" / "z.png")
    Image.new("RGB", (9, 9), (4, 5, 6)).save(tmp_path / "imgs" / "b" / "a.jpg")
    (tmp_path / "imgs" / "bad.png").write_bytes(b"no image")
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    (tmp_path / "imgs" / ".hidden.png").write_bytes(b"left out")
    ds = data.build_image_set(str(tmp_path / "imgs"), T.ToTensor())
    assert isinstance(ds, data.ImageFilesDataset) and len(ds) == 3
    items = [ds[i] for i in range(3)]
    # walk order: a folder's files (sorted), then its subfolders
    assert [it[3] for it in items if not isinstance(it, data.EvalSkip)] == ["z.png", "b/a.jpg"]
    skip = items[0]
    assert isinstance(skip, data.EvalSkip) and skip.reason == "decode" and skip.where.endswith("bad.png")
    assert items[1][0].shape == (3, 9, 9) and items[1][1] == -1
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no images in"):
        data.build_image_set(str(tmp_path / "empty"), T.ToTensor())
