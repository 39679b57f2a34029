"""mmcl.storage.manifest: a command owns a new or empty folder, or one its own manifest names; it records each file
before writing it, never replaces nor deletes a file of the user's, and refuses another command's folder, a
non-empty folder and a manifest entry outside the folder, each in one line with nothing changed."""

import json

import pytest

from mmcl.errors import ConfigError
from mmcl.storage.manifest import MANIFEST, OutputManifest


def test_a_new_folder_is_claimed_and_files_are_listed_before_they_are_written(tmp_path):
    out = tmp_path / "out"
    manifest = OutputManifest.claim(out, "shards")
    manifest.will_write(["shard-000000.tar", "sizes.json"])
    assert json.loads((out / MANIFEST).read_text()) == {"command": "shards", "data": {},
                                                        "files": ["shard-000000.tar", "sizes.json"]}
    # A re-run (or a resumed run) of the same command finds its folder and its list again.
    again = OutputManifest.claim(out, "shards")
    assert again.files == {"shard-000000.tar", "sizes.json"}


def test_other_folders_are_refused_and_left_as_they_were(tmp_path):
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"is not empty and was not written by mmcl shards \(it holds notes.txt\)"):
        OutputManifest.claim(users, "shards")
    assert sorted(p.name for p in users.iterdir()) == ["notes.txt"]
    OutputManifest.claim(tmp_path / "demo", "demo-data")
    with pytest.raises(ConfigError, match="holds the output of mmcl demo-data, not of mmcl shards"):
        OutputManifest.claim(tmp_path / "demo", "shards")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        OutputManifest.claim(tmp_path / "file", "shards")


def test_a_file_of_the_users_is_never_replaced_nor_deleted(tmp_path):
    manifest = OutputManifest.claim(tmp_path / "out", "shards")
    manifest.will_write(["a.tar"])
    (tmp_path / "out" / "a.tar").write_text("the command's")
    (tmp_path / "out" / "b.tar").write_text("the user's")
    with pytest.raises(ConfigError, match="did not write with the names of files it is about to write: b.tar"):
        manifest.will_write(["a.tar", "b.tar"])
    assert manifest.files == {"a.tar"}  # nothing recorded from the refused call
    manifest.keep_only([])  # removes the command's a.tar only
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([MANIFEST, "b.tar"])
    manifest.remove(["b.tar"])  # not listed: left alone
    assert (tmp_path / "out" / "b.tar").read_text() == "the user's"


@pytest.mark.parametrize("entry", ["/etc/passwd", "../outside.txt"])
def test_a_manifest_entry_outside_its_folder_is_refused_when_the_folder_is_claimed(tmp_path, entry):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"command": "shards", "files": [entry]}))
    with pytest.raises(ConfigError):
        OutputManifest.claim(out, "shards")
