"""Files from elsewhere: every sample's work and memory are bounded, and every malformed input is one line.

Captions are cut before they are tokenized (ordinary captions keep their ids), JSON members nested too deeply
are bad samples, lists that expand (braces, YAML aliases, globs) are refused past a bound, and a malformed
sizes.json, table or templates file, or a control character in a name, gives one escaped ``mmcl: error:`` line.
"""

import json
import time
import warnings
from pathlib import Path

import pytest
import torch

from mmcl.cli import _WarningLines, main
from mmcl.data import limits
from mmcl.data.decode import SampleKeys, SkipSample, parse_sample, stored_teacher_features
from mmcl.data.sizes import shard_samples
from mmcl.data.sources import expand_urls, missing_shards
from mmcl.errors import DataError, printable
from mmcl.evaluation.evaluate import load_templates
from mmcl.models import build_tokenizer

from helpers import encode, image_for, write_tar

ROOT = Path(__file__).resolve().parents[2]
DEEP = b"[" * 400_000 + b"]" * 400_000  # 800 KB of nesting: deeper than any JSON parser recurses
ORDINARY = [
    "a photo of a dog",
    "A red double-decker bus drives past Big Ben in London on a rainy afternoon, 2019.",
    "Donaudampfschifffahrtsgesellschaftskapitän steht am Ufer &amp; winkt",
    "see https://example.com/images/products/2019/summer-collection/item-12345.jpg for details",
    " ".join(f"word{i}" for i in range(120)),  # past the context: cut by the context, not the bound
    "日本の桜 🌸 and émigré café — “quoted” text\twith\ttabs\nand lines",
]


def error_lines(capsys):
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text, text
    return [ln for ln in text.splitlines() if ln.startswith("mmcl: error:")]


# ------------------------------------------------------------------------------------------------ captions
def test_ordinary_captions_keep_open_clips_token_ids():
    import open_clip

    ours = build_tokenizer({"text_cfg": {"context_length": 77}})
    assert torch.equal(ours(ORDINARY), open_clip.get_tokenizer("ViT-B-32")(ORDINARY))
    assert ours.cut == 0


def test_ordinary_captions_keep_a_hugging_face_tokenizers_ids(tokenizer_dir):
    from open_clip.tokenizer import HFTokenizer

    ours = build_tokenizer({"text_cfg": {"hf_tokenizer_name": str(tokenizer_dir), "context_length": 64}})
    assert torch.equal(ours(ORDINARY), HFTokenizer(str(tokenizer_dir), context_length=64)(ORDINARY))


@pytest.mark.parametrize("caption", [
    " ".join(["x" * 65_536] * 4),  # four 65k-letter words: minutes of byte-pair merges if tokenized whole
    "!" * 200_000,  # one run of punctuation is one word too
    "a photo of " * 600_000,  # 6.6 MB of ordinary words
    " " * 1_000_000 + "y" * 100_000,
])
def test_a_caption_costs_its_bound_to_tokenize(caption):
    tokenizer = build_tokenizer({"text_cfg": {"context_length": 77}})
    start = time.perf_counter()
    with pytest.warns(UserWarning, match="cut to that before tokenizing"):
        tokens = tokenizer([caption, "a dog"])
    assert time.perf_counter() - start < 0.5
    assert tokens.shape == (2, 77) and tokenizer.cut == 1
    assert torch.equal(tokens[1], tokenizer(["a dog"])[0])


def test_bound_text_cuts_characters_and_words_only_where_over():
    assert limits.bound_text("a b  c\n d") == "a b  c\n d"
    cut = limits.bound_text(("w" * 500 + " ") * 100)
    assert len(cut) <= limits.MAX_TEXT_CHARS
    assert max(len(w) for w in cut.split()) == limits.MAX_WORD_CHARS


# ------------------------------------------------------------------------------------------- deep JSON
def _sample(**members):
    return {"png": encode(image_for(0), "PNG"), **members}


def test_a_deeply_nested_json_caption_is_a_bad_sample():
    keys = SampleKeys(caption_keys="json:caption")
    with pytest.raises(SkipSample) as skip:
        parse_sample(_sample(json=DEEP), keys=keys)
    assert skip.value.reason == "bad_caption"


