"""Files from elsewhere: nothing mmcl loads runs code, and no command overwrites or deletes the user's files.

Each poisoned file holds an object whose unpickling would create a marker file (``pathlib.Path.touch``): the
marker must never appear, and the command must end with one error line naming the file.
"""

import hashlib
import json
import pathlib
import shutil
from pathlib import Path

import pytest
import torch

from mmcl.cli import main
from mmcl.shards import writer as shard_writer
from mmcl.storage.checkpoints import latest_checkpoint

from helpers import short_run

# Every checkpoint kept, and a model at the 32 pixels of the small demo's images.
SETTINGS = ("train.keep_checkpoints=0", "model.image_size=32")


class Touch:
    """Unpickling this calls ``Path.touch(marker)``: what a poisoned file could run instead (a shell command)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def error_lines(capsys):
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text, text
    return [ln for ln in text.splitlines() if ln.startswith("mmcl: error:")]


def reseal(ckpt: Path) -> None:
    """Rewrite the COMPLETE marker's sizes and checksums, as whoever hands over a poisoned folder would."""
    marker = json.loads((ckpt / "COMPLETE").read_text())
    marker["files"] = {str(p.relative_to(ckpt)): {"size": p.stat().st_size,
                                                  "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                       for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != "COMPLETE"}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))


@pytest.fixture(scope="module")
def saved_run(small_demo, tmp_path_factory):
    """A finished 4-step run (with a weight average) whose checkpoints are at steps 2 and 4."""
    out = tmp_path_factory.mktemp("saved") / "run"
    assert main(short_run(small_demo, out, *SETTINGS, "train.steps=4", "train.ema_decay=0.5")) == 0
    return out


def at_step_2(saved_run, tmp_path) -> Path:
    """A copy of the saved run cut back to its step-2 checkpoint: resuming it runs steps 3 and 4 again."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    shutil.rmtree(run / "model")
    (run / "checkpoints" / "latest").unlink(missing_ok=True)
    return run


def final_weights(run):
    from safetensors.torch import load_file

    return load_file(str(run / "model" / "open_clip_model.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, worst


# ------------------------------------------------------------------------------------------- checkpoints
def test_a_poisoned_rank_state_is_refused_without_running_it(small_demo, saved_run, tmp_path, capsys):
    run = at_step_2(saved_run, tmp_path)
    ckpt = run / "checkpoints" / "step-00000002"
    marker = tmp_path / "ran"
    state = torch.load(ckpt / "rank_state_0.pt", weights_only=True)
    state["data"]["note"] = Touch(marker)
    torch.save(state, ckpt / "rank_state_0.pt")
    reseal(ckpt)
    capsys.readouterr()
    assert main(short_run(small_demo, run, *SETTINGS, "train.steps=4", "train.ema_decay=0.5")) == 2
    assert not marker.exists()
    lines = error_lines(capsys)
    assert len(lines) == 1 and "rank_state_0.pt" in lines[0] and "plain tensors" in lines[0], lines
    assert ckpt.is_dir() and not (run / "model").exists()  # nothing set aside, nothing trained


def test_a_poisoned_custom_checkpoint_pkl_is_refused_without_running_it(small_demo, saved_run, tmp_path, capsys):
    """accelerate unpickles ``custom_checkpoint_<i>.pkl`` with weights_only=False: mmcl never lets it."""
    run = at_step_2(saved_run, tmp_path)
    ckpt = run / "checkpoints" / "step-00000002"
    marker = tmp_path / "ran"
    torch.save({"step": 2, "samples": 16, "skipped_steps": 0, "note": Touch(marker)},
               ckpt / "custom_checkpoint_0.pkl")
    reseal(ckpt)
    capsys.readouterr()
    assert main(short_run(small_demo, run, *SETTINGS, "train.steps=4", "train.ema_decay=0.5")) == 2
    assert not marker.exists()
    lines = error_lines(capsys)
    assert len(lines) == 1 and "custom_checkpoint_0.pkl" in lines[0], lines


def test_a_poisoned_rank_state_of_another_world_size_is_refused(small_demo, saved_run, tmp_path, capsys):
    """The elastic path (a checkpoint of 2 processes resumed on 1) reads every rank's state: each as plain data."""
    run = at_step_2(saved_run, tmp_path)
    ckpt = run / "checkpoints" / "step-00000002"
    marker = tmp_path / "ran"
    state = torch.load(ckpt / "rank_state_0.pt", weights_only=True)
    state["objective"]["note"] = Touch(marker)
    torch.save(state, ckpt / "rank_state_1.pt")
    complete = json.loads((ckpt / "COMPLETE").read_text())
    (ckpt / "COMPLETE").write_text(json.dumps(dict(complete, world_size=2)))
    reseal(ckpt)
    capsys.readouterr()
    assert main(short_run(small_demo, run, *SETTINGS, "train.steps=4", "train.ema_decay=0.5")) == 2
    assert not marker.exists()
    lines = error_lines(capsys)
    assert len(lines) == 1 and "rank_state_1.pt" in lines[0], lines


def test_a_checkpoint_with_progress_in_custom_checkpoint_files_still_resumes_exactly(small_demo, saved_run, tmp_path):
    """A checkpoint written when the progress and EMA were registered with accelerate (custom_checkpoint_0/1.pkl,
    plain dicts): read as plain data, it resumes to the uninterrupted run's final weights (the EMA)."""
    run = at_step_2(saved_run, tmp_path)
    ckpt = run / "checkpoints" / "step-00000002"
    state = torch.load(ckpt / "rank_state_0.pt", weights_only=True)
    torch.save(state.pop("progress"), ckpt / "custom_checkpoint_0.pkl")
    torch.save(state.pop("ema"), ckpt / "custom_checkpoint_1.pkl")
    torch.save(state, ckpt / "rank_state_0.pt")
    reseal(ckpt)
    assert main(short_run(small_demo, run, *SETTINGS, "train.steps=4", "train.ema_decay=0.5")) == 0
    assert_same_weights(final_weights(run), final_weights(saved_run))
    assert sorted(p.name for p in latest_checkpoint(run / "checkpoints").iterdir()
                  if p.name.startswith("custom_checkpoint")) == []  # new checkpoints hold none


def test_a_rank_state_saved_on_another_device_resumes_on_this_one(small_demo, saved_run, tmp_path, monkeypatch):
    """Tensors tagged with a GPU this machine lacks (another host's, another process's) load onto the CPU."""
    import torch.serialization as ser

    run = at_step_2(saved_run, tmp_path)
    ckpt = run / "checkpoints" / "step-00000002"
    state = torch.load(ckpt / "rank_state_0.pt", weights_only=True)
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU here (cuda:0 on a CPU machine)
    with monkeypatch.context() as m:
        m.setattr(ser, "location_tag", lambda storage: absent)
        torch.save(state, ckpt / "rank_state_0.pt")
    with pytest.raises(RuntimeError):  # what loading it as saved does
        torch.load(ckpt / "rank_state_0.pt", weights_only=True)
    reseal(ckpt)
    assert main(short_run(small_demo, run, *SETTINGS, "train.steps=4", "train.ema_decay=0.5")) == 0
    assert_same_weights(final_weights(run), final_weights(saved_run))


# -------------------------------------------------------------------------------------- weight loading
def poisoned_weights(path: Path, marker: Path) -> Path:
    torch.save({"state_dict": {"logit_scale": torch.zeros(())}, "note": Touch(marker)}, path)
    return path


def test_init_from_refuses_a_pickled_object(small_demo, tmp_path, capsys):
    marker = tmp_path / "ran"
    bad = poisoned_weights(tmp_path / "epoch_1.pt", marker)
    assert main(short_run(small_demo, tmp_path / "run", *SETTINGS, "train.steps=1", f"model.init_from={bad}")) == 2
    assert not marker.exists()
    lines = error_lines(capsys)
    assert len(lines) == 1 and str(bad) in lines[0] and "plain tensors" in lines[0], lines


@pytest.fixture(scope="module")
def poisoned_model_dir(saved_run, tmp_path_factory):
    """A copy of a saved model whose weights file is a pickle with an object (its record resealed to match)."""
    from mmcl.storage.weights import weights_record

    root = tmp_path_factory.mktemp("poisoned")
    model = root / "model"
    shutil.copytree(saved_run / "model", model)
    poisoned_weights(model / "open_clip_model.safetensors", root / "ran")
    config = json.loads((model / "open_clip_config.json").read_text())
    config["mmcl"]["weights"] = weights_record(model / "open_clip_model.safetensors")
    (model / "open_clip_config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("command", ["export", "zeroshot", "teacher"])
def test_model_loading_commands_refuse_a_pickled_weights_file(small_demo, poisoned_model_dir, tmp_path, capsys,
                                                              command):
    marker = poisoned_model_dir.parent / "ran"
    argv = {"export": ["export", "--model", str(poisoned_model_dir), "--format", "safetensors",
                       "--out", str(tmp_path / "exp")],
            "zeroshot": ["zeroshot", "--model", str(poisoned_model_dir), "--data", small_demo["zeroshot_colour"],
                         "--out", str(tmp_path / "r.json")],
            "teacher": short_run(small_demo, tmp_path / "run", *SETTINGS, "train.steps=1",
                                 f"distill.teacher={poisoned_model_dir}", "loss.distill=1.0")}[command]
    capsys.readouterr()
    assert main(argv) == 2
    assert not marker.exists()
    lines = error_lines(capsys)
    assert len(lines) == 1 and "open_clip_model.safetensors" in lines[0], lines


# --------------------------------------------------------------------------------------- Hugging Face
def custom_code_dir(root: Path, marker: Path) -> Path:
    """A Hugging Face model folder whose config and tokenizer map (auto_map) to Python code shipped beside them."""
    d = root / "hf-custom"
    d.mkdir()
    (d / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                 "from transformers import BertConfig, BertModel, BertTokenizerFast\n"
                                 "class CustomConfig(BertConfig):\n    model_type = 'custom-bert'\n"
                                 "class CustomModel(BertModel):\n    config_class = CustomConfig\n"
                                 "class CustomTokenizer(BertTokenizerFast):\n    pass\n")
    auto_map = {"AutoConfig": "custom.CustomConfig", "AutoModel": "custom.CustomModel"}
    (d / "config.json").write_text(json.dumps({"model_type": "custom-bert", "auto_map": auto_map, "hidden_size": 16,
                                               "num_hidden_layers": 1, "num_attention_heads": 2,
                                               "intermediate_size": 32, "vocab_size": 40}))
    auto_map = {"AutoTokenizer": [None, "custom.CustomTokenizer"]}
    (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map,
                                                         "tokenizer_class": "CustomTokenizer"}))
    return d


@pytest.mark.parametrize("what", ["tower", "tokenizer"])
def test_a_hugging_face_folder_with_custom_code_is_refused_even_if_the_user_would_say_yes(tmp_path, monkeypatch,
                                                                                          what):
    """transformers asks "Do you wish to run the custom code? [y/N]" when trust_remote_code is not passed: mmcl
    passes False, so nobody is asked and the code never runs (here: the answer would have been yes)."""
    import builtins

    from mmcl import models
    from mmcl.config import ModelConfig, TextTowerConfig
    from mmcl.errors import ConfigError

    marker = tmp_path / "ran"
    d = custom_code_dir(tmp_path, marker)
    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")
    cfg = models.resolve_model_config(ModelConfig(name="tiny", text=TextTowerConfig(hf=str(d)), context_length=16))
    with pytest.raises(ConfigError, match="custom Python code"):
        if what == "tower":
            models.create(cfg)
        else:
            models.build_tokenizer(cfg)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------- output folders
def users_folder(root: Path, names) -> dict:
    """A folder of the user's holding `names` (each with its own bytes); returns {path: bytes} to compare."""
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for i, name in enumerate(names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"the user's own {name} #{i}\n".encode())
        files[path] = path.read_bytes()
    return files


def assert_untouched(root: Path, files: dict) -> None:
    assert sorted(p for p in root.rglob("*") if p.is_file()) == sorted(files)
    for path, data in files.items():
        assert path.read_bytes() == data, path


def assert_refused(capsys, folder: Path):
    lines = error_lines(capsys)
    assert len(lines) == 1 and str(folder) in lines[0] and "nothing" in lines[0], lines


def test_demo_data_refuses_a_folder_of_the_users(tmp_path, capsys):
    d = tmp_path / "mine"
    files = users_folder(d, ["train/shard-000000.tar", "train/shard-000007.tar", "notes.txt"])
    assert main(["demo-data", "--out", str(d), "--n-train", "16"]) == 2
    assert_refused(capsys, d)
    assert_untouched(d, files)


def test_shards_refuses_a_folder_of_the_users(small_demo, tmp_path, capsys):
    src = Path(small_demo["zeroshot_colour"])  # an ImageFolder
    d = tmp_path / "mine"
    files = users_folder(d, ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar", "shard-000003.tar",
                             "classnames.txt"])
    assert main(["shards", "--input", str(src), "--out", str(d)]) == 2
    assert_refused(capsys, d)
    assert_untouched(d, files)


