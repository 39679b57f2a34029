"""Writing outputs (mmcl/storage/fsutil.py): a whole directory or nothing, the user's files kept through a swap,
nothing written through a link or outside the folder, small files replaced atomically."""

import hashlib
import os

import pytest

from mmcl.errors import ConfigError
from mmcl.storage import fsutil


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_inside_refuses_paths_out_of_the_folder_and_links_on_the_way(tmp_path):
    (tmp_path / "sub").mkdir()
    assert fsutil.inside(tmp_path, "sub/new.txt") == tmp_path / "sub" / "new.txt"
    for rel in ("/etc/passwd", "../x", "sub/../../x", "", "."):
        with pytest.raises(ConfigError, match="is not a path inside it"):
            fsutil.inside(tmp_path, rel)
    os.symlink(tmp_path / "sub", tmp_path / "link")
    with pytest.raises(ConfigError, match="link is a symbolic link"):
        fsutil.inside(tmp_path, "link/file.txt")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="not a regular file or folder"):
        fsutil.inside(tmp_path, "fifo")


def test_inside_gives_the_whole_path_when_a_folder_on_the_way_does_not_exist_yet(tmp_path):
    assert fsutil.inside(tmp_path, "a/b/c.txt") == tmp_path / "a" / "b" / "c.txt"
    assert fsutil.inside(tmp_path, "./a//b") == tmp_path / "a" / "b"


def test_atomic_dir_swaps_in_the_new_version_and_keeps_the_users_files(tmp_path):
    out = tmp_path / "out"
    with fsutil.atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and tmp != out and not out.exists()
        (tmp / "weights.bin").write_text("v1")
        (tmp / "deep").mkdir()
        (tmp / "deep" / "ours.txt").write_text("v1")
    assert _tree(out) == {"weights.bin": "v1", "deep/ours.txt": "v1"}
    (out / "notes.md").write_text("mine")
    (out / "deep" / "theirs.txt").write_text("mine too")
    (out / "empty").mkdir()
    with fsutil.atomic_dir(out, ours=["weights.bin", "deep/ours.txt"]) as tmp:
        (tmp / "weights.bin").write_text("v2")
    assert _tree(out) == {"weights.bin": "v2", "notes.md": "mine", "deep/theirs.txt": "mine too"}
    assert (out / "empty").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left


def test_a_failed_write_or_check_leaves_the_old_directory_as_it_was(tmp_path):
    out = tmp_path / "out"
    with fsutil.atomic_dir(out) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError, match="disk"):
        with fsutil.atomic_dir(out, ours=["a"]) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("disk full")
    assert _tree(out) == {"a": "old"}

    def refuse(path):
        assert (path / "a").read_text() == "new"  # the new version is in place when the check runs
        raise ValueError("no")

    with pytest.raises(ValueError):
        with fsutil.atomic_dir(out, ours=["a"], check=refuse) as tmp:
            (tmp / "a").write_text("new")
    assert _tree(out) == {"a": "old"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_user_file_with_the_name_of_a_new_file_is_refused_and_nothing_changes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.bin").write_text("the user's")
    with pytest.raises(ConfigError, match="holds files mmcl did not write .*: model.bin"):
        with fsutil.atomic_dir(out) as tmp:
            (tmp / "model.bin").write_text("ours")
    assert _tree(out) == {"model.bin": "the user's"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_write_text_replaces_a_file_and_refuses_a_link(tmp_path):
    path = tmp_path / "latest"
    fsutil.atomic_write_text(path, "step-1")
    fsutil.atomic_write_text(path, "step-2")
    assert path.read_text() == "step-2" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    target = tmp_path / "target"
    target.write_text("keep")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(ConfigError, match="symbolic link"):
        fsutil.atomic_write_text(tmp_path / "link", "x")
    assert target.read_text() == "keep"


def test_new_file_replaces_its_own_name_and_file_sha256_is_hashlibs(tmp_path):
    (tmp_path / "f").write_bytes(b"old")
    with fsutil.new_file(tmp_path, "f") as f:
        f.write(b"x" * (5 << 20))  # over one 4 MiB block
    data = (tmp_path / "f").read_bytes()
    assert len(data) == 5 << 20
    assert fsutil.file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_files_under_and_foreign_files(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "x").write_text("")
    (tmp_path / "a" / "b" / "y").write_text("")
    os.symlink(tmp_path / "a", tmp_path / "dirlink")
    assert fsutil.files_under(tmp_path) == {"x", "a/b/y", "dirlink"}
    assert fsutil.foreign_files(tmp_path, ["x"]) == ["a/b/y", "dirlink"]
    assert fsutil.foreign_files(tmp_path / "missing", []) == []


def test_os_error_text():
    assert fsutil.os_error_text(OSError(28, "No space left on device", "/d/f")) == "No space left on device (/d/f)"
    assert fsutil.os_error_text(OSError(13, "Permission denied")) == "Permission denied"
    assert fsutil.os_error_text(ValueError("first\nsecond")) == "first"
    assert fsutil.os_error_text(ValueError()) == "ValueError"
