"""An open_clip_train user's first hour, from their own tab-separated CSV (paths relative to the folder they work
in, a few broken files) through `mmcl shards`, `mmcl train` by epochs and `mmcl zeroshot`, as docs/data.md and
Getting started give the commands; every line that promises a path or a number is checked against the files."""

import json
import re

import numpy as np
import pytest
from PIL import Image

from mmcl.cli import main

from helpers import ROOT, metrics

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
TINY = ["model.vision_cfg={layers: 1, width: 32, head_width: 16}", "model.text_cfg={layers: 1, width: 32, heads: 2}",
        "model.embed_dim=16", "data.workers=0", "train.plot=false", "train.progress=false"]


def _image(path, rgb, seed):
    noise = np.random.default_rng(seed).integers(-20, 21, (24, 24, 3))
    Image.fromarray(np.clip(np.array(rgb) + noise, 0, 255).astype(np.uint8)).save(path)


def _their_files(root):
    """mydata/images/*.png and mydata/train.csv in open_clip's layout (tab-separated filepath/title), paths relative
    to `root`; 3 broken rows: a file that is not an image, a cut-off PNG, a missing file. Also an ImageFolder of
    the colours to score zero-shot."""
    images = root / "mydata" / "images"
    images.mkdir(parents=True)
    rows = []
    for i in range(45):
        name = list(COLOURS)[i % 3]
        _image(images / f"{i:05d}.png", COLOURS[name], i)
        rows.append(f"mydata/images/{i:05d}.png\ta {name} square")
    (images / "notes.png").write_text("not an image")
    cut = (images / "00000.png").read_bytes()
    (images / "cut.png").write_bytes(cut[:len(cut) // 2])
    rows += ["mydata/images/notes.png\ta note", "mydata/images/cut.png\ta cut file", "mydata/images/gone.png\tgone"]
    (root / "mydata" / "train.csv").write_text("filepath\ttitle\n" + "".join(r + "\n" for r in rows))
    for name, rgb in COLOURS.items():
        (root / "colours" / name).mkdir(parents=True)
        for j in range(4):
            _image(root / "colours" / name / f"{j}.png", rgb, 100 + j)


@pytest.mark.slow
def test_an_open_clip_csv_to_a_zero_shot_score_says_what_it_did(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _their_files(tmp_path)

    # mmcl shards reads the CSV as open_clip does: paths against the current directory, the rule said once
    assert main(["shards", "--input", "mydata/train.csv", "--out", "shards"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert (f"mmcl: image paths of mydata/train.csv: 47 relative to the current directory {tmp_path}, as open_clip "
            f"reads them; 1 found in neither (missing_file)") in said, said
    wrote = next(ln for ln in said if ln.startswith("mmcl: wrote "))
    assert wrote.startswith("mmcl: wrote 45 samples in 1 shards to shards; skipped 3 (decode=2, missing_file=1; each "
                            "in shards/skipped.jsonl; first: train.csv:47: decode (mydata/images/notes.png: "), wrote
    records = [json.loads(ln) for ln in (tmp_path / "shards" / "skipped.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["member"]) for r in records] == [("decode", "train.csv:47"), ("decode", "train.csv:48"),
                                                             ("missing_file", "train.csv:49")]
    assert records[0]["detail"].startswith("mydata/images/notes.png: ")
    assert records[1]["detail"].startswith("mydata/images/cut.png: ")
    assert records[2]["detail"] == f"no file mydata/images/gone.png (nor mydata/mydata/images/gone.png) relative " \
                                   f"to {tmp_path}"
    assert json.loads((tmp_path / "shards" / "sizes.json").read_text()) == {"shard-000000.tar": 45}

    # mmcl train by epochs, as open_clip's --epochs: the counts it promises are the files' and the run's
    assert main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "data.train=shards", "train.epochs=2",
                 "data.batch_size=8", "train.output_dir=runs/mine", "eval.zeroshot=colours", *TINY]) == 0
    out = capsys.readouterr()
    said = out.out.splitlines()
    assert "mmcl: runs/mine: a new run" in said
    assert "mmcl: train.epochs=2 of 45 samples (sizes.json): 12 steps of 8 samples (6 per epoch)" in said, said
    assert ("mmcl: warning: optim.warmup_steps=15 is longer than the run's 12 steps: the whole run is warm-up, its "
            "last step at lr 0.0008 of the peak optim.lr=0.001 (80 %); set optim.warmup_steps below 12") in said
    assert "mmcl: data.train: 'shards' (a folder: its shards): 1 shard(s) (shard-000000.tar), 45 samples" in said
    steps = [ln for ln in said if ln.startswith("mmcl: step ")]
    rows = metrics(tmp_path / "runs" / "mine")
    assert len(steps) == len(rows) and steps[-1].startswith("mmcl: step 12/12 (100%) | samples 96 | ")
    assert steps[-1].endswith("| skipped 0 samples, 0 shards") and rows[-1]["samples"] == 96
    finished = next(ln for ln in said if ln.startswith("mmcl: run finished: "))
    assert finished.startswith("mmcl: run finished: 12 steps, 96 samples")
    assert "skipped: 0 samples, 0 shards" in finished
    assert not (tmp_path / "runs" / "mine" / "skipped.jsonl").exists()  # the shards' skips stay with the shards
    acc = rows[-1]["eval/zeroshot_classification/colours/acc1"]

    # a re-run says it is finished, naming the key that sets its length
    assert main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "data.train=shards", "train.epochs=2",
                 "data.batch_size=8", "train.output_dir=runs/mine", "eval.zeroshot=colours", *TINY]) == 0
    assert "raise train.epochs to train on" in capsys.readouterr().out

    # mmcl zeroshot on the run: the same score as the run's final evaluation, in the file it names
    assert main(["zeroshot", "--model", "runs/mine", "--data", "colours", "--out", "zs.json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "zs.json").read_text())
    assert printed["metrics"] == saved["metrics"] and saved["n_samples"] == 12 and saved["n_classes"] == 3
    assert saved["metrics"]["acc1"] == pytest.approx(acc, abs=1e-6)
    assert re.fullmatch(r"\d+(\.\d+)?", str(saved["metrics"]["acc1"]))
