"""Shard sources (mmcl/data/sources.py): brace ranges, globs, lists, folders, list files and pipe: commands
expanded to shard URLs, one list per source."""


import pytest

from mmcl import data
from mmcl.errors import DataError


def test_expand_urls(tmp_path):
    for name in ("a-000.tar", "a-001.tar", "a-002.tar", "b-000.tar"):
        (tmp_path / name).write_bytes(b"")
    d = str(tmp_path)
    assert data.expand_urls(f"{d}/a-{{000..002}}.tar") == [f"{d}/a-00{i}.tar" for i in range(3)]
    assert data.expand_urls(f"{d}/a-*.tar") == [f"{d}/a-00{i}.tar" for i in range(3)]
    assert data.expand_urls(f"{d}/a-000.tar::{d}/b-000.tar") == [f"{d}/a-000.tar", f"{d}/b-000.tar"]
    assert data.expand_sources(f"{d}/a-00[01].tar::{d}/b-*.tar") == [[f"{d}/a-000.tar", f"{d}/a-001.tar"],
                                                                    [f"{d}/b-000.tar"]]
    assert data.expand_urls(f"[{d}/a-000.tar, {d}/b-000.tar]") == [f"{d}/a-000.tar", f"{d}/b-000.tar"]
    assert data.expand_urls([f"{d}/b-000.tar", f"{d}/a-00{{1..2}}.tar"]) == [f"{d}/b-000.tar", f"{d}/a-001.tar",
                                                                             f"{d}/a-002.tar"]
    (tmp_path / "list.yaml").write_text(f"- {d}/a-000.tar\n- {d}/b-*.tar\n")
    assert data.expand_urls(str(tmp_path / "list.yaml")) == [f"{d}/a-000.tar", f"{d}/b-000.tar"]
    assert len(data.expand_urls(d)) == 4  # a directory means its shards
    assert data.expand_urls(f"file://{d}/b-000.tar") == [f"{d}/b-000.tar"]
    assert data.expand_urls("pipe:curl -s https://host/s-{0..1}.tar") == [
        "pipe:curl -s https://host/s-0.tar", "pipe:curl -s https://host/s-1.tar"]
    assert data.expand_urls("https://host/x-{0..2}.tar")[2] == "https://host/x-2.tar"
    with pytest.warns(UserWarning, match="1 of 4 shards"):
        assert len(data.expand_urls(f"{d}/a-{{000..003}}.tar")) == 3
    with pytest.raises(DataError, match="no shards match '.*/zz-\\*.tar'"):
        data.expand_urls(f"{d}/a-000.tar::{d}/zz-*.tar")
    with pytest.raises(DataError, match="no training data"):
        data.expand_urls(None)
