"""Journeys: the commands chained as users chain them, each in a fresh folder, each step's output checked as what the
next step needs (not only that it exits 0).

1. own images + a tab-separated CSV (open_clip's layout) -> `mmcl shards` -> `train.epochs` -> a checkpoint ->
   `mmcl zeroshot` and `mmcl retrieval` on it -> `model.init_from` the checkpoint -> `mmcl export --format open_clip`
   -> open_clip loads it and gives the same embeddings;
2. `mmcl demo-data` -> train on 2 processes -> Ctrl-C -> resume on 1 -> `mmcl curate` the training shards with the
   run's model -> train on the curated shards with `train.epochs`;
3. `mmcl reinforce` with a teacher -> `distill.from_shards` training -> `mmcl interpolate` between the run's start and
   end -> `mmcl index` + `mmcl search`;
4. an open_clip_train run folder (`epoch_N.pt`) -> `model.pretrained` -> fine-tune -> WiSE-FT.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mmcl
from mmcl.cli import main

from helpers import ROOT, TRAINING_TOWERS, metrics

pytestmark = pytest.mark.slow
MMCL = str(Path(sys.executable).with_name("mmcl"))
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 40), "blue": (40, 60, 220)}


def _ok(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"mmcl {' '.join(argv[:1])} exited {code}:\n{out}\n{err}"
    return out + err


def _train_args(out, *extra):
    """configs/tiny.yaml with micro towers: a run of a few seconds."""
    return ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"train.output_dir={out}", "eval.zeroshot=null",
            "train.progress=false", "train.plot=false", "train.log_with=[]", "data.workers=0",
            "data.shuffle_buffer=16", "optim.warmup_steps=0", "train.log_every=1", *TRAINING_TOWERS, *extra]


def _picture(colour, i, side=32):
    rng = np.random.default_rng(i)
    arr = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 20, (side, side, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr)


def _embeddings(model_path, images, texts):
    model, preprocess, tokenizer = mmcl.load(model_path)
    model.eval()
    with torch.no_grad():
        return (model.encode_image(torch.stack([preprocess(im) for im in images]), normalize=True),
                model.encode_text(tokenizer(texts), normalize=True))


def _state(model_path):
    return {k: v.clone() for k, v in mmcl.load(model_path)[0].state_dict().items()}


# --------------------------------------------------------------------------------------------- journey 1
def test_own_csv_to_shards_to_epochs_to_checkpoint_evaluation_fine_tuning_and_open_clip(tmp_path, capsys):
    import open_clip

    # A user's own images and open_clip's CSV: tab-separated `filepath` and `title`, paths as the user wrote them.
    images, folder = tmp_path / "images", tmp_path / "eval"
    images.mkdir()
    rows = ["filepath\ttitle"]
    for i in range(48):
        colour = list(COLOURS)[i % 3]
        _picture(colour, i).save(images / f"{i:03d}.jpg", quality=92)
        rows.append(f"{images / f'{i:03d}.jpg'}\ta photo of a {colour} square")
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    for colour in COLOURS:  # the held-out ImageFolder for zero-shot
        (folder / colour).mkdir(parents=True)
        for i in range(4):
            _picture(colour, 1000 + i).save(folder / colour / f"{i}.png")

    shards = tmp_path / "shards"
    said = _ok(["shards", "--input", str(tmp_path / "train.csv"), "--out", str(shards), "--shard-size", "16"], capsys)
    sizes = json.loads((shards / "sizes.json").read_text())  # what train.epochs reads
    assert sorted(sizes) == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"], said
    assert sum(sizes.values()) == 48

    run = tmp_path / "run"
    said = _ok(_train_args(run, f"data.train={shards}", "train.epochs=2", "data.batch_size=8", "train.save_every=4",
                           "train.keep_checkpoints=5"), capsys)
    assert "unknown" not in said
    rows = metrics(run)
    assert rows[-1]["step"] == 12 and rows[-1]["samples"] == 96  # two passes of 48 samples at batch 8
    ckpt = run / "checkpoints" / "step-00000008"
    assert ckpt.is_dir() and (run / "checkpoints" / "step-00000012").is_dir()

    # An intermediate checkpoint is a model for every command; the last one is the run's final model.
    z_ckpt, z_last, z_run = (tmp_path / f"z{i}.json" for i in range(3))
    _ok(["zeroshot", "--model", str(ckpt), "--data", str(folder), "--out", str(z_ckpt)], capsys)
    _ok(["zeroshot", "--model", str(run / "checkpoints" / "step-00000012"), "--data", str(folder), "--out",
         str(z_last)], capsys)
    _ok(["zeroshot", "--model", str(run), "--data", str(folder), "--out", str(z_run)], capsys)
    results = [json.loads(p.read_text()) for p in (z_ckpt, z_last, z_run)]
    assert [(r["n_samples"], r["classnames"]) for r in results] == [(12, sorted(COLOURS))] * 3
    assert results[0]["model"] == str(ckpt) and results[1]["metrics"] == results[2]["metrics"]
    ckpt_state, final_state = _state(ckpt), _state(run)
    assert not all(torch.equal(ckpt_state[k], v) for k, v in final_state.items())  # step 8 is not the end
    assert all(torch.equal(v, _state(run / "checkpoints" / "step-00000012")[k]) for k, v in final_state.items())
    retrieval = tmp_path / "retrieval.json"
    _ok(["retrieval", "--model", str(ckpt), "--data", str(shards), "--out", str(retrieval)], capsys)
    recall = json.loads(retrieval.read_text())
    assert recall["n_images"] == recall["n_texts"] == 48 and recall["n_skipped"] == 0
    assert 0 < recall["metrics"]["image_retrieval_recall@10"] <= 1

    # Fine-tuning starts from exactly the checkpoint's weights (lr 0 keeps them: the run's end is its start).
    tuned = tmp_path / "tuned"
    said = _ok(_train_args(tuned, f"data.train={shards}", f"model.init_from={ckpt}", "train.steps=2",
                           "data.batch_size=8", "optim.lr=0", "train.save_every=0"), capsys)
    tuned_state = _state(tuned)
    assert all(torch.equal(tuned_state[k], v) for k, v in ckpt_state.items())

    export = tmp_path / "export"
    _ok(["export", "--model", str(tuned), "--format", "open_clip", "--out", str(export)], capsys)
    oc_model, _, oc_preprocess = open_clip.create_model_and_transforms(f"local-dir:{export}")
    oc_tokenizer = open_clip.get_tokenizer(f"local-dir:{export}")
    oc_model.eval()
    pics = [Image.open(p) for p in sorted(folder.rglob("*.png"))[:5]]
    texts = [f"a photo of a {c} square" for c in COLOURS]
    with torch.no_grad():
        oc_img = oc_model.encode_image(torch.stack([oc_preprocess(im) for im in pics]), normalize=True)
        oc_txt = oc_model.encode_text(oc_tokenizer(texts), normalize=True)
    img, txt = _embeddings(ckpt, pics, texts)
    torch.testing.assert_close(oc_img, img, rtol=0, atol=1e-5)
    torch.testing.assert_close(oc_txt, txt, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------- journey 2
def _launch(argv, log):
    """`mmcl launch` (accelerate's launcher, exiting with the training processes' code) on 2 CPU processes."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [MMCL, "launch", "--config_file", str(ROOT / "launch" / "cpu-2proc.yaml"), "-m", "mmcl", *argv]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_demo_two_processes_ctrl_c_resume_on_one_curate_then_train_on_the_curated_shards(tmp_path, capsys):
    data = tmp_path / "demo"
    _ok(["demo-data", "--out", str(data), "--n-train", "192"], capsys)
    train_spec = str(data / "train")
    run = tmp_path / "run"
    args = _train_args(run, f"data.train={train_spec}", "train.steps=40", "data.batch_size=4", "train.save_every=0")

    with open(tmp_path / "launch.log", "w") as log:
        p = _launch(args, log)
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            if (run / "metrics.jsonl").is_file() and len(metrics(run)) >= 3:
                break
            time.sleep(0.05)
        assert p.poll() is None, (tmp_path / "launch.log").read_text()
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        code = p.wait(timeout=180)
    said = (tmp_path / "launch.log").read_text()
    assert "Traceback" not in said and said.count("checkpoint saved") == 1, said
    assert code == 130, said  # interrupted (mmcl/run/signals.py), from every process and the launcher
    stopped = metrics(run)[-1]["step"]
    assert 3 <= stopped < 40

    # The same command on one process resumes (the global batch kept) and finishes.
    said = _ok(args, capsys)
    assert f"at step {stopped}" in said
    assert metrics(run)[-1]["step"] == 40

    curated = tmp_path / "curated"
    _ok(["curate", "--model", str(run), "--data", train_spec, "--out", str(curated), "--clip-score-top", "0.75",
         "--no-progress"], capsys)
    kept = json.loads((curated / "sizes.json").read_text())
    assert sum(kept.values()) == 144  # exactly the top three quarters of 192

    again = tmp_path / "on-curated"
    said = _ok(_train_args(again, f"data.train={curated}", "train.epochs=1", "data.batch_size=8",
                           f"model.init_from={run}", "train.save_every=0"), capsys)
    assert metrics(again)[-1]["step"] == 18 and metrics(again)[-1]["samples"] == 144


