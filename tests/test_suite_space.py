"""The suite's own use of the disk: a whole run on a disk without room for its temporary files stops before its
first test in one line, and a passing test's temporary folder does not outlive it."""

import importlib.util
import shutil
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest

# tests/conftest.py by its path: the name `conftest` is also tests/losses/conftest.py's, whichever pytest loaded last.
_spec = importlib.util.spec_from_file_location("suite_conftest", Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)

Usage = namedtuple("Usage", "total used free")


def test_a_whole_run_without_room_for_its_temporary_files_stops_in_one_line(tmp_path, monkeypatch):
    config = SimpleNamespace(option=SimpleNamespace(basetemp=str(tmp_path / "not" / "made" / "yet")))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * 2**30, 99 * 2**30, 2**30))
    with pytest.raises(pytest.exit.Exception, match=rf"mmcl tests: 1.0 GiB free in {tmp_path}, and a full run "
                                                    rf"needs about 5 GiB for its temporary files") as stop:
        conftest._check_temp_space(config)
    assert stop.value.returncode == 4
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * 2**30, 50 * 2**30, 50 * 2**30))
    conftest._check_temp_space(config)  # room enough: the run goes on


def test_a_passing_tests_temporary_folder_is_deleted(pytestconfig):
    # A full run writes about 13 GB in all; pytest's default keeps every test's folder for three runs.
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
    assert int(pytestconfig.getini("tmp_path_retention_count")) == 1
