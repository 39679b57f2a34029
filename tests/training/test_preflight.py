"""The pre-flight check of a training run's inputs: every missing path at once, resolved, before anything is built."""

import os
from pathlib import Path

import pytest

from mmcl.cli import main
from mmcl.config import load_config
from mmcl.errors import ConfigError
from mmcl.training.preflight import input_problems

from helpers import check_run_inputs, inputs_of

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _touch(path, data=b"x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_every_missing_input_is_named_with_its_resolved_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for i in (0, 1, 3):
        _touch(tmp_path / "shards" / f"shard-{i:06d}.tar")
    _touch(tmp_path / "folder" / "cat" / "0.png")
    (tmp_path / "empty_dir").mkdir()
    cfg = load_config(None, [
        "data.train=shards/shard-{000000..000004}.tar::nowhere/*.tar::pipe:curl -s http://x/{0..3}.tar"
        "::https://host/shard-{0..9}.tar::empty_dir",
        "eval.zeroshot=folder", "eval.retrieval=val/shard-000000.tar", "eval.classnames=names.txt",
        "eval.templates=my_templates.txt", "model.init_from=~/no-such-mmcl-run-here",
        "model.text.hf=shards/minilm",  # one slash, like a hub id, but ./shards is a directory here
        "data.require_all_shards=true"])  # holes in a range are refused only with this key
    home = os.path.expanduser("~")
    assert input_problems(*inputs_of(cfg)) == [
        f"data.train: 2 of the 5 paths that 'shards/shard-{{000000..000004}}.tar' names are missing "
        f"({tmp_path}/shards/shard-000002.tar, {tmp_path}/shards/shard-000004.tar)",
        f"data.train: no file matches {tmp_path}/nowhere/*.tar",
        f"data.train: no .tar/.tar.gz/.tgz shards in the directory {tmp_path}/empty_dir",
        f"eval.retrieval: {tmp_path}/val/shard-000000.tar does not exist",
        f"eval.classnames: {tmp_path}/names.txt does not exist",
        f"eval.templates: {tmp_path}/my_templates.txt does not exist",
        f"model.init_from: {home}/no-such-mmcl-run-here does not exist",
        f"model.text.hf: {tmp_path}/shards/minilm is not a directory (expected a local model directory or a hub name "
        f"such as sentence-transformers/all-MiniLM-L6-v2)",
    ]
    with pytest.raises(ConfigError) as err:
        check_run_inputs(cfg)
    assert str(err.value).startswith(f"missing inputs (relative paths resolve against the current directory, "
                                     f"{tmp_path}): data.train: 2 of the 5 paths")
    # Once everything is there (hub names and URLs are not checked), nothing is reported.
    for i in (2, 4):
        _touch(tmp_path / "shards" / f"shard-{i:06d}.tar")
    ok = load_config(None, ["data.train=shards/shard-{000000..000004}.tar::pipe:cat /nope/{0..3}.tar",
                            "eval.zeroshot=folder", "model.text.hf=sentence-transformers/all-MiniLM-L6-v2",
                            "eval.templates=openai_imagenet_template"])
    assert input_problems(*inputs_of(ok)) == []
    check_run_inputs(ok)


def test_one_template_in_eval_templates_is_checked_as_a_template_not_looked_for_as_a_file(tmp_path):
    train = f"data.train={_touch(tmp_path / 'a.tar')}"
    _touch(tmp_path / "folder" / "cat" / "0.png")
    ok = load_config(None, [train, f"eval.zeroshot={tmp_path / 'folder'}", "eval.templates=a sketch of a {}."])
    assert input_problems(*inputs_of(ok)) == []
    bad = load_config(None, [train, f"eval.zeroshot={tmp_path / 'folder'}", "eval.templates=a {name} of a {}."])
    assert input_problems(*inputs_of(bad)) == [
        "eval.templates: templates a {name} of a {}.: every template needs '{}' for the "
                                   "class name, and no other field in braces (write a brace as '{{' or '}}') (got "
                                   "'a {name} of a {}.')"]


def test_an_eval_directory_without_images_or_shards_is_missing_data(tmp_path):
    (tmp_path / "eval").mkdir()
    cfg = load_config(None, [f"data.train={_touch(tmp_path / 'a.tar')}", f"eval.zeroshot={tmp_path / 'eval'}"])
    assert input_problems(*inputs_of(cfg)) == [
        f"eval.zeroshot: no images or shards in {tmp_path}/eval (expected an ImageFolder "
                                   f"{tmp_path}/eval/<class>/<image>.jpg|png|... or .tar shards)"]


@pytest.mark.parametrize("name", ["tiny", "siglip", "supcon", "mochi", "lit-minilm", "vit-b-32"])
def test_shipped_configs_ask_for_data_train(capsys, tmp_path, name):
    code = main(["train", "--config", str(CONFIG_DIR / f"{name}.yaml"), f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "mmcl: error: data.train is not set: set it with data.train=... "
        "(e.g. data.train='shards/shard-{000000..000009}.tar')"], err
    assert not (tmp_path / "run").exists()