# --------------------------------------------------------------------------------------------- journey 3
def test_reinforce_distill_from_shards_interpolate_then_index_and_search(tmp_path, capsys):
    data = tmp_path / "demo"
    _ok(["demo-data", "--out", str(data), "--n-train", "96"], capsys)
    teacher = tmp_path / "teacher"
    _ok(_train_args(teacher, f"data.train={data / 'train'}", "train.steps=6", "data.batch_size=8",
                    "train.save_every=0"), capsys)

    reinforced = tmp_path / "reinforced"
    _ok(["reinforce", "--teacher", str(teacher), "--data", str(data / "train"), "--out", str(reinforced),
         "--batch-size", "16", "--no-progress"], capsys)
    assert sorted(p.name for p in reinforced.glob("*.tar")) == sorted(p.name for p in (data / "train").glob("*.tar"))
    sizes = json.loads((data / "train" / "sizes.json").read_text())
    assert json.loads((reinforced / "sizes.json").read_text()) == sizes  # every sample kept, for train.epochs

    # The student starts from the teacher and learns from the stored embeddings (no teacher loaded).
    student = tmp_path / "student"
    _ok(_train_args(student, f"data.train={reinforced}", "train.epochs=0.5", "data.batch_size=8",
                    "train.save_every=0", f"model.init_from={teacher}", "distill.from_shards=true",
                    "loss.distill=1.0"), capsys)
    assert [r["step"] for r in metrics(student)] == list(range(1, 7))  # half a pass of 96 samples at batch 8
    assert all(r["loss/distill"] > 0 for r in metrics(student))

    wise = tmp_path / "wise"
    _ok(["interpolate", "--to", str(student), "--alpha", "0", "0.5", "1", "--out", str(wise)], capsys)
    start, end, half = _state(teacher), _state(student), _state(wise / "alpha_0.5")
    assert all(torch.equal(_state(wise / "alpha_0")[k], v) for k, v in start.items())
    for k, v in start.items():
        torch.testing.assert_close(half[k], 0.5 * v + 0.5 * end[k], rtol=0, atol=1e-6)

    index = tmp_path / "index"
    _ok(["index", "--model", str(wise / "alpha_0.5"), "--data", str(data / "val"), "--out", str(index)], capsys)
    said = _ok(["search", "--index", str(index), "a red circle", "-k", "3", "--json"], capsys)
    hits = json.loads(said[said.index("["):])
    assert len(hits) == 3 and [h["rank"] for h in hits] == [1, 2, 3]
    assert hits[0]["score"] >= hits[1]["score"] >= hits[2]["score"]


