"""`mmcl curate`: each rule against hand-computed decisions, the whole command against a reference computed here
with the model's own encoders, members kept byte for byte, exact resume, refusal of other rules, and 2 processes
giving the output of 1."""

import hashlib
import importlib
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmcl import models
from mmcl.curation import REASONS, Rules, decide
from mmcl.curation import rules as rules_mod
from mmcl.curation.rules import KEPT, greedy_dedup, top_count
from mmcl.errors import ConfigError
from mmcl.storage import weights

from helpers import png

curate_mod = importlib.import_module("mmcl.curation.curate")  # the module (the package exports its function)


def coefficient_unit(rows):
    x = np.asarray(rows, dtype=np.float64)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _reasons(decision):
    return [None if r == KEPT else REASONS[r] for r in decision.reason.tolist()]


# ------------------------------------------------------------------------------------ the rules, by hand
def test_text_and_score_rules_by_hand():
    n = 6
    readable = np.array([True, True, True, True, True, False])
    caption_len = np.array([3, 10, 25, 12, 8, 0])
    score = np.array([0.30, 0.10, 0.25, 0.31, 0.05, np.nan], dtype=np.float32)
    images = coefficient_unit(np.eye(n, 4, k=0) + 0.01)
    rules = Rules(min_caption_len=5, max_caption_len=20, clip_score_min=0.08).check()
    d = decide(rules, readable, caption_len, score, images)
    # 0: 3 chars < 5; 2: 25 > 20; 4: 0.05 < 0.08; 5: no embedding
    assert _reasons(d) == ["caption_too_short", None, "caption_too_long", None, "clip_score_min", "unreadable"]
    # every rule counts the samples failing it, also those an earlier rule dropped (0 fails no score rule)
    assert d.fails == {"unreadable": 1, "caption_too_short": 1, "caption_too_long": 1, "clip_score_min": 1}


def test_top_fraction_is_exact_over_the_whole_set_with_ties_to_the_earlier_sample():
    # 5 readable samples: round(0.5 * 5) = 3 kept (half up), ranked 0.9 > 0.5 (index 1) = 0.5 (index 3) > ...
    readable = np.array([True, True, True, True, True, False])
    score = np.array([0.9, 0.5, 0.1, 0.5, 0.3, np.nan], dtype=np.float32)
    images = coefficient_unit(np.ones((6, 3)))
    d = decide(Rules(clip_score_top=0.5).check(), readable, np.full(6, 10), score, images)
    assert _reasons(d) == [None, None, "clip_score_top", None, "clip_score_top", "unreadable"]
    assert d.top_threshold == pytest.approx(0.5)
    d = decide(Rules(clip_score_top=0.4).check(), readable, np.full(6, 10), score, images)  # 2 of 5: tie cut
    assert _reasons(d) == [None, None, "clip_score_top", "clip_score_top", "clip_score_top", "unreadable"]
    # the fraction is of the whole readable set, not of what the text rules left
    d = decide(Rules(clip_score_top=0.4, min_caption_len=5).check(), readable, np.array([1, 10, 10, 10, 10, 0]),
               score, images)
    assert _reasons(d) == ["caption_too_short", None, "clip_score_top", "clip_score_top", "clip_score_top",
                           "unreadable"]
    assert [top_count(f, 10) for f in (0.05, 0.3, 0.25, 0.24, 1.0)] == [1, 3, 3, 2, 10]


