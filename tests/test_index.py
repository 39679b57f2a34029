"""The embedding index returns the exact nearest neighbours of brute force, by text and by image."""

import json

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from mmcl import index as index_mod
from mmcl import models, weights
from mmcl.errors import CheckpointError, DataError


def _unit_rows(n, dim, seed, clusters=None):
    rng = np.random.default_rng(seed)
    if clusters:
        centres = rng.standard_normal((clusters, dim))
        x = centres[rng.integers(0, clusters, n)] + 0.3 * rng.standard_normal((n, dim))
    else:
        x = rng.standard_normal((n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _brute_force(base, queries, k):
    sim = queries.astype(np.float64) @ base.astype(np.float64).T
    ids = np.argsort(-sim, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(sim, ids, axis=1)


def test_flat_index_is_brute_force():
    base, queries = _unit_rows(300, 24, seed=0), _unit_rows(20, 24, seed=1)
    index, params = index_mod.make_index(base)
    assert params == {"kind": "flat"}
    scores, ids = index.search(queries, 10)
    ref_ids, ref_scores = _brute_force(base, queries, 10)
    assert np.array_equal(ids, ref_ids)  # random continuous data: no ties
    np.testing.assert_allclose(scores, ref_scores, atol=1e-5)  # float32 dot products of unit vectors


def test_ivf_index_for_large_sets():
    data = _unit_rows(2050, 16, seed=2, clusters=20)
    base, queries = data[:2000], data[2000:]
    index, params = index_mod.make_index(base, exact_max=1000)
    # 4 sqrt(N) cells, capped so that each k-means cell has 39 training points
    assert params["kind"] == "ivf" and params["nlist"] == min(int(4 * np.sqrt(2000)), 2000 // 39)
    ref_ids, _ = _brute_force(base, queries, 10)
    _, ids = index.search(queries, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, ref_ids)])
    assert recall >= 0.8  # approximate by design: only nprobe of nlist cells are scanned
    index.nprobe = params["nlist"]  # scanning every cell makes it exact
    _, ids = index.search(queries, 10)
    assert np.array_equal(ids, ref_ids)


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """A tiny random model, a shard of 12 random images with captions, and the index built over it."""
    root = tmp_path_factory.mktemp("idx")
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    model_dir = weights.save_model_dir(models.create(cfg), cfg, models.preprocess_config(cfg), root / "model")
    rng = np.random.default_rng(0)
    images = {}
    with wds.TarWriter(str(root / "shard-000000.tar")) as sink:
        for i in range(12):
            img = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
            images[f"img{i:02d}"] = img
            sink.write({"__key__": f"img{i:02d}", "png": img, "txt": f"caption number {i}", "cls": i % 3})
    out = index_mod.build_index(model_dir, str(root / "shard-000000.tar"), root / "index", batch_size=5,
                                progress=False)
    return {"root": root, "model_dir": model_dir, "images": images, "out": out}


def _reference_image_features(indexed):
    model, preprocess, _ = weights.load(indexed["model_dir"])
    keys = sorted(indexed["images"])
    with torch.no_grad():
        feats = model.encode_image(torch.stack([preprocess(indexed["images"][k]) for k in keys]), normalize=True)
    return model, preprocess, keys, feats.numpy()


def test_index_dir_records_model_items_and_kind(indexed):
    meta = json.loads((indexed["out"] / index_mod.META_FILE).read_text())
    assert meta["model"] == str(indexed["model_dir"].resolve()) and meta["n"] == 12 and meta["kind"] == "flat"
    items = [json.loads(line) for line in (indexed["out"] / index_mod.ITEMS_FILE).read_text().splitlines()]
    assert [it["key"] for it in items] == sorted(indexed["images"])
    assert items[4] == {"key": "img04", "caption": "caption number 4", "label": 1}


def test_text_search_equals_brute_force(indexed):
    model, _, keys, feats = _reference_image_features(indexed)
    tokenizer = weights.load(indexed["model_dir"])[2]
    query = "caption number 7"
    with torch.no_grad():
        q = model.encode_text(tokenizer([query]), normalize=True).numpy()
    ref_ids, ref_scores = _brute_force(feats, q, 5)
    hits = index_mod.search(indexed["out"], query=query, k=5)
    assert [h["key"] for h in hits] == [keys[i] for i in ref_ids[0]]
    # the index holds the embeddings of a batched pass; per-image recomputation differs in float32 rounding
    np.testing.assert_allclose([h["score"] for h in hits], ref_scores[0], atol=1e-5)
    assert [h["rank"] for h in hits] == [1, 2, 3, 4, 5]


def test_image_search_finds_the_image_itself(indexed, tmp_path):
    path = tmp_path / "q.png"
    indexed["images"]["img09"].save(path)
    hits = index_mod.search(indexed["out"], image=str(path), k=3)
    assert hits[0]["key"] == "img09" and hits[0]["caption"] == "caption number 9"
    assert hits[0]["score"] == pytest.approx(1.0, abs=1e-5)  # cosine of an embedding with itself
    assert hits[0]["score"] > hits[1]["score"] >= hits[2]["score"]


def test_k_above_index_size_returns_everything(indexed):
    hits = index_mod.search(indexed["out"], query="anything", k=50)
    assert sorted(h["key"] for h in hits) == sorted(indexed["images"])


def test_search_errors(indexed, tmp_path):
    with pytest.raises(DataError, match="exactly one query"):
        index_mod.search(indexed["out"], query="a", image="b.png")
    with pytest.raises(DataError, match="exactly one query"):
        index_mod.search(indexed["out"])
    with pytest.raises(DataError, match="k must be >= 1"):
        index_mod.search(indexed["out"], query="a", k=0)
    with pytest.raises(DataError, match="query image not found"):
        index_mod.search(indexed["out"], image=str(tmp_path / "missing.png"))
    with pytest.raises(DataError, match="not an mmcl index"):
        index_mod.search(tmp_path, query="a")
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in (index_mod.INDEX_FILE, index_mod.ITEMS_FILE):
        (moved / name).write_bytes((indexed["out"] / name).read_bytes())
    meta = json.loads((indexed["out"] / index_mod.META_FILE).read_text())
    meta["model"] = str(tmp_path / "gone")
    (moved / index_mod.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="is gone"):
        index_mod.search(moved, query="a")


def test_cli_index_and_search(indexed, tmp_path, capsys):
    from mmcl import cli

    out = tmp_path / "cli-index"
    assert cli.main(["index", "--model", str(indexed["model_dir"]), "--data",
                     str(indexed["root"] / "shard-000000.tar"), "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["search", "--index", str(out), "caption number 3", "-k", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and set(lines[0]) >= {"rank", "key", "caption", "score"}
    assert cli.main(["search", "--index", str(out)]) == 2