def test_deeply_nested_teacher_members_are_no_teacher_features():
    import io

    import numpy as np

    def npy(a):
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    files = _sample(txt=b"a dog", **{"teacher_image.npy": npy(np.zeros(4, np.float16)),
                                     "teacher_text.npy": npy(np.zeros((1, 4), np.float16)), "teacher.json": DEEP})
    with pytest.raises(SkipSample) as skip:
        stored_teacher_features(files, "a dog")
    assert skip.value.reason == "no_teacher_features"

    from mmcl.curation.curate import _stored

    assert _stored(files, None, "teacher") is None  # curate: embedded afresh, not read from the members


def test_a_deeply_nested_json_member_gives_an_index_no_source_url():
    from mmcl.evaluation.index import _sample_url

    assert _sample_url(_sample(json=DEEP)) is None
    assert _sample_url(_sample(json=b'{"url": "http://x/y.jpg"}')) == "http://x/y.jpg"


def test_shards_counts_a_deeply_nested_metadata_row(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(encode(image_for(1), "PNG"))
    table = tmp_path / "t.jsonl"
    table.write_text(json.dumps({"image": "a.png", "caption": "a dog"}) + "\n" + DEEP.decode() + "\n")
    assert main(["shards", "--input", str(table), "--out", str(tmp_path / "out")]) == 0
    skipped = [json.loads(ln) for ln in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert [s["reason"] for s in skipped] == ["bad_row"]
    assert json.loads((tmp_path / "out" / "sizes.json").read_text()) == {"shard-000000.tar": 1}


# ------------------------------------------------------------------------------------------ long lists
def _aliases_yaml(path: Path, levels: int = 9) -> Path:
    """A shard list of a few hundred bytes whose aliases repeat a list to 10**levels entries."""
    doc = "- &l0 [x.tar, x.tar, x.tar, x.tar, x.tar, x.tar, x.tar, x.tar, x.tar, x.tar]\n"
    for i in range(1, levels):
        doc += f"- &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]\n"
    path.write_text(doc)
    return path


@pytest.mark.parametrize("spec", [
    "shards/s-{0..999999999}.tar",  # braceexpand would hold the range whole
    "shards/{a,b}/s-{0000..9999}-{000..999}.tar",
    "pipe:cat s-{0..999999999}.tar",
    "{a,b}" * 40,
    "{" * 10_000 + "x" + "}" * 10_000,
    "aliases",
])
def test_a_spec_that_expands_too_far_is_one_error(tmp_path, spec):
    if spec == "aliases":
        spec = str(_aliases_yaml(tmp_path / "list.yaml"))
    start = time.perf_counter()
    with pytest.raises(DataError, match="more than 1,000,000 entries|nested more than"):
        expand_urls(spec)
    assert len(missing_shards(spec)) == (0 if spec.startswith("pipe:") else 1)  # preflight checks local paths
    assert time.perf_counter() - start < 10


def test_a_glob_or_folder_that_lists_too_many_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "MAX_LIST_ENTRIES", 5)
    for i in range(8):
        write_tar(tmp_path / f"s-{i}.tar", [])
    with pytest.raises(DataError, match="more than 5 entries"):
        expand_urls(str(tmp_path / "s-*.tar"))
    with pytest.raises(DataError, match="more than 5 entries"):
        expand_urls(str(tmp_path))
    assert len(expand_urls(str(tmp_path / "s-{0..4}.tar"))) == 5


def test_train_refuses_an_expanding_shard_list_in_one_line(tmp_path, capsys):
    spec = _aliases_yaml(tmp_path / "list.yaml")
    argv = ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={spec}",
            f"train.output_dir={tmp_path / 'run'}"]
    start = time.perf_counter()
    assert main(argv) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "list.yaml" in lines[0] and "1,000,000" in lines[0], lines
    assert time.perf_counter() - start < 30


