"""Negative captions that come with the data (``data.negatives``): read from a sample's ``neg.txt`` (one a line) and
its JSON ``negatives`` list, bounded, drawn per epoch, and batched as the real ones' tokens with the (B, K) mask."""

import json

import pytest
import torch

from mmcl import data
from mmcl.config import load_config, validate
from mmcl.data.decode import SkipSample, parse_negatives
from mmcl.data.limits import MAX_NEGATIVE_CANDIDATES
from mmcl.errors import ConfigError

from helpers import PREPROCESS, cfg_for, encode, image_for, tokenizer, write_tar


def test_negatives_come_from_neg_txt_then_the_json_list():
    files = {"neg.txt": b"a blue dog\n\n  a   red\tcat \n",
             "json": json.dumps({"negatives": ["x y", " ", "z"]}).encode()}
    assert parse_negatives(files, 10) == ["a blue dog", "a red cat", "x y", "z"]
    assert parse_negatives({"json": b'{"negatives": "one"}'}, 4) == ["one"]
    assert parse_negatives({"json": b'{"caption": "c"}'}, 4) == []
    assert parse_negatives({}, 4) == []


def test_more_negatives_than_the_limit_are_drawn_in_order_by_the_seed():
    files = {"neg.txt": "\n".join(f"n{i}" for i in range(20)).encode()}
    a, b, c = (parse_negatives(files, 5, draw) for draw in (1, 1, 2))
    assert a == b and a != c and len(a) == 5 and len(set(a)) == 5
    assert a == sorted(a, key=lambda t: int(t[1:]))  # the file's order kept
    many = {"neg.txt": "\n".join(f"n{i}" for i in range(MAX_NEGATIVE_CANDIDATES + 50)).encode()}
    drawn = parse_negatives(many, 64, 0)
    assert len(drawn) == 64 and max(int(t[1:]) for t in drawn) < MAX_NEGATIVE_CANDIDATES


@pytest.mark.parametrize("files,match", [
    ({"neg.txt": b"\xff\xfe bad"}, "neg.txt is not UTF-8"),
    ({"json": b"{not json"}, "json is not UTF-8 JSON"),
    ({"json": b'{"negatives": [1, 2]}'}, "negatives holds list, not text"),
])
def test_unreadable_negatives_skip_the_sample_as_a_bad_caption(files, match):
    with pytest.raises(SkipSample, match=match) as err:
        parse_negatives(files, 3)
    assert err.value.reason == "bad_caption"


def _shard(path):
    samples = {  # key: (neg.txt, json negatives)
        "s0": ("blue dog\nred cat\ngreen bird", None),
        "s1": (None, ["a cat on a dog"]),
        "s2": (None, None),
        "s3": ("one", ["two"]),
    }
    members = []
    for i, (key, (neg, listed)) in enumerate(samples.items()):
        members += [(f"{key}.png", encode(image_for(i), "PNG")), (f"{key}.txt", f"caption {key}".encode())]
        if neg is not None:
            members.append((f"{key}.neg.txt", neg.encode()))
        if listed is not None:
            members.append((f"{key}.json", json.dumps({"negatives": listed}).encode()))
    members.append(("s4.png", encode(image_for(9), "PNG")))
    members += [("s4.txt", b"caption s4"), ("s4.neg.txt", b"\xff bad")]
    write_tar(path, members)
    return {"s0": ["blue dog", "red cat", "green bird"], "s1": ["a cat on a dog"], "s2": [], "s3": ["one", "two"]}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_carries_each_samples_negatives_and_their_mask(tmp_path, workers):
    expected = _shard(tmp_path / "neg.tar")
    cfg = cfg_for(str(tmp_path / "neg.tar"), batch_size=4, workers=workers, negatives=2, shuffle_buffer=1)
    stream = data.build_train_stream(cfg, PREPROCESS, tokenizer, seed=0)
    it = iter(stream)
    batch = next(it)
    next(it)  # past s4
    if hasattr(it, "close"):
        it.close()
    assert batch["negatives_valid"].shape == (4, 2) and batch["negatives_valid"].dtype == torch.bool
    rows = iter(batch["negatives"])
    for key, valid in zip(batch["key"], batch["negatives_valid"]):
        want = expected[key]
        assert valid.tolist() == [i < min(2, len(want)) for i in range(2)], key
        got = [next(rows) for _ in range(int(valid.sum()))]
        if len(want) <= 2:
            assert [torch.equal(g, t) for g, t in zip(got, tokenizer(want))] == [True] * len(want), key
        else:  # two of the three, drawn, in order
            texts = [bytes(t[t != 0].tolist()).decode() for t in got]
            assert set(texts) <= set(want) and len(set(texts)) == 2
    assert next(rows, None) is None
    assert batch["negatives"].shape[1] == batch["text"].shape[1]
    assert stream.skipped["bad_caption"] == 1  # s4's neg.txt is not UTF-8