def test_reinforce_refuses_a_folder_of_the_users(small_demo, saved_run, tmp_path, capsys):
    d = tmp_path / "mine"
    first = Path(small_demo["train"].replace("{000000..000001}", "000000"))
    files = users_folder(d, [first.name, first.name + ".reinforce-partial", "notes.txt"])
    argv = ["reinforce", "--teacher", str(saved_run), "--data", small_demo["train"], "--out", str(d), "--no-progress"]
    assert main(argv) == 2
    assert_refused(capsys, d)
    assert_untouched(d, files)


def test_writing_commands_refuse_each_others_folders(tmp_path, capsys):
    from mmcl.shards.demo import make_demo_data

    d = tmp_path / "demo"
    make_demo_data(str(d), n_train=8, n_val=4, n_zeroshot=1, image_size=16, shard_size=8, progress=False)
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    assert main(["shards", "--input", str(d / "zeroshot" / "colour"), "--out", str(d)]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "mmcl demo-data" in lines[0], lines
    assert_untouched(d, before)


def test_a_rerun_into_its_own_folder_replaces_only_its_own_files(small_demo, tmp_path):
    """demo-data and shards write again into their own folder: their earlier files are replaced, those of an
    earlier, larger run deleted (no stale shard left for a glob to mix in), the user's added files kept."""
    from mmcl.shards.demo import make_demo_data

    d = tmp_path / "demo"
    kw = dict(n_val=4, n_zeroshot=1, image_size=16, shard_size=8, progress=False)
    make_demo_data(str(d), n_train=32, **kw)
    assert len(list((d / "train").glob("shard-*.tar"))) == 4
    added = users_folder(d, ["train/notes.txt", "zeroshot/mine.txt"])
    again = make_demo_data(str(d), n_train=16, **kw)
    assert sorted(p.name for p in (d / "train").glob("shard-*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    assert again["train"].endswith("shard-{000000..000001}.tar")
    for path, data_ in added.items():
        assert path.read_bytes() == data_

    out = tmp_path / "shards"
    src = Path(small_demo["zeroshot_colour"])
    first = shard_writer.shards_from_input(str(src), str(out), shard_size=4, progress=False)
    assert first["n_shards"] == 4  # 8 colours x 2 images
    mine = users_folder(out, ["readme.md"])
    second = shard_writer.shards_from_input(str(src), str(out), shard_size=8, progress=False)
    assert second["n_shards"] == 2
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-000000.tar", "shard-000001.tar"]
    assert (out / "classnames.txt").is_file()
    for path, data_ in mine.items():
        assert path.read_bytes() == data_