def test_dedup_keeps_the_first_of_each_group_greedily(monkeypatch):
    # cos(a, b) = cos(b, c) = 0.8, cos(a, c) = 0.28: b is a duplicate of a; c is not (b was not kept)
    a = [1.0, 0.0, 0.0]
    b = [0.8, 0.6, 0.0]
    c = [0.28, 0.96, 0.0]
    d_ = [0.0, 0.0, 1.0]
    e = [1.0, 0.0, 0.0]  # an exact copy of a
    images = coefficient_unit([a, b, c, d_, e])
    keep, of, sim = greedy_dedup(images, 0.75)
    assert keep.tolist() == [True, False, True, True, False]
    assert of.tolist() == [-1, 0, -1, -1, 0]
    np.testing.assert_allclose(sim[[1, 4]], [0.8, 1.0], atol=1e-6)
    # through decide, after the other rules: with a dropped by its score, b is the first of its group, and
    # c (cos 0.8 with b) and e (a copy of a: cos 0.8 with b) are its duplicates
    d = decide(Rules(dedup=0.75, clip_score_min=0.0).check(), np.ones(5, bool), np.full(5, 9),
               np.array([-0.5, 0.2, 0.2, 0.2, 0.2], dtype=np.float32), images)
    assert _reasons(d) == ["clip_score_min", None, "duplicate", None, "duplicate"]
    assert d.other.tolist() == [-1, -1, 1, -1, 1]
    # the blocks of the scan do not change the answer
    rng = np.random.default_rng(0)
    many = coefficient_unit(rng.standard_normal((2500, 8)))
    many[1500] = many[3]
    reference = greedy_dedup(many, 0.9)
    monkeypatch.setattr(rules_mod, "_BLOCK", 7)
    small_blocks = greedy_dedup(many, 0.9)
    assert np.array_equal(reference[0], small_blocks[0]) and np.array_equal(reference[1], small_blocks[1])
    assert not reference[0][1500] and reference[1][1500] == 3


def test_decontamination_drops_matches_of_any_evaluation_image():
    images = coefficient_unit([[1, 0, 0], [0, 1, 0], [0.6, 0.8, 0], [0, 0, 1]])
    eval_images = coefficient_unit([[0, 0.1, 1], [0.62, 0.78, 0]])
    d = decide(Rules(decontaminate="x", decontaminate_threshold=0.99).check(), np.ones(4, bool), np.full(4, 9),
               np.zeros(4, np.float32), images, eval_images)
    cos_2 = float(images[2] @ eval_images[1])  # 0.9995
    cos_3 = float(images[3] @ eval_images[0])  # 0.995
    assert cos_2 >= 0.99 and cos_3 >= 0.99
    assert _reasons(d) == [None, None, "decontaminated", "decontaminated"]
    assert d.other.tolist() == [-1, -1, 1, 0]


