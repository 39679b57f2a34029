"""Every setting is discoverable: ``mmcl train --help`` lists each config key with its type, default and
description, ``--print-config`` shows the resolved config, every option shows its default, ``mmcl --version``
works, every config problem is reported at once in mmcl's words, and the shipped configs/ and launch/ folders reach
an installed package (``mmcl init``)."""

import argparse
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import mmcl
from mmcl.cli import build_parser, main
from mmcl.config import TrainConfig, load_config, to_dict
from mmcl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
# Words of OmegaConf's own messages that a user should never see.
INTERNALS = ("Merge error", "subclass", "OptimConfig", "TextTowerConfig", "ListConfig", "could not be converted",
             "full_key", "object_type", "reference_type")


def _leaves(node, prefix=""):
    """(dotted key, default) of every leaf of the schema, as OmegaConf (not mmcl's help code) sees it."""
    out = {}
    for k, v in node.items():
        key = prefix + k
        if isinstance(v, dict) and key not in ("model.vision_cfg", "model.text_cfg", "optim.kwargs"):
            out.update(_leaves(v, key + "."))
        else:
            out[key] = v
    return out


def _help(capsys, monkeypatch, *argv):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    assert stop.value.code == 0
    return capsys.readouterr().out


def _keys_in_help(text):
    """key -> (type, default, description) parsed from the config-key table of ``mmcl train --help``."""
    table = text.split("config keys", 1)[1].splitlines()[1:]
    keys, current = {}, None
    for line in table:
        m = re.fullmatch(r"  (\S+) \((.+), default: (.*)\)", line)
        if m:
            current = m.group(1)
            keys[current] = [m.group(2), m.group(3), ""]
        elif line.startswith("      ") and current:
            keys[current][2] = (keys[current][2] + " " + line.strip()).strip()
    return keys


def test_train_help_lists_every_key_with_type_default_and_description(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, "train", "--help")
    assert "config keys" in text
    listed = _keys_in_help(text)
    schema = _leaves(OmegaConf.to_container(OmegaConf.structured(TrainConfig)))
    assert sorted(listed) == sorted(schema)
    for key, default in schema.items():
        type_name, shown, description = listed[key]
        assert description, f"{key} has no description"
        assert yaml.safe_load(shown) == default or shown == str(default), (key, shown, default)
    assert listed["data.batch_size"][0] == "int" and listed["data.batch_size"][1] == "64"
    assert listed["optim.grad_clip"][0] == "float or null"
    assert listed["data.weights"][0] == "list of float or null"
    assert listed["train.log_with"][:2] == ["list of str", '["tensorboard"]']
    assert listed["model.lock_image"][:2] == ["bool", "false"]
    assert "freeze the image tower" in listed["model.lock_image"][2]