# --------------------------------------------------------------------------------------------- journey 4
def test_open_clip_train_folder_to_pretrained_fine_tune_and_wise_ft(tmp_path, capsys):
    from mmcl import models
    from mmcl.config import ModelConfig

    torch.manual_seed(5)
    model, *_ = models.build(ModelConfig(name="tiny"))
    published = {k: v.detach().clone() for k, v in model.state_dict().items()}
    logs = tmp_path / "logs" / "my-run"  # what `python -m open_clip_train.main --name my-run` leaves
    (logs / "checkpoints").mkdir(parents=True)
    (logs / "params.txt").write_text("batch_size: 8\nepochs: 2\nlr: 0.0005\nmodel: tiny\nname: my-run\n"
                                     "precision: amp\n")
    torch.save({"epoch": 2, "name": "my-run", "state_dict": {"module." + k: v for k, v in published.items()}},
               logs / "checkpoints" / "epoch_2.pt")

    data = tmp_path / "demo"
    _ok(["demo-data", "--out", str(data), "--n-train", "64"], capsys)
    run = tmp_path / "ft"
    _ok(["train", "--config", str(ROOT / "configs" / "finetune.yaml"), f"train.output_dir={run}",
         f"data.train={data / 'train'}", f"model.pretrained={logs}", "train.steps=3", "data.batch_size=8",
         "data.workers=0", "data.shuffle_buffer=8", "train.save_every=0", "optim.warmup_steps=0",
         "train.progress=false", "train.plot=false", "train.log_with=[]",
         f"eval.zeroshot={data / 'zeroshot' / 'colour'}",
         "train.wise_ft=[0.5]"], capsys)
    final = _state(run)
    assert not all(torch.equal(final[k], v) for k, v in published.items())  # it trained
    half = _state(run / "wise_ft" / "alpha_0.5")
    for k, v in published.items():  # WiSE-FT between the open_clip_train checkpoint and the fine-tuned end
        torch.testing.assert_close(half[k], 0.5 * v + 0.5 * final[k], rtol=0, atol=1e-6)
    wise = json.loads((run / "wise_ft" / "wise_ft.json").read_text())
    assert [r["alpha"] for r in wise["results"]] == [0.5]
    assert 0 <= wise["results"][0]["metrics"]["eval/zeroshot_classification/colour/acc1"] <= 1
    assert wise["from"] == f"model.pretrained={logs}"  # what the run started from, by name
