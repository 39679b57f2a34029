"""open_clip_train's flags: the table (mmcl/training/open_clip_flags.py) covers open_clip_train's own parser, names
real config keys and is the source of docs/migration.md; `mmcl train` answers such flags with the keys they map to,
and `mmcl from-open-clip` turns a command line into a config file."""

import argparse
import importlib.util
import types
from pathlib import Path

import pytest

from mmcl.cli import main
from mmcl.config import load_config, valid_keys
from mmcl.training.open_clip_flags import DEFAULTS, FLAGS, overrides_for

ROOT = Path(__file__).resolve().parents[2]


def open_clip_parser() -> argparse.ArgumentParser:
    """The parser `open_clip_train.params.parse_args` builds, taken before it parses."""
    params = pytest.importorskip("open_clip_train.params")

    class Taken(Exception):
        pass

    class Parser(argparse.ArgumentParser):
        def parse_args(self, *a, **k):
            raise Taken(self)

    real = params.argparse
    params.argparse = types.SimpleNamespace(ArgumentParser=Parser, Action=argparse.Action)
    try:
        params.parse_args([])
    except Taken as taken:
        return taken.args[0]
    finally:
        params.argparse = real
    raise AssertionError("open_clip_train.params.parse_args built no parser")


def open_clip_actions():
    return {a.option_strings[-1]: a for a in open_clip_parser()._actions if not isinstance(a, argparse._HelpAction)}


def test_every_open_clip_train_flag_is_in_the_table_with_its_arity():
    actions = open_clip_actions()
    assert len(actions) > 80
    assert sorted(set(actions) - set(FLAGS)) == [], "flags of open_clip_train missing from the table"
    assert sorted(set(FLAGS) - set(actions)) == [], "flags in the table that open_clip_train does not have"
    for flag, action in actions.items():
        assert FLAGS[flag].nargs == (1 if action.nargs is None else action.nargs), flag
        to = FLAGS[flag].to
        if isinstance(to, dict) and action.choices:
            assert set(to) - {"*"} == set(action.choices), flag
        assert to is not None or FLAGS[flag].note, f"{flag} has no mapping and no note"


def test_defaults_carried_are_open_clip_trains():
    actions = open_clip_actions()
    for flag, value in DEFAULTS.items():
        default = actions[flag].default
        assert value == ("null" if default is None else str(default)), flag


def _sample(flag):
    nargs, to = FLAGS[flag].nargs, FLAGS[flag].to
    values = [v for v in to if v != "*"] + ["some/path"] if isinstance(to, dict) else ["3"]
    if nargs == 0:
        return [True]
    if flag == "--aug-cfg":
        return [["scale=(0.5, 1.0)", "use_timm=True"]]
    return [[v] for v in values] if nargs in ("+", "*") else values


def test_every_key_the_table_names_is_a_config_key():
    keys, sections = set(valid_keys()), ("model.vision_cfg.", "model.text_cfg.", "data.aug.")
    for flag in FLAGS:
        for value in _sample(flag):
            for item in overrides_for(flag, value) or []:
                if item.startswith("mmcl "):
                    continue
                key = item.split("=", 1)[0]
                assert key in keys or key.startswith(sections), f"{flag} names {key}, not a config key"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_migration_page_is_generated_from_the_table():
    page = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    assert page == _generator().migration_page(), "docs/migration.md is stale: run python docs/gen_reference.py"
    for flag in FLAGS:
        assert f"| `{flag}` |" in page


def run_main(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def test_train_answers_open_clip_flags_with_mmcl_keys_in_one_line(capsys):
    code, _, err = run_main(capsys, "train", "--train-data", "x.csv", "--batch-size", "32", "--epochs", "1")
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert line.startswith("mmcl: error: open_clip_train flags: --train-data x.csv -> data.train=x.csv"), line
    assert "mmcl shards --input x.csv" in line
    assert "--batch-size 32 -> data.batch_size=32" in line and "--epochs 1 -> train.epochs=1" in line


def test_train_takes_a_first_positional_as_the_config_only_when_it_is_yaml(capsys, tmp_path):
    table = tmp_path / "x.csv"
    table.write_text("filepath\ttitle\nimages/a.jpg\ta cat\n", encoding="utf-8")
    code, out, err = run_main(capsys, "train", str(table), "--print-config")
    assert code == 2 and len(err) == 1 and err[0].startswith("mmcl: error: "), err
    assert "not a config file" in err[0] and f"mmcl shards --input {table}" in err[0], err
    code, out, err = run_main(capsys, "train", "shards/{000..009}.tar", "--print-config")
    assert code == 2 and len(err) == 1 and "data.train=shards/{000..009}.tar" in err[0], err
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  steps: 7\n", encoding="utf-8")
    code, out, err = run_main(capsys, "train", str(config), "--print-config")
    assert code == 0 and "steps: 7" in out, err


def test_from_open_clip_writes_a_config_and_lists_what_it_could_not_map(capsys, tmp_path):
    out_file = tmp_path / "config.yaml"
    code, out, err = run_main(
        capsys, "from-open-clip", "--out", str(out_file), "--", "--train-data", "data/{000..009}.tar",
        "--train-num-samples", "10000", "--batch-size", "32", "--epochs", "2", "--lr", "1e-4", "--model",
        "ViT-B-32", "--siglip", "--report-to", "wandb,tensorboard", "--logs", "/runs", "--name", "exp1",
        "--aug-cfg", "scale=(0.4,1.0)", "--dist-url", "env://", "--csv-separator", ",", "--zeroshot-frequency", "1")
    assert code == 0, err
    cfg = load_config(str(out_file))
    assert cfg.data.train == "data/{000..009}.tar" and cfg.data.train_num_samples == 10000
    assert (cfg.data.batch_size, cfg.train.epochs, cfg.optim.lr, cfg.model.name) == (32, 2, 1e-4, "ViT-B-32")
    assert cfg.loss.siglip == 1.0 and cfg.loss.clip == 0.0 and cfg.model.init_logit_bias == -10.0
    assert list(cfg.train.log_with) == ["wandb", "tensorboard"] and cfg.train.output_dir == "/runs/exp1"
    assert list(cfg.data.aug.scale) == [0.4, 1.0]
    assert cfg.optim.warmup_steps == 10000 and cfg.optim.grad_clip is None  # open_clip_train's defaults
    for flag in ("--dist-url env://", "--csv-separator ,", "--zeroshot-frequency 1"):
        assert flag in out, out
    assert "mmcl shards --sep ," in out


def test_from_open_clip_errors_are_one_line(capsys, tmp_path):
    taken = tmp_path / "taken.yaml"
    taken.write_text("{}\n", encoding="utf-8")
    for argv in (["--out", str(taken), "--", "--epochs", "1"],
                 ["--out", str(tmp_path / "c.yaml"), "--", "--batch-size"],
                 ["--out", str(tmp_path / "c.yaml"), "--", "--batch-size", "-3"]):
        code, _, err = run_main(capsys, "from-open-clip", *argv)
        assert code == 2 and len(err) == 1 and err[0].startswith("mmcl: error: "), (argv, err)
    assert taken.read_text(encoding="utf-8") == "{}\n"