def test_without_data_negatives_the_members_are_not_read_and_batches_have_none(tmp_path):
    _shard(tmp_path / "neg.tar")
    stream = data.build_train_stream(cfg_for(str(tmp_path / "neg.tar"), batch_size=5, workers=0), PREPROCESS,
                                     tokenizer, seed=0)
    batch = next(iter(stream))
    assert "negatives" not in batch and "negatives_valid" not in batch
    assert stream.skipped["bad_caption"] == 0


def test_the_negatives_count_is_checked():
    with pytest.raises(ConfigError, match=r"data.negatives must be >= 0 \(got -1\)"):
        load_config(None, ["data.negatives=-1"])
    with pytest.raises(ConfigError, match="only loss.clip and loss.siglip score"):
        load_config(None, ["data.negatives=2", "loss.clip=0", "loss.supcon=1"])
    assert not [p for p in validate(load_config(None, ["data.negatives=2"])) if "negatives" in p]
    with pytest.raises(ConfigError, match=r"data.negatives must be in \[0, 64\]"):
        data.build_train_stream(cfg_for("x.tar", negatives=65), PREPROCESS, tokenizer, seed=0)


def _table(tmp_path, rows, header="image,caption,neg"):
    (tmp_path / "img").mkdir(exist_ok=True)
    lines = [header]
    for i, (caption, neg) in enumerate(rows):
        image_for(i, 16).save(tmp_path / "img" / f"{i}.png")
        lines.append(f'img/{i}.png,{caption},"{neg}"')
    path = tmp_path / "table.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mmcl_shards_writes_a_tables_negatives_column_into_each_samples_json(tmp_path, capsys):
    from mmcl.cli import main

    table = _table(tmp_path, [("a red cube", "a blue cube\na red ball"), ("a dog", ""),
                              ("a cat", '[""a cat dog""]'), ("bad", '[1, 2]')])
    assert main(["shards", "--input", str(table), "--out", str(tmp_path / "out"), "--negatives-col", "neg"]) == 0
    negatives = {}
    stream = data.build_train_stream(cfg_for(str(tmp_path / "out" / "*.tar"), batch_size=3, workers=0, negatives=4,
                                             shuffle_buffer=1), PREPROCESS, tokenizer, seed=0)
    batch = next(iter(stream))
    rows = iter(batch["negatives"])
    for text, valid in zip(batch["text"], batch["negatives_valid"]):
        caption = bytes(text[text != 0].tolist()).decode()
        negatives[caption] = [bytes(t[t != 0].tolist()).decode() for t in (next(rows) for _ in range(valid.sum()))]
    assert negatives == {"a red cube": ["a blue cube", "a red ball"], "a dog": [], "a cat": ["a cat dog"]}
    assert "bad_caption" in capsys.readouterr().out + (tmp_path / "out" / "skipped.jsonl").read_text()


def test_mmcl_shards_names_a_missing_negatives_column_in_one_line(tmp_path, capsys):
    from mmcl.cli import main

    table = _table(tmp_path, [("a red cube", "x")], header="image,caption,other")
    assert main(["shards", "--input", str(table), "--out", str(tmp_path / "out"), "--negatives-col", "neg"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmcl: error:") and "no column 'neg' for --negatives-col" in err[0]
