"""One resolver of model paths: a run folder, its model/, an export and a complete training checkpoint are models
for every command and key that takes one; a damaged checkpoint is one error line; config.yaml records the
architecture model.pretrained brings."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmcl.cli import main
from mmcl.config import ModelConfig, load_config
from mmcl.storage import checkpoints, pretrained, weights

from helpers import FOLDER_TOWERS

ROOT = Path(__file__).resolve().parents[2]


def _train_args(demo, out, *extra):
    return ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={demo['train']}",
            f"train.output_dir={out}", "eval.zeroshot=null", "train.progress=false", "train.plot=false",
            "data.shuffle_buffer=8", "data.batch_size=8", "data.workers=0", "train.log_with=[]", *FOLDER_TOWERS, *extra]


@pytest.fixture(scope="module")
def run(small_demo, tmp_path_factory):
    """A finished 4-step run with the weight average, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("paths") / "run"
    assert main(_train_args(small_demo, out, "train.steps=4", "train.save_every=2", "train.keep_checkpoints=0",
                            "train.ema_decay=0.5")) == 0
    return out


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _one_error_line(capsys, code):
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and err[0].startswith("mmcl: error: "), err
    return err[0]


def test_a_checkpoint_is_the_model_the_run_would_export_at_that_step(run):
    last, middle = run / "checkpoints" / "step-00000004", run / "checkpoints" / "step-00000002"
    # The last step's checkpoint is model/: the weight average, the same architecture and preprocessing.
    final = weights.load_model_dir(run / "model")
    from_ckpt = weights.load_model_dir(last)
    assert _same(_state(from_ckpt[0]), _state(final[0])) and from_ckpt[1:] == final[1:]
    # An earlier one: its own weight average (rank 0's state), not the trained weights nor the final model.
    model = weights.load_model_dir(middle)[0]
    shadow = checkpoints.load_plain(checkpoints.rank_state_file(middle, 0))["ema"]["shadow"]
    trained = load_file(str(middle / checkpoints.MODEL_WEIGHTS))
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in shadow.items())
    assert not all(torch.equal(params[n], trained[n]) for n in shadow)
    assert not _same(_state(model), _state(final[0]))
    # Self-describing: copied away from its run folder it is the same model.
    alone = shutil.copytree(middle, run.parent / "alone")
    assert _same(_state(weights.load(alone)[0]), _state(model))
    assert weights.find_model_dir(middle) == middle


def test_zeroshot_export_and_interpolate_take_a_checkpoint(run, small_demo, tmp_path):
    ckpt = run / "checkpoints" / "step-00000002"
    data = small_demo["zeroshot_colour"]
    assert main(["export", "--model", str(ckpt), "--format", "open_clip", "--out", str(tmp_path / "export")]) == 0
    assert _same(_state(weights.load(tmp_path / "export")[0]), _state(weights.load(ckpt)[0]))
    results = {}
    for name, model in (("ckpt", ckpt), ("export", tmp_path / "export")):
        assert main(["zeroshot", "--model", str(model), "--data", data, "--out", str(tmp_path / f"{name}.json")]) == 0
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())["metrics"]
    assert results["ckpt"] == results["export"] and 0.0 <= results["ckpt"]["acc1"] <= 1.0
    assert main(["index", "--model", str(ckpt), "--data", small_demo["val"], "--out", str(tmp_path / "index")]) == 0
    # alpha 0 is --from (the checkpoint), alpha 1 is --to (the final model)
    assert main(["interpolate", "--from", str(ckpt), "--to", str(run / "model"), "--alpha", "0", "1",
                 "--out", str(tmp_path / "wise")]) == 0
    assert _same(_state(weights.load(tmp_path / "wise" / "alpha_0")[0]), _state(weights.load(ckpt)[0]))
    assert _same(_state(weights.load(tmp_path / "wise" / "alpha_1")[0]), _state(weights.load(run)[0]))


def test_init_from_and_pretrained_start_from_exactly_the_checkpoint(run, small_demo, tmp_path):
    ckpt = run / "checkpoints" / "step-00000002"
    expected = _state(weights.load(ckpt)[0])
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), FOLDER_TOWERS).model
    from mmcl import models

    model = models.build(cfg)[0]
    assert "mmcl training checkpoint step-00000002" in weights.init_from(model, ckpt)
    assert _same(_state(model), expected)
    # model.pretrained: the checkpoint brings its architecture (not model.name's ViT-B-32) and its weights.
    built, model_cfg, *_ = pretrained.build_pretrained(ModelConfig(name="ViT-B-32", pretrained=str(ckpt)))
    assert _same(_state(built), expected) and model_cfg["embed_dim"] == 16


def test_model_name_recorded_is_the_architecture_pretrained_brings(run, small_demo, tmp_path, capsys):
    out = tmp_path / "ft"
    args = _train_args(small_demo, out, "train.steps=1", "train.save_every=0", "model.name=ViT-B-32",
                       f"model.pretrained={run / 'model'}", "optim.lr=0")
    assert main(args) == 0
    recorded = load_config(str(out / "config.yaml")).model.name
    assert recorded == f"local-dir:{(run / 'model').resolve()}"
    assert json.loads((out / "model" / "open_clip_config.json").read_text())["model_cfg"]["embed_dim"] == 16
    assert _same(_state(weights.load(out)[0]), _state(weights.load(run)[0]))  # lr 0: the model it started from
    capsys.readouterr()
    assert main(args) == 0  # the same command again is the same, finished run, not another one
    assert "finished" in capsys.readouterr().out


@pytest.mark.parametrize("damage, says", [
    ("no_marker", r"checkpoint .*step-00000002 is incomplete: it has no COMPLETE marker"),
    ("corrupt_weights", r"checkpoint .*step-00000002 is damaged: model.safetensors differs from what was written"),
    ("truncated_weights", r"checkpoint .*step-00000002 is damaged: model.safetensors has \d+ bytes, \d+ were written"),
])
def test_a_damaged_checkpoint_is_one_line(run, small_demo, tmp_path, capsys, damage, says):
    import re

    ckpt = shutil.copytree(run / "checkpoints" / "step-00000002", tmp_path / "run" / "checkpoints" / "step-00000002")
    weights_file = ckpt / checkpoints.MODEL_WEIGHTS
    raw = bytearray(weights_file.read_bytes())
    if damage == "no_marker":
        (ckpt / checkpoints.COMPLETE).unlink()
    elif damage == "corrupt_weights":
        raw[-100] ^= 0x40
        weights_file.write_bytes(bytes(raw))
    else:
        weights_file.write_bytes(bytes(raw[: len(raw) // 2]))
    for command in (["zeroshot", "--model", str(ckpt), "--data", small_demo["zeroshot_colour"],
                     "--out", str(tmp_path / "r.json")],
                    ["export", "--model", str(ckpt), "--format", "safetensors", "--out", str(tmp_path / "x")],
                    _train_args(small_demo, tmp_path / "ft", "train.steps=1", f"model.init_from={ckpt}")):
        line = _one_error_line(capsys, main(command))
        assert re.search(says, line), line