def test_print_config_prints_the_resolved_config_and_trains_nothing(capsys, tmp_path):
    out = tmp_path / "run"
    argv = ["--config", TINY, "data.batch_size=7", "optim.lr=0.01", f"train.output_dir={out}"]
    assert main(["train", *argv, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == to_dict(load_config(TINY, argv[2:]))
    assert printed["data"]["batch_size"] == 7 and printed["optim"]["lr"] == 0.01
    assert printed["optim"]["warmup_steps"] == 15  # from the file
    assert not out.exists()  # no run folder, no training
    saved = tmp_path / "resolved.yaml"  # what it prints is a config file giving the same config
    saved.write_text(yaml.safe_dump(printed))
    assert to_dict(load_config(str(saved))) == printed


def test_every_option_has_help_and_shows_its_default(capsys, monkeypatch):
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for name, sub in subs.choices.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            assert action.help, f"mmcl {name} {action.dest} has no help text"
            if action.default is not None and action.default is not False:
                assert f"default: {action.default}" in text, f"mmcl {name} {action.dest}: default not shown"
                checked += 1
    assert checked >= 15
    assert "(default: 128)" in " ".join(_help(capsys, monkeypatch, "zeroshot", "--help").split())


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert capsys.readouterr().out.strip() == f"mmcl {version}" == f"mmcl {mmcl.__version__}"


def test_bad_values_are_reported_together_with_unknown_keys(capsys):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["foo=1", "optim.lrr=1", "data.batch_size=-3"])
    msg = str(err.value)
    assert msg.startswith("3 problems")
    assert "'foo'" in msg and "'optim.lrr'" in msg and "optim.lr" in msg and "data.batch_size must be > 0" in msg
    # an argument that is not key=value joins the others; all in one line
    assert main(["train", "--config", TINY, "nonsense", "train.stepz=3", "train.steps=0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmcl: error: 3 problems"), lines
    assert "nonsense" in lines[0] and "train.stepz" in lines[0] and "train.steps must be > 0" in lines[0]
    # a value that is not YAML is one of the problems, not a traceback
    assert main(["train", "data.weights=[1,2", "train.steps=x"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmcl: error: 2 problems"), lines
    assert "'data.weights=[1,2': the value is not valid YAML" in lines[0] and "'train.steps'" in lines[0]


@pytest.mark.parametrize("overrides, expected", [
    (["optim=1"], "'optim' is a section, not a value: set its keys, e.g. optim.name="),
    (["model.text=3"], "'model.text' is a section"),
    (["data.batch_size=abc"], "bad value for 'data.batch_size': expected int, got 'abc'"),
    (["optim.grad_clip=[1, 2]"], "bad value for 'optim.grad_clip': expected float or null"),
])
def test_messages_are_in_mmcls_words(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert expected in msg and not any(word in msg for word in INTERNALS), msg


def test_a_section_given_a_value_in_the_file_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: 1\ntrain:\n  steps: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    msg = str(err.value)
    assert f"{path}: 'optim' is a section" in msg and not any(word in msg for word in INTERNALS), msg


@pytest.mark.parametrize("text, where", [
    ("data:\n  batch_size: 3\n   x: 2\n", ":3:5: YAML syntax error: mapping values are not allowed"),
    ("model:\n  name: tiny\ndata:\n  weights: [1, 2\n", ":5:1: YAML syntax error:"),
    ("train:\n  steps: 3\n  steps: 4\n", ":3:3: YAML syntax error: found duplicate key"),
])
def test_yaml_syntax_error_gives_file_line_and_column(capsys, tmp_path, text, where):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mmcl: error: {path}{where}"), lines


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_init_copies_the_shipped_configs_and_launch_files(capsys, tmp_path):
    assert main(["init", str(tmp_path / "proj")]) == 0
    for name in ("configs", "launch"):
        copied = _tree(tmp_path / "proj" / name)
        assert copied == _tree(ROOT / name) and "tiny.yaml" in _tree(ROOT / "configs")
    assert os.access(tmp_path / "proj" / "launch" / "slurm.sh", os.X_OK)
    assert load_config(str(tmp_path / "proj" / "configs" / "tiny.yaml")).model.name == "tiny"
    # a second run writes nothing and says why, in one line
    (tmp_path / "proj" / "configs" / "tiny.yaml").write_text("model:\n  name: mine\n")
    before = _tree(tmp_path / "proj")
    capsys.readouterr()
    assert main(["init", str(tmp_path / "proj")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exist" in err[0]
    assert _tree(tmp_path / "proj") == before


@pytest.mark.slow
def test_a_wheel_ships_configs_and_launch_and_init_reads_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("mmcl", "configs", "launch"):
        shutil.copytree(ROOT / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, cwd=tmp_path, capture_output=True)
    [wheel] = (tmp_path / "dist").glob("mmcl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for name in ("configs", "launch"):
            for rel, data in _tree(ROOT / name).items():
                member = f"mmcl/training/starter/{name}/{rel}"
                assert member in names and zf.read(member) == data, member
        zf.extractall(tmp_path / "site")
    # The unpacked wheel, not the checkout, is what `mmcl init` runs from here.
    code = ("import mmcl, sys; from mmcl.cli import main; print(mmcl.__file__, file=sys.stderr); "
            "sys.exit(main(['init', 'proj']))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().startswith(str(tmp_path / "site")), res.stderr
    assert _tree(tmp_path / "proj" / "configs") == _tree(ROOT / "configs")
    assert _tree(tmp_path / "proj" / "launch") == _tree(ROOT / "launch")
