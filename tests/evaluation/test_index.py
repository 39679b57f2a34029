"""The embedding index returns the exact nearest neighbours of brute force, by text and by image."""

import json
import os

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from mmcl import models
from mmcl.errors import CheckpointError, DataError
from mmcl.evaluation import index as index_mod
from mmcl.shards import writer as shard_writer
from mmcl.storage import weights


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
            sample = {"__key__": f"img{i:02d}", "png": img, "txt": f"caption number {i}", "cls": i % 3}
            if i % 4:  # img2dataset's metadata, with the image's source URL, on most samples
                sample["json"] = {"url": f"http://127.0.0.1:8000/img{i:02d}.jpg", "status": "success"}
            sink.write(sample)
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
    assert meta["model_relative"] == "../model"
    items = [json.loads(line) for line in (indexed["out"] / index_mod.ITEMS_FILE).read_text().splitlines()]
    assert [it["key"] for it in items] == sorted(indexed["images"])
    shard = str((indexed["root"] / "shard-000000.tar").resolve())
    assert items[5] == {"key": "img05", "caption": "caption number 5", "label": 2, "__url__": shard,
                        "url": "http://127.0.0.1:8000/img05.jpg"}
    assert items[4] == {"key": "img04", "caption": "caption number 4", "label": 1, "__url__": shard}  # no .json


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
    assert cli.main(["search", "--index", str(out), "caption number 3", "-k", "2", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 2 and set(hits[0]) >= {"rank", "key", "caption", "score", "__url__"}
    assert hits == index_mod.search(out, query="caption number 3", k=2)
    assert cli.main(["search", "--index", str(out), "caption number 3", "-k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()  # for reading: rank, score, key, caption, where it came from
    assert len(lines) == 2 and lines[0].split()[:3] == ["1", f"{hits[0]['score']:.4f}", hits[0]["key"]]
    assert lines[0].endswith(hits[0].get("url", hits[0]["__url__"]))
    assert cli.main(["search", "--index", str(out)]) == 2


def test_moved_index_still_loads_and_hits_point_back_to_the_data(indexed, tmp_path):
    """An index folder moved together with its model loads through the relative path, one moved alone through the
    absolute one; either way each hit names its shard (__url__), its key and the sample's own url."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(indexed["root"], project)  # model/, index/ and the shard, side by side
    shutil.move(str(project), str(tmp_path / "moved-project"))
    moved = tmp_path / "moved-project"
    reference = index_mod.search(indexed["out"], query="caption number 5", k=12)
    hits = index_mod.search(moved / "index", query="caption number 5", k=12)
    assert [(h["key"], h["score"]) for h in hits] == [(h["key"], h["score"]) for h in reference]
    by_key = {h["key"]: h for h in hits}
    assert by_key["img05"]["url"] == "http://127.0.0.1:8000/img05.jpg" and "url" not in by_key["img04"]
    assert all(h["__url__"] == str((indexed["root"] / "shard-000000.tar").resolve()) for h in hits)
    # the model beside the moved index is the one used, also when the path it was built with no longer exists
    meta = json.loads((moved / "index" / index_mod.META_FILE).read_text())
    assert index_mod.find_query_model(meta, moved / "index").resolve() == (moved / "model").resolve()
    meta["model"] = str(tmp_path / "nowhere")
    (moved / "index" / index_mod.META_FILE).write_text(json.dumps(meta))
    assert [h["key"] for h in index_mod.search(moved / "index", query="caption number 5", k=12)] == \
        [h["key"] for h in reference]
    # the index alone, moved away from the model: the absolute path it was built with still finds the model
    alone = tmp_path / "alone" / "idx"
    shutil.copytree(indexed["out"], alone)
    assert [h["key"] for h in index_mod.search(alone, query="caption number 5", k=12)] == \
        [h["key"] for h in reference]


def test_index_of_an_image_folder_points_at_the_files(indexed, tmp_path):
    folder = tmp_path / "folder"
    for i, (key, img) in enumerate(sorted(indexed["images"].items())[:6]):
        (folder / f"class{i % 2}").mkdir(parents=True, exist_ok=True)
        img.save(folder / f"class{i % 2}" / f"{key}.png")
    out = index_mod.build_index(indexed["model_dir"], str(folder), tmp_path / "idx", progress=False)
    items = [json.loads(line) for line in (out / index_mod.ITEMS_FILE).read_text().splitlines()]
    assert len(items) == 6
    for it in items:
        assert os.path.isfile(it["__url__"]) and it["__url__"].endswith(it["key"])
        assert it["label"] == int(it["key"].split(os.sep)[0][-1])


def test_index_of_img2dataset_files_points_back_to_source_urls(indexed, tmp_path):
    """img2dataset's files layout -> mmcl shards -> mmcl index: each hit carries the URL img2dataset downloaded
    the image from, its key and the shard it is in."""

    root = tmp_path / "i2d" / "00000"
    root.mkdir(parents=True)
    urls = {}
    for i, (name, img) in enumerate(sorted(indexed["images"].items())[:5]):
        key = f"00000{i:04d}"
        img.save(root / f"{key}.jpg", quality=95)
        (root / f"{key}.txt").write_text(f"caption of {name}")
        urls[key] = f"https://images.example.com/{name}.jpg"
        (root / f"{key}.json").write_text(json.dumps({"url": urls[key], "key": key, "status": "success"}, indent=4))
    summary = shard_writer.shards_from_input(str(tmp_path / "i2d"), str(tmp_path / "shards"), progress=False)
    out = index_mod.build_index(indexed["model_dir"], str(tmp_path / "shards"), tmp_path / "idx", progress=False)
    hits = index_mod.search(out, image=str(root / "000000003.jpg"), k=5)
    assert hits[0]["key"] == "000000003" and hits[0]["url"] == urls["000000003"]
    assert {h["key"]: h["url"] for h in hits} == urls
    assert {h["__url__"] for h in hits} == {os.path.abspath(p) for p in summary["shards"]}
