"""Samples per pass over the training shards (mmcl/data/sizes.py): sizes.json, img2dataset's _stats.json and a
folder's __len__, the first that knows; an unknown count is one error naming the shard and the way on."""

import json

import pytest

from mmcl.data import sizes
from mmcl.errors import DataError


def _shards(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return [str(folder / n) for n in names]


def test_sizes_json_then_img2dataset_stats_give_the_counts(tmp_path):
    a = _shards(tmp_path / "a", ["shard-0.tar", "shard-1.tar"])
    (tmp_path / "a" / "sizes.json").write_text(json.dumps({"shard-0.tar": 7, "shard-1.tar": 5}))
    b = _shards(tmp_path / "b", ["00000.tar", "00001.tar"])
    (tmp_path / "b" / "00000_stats.json").write_text(json.dumps({"count": 10, "successes": 9}))
    (tmp_path / "b" / "00001_stats.json").write_text(json.dumps({"count": 10, "successes": 4}))
    assert sizes.known_total(a) == 12 and sizes.known_total(b) == 13 and sizes.known_total(a + b) == 25
    assert sizes.shard_samples(a) == (12, "sizes.json")
    assert sizes.shard_samples(b) == (13, "img2dataset stats")
    spec = f"{tmp_path}/a/shard-{{0..1}}.tar::{tmp_path}/b/0000{{0..1}}.tar"
    assert sizes.shard_samples(spec) == (25, "img2dataset stats and sizes.json")
    (tmp_path / "b" / "00000_stats.json").unlink()
    assert sizes.known_total(b) is None
    assert sizes.known_total(["https://host/x.tar"]) is None


def test_a_folders_len_counts_only_for_a_source_of_every_shard_in_it(tmp_path):
    urls = _shards(tmp_path / "c", ["s-0.tar", "s-1.tar", "s-2.tar"])
    (tmp_path / "c" / "__len__").write_text("30\n")
    assert sizes.shard_samples(str(tmp_path / "c")) == (30, "__len__")
    with pytest.raises(DataError, match=r"the number of samples in .*s-0.tar is unknown .*data.train_num_samples"):
        sizes.shard_samples(urls[:2])  # two of three shards: the folder's total cannot be split


def test_remote_shards_and_damaged_counts_are_one_error(tmp_path):
    with pytest.raises(DataError, match=r"https://host/s-0.tar is unknown \(a URL or pipe: command"):
        sizes.shard_samples("https://host/s-{0..1}.tar")
    urls = _shards(tmp_path / "d", ["x.tar"])
    for table in ({"x.tar": -1}, {"x.tar": "many"}, {"x.tar": 10 ** 13}):
        (tmp_path / "d" / "sizes.json").write_text(json.dumps(table))
        with pytest.raises(DataError, match="sizes.json"):
            sizes.shard_samples(urls)
        assert sizes.known_total(urls) is None


def test_describe_sources_says_the_shards_and_samples_of_each_source(tmp_path):
    _shards(tmp_path / "a", ["shard-0.tar", "shard-1.tar"])
    (tmp_path / "a" / "sizes.json").write_text(json.dumps({"shard-0.tar": 1000, "shard-1.tar": 234}))
    _shards(tmp_path / "e", ["one.tar"])
    lines = sizes.describe_sources(f"{tmp_path}/a::{tmp_path}/e/one.tar", num_samples=2000)
    assert lines == [
        f"data.train source 1 of 2: '{tmp_path}/a' (a folder: its shards): 2 shard(s) (shard-0.tar .. shard-1.tar), "
        "1,234 samples",
        f"data.train source 2 of 2: '{tmp_path}/e/one.tar': 1 shard(s) (one.tar), samples unknown",
        "data.train_num_samples=2,000 samples per epoch"]