# ------------------------------------------------------------------------------------- malformed files
@pytest.mark.parametrize("count", ["many", -5, 1e999, [3], {"n": 1}, 10 ** 30, True, 2.5, None])
def test_a_malformed_sizes_json_count_is_one_error_naming_the_file(tmp_path, count):
    write_tar(tmp_path / "shard-0.tar", [])
    (tmp_path / "sizes.json").write_text(json.dumps({"shard-0.tar": count}))
    with pytest.raises(DataError, match=r"sizes\.json: the sample count of shard-0\.tar must be a whole number"):
        shard_samples(str(tmp_path / "shard-0.tar"))


def test_sizes_json_counts_open_clip_reads_still_count(tmp_path):
    for i in range(2):
        write_tar(tmp_path / f"shard-{i}.tar", [])
    (tmp_path / "sizes.json").write_text(json.dumps({"shard-0.tar": 3, "shard-1.tar": "4"}))
    assert shard_samples(str(tmp_path / "shard-{0..1}.tar"))[0] == 7
    (tmp_path / "sizes.json").write_bytes(DEEP)
    with pytest.raises(DataError, match="sizes.json"):
        shard_samples(str(tmp_path / "shard-{0..1}.tar"))


def test_a_csv_field_over_the_csv_limit_is_one_error_naming_the_file(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(encode(image_for(1), "PNG"))
    table = tmp_path / "x.csv"
    table.write_text("image,caption\na.png,a dog\na.png," + "w" * 200_000 + "\n")
    assert main(["shards", "--input", str(table), "--out", str(tmp_path / "out")]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "x.csv" in lines[0] and "line 3" in lines[0], lines


@pytest.mark.parametrize("template", ["a photo of {0}.", "a {name}.", "a {} of {1}.", "a {} {name}", "a {}} x",
                                      "a {{}} x", "a {!r}", "{0.__class__}"])
def test_a_template_with_another_field_is_one_error_naming_the_file(tmp_path, template):
    path = tmp_path / "templates.txt"
    path.write_text(f"a photo of a {{}}.\n{template}\n")
    with pytest.raises(DataError, match="templates.txt: every template needs"):
        load_templates(str(path))


def test_ordinary_templates_load():
    assert load_templates(["a photo of a {c}.", "a {} with {{braces}}"]) == ["a photo of a {}.",
                                                                             "a {} with {{braces}}"]


# ----------------------------------------------------------------------------------- control characters
NASTY = "k\x1b[31mred\r\x07\nx\u202e\x9b"


def test_printable_escapes_control_characters_and_keeps_the_rest():
    assert printable(NASTY) == "k\\x1b[31mred\\r\\x07\\nx\\u202e\\x9b"
    assert printable("émigré 日本 🌸 a/b.tar") == "émigré 日本 🌸 a/b.tar"


def test_an_error_line_shows_a_name_from_elsewhere_escaped(tmp_path, capsys):
    missing = tmp_path / f"{NASTY}.tar"
    assert main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={missing}",
                 f"train.output_dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert not any(c in text for c in "\x1b\r\x07\u202e\x9b"), repr(text)
    lines = [ln for ln in text.splitlines() if ln.startswith("mmcl: error:")]
    assert len(lines) == 1 and "k\\x1b[31mred\\r\\x07\\nx" in lines[0], lines


def test_a_warning_shows_a_name_from_elsewhere_escaped(capsys):
    import mmcl.data.sources as sources

    show = _WarningLines(warnings.showwarning)
    show(UserWarning(f"caption {NASTY}"), UserWarning, sources.__file__, 1)
    err = capsys.readouterr().err
    assert err.startswith("mmcl: warning: caption k\\x1b[31mred\\r\\x07 x\\u202e\\x9b")  # a line break: a space
    assert "\x1b" not in err and err.count("\n") == 1


@pytest.mark.parametrize("text,says", [
    # nine levels of nine aliases: 9^9 (387 million) values once OmegaConf copies each alias out
    ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")) + "model: {name: tiny}\n",
     "YAML aliases expand to"),
    ("data:\n  train: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
])
def test_a_config_file_that_expands_or_nests_without_end_is_one_line(tmp_path, capsys, text, says):
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    start = time.perf_counter()
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mmcl: error: {path}: ") and says in err and "\n" not in err, err
    assert time.perf_counter() - start < 10
