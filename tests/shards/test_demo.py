"""Tests for mmcl.demo: layout, determinism, caption/label consistency and that colour is learnable."""

import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from mmcl import data
from mmcl.errors import DataError
from mmcl.shards import demo as demo_module


def read_samples(spec):
    return list(data.read_raw_samples([(u, None) for u in data.expand_urls(spec)]))


def colour_pixels(img: Image.Image, colour: str) -> int:
    """Pixels within 40 (L2 over RGB) of the named colour: JPEG error plus the +-12 jitter stay inside 40, and
    the low-saturation background (channels 32..228) lies farther than that from every palette colour."""
    arr = np.asarray(img.convert("RGB"), dtype=np.float64)
    return int((np.linalg.norm(arr - np.array(demo_module.COLOURS[colour], dtype=np.float64), axis=-1) < 40).sum())


def test_layout_and_counts(demo):
    out = os.path.dirname(os.path.dirname(demo["train"]))  # conftest.py's demo: 768, 32 and 8 a class
    assert demo["train"] == os.path.join(out, "train", "shard-{000000..000007}.tar")
    assert demo["val"] == os.path.join(out, "val", "shard-000000.tar")
    assert len(read_samples(demo["train"])) == 768
    assert len(read_samples(demo["val"])) == 32
    colours = list(demo_module.COLOURS)
    for task, classes in (("colour", colours), ("shape", list(demo_module.SHAPES))):
        root = demo[f"zeroshot_{task}"]
        assert open(os.path.join(root, "classnames.txt")).read().split("\n")[:-1] == classes
        templates = open(os.path.join(root, "templates.txt")).read().strip().split("\n")
        assert len(templates) >= 4 and all(t.count("{}") == 1 for t in templates)
        ds = data.build_eval_dataset(root, lambda im: im)
        assert ds.classnames == classes and ds.templates == templates
        assert len(ds) == 8 * len(classes)
        # Folder labels (sorted folder order) agree with the names and with the shards' .cls indices.
        assert all(ds.classnames[label] == key.split(os.sep)[0] for _, label, _, key in (ds[i] for i in range(len(ds))))
    assert colours == sorted(colours) and list(demo_module.SHAPES) == sorted(demo_module.SHAPES)


def test_captions_and_labels_match_the_pictures(demo):
    colours = list(demo_module.COLOURS)
    samples = read_samples(demo["train"])
    for s in samples:
        label = int(s.files["cls"])
        caption = s.files["txt"].decode()
        meta = json.loads(s.files["json"])
        assert meta["colour"] == colours[label]
        words = caption.replace(",", " ").replace(":", " ").split()
        assert [w for w in words if w in colours] == [colours[label]], caption
        img = Image.open(io.BytesIO(s.files["jpg"]))
        assert img.size == (64, 64)
        # The smallest shape (radius 0.16 * 32 px * 0.9, a triangle or star) still covers >= 12 pixels.
        assert colour_pixels(img, colours[label]) >= 12, (s.key, caption)
    # Phrasing varies: many distinct caption patterns once the attribute words are removed.
    forms = {" ".join(w for w in s.files["txt"].decode().split() if w not in colours)[:12] for s in samples}
    assert len(forms) >= 8
    assert len({s.files["txt"] for s in samples}) > 300


def test_colour_is_unambiguous_in_train_and_zeroshot_images(demo):
    """The labelled colour covers more pixels than any other palette colour, in every training image and every
    zero-shot image: colour alone identifies the class, and the zero-shot folder follows the same rule."""
    colours = list(demo_module.COLOURS)
    images = [(Image.open(io.BytesIO(s.files["jpg"])), int(s.files["cls"])) for s in read_samples(demo["train"])]
    ds = data.build_eval_dataset(demo["zeroshot_colour"], lambda im: im)
    images += [(ds[i][0], ds[i][1]) for i in range(len(ds))]
    for img, label in images:
        counts = [colour_pixels(img, c) for c in colours]
        assert int(np.argmax(counts)) == label, (colours[label], dict(zip(colours, counts)))


def test_deterministic_from_seed(tmp_path):
    kw = dict(n_train=60, n_val=5, n_zeroshot=2, progress=False)
    first = demo_module.make_demo_data(str(tmp_path / "a"), seed=0, **kw)
    again = demo_module.make_demo_data(str(tmp_path / "b"), seed=0, **kw)
    other = demo_module.make_demo_data(str(tmp_path / "c"), seed=1, **kw)
    read = lambda spec: open(data.expand_urls(spec)[0], "rb").read()  # noqa: E731
    assert read(first["train"]) == read(again["train"]) and read(first["val"]) == read(again["val"])
    assert read(first["train"]) != read(other["train"])
    zs = os.path.join("red", "0001.png")
    assert (open(os.path.join(first["zeroshot_colour"], zs), "rb").read()
            == open(os.path.join(again["zeroshot_colour"], zs), "rb").read())
    with pytest.raises(DataError, match="n_train must be > 0"):
        demo_module.make_demo_data(str(tmp_path / "d"), n_train=0)


def test_demo_is_made_once(tmp_path, capsys):
    """A second `mmcl demo-data` into the same folder with the same settings writes nothing (make demo's re-run);
    other settings write the demo again, and an interrupted first one (no demo.json) is finished."""
    kw = dict(n_train=60, n_val=5, n_zeroshot=2, shard_size=40)
    out = tmp_path / "d"
    first = demo_module.make_demo_data(str(out), seed=0, progress=False, **kw)
    shard = data.expand_urls(first["train"])[0]
    stamp = os.stat(shard).st_mtime_ns
    again = demo_module.make_demo_data(str(out), seed=0, progress=True, **kw)
    assert again == first and os.stat(shard).st_mtime_ns == stamp
    assert "holds this demo already" in capsys.readouterr().out
    os.remove(out / demo_module.DONE)
    demo_module.make_demo_data(str(out), seed=0, progress=False, **kw)
    assert os.stat(shard).st_mtime_ns != stamp and (out / demo_module.DONE).is_file()
    other = demo_module.make_demo_data(str(out), seed=0, progress=False, **dict(kw, n_train=100))
    assert len(data.expand_urls(other["train"])) == 3