def test_language_rule_by_hand_and_by_py3langid(setup, tmp_path):
    from mmcl.cli import main
    from mmcl.curation.rules import caption_languages

    languages = np.array(["en", "de", "en", "fr", ""])
    d = decide(Rules(language=("en", "fr")).check(), np.array([True, True, True, True, False]), np.full(5, 9),
               np.zeros(5, np.float32), coefficient_unit(np.ones((5, 2))), languages=languages)
    assert _reasons(d) == [None, "language", None, None, "unreadable"]
    assert caption_languages(["a dog runs in the park with a red ball",
                              "ein Hund läuft mit einem roten Ball im Park"]).tolist() == ["en", "de"]
    shard = tmp_path / "in" / "shard-000000.tar"
    shard.parent.mkdir()
    captions = ["a dog runs in the park with a red ball", "ein Hund läuft mit einem roten Ball im Park",
                "the cat is sleeping on the warm window sill", "le chat dort sur le rebord de la fenêtre"]
    _write_shard(shard, [(f"k{i}", {"png": png(i), "txt": c.encode()}) for i, c in enumerate(captions)])
    assert main(["curate", "--model", str(setup["model"]), "--data", str(shard), "--out", str(tmp_path / "out"),
                 "--no-progress", "--language", "en"]) == 0
    dropped = [json.loads(line) for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert [(d["key"], d["reason"], d["language"]) for d in dropped] == [("k1", "language", "de"),
                                                                        ("k3", "language", "fr")]


def test_bad_rules_are_one_line_errors():
    for rules, message in ((Rules(), "at least one rule"), (Rules(clip_score_top=0.0), "in (0, 1]"),
                           (Rules(dedup=1.5), "between -1 and 1"),
                           (Rules(min_caption_len=9, max_caption_len=3), "nothing would be kept"),
                           (Rules(language=("EN",)), "ISO 639-1")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            rules.check()


# ------------------------------------------------------------------------------------ the command


def _write_shard(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _members(path):
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def _tree_digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random model and 3 shards of 8 samples: exact duplicates across shards, short and long captions,
    one image that cannot be decoded, one sample with json metadata."""
    root = tmp_path_factory.mktemp("curate")
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    model_dir = weights.save_model_dir(models.create(cfg), cfg, models.preprocess_config(cfg), root / "model")
    words = ["a red circle", "two blue squares on grass", "x", "a photo of a small green triangle near a tree",
             "yellow", "the number seven written in black ink", "dog", "an orange star"]
    shards = []
    for s in range(3):
        samples = []
        for i in range(8):
            n = 8 * s + i
            image = png(n)
            if s == 2 and i in (1, 4):  # exact copies of shard 0's images 1 and 4, other captions
                image = png(i)
            members = {"png": image, "txt": f"{words[(n * 3) % 8]} {n}".encode()}
            if n == 13:
                members["png"] = b"not an image"
            if n == 5:
                members["json"] = json.dumps({"url": "http://example.com/5.jpg"}).encode()
            samples.append((f"s{s}-{i:03d}", members))
        path = root / "in" / f"shard-{s:06d}.tar"
        path.parent.mkdir(exist_ok=True)
        _write_shard(path, samples)
        shards.append(path)
    spec = str(root / "in" / "shard-{000000..000002}.tar")
    return {"root": root, "model": model_dir, "shards": shards, "spec": spec}


def _reference(setup):
    """Per sample in shard order: key, caption, readable, CLIP score and image embedding, computed here with
    the model's own preprocess, tokenizer and encoders (float64 cosines)."""
    model, preprocess, tokenizer = weights.load(setup["model"])
    rows = []
    for path in setup["shards"]:
        files = {}
        for name, data in _members(path):
            key, ext = name.split(".", 1)
            files.setdefault(key, {})[ext] = data
        for key, members in files.items():
            caption = members["txt"].decode().strip()
            try:
                image = Image.open(io.BytesIO(members["png"])).convert("RGB")
            except Exception:
                rows.append((key, caption, False, np.nan, None))
                continue
            with torch.no_grad():
                img = model.encode_image(preprocess(image)[None], normalize=True)[0].double().numpy()
                txt = model.encode_text(tokenizer([caption]), normalize=True)[0].double().numpy()
            rows.append((key, caption, True, float(img @ txt), img))
    return rows


def _reference_kept(rows, min_len, top, dedup):
    """The rules written out plainly over the reference rows: text, then exact top fraction, then greedy dedup."""
    readable = [r for r in rows if r[2]]
    k = int(np.floor(top * len(readable) + 0.5))
    ranked = sorted(range(len(rows)), key=lambda i: (-rows[i][3], i))
    top_set = set([i for i in ranked if rows[i][2]][:k])
    kept, reasons = [], []
    for i, (key, caption, ok, score, img) in enumerate(rows):
        if not ok:
            reasons.append("unreadable")
        elif len(caption) < min_len:
            reasons.append("caption_too_short")
        elif i not in top_set:
            reasons.append("clip_score_top")
        elif any(float(img @ rows[j][4]) >= dedup for j in kept):
            reasons.append("duplicate")
        else:
            reasons.append(None)
            kept.append(i)
    return reasons


ARGS = ["--min-caption-len", "5", "--clip-score-top", "0.75", "--dedup", "0.999"]


@pytest.fixture(scope="module")
def curated(setup):
    from mmcl.cli import main

    before = _tree_digest(setup["root"] / "in")
    out = setup["root"] / "out"
    assert main(["curate", "--model", str(setup["model"]), "--data", setup["spec"], "--out", str(out),
                 "--no-progress", "--batch-size", "5", *ARGS]) == 0
    assert _tree_digest(setup["root"] / "in") == before  # the input is never changed
    return out


def test_curate_matches_the_reference_decision(setup, curated):
    rows = _reference(setup)
    table = [np.load(curated / "embeddings" / f"{p.name}.npz") for p in setup["shards"]]
    scores = np.concatenate([t["score"] for t in table])
    ref_scores = np.array([r[3] for r in rows])
    np.testing.assert_allclose(scores, ref_scores, atol=2e-5)  # float32 features, nan where unreadable
    images = np.concatenate([t["image"] for t in table]).astype(np.float64)
    for got, r in zip(images, rows):
        if r[2]:
            np.testing.assert_allclose(got, r[4], atol=2e-3)  # stored as float16
    expected = _reference_kept(rows, 5, 0.75, 0.999)
    # the exact copies are duplicates, unless an earlier rule dropped them or their original
    assert expected.count("duplicate") >= 1 and expected.count("unreadable") == 1
    dropped = [json.loads(line) for line in (curated / "dropped.jsonl").read_text().splitlines()]
    assert {d["key"]: d["reason"] for d in dropped} == {r[0]: why for r, why in zip(rows, expected) if why}
    for d in dropped:
        if d["reason"] == "duplicate":
            assert d["duplicate_of"][3:] == d["key"][3:] and d["cosine"] >= 0.999
    report = json.loads((curated / "report.json").read_text())
    assert report["samples"] == 24 and report["kept"] == expected.count(None)
    assert {k: v for k, v in report["dropped"].items() if v} == {
        why: expected.count(why) for why in set(expected) if why}
    assert sum(report["clip_score"]["histogram"]["kept"]) + sum(report["clip_score"]["histogram"]["dropped"]) == 23
    assert report["examples"]["clip_score_top"]["kept_lowest"][0]["score"] >= report["clip_score"]["top_threshold"]
    assert (curated / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_kept_samples_keep_every_member_byte_for_byte(setup, curated):
    dropped = {json.loads(line)["key"] for line in (curated / "dropped.jsonl").read_text().splitlines()}
    for path in setup["shards"]:
        expected = [(n, d) for n, d in _members(path) if n.split(".", 1)[0] not in dropped]
        assert _members(curated / path.name) == expected
    # the output is shards mmcl reads as it reads the input
    from mmcl.data import expand_urls

    assert len(expand_urls(str(curated))) == 3


def test_a_killed_run_resumes_to_the_same_bytes(setup, curated, tmp_path, monkeypatch):
    from mmcl.cli import main

    out = tmp_path / "out"
    calls = {"embed": 0, "write": 0}
    real_embed = curate_mod._embed_shard

    def embed_then_die(*a, **k):
        calls["embed"] += 1
        if calls["embed"] == 3:
            raise KeyboardInterrupt  # killed while embedding the third shard
        return real_embed(*a, **k)

    real_add = curate_mod.add_tar_member

    def write_then_die(tar, name, data):
        calls["write"] += name.startswith("s1-")
        if calls["write"] == 3:
            raise KeyboardInterrupt  # killed in the middle of the second shard
        return real_add(tar, name, data)

    args = ["curate", "--model", str(setup["model"]), "--data", setup["spec"], "--out", str(out), "--no-progress",
            "--batch-size", "5", *ARGS]
    monkeypatch.setattr(curate_mod, "_embed_shard", embed_then_die)
    assert main(args) == 130
    assert sorted(p.name for p in (out / "embeddings").iterdir()) == [f"{p.name}.npz" for p in setup["shards"][:2]]
    monkeypatch.setattr(curate_mod, "_embed_shard", real_embed)
    monkeypatch.setattr(curate_mod, "add_tar_member", write_then_die)
    assert main(args) == 130
    assert [p.name for p in out.glob("*.tar")] == [setup["shards"][0].name]
    assert not list(out.rglob("*partial*"))
    (out / "notes.txt").write_text("mine")  # a file of the user's in the folder is kept
    embedded = []
    monkeypatch.setattr(curate_mod, "_embed_shard", lambda url, *a, **k: embedded.append(url))
    monkeypatch.setattr(curate_mod, "add_tar_member", real_add)
    assert main(args) == 0
    assert embedded == []  # every shard was embedded before
    got, want = _tree_digest(out), _tree_digest(curated)
    assert got.pop("notes.txt") and got.pop("curate.json") and want.pop("curate.json")
    assert got == want  # shards, embeddings, report, plot and dropped list: the same bytes


def test_another_rule_set_is_refused_in_one_line(setup, curated, capsys):
    from mmcl.cli import main

    before = _tree_digest(curated)
    assert main(["curate", "--model", str(setup["model"]), "--data", setup["spec"], "--out", str(curated),
                 "--no-progress", "--min-caption-len", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmcl: error:") and "other rules" in err and "\n" not in err, err
    assert _tree_digest(curated) == before
    assert main(["curate", "--model", str(setup["model"]), "--data", setup["spec"], "--out",
                 str(setup["root"] / "in"), "--dedup", "0.9"]) == 2  # into the input's own folder
    assert "folder of the input shards" in capsys.readouterr().err
    assert main(["curate", "--model", str(setup["model"]), "--data", setup["spec"], "--out",
                 str(setup["root"] / "x"), "--clip-score-top", "1.5"]) == 2
    assert "in (0, 1]" in capsys.readouterr().err
    users = setup["root"] / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")  # a folder curate did not make
    assert main(["curate", "--model", str(setup["model"]), "--data", setup["spec"], "--out", str(users),
                 "--dedup", "0.9"]) == 2
    assert "was not written by mmcl curate" in capsys.readouterr().err
    assert sorted(p.name for p in users.iterdir()) == ["notes.txt"]


def test_stored_embeddings_from_reinforce_are_used(setup, curated, tmp_path):
    from mmcl.cli import main
    from mmcl.curation.reinforce import reinforce

    reinforced = tmp_path / "reinforced"
    reinforce(str(setup["model"]), setup["spec"], str(reinforced), batch_size=5, progress=False)
    out = tmp_path / "out"
    assert main(["curate", "--model", str(setup["model"]), "--data", str(reinforced), "--out", str(out),
                 "--no-progress", *ARGS]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["from_stored_embeddings"] == 23  # every readable sample: no second forward
    reference = json.loads((curated / "report.json").read_text())
    assert report["kept"] == reference["kept"] and report["dropped"] == reference["dropped"]


def test_decontamination_against_an_image_folder(setup, tmp_path):
    from mmcl.cli import main

    folder = tmp_path / "eval" / "cls"
    folder.mkdir(parents=True)
    (folder / "a.png").write_bytes(png(2))  # shard 0's third image
    (folder / "b.png").write_bytes(png(999))
    out = tmp_path / "out"
    assert main(["curate", "--model", str(setup["model"]), "--data", setup["spec"], "--out", str(out),
                 "--no-progress", "--decontaminate", str(tmp_path / "eval"), "--decontaminate-threshold",
                 "0.999"]) == 0
    dropped = [json.loads(line) for line in (out / "dropped.jsonl").read_text().splitlines()]
    assert [(d["key"], d["reason"]) for d in dropped if d["reason"] != "unreadable"] == [
        ("s0-002", "decontaminated")]
    assert dropped[0]["matches"] == "cls/a.png" and dropped[0]["cosine"] >= 0.999


@pytest.mark.slow
def test_two_processes_write_what_one_writes(setup, curated, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out2"
    procs = []
    for rank in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(Path(curate_mod.__file__).parents[2]))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mmcl", "curate", "--model", str(setup["model"]), "--data", setup["spec"],
             "--out", str(out), "--no-progress", "--batch-size", "5", *ARGS],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    assert json.loads(results[0][0])["processes"] == 2
    got, want = _tree_digest(out), _tree_digest(curated)
    got.pop("curate.json"), want.pop("curate.json")
    assert got == want
