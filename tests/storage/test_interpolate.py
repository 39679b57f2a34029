"""WiSE-FT (`mmcl interpolate`): the weights (1 - a) * initial + a * fine-tuned, each alpha a model mmcl.load reads,
evaluated zero-shot, refused for two architectures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_pretrained import SMALL_B32, SMALL_B32_ARGS, TAG_REPO, _saved

import mmcl
from mmcl import models
from mmcl.cli import main
from mmcl.config import ModelConfig
from mmcl.storage import weights

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(name="tiny", embed_dim=24, image_size=32, vision_cfg={"layers": 1, "width": 32, "head_width": 16},
             text_cfg={"layers": 1, "width": 32, "heads": 2, "context_length": 16})


def _save(tmp_path, name, seed, **changes):
    """A tiny model with seeded random weights, saved as a model directory: (directory, its state dict)."""
    torch.manual_seed(seed)
    model, model_cfg, pp, *_ = models.build(ModelConfig(**{**SMALL, **changes}))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "logit" not in key:
                p.add_(torch.randn_like(p))
            else:
                p.fill_(seed)  # a logit scale of its own per model, under the clamp
    out = weights.save_model_dir(model, model_cfg, pp, tmp_path / name)
    return out, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def pair(tmp_path):
    init, init_state = _save(tmp_path, "init", 1)
    tuned, tuned_state = _save(tmp_path, "tuned", 2)
    return init, init_state, tuned, tuned_state


def test_alphas_are_the_hand_computed_interpolation_and_the_ends_are_the_models(tmp_path, pair, capsys):
    init, init_state, tuned, tuned_state = pair
    out = tmp_path / "wise"
    assert main(["interpolate", "--from", str(init), "--to", str(tuned), "--alpha", "0", "0.25", "0.5", "1",
                 "--out", str(out)]) == 0
    assert "alpha 0.25" in capsys.readouterr().out
    for alpha in (0.25, 0.5):
        model, _, _ = mmcl.load(out / f"alpha_{alpha}")
        got = model.state_dict()
        assert sorted(got) == sorted(tuned_state)
        for key, y in tuned_state.items():
            want = ((1 - alpha) * init_state[key].double() + alpha * y.double()).to(y.dtype)
            assert torch.allclose(got[key], want, rtol=0, atol=1e-6), key
            if y.is_floating_point() and not torch.equal(init_state[key], y):
                assert not torch.equal(got[key], y) and not torch.equal(got[key], init_state[key])
    for alpha, state in ((0, init_state), (1, tuned_state)):
        model, _, _ = mmcl.load(out / f"alpha_{alpha}")
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items()), alpha
    results = json.loads((out / "wise_ft.json").read_text())
    assert [r["alpha"] for r in results["results"]] == [0, 0.25, 0.5, 1] and results["dataset"] is None
    # An open_clip local-dir: open_clip itself loads an alpha's folder.
    import open_clip

    oc_model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out / 'alpha_0.5'}")
    ours = mmcl.load(out / "alpha_0.5")[0].state_dict()
    assert all(torch.equal(v, ours[k]) for k, v in oc_model.state_dict().items())


def test_each_alpha_is_evaluated_zero_shot_as_mmcl_zeroshot_does(tmp_path, pair):
    from mmcl.shards.demo import make_demo_data

    init, _, tuned, _ = pair
    demo = make_demo_data(str(tmp_path / "demo"), n_train=4, n_val=2, n_zeroshot=3, image_size=32, shard_size=4,
                          progress=False)
    out = tmp_path / "wise"
    assert main(["interpolate", "--from", str(init), "--to", str(tuned), "--alpha", "0.3", "0.7", "--out", str(out),
                 "--data", demo["zeroshot_colour"]]) == 0
    results = json.loads((out / "wise_ft.json").read_text())["results"]
    for entry in results:
        alone = tmp_path / f"zs_{entry['alpha']}.json"
        assert main(["zeroshot", "--model", entry["model"], "--data", demo["zeroshot_colour"], "--out",
                     str(alone)]) == 0
        assert entry["metrics"] == json.loads(alone.read_text())["metrics"]
        assert entry["n_samples"] > 0


@pytest.mark.parametrize("changes,key", [({"vision_cfg": {"layers": 2, "width": 32, "head_width": 16}},
                                          "vision_cfg.layers"),
                                         ({"embed_dim": 16}, "embed_dim")])
def test_two_architectures_are_refused_naming_the_first_differing_key(tmp_path, pair, capsys, changes, key):
    init, *_ = pair
    other, _ = _save(tmp_path, "other", 3, **changes)
    out = tmp_path / "wise"
    assert main(["interpolate", "--from", str(init), "--to", str(other), "--alpha", "0.5", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmcl: error:") and "not the same architecture" in err[0], err
    assert f"{key} is" in err[0]
    assert not out.exists()  # nothing written


def test_weights_of_other_shapes_are_named_when_the_configs_agree(pair):
    from mmcl.storage.interpolate import architecture_difference

    _, init_state, _, tuned_state = pair
    cut = dict(tuned_state)
    cut["visual.proj"] = cut["visual.proj"][:, :4]
    assert architecture_difference({}, {}, init_state, cut).startswith("visual.proj has shape")
    del cut["visual.proj"]
    assert architecture_difference({}, {}, init_state, cut) == "visual.proj is a weight of --from only"


def test_bad_alpha_and_a_foreign_output_folder_are_one_line(tmp_path, pair, capsys):
    init, _, tuned, _ = pair
    assert main(["interpolate", "--from", str(init), "--to", str(tuned), "--alpha", "1.5", "--out",
                 str(tmp_path / "w")]) == 2
    assert "--alpha takes one or more values in [0, 1]" in capsys.readouterr().err
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert main(["interpolate", "--from", str(init), "--to", str(tuned), "--alpha", "0.5", "--out", str(theirs)]) == 2
    assert "not empty" in capsys.readouterr().err and (theirs / "notes.txt").read_text() == "mine"
    # The command's own folder is written again (a re-run), replacing only its own files.
    out = tmp_path / "again"
    for _ in range(2):
        assert main(["interpolate", "--from", str(init), "--to", str(tuned), "--alpha", "0.5", "--out", str(out)]) == 0


@pytest.mark.slow
def test_train_wise_ft_interpolates_the_runs_start_and_end_and_evaluates_each(tmp_path, pair):
    from mmcl.shards.demo import make_demo_data

    init, init_state, _, _ = pair
    demo = make_demo_data(str(tmp_path / "demo"), n_train=16, n_val=2, n_zeroshot=2, image_size=32, shard_size=16,
                          progress=False)
    out = tmp_path / "run"
    assert main(["train", "--config", str(ROOT / "configs" / "finetune.yaml"), f"model.pretrained={init}",
                 f"data.train={demo['train']}", f"train.output_dir={out}", f"eval.zeroshot={demo['zeroshot_colour']}",
                 "train.progress=false", "train.plot=false", "data.batch_size=8", "data.workers=0",
                 "data.shuffle_buffer=8", "train.steps=2", "train.save_every=0", "optim.warmup_steps=0",
                 "train.log_with=[]", "train.wise_ft=[0,0.5,1]"]) == 0
    final = mmcl.load(out)[0].state_dict()
    start = mmcl.load(out / "wise_ft" / "alpha_0")[0].state_dict()
    half = mmcl.load(out / "wise_ft" / "alpha_0.5")[0].state_dict()
    assert all(torch.equal(start[k], v) for k, v in init_state.items())  # the published weights it started from
    assert all(torch.equal(mmcl.load(out / "wise_ft" / "alpha_1")[0].state_dict()[k], v) for k, v in final.items())
    assert not all(torch.equal(final[k], v) for k, v in init_state.items())  # it trained
    for key, v in final.items():
        assert torch.allclose(half[key], 0.5 * init_state[key] + 0.5 * v, rtol=0, atol=1e-6), key
    results = json.loads((out / "wise_ft" / "wise_ft.json").read_text())["results"]
    assert [r["alpha"] for r in results] == [0, 0.5, 1]
    run_final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    acc_key = next(k for k in results[-1]["metrics"] if k.endswith("/acc1"))
    assert results[-1]["metrics"][acc_key] == run_final[acc_key]  # alpha 1 is the final model, evaluated alike


def _readme_finetune_commands():
    """The commands of the fine-tuning example (the first bash block of docs/finetuning.md)."""
    import shlex

    section = (ROOT / "docs" / "finetuning.md").read_text()
    block = section[section.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    commands, current = [], ""
    for line in block.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(shlex.split(current))
            current = ""
    return commands


@pytest.mark.slow
def test_readme_finetune_from_a_tag_then_zeroshot_then_wise_ft(tmp_path, monkeypatch, hf_cache, capsys):
    """docs/finetuning.md's sequence as written (train from a published tag with configs/finetune.yaml, zero-shot,
    WiSE-FT from the run's own start), offline, the tag's weights in a Hugging Face cache built here; the data, and the
    model's size and run length (a ViT-B-32 at a test's size), are the only changes."""
    from mmcl.shards.demo import make_demo_data

    commands = _readme_finetune_commands()
    assert [c[:2] for c in commands] == [["mmcl", "train"], ["mmcl", "zeroshot"], ["mmcl", "interpolate"]]
    saved, published = _saved(tmp_path, ModelConfig(**SMALL_B32))
    hf_cache(TAG_REPO, {"open_clip_model.safetensors": saved / "open_clip_model.safetensors"})
    demo = make_demo_data(str(tmp_path / "demo"), n_train=16, n_val=2, n_zeroshot=2, image_size=32, shard_size=16,
                          progress=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "finetune.yaml").write_text((ROOT / "configs" / "finetune.yaml").read_text())
    (tmp_path / "my-shards").mkdir()
    (tmp_path / "my-shards" / "000000.tar").symlink_to(demo["train"])
    (tmp_path / "my-eval-folder").symlink_to(demo["zeroshot_colour"], target_is_directory=True)
    small_run = [*SMALL_B32_ARGS, "train.steps=2", "data.batch_size=8", "data.workers=0", "data.shuffle_buffer=8",
                 "train.save_every=0", "optim.warmup_steps=0", "train.progress=false", "train.plot=false",
                 "train.log_with=[]"]
    for command in commands:
        args = command[1:] + (small_run if command[1] == "train" else [])
        assert main(args) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "ft-b32.json").read_text())["metrics"]["acc1"] >= 0
    wise = json.loads((tmp_path / "runs" / "ft-b32-wise" / "wise_ft.json").read_text())
    assert wise["from"] == "model.pretrained=laion2b_s34b_b79k"
    assert [r["alpha"] for r in wise["results"]] == [0.25, 0.5, 0.75] and all("acc1" in r["metrics"]
                                                                             for r in wise["results"])
    final = mmcl.load("runs/ft-b32")[0].state_dict()
    quarter = mmcl.load("runs/ft-b32-wise/alpha_0.25")[0].state_dict()
    assert not all(torch.equal(final[k], v) for k, v in published.items())  # it trained
    for key, v in published.items():  # between the published weights the run started from and its final model
        assert torch.allclose(quarter[key], 0.75 * v + 0.25 * final[key], rtol=0, atol=1e-6), key
