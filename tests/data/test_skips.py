"""What is skipped is named: skipped.jsonl of a training run (one and two processes), of `mmcl shards` and of
`mmcl curate`; `mmcl shards` keeps its sizes.json (train.epochs reads it) and says what a re-run replaces; curate's
deduplication drops byte-identical images whatever the threshold."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mmcl.cli import main
from mmcl.data.skips import REASONS, SkipLog, record

from helpers import ACCELERATE_LAUNCH, FOLDER_TOWERS, ROOT, encode, image_for, metrics, png, run_args, write_tar

ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _caption_folder(root: Path, n: int, corrupt=()) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        data = b"\xff\xd8 not a jpeg" if i in corrupt else encode(image_for(i, 16), "JPEG")
        (root / f"img{i:03d}.jpg").write_bytes(data)
        (root / f"img{i:03d}.txt").write_text(f"a picture number {i}")
    return root


# ------------------------------------------------------------------------------------------- mmcl shards
@pytest.mark.slow
def test_shards_keep_sizes_json_and_train_epochs_runs_on_them(tmp_path, capsys):
    out = tmp_path / "shards"
    assert main(["shards", "--input", str(_caption_folder(tmp_path / "in", 12)), "--out", str(out),
                 "--shard-size", "5"]) == 0
    sizes = json.loads((out / "sizes.json").read_text())
    assert sizes == {"shard-000000.tar": 5, "shard-000001.tar": 5, "shard-000002.tar": 2}
    assert "sizes.json" in json.loads((out / "mmcl-manifest.json").read_text())["files"]
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "mmcl", "train",
                        *run_args(out, run, "train.epochs=2", "data.batch_size=4", "data.workers=0",
                                  "train.save_every=0", "train.log_every=1", towers=FOLDER_TOWERS)],
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert metrics(run)[-1]["step"] == 6  # 2 epochs of 12 samples, 4 a step


def test_a_rerun_says_what_it_replaces(tmp_path, capsys):
    out = tmp_path / "shards"
    assert main(["shards", "--input", str(_caption_folder(tmp_path / "big", 30)), "--out", str(out),
                 "--shard-size", "10"]) == 0
    assert "replaced" not in capsys.readouterr().out
    assert main(["shards", "--input", str(_caption_folder(tmp_path / "small", 6)), "--out", str(out),
                 "--shard-size", "10"]) == 0
    said = capsys.readouterr().out
    assert f"replaced the earlier conversion in {out}: 3 shards, 30 samples -> 1 shards, 6 samples" in said, said
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000000.tar"]


def test_shards_name_every_skipped_file_in_skipped_jsonl(tmp_path, capsys):
    src = _caption_folder(tmp_path / "in", 10, corrupt=(2, 7))
    table = tmp_path / "in.csv"
    table.write_text("image,caption\n" + "".join(f"{src}/img{i:03d}.jpg,cap {i}\n" for i in range(10))
                     + f"{src}/gone.jpg,no file\n")
    out = tmp_path / "shards"
    assert main(["shards", "--input", str(table), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"skipped 3 (decode=2, missing_file=1; each in {out / 'skipped.jsonl'}; first: in.csv:4: decode" in said
    recs = _records(out / "skipped.jsonl")
    assert [(r["reason"], r["member"]) for r in recs] == [("decode", "in.csv:4"), ("decode", "in.csv:9"),
                                                          ("missing_file", "in.csv:12")]
    assert all(r["source"] == str(table) for r in recs)
    assert "skipped.jsonl" in json.loads((out / "mmcl-manifest.json").read_text())["files"]
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000000.tar"]  # never taken for a shard
    # a conversion with nothing skipped leaves no skip log of an earlier one
    assert main(["shards", "--input", str(_caption_folder(tmp_path / "clean", 4)), "--out", str(out)]) == 0
    assert not (out / "skipped.jsonl").exists()


# ------------------------------------------------------------------------------------------ the skip log
def test_the_skip_log_is_bounded_and_counts_what_it_leaves_out(tmp_path):
    log = SkipLog(tmp_path / "skipped.jsonl", max_bytes=300)
    for i in range(20):
        log.write(record("decode" if i % 2 else "bad_caption", "shard.tar", f"k{i}"))
    log.close()
    recs = _records(tmp_path / "skipped.jsonl")
    assert recs[-1]["reason"] == "left_out"
    assert recs[-1]["count"] == 20 - (len(recs) - 1) and sum(recs[-1]["reasons"].values()) == recs[-1]["count"]
    with pytest.raises(ValueError):
        record("not_a_reason", "x")
    assert {"decode", "truncated_tar", "shard_open", "missing_file", "left_out"} <= set(REASONS)


# ------------------------------------------------------------------------------------------ training runs
def _jpeg_shards(root: Path, n_shards: int, good: int, bad: int, truncate_last: bool) -> Path:
    root.mkdir()
    jpeg = encode(image_for(99, 32), "JPEG")
    for s in range(n_shards):
        members = []
        for i in range(good):
            members += [(f"s{s}g{i:02d}.png", encode(image_for(100 * s + i), "PNG")),
                        (f"s{s}g{i:02d}.txt", f"caption {s} {i}".encode())]
        for i in range(bad):  # cut-off JPEGs
            members += [(f"s{s}bad{i:02d}.jpg", jpeg[:len(jpeg) // 3]), (f"s{s}bad{i:02d}.txt", b"broken")]
        path = root / f"shard-{s}.tar"
        write_tar(path, members)
        if truncate_last and s == n_shards - 1:
            with tarfile.open(path) as tar:
                cut = [m for m in tar.getmembers() if m.name.endswith(".png")][good - 1].offset_data + 10
            with open(path, "r+b") as f:
                f.truncate(cut)
    return root


@pytest.mark.slow
def test_a_run_names_each_skip_in_skipped_jsonl_and_counts_them_by_reason(tmp_path):
    shards = _jpeg_shards(tmp_path / "shards", 2, good=6, bad=5, truncate_last=True)
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "mmcl", "train",
                        *run_args(f"{shards}/*.tar", run, "train.steps=4", "data.batch_size=4", "data.workers=1",
                                  "data.shuffle_buffer=4", "train.save_every=0", towers=FOLDER_TOWERS)],
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = _records(run / "skipped.jsonl")
    last = metrics(run)[-1]
    decode = [r for r in recs if r["reason"] == "decode"]
    shard = [r for r in recs if r["reason"] == "truncated_tar"]
    assert len(decode) == last["data/skipped_samples"] and len(shard) == last["data/skipped_shards"] >= 1
    assert {r["key"] for r in decode} <= {f"s{s}bad{i:02d}" for s in range(2) for i in range(5)}
    assert all(r["member"] == r["key"] + ".jpg" and r["source"].endswith(".tar") for r in decode)
    assert shard[0]["source"] == str(shards / "shard-1.tar") and shard[0]["key"] is None
    counts = f"decode={len(decode)}, truncated_tar={len(shard)}"
    log = (run / "out.log").read_text()
    assert f"skipped by reason: {counts} (each in {run / 'skipped.jsonl'}; first: " in log, log
    assert f"skipped by reason: {counts}" in p.stdout
    # as it happens: one warning for the reason (not one per sample), and the step lines count the skips
    said = [ln for ln in p.stderr.splitlines() if "samples are being skipped" in ln]
    assert said == [f"mmcl: warning: samples are being skipped: decode (an image cannot be decoded); each is counted "
                    f"in data/skipped_samples and named in {run / 'skipped.jsonl'}"], p.stderr
    steps = [ln for ln in p.stdout.splitlines() if ln.startswith("mmcl: step 4/4")]
    assert steps and steps[0].endswith(f"| skipped {len(decode)} samples, {len(shard)} shards"), p.stdout


def test_a_training_skip_log_warns_once_per_sample_reason(tmp_path, recwarn):
    log = SkipLog(tmp_path / "skipped.jsonl", warn=True)
    for reason in ("decode", "decode", "truncated_tar", "missing_caption", "decode", "shard_open"):
        log.write(record(reason, "s.tar", "k"))
    log.close()
    assert [str(w.message) for w in recwarn] == [
        f"samples are being skipped: decode (an image cannot be decoded); each is counted in data/skipped_samples "
        f"and named in {tmp_path / 'skipped.jsonl'}",
        f"samples are being skipped: missing_caption (a sample has no caption member (data.caption_key)); each is "
        f"counted in data/skipped_samples and named in {tmp_path / 'skipped.jsonl'}"]
    assert len(_records(tmp_path / "skipped.jsonl")) == 6
    quiet = SkipLog(tmp_path / "q.jsonl")  # mmcl shards and curate report their skips themselves
    quiet.write(record("decode", "s.tar", "k"))
    quiet.close()
    assert len(recwarn) == 2


@pytest.mark.slow
def test_two_processes_append_whole_lines(tmp_path):
    shards = _jpeg_shards(tmp_path / "shards", 4, good=8, bad=12, truncate_last=False)
    run = tmp_path / "run"
    cmd = [*ACCELERATE_LAUNCH, "--config_file",
           str(ROOT / "launch" / "cpu-2proc.yaml"), "-m", "mmcl", "train",
           *run_args(f"{shards}/*.tar", run, "train.steps=6", "data.batch_size=4", "data.workers=1",
                     "data.shuffle_buffer=8", "train.save_every=0", "train.log_every=2", towers=FOLDER_TOWERS)]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = _records(run / "skipped.jsonl")  # every line parses: no two records interleave
    ranks = {int(r["key"][1]) % 2 for r in recs}  # with 4 shards, rank r reads shards r and r + 2
    assert ranks == {0, 1} and len(recs) == metrics(run)[-1]["data/skipped_samples"]


# ------------------------------------------------------------------------------------------------- curate


@pytest.mark.slow
def test_curate_drops_every_byte_identical_copy_and_names_unreadable_samples(tmp_path):
    import torch

    from mmcl import models
    from mmcl.storage import weights

    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    model = weights.save_model_dir(models.create(cfg), cfg, models.preprocess_config(cfg), tmp_path / "model")
    n, copies = 200, 40
    samples = [(f"k{i:04d}", png(i), f"caption {i}") for i in range(n)]
    samples += [(f"copy{i:03d}", png(i * 5), f"another caption {i}") for i in range(copies)]
    samples.append(("broken", b"not an image", "x"))
    (tmp_path / "in").mkdir()
    for s in range(4):  # the copies land in other shards and other batches than their originals
        write_tar(tmp_path / "in" / f"shard-{s}.tar",
                  [m for key, img, cap in samples[s::4] for m in ((f"{key}.png", img), (f"{key}.txt", cap.encode()))])
    for threshold in ("0.9999", "0.9", "0.5"):
        out = tmp_path / f"out{threshold}"
        assert main(["curate", "--model", str(model), "--data", str(tmp_path / "in" / "shard-{0..3}.tar"),
                     "--out", str(out), "--no-progress", "--batch-size", "7", "--dedup", threshold]) == 0
        kept = {}
        for s in range(4):
            with tarfile.open(out / f"shard-{s}.tar") as tar:
                kept.update({m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".png")})
        identical_kept = len(kept) - len(set(kept.values()))
        assert identical_kept == 0, threshold  # no two kept images are the same bytes
        dropped = {d["key"]: d for d in map(json.loads, (out / "dropped.jsonl").read_text().splitlines())}
        for i in range(copies):
            d = dropped[f"copy{i:03d}"]
            assert d["reason"] == "duplicate" and d["duplicate_of"] + ".png" in kept, d
    assert _records(out / "skipped.jsonl") == [
        {"reason": "decode", "source": str(tmp_path / "in" / "shard-0.tar"), "key": "broken", "member": None,
         "detail": ""}]
