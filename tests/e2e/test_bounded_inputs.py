"""Files from elsewhere: every sample's work and memory are bounded, and every malformed input is one line.

Captions are cut before they are tokenized (ordinary captions keep their ids), JSON members nested too deeply
are bad samples, lists that expand (braces, YAML aliases, globs) are refused past a bound, and a malformed
sizes.json, table or templates file, or a control character in a name, gives one escaped ``mmcl: error:`` line.
"""

import io
import json
import os
import subprocess
import sys
import tarfile
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
    from mmcl.evaluation.embed import _sample_url

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
    undecodable = os.fsdecode(b"shard-\xff\xfe.tar")  # as Python names a file that is not UTF-8
    assert printable(undecodable) == "shard-\\udcff\\udcfe.tar"
    printable(undecodable).encode("utf-8")  # every stream can write it
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



# ----------------------------------------------------------------------------- names that are not UTF-8
BAD_KEY = os.fsdecode(b"k\xff\xfe") + "\x1b[31m\r"  # a tar member's key: undecodable bytes and controls


def _bad_name_shards(small_demo, folder: Path) -> Path:
    """The demo's two training shards in `folder`, one under a file name that is not UTF-8, the other with two
    samples under a key that is not UTF-8 (one of them with a damaged image: skipped, so named at the end)."""
    folder.mkdir()
    first, second = sorted(Path(small_demo["train"].split("{")[0]).parent.glob("shard-*.tar"))
    (folder / os.fsdecode(b"shard-\xff\xfe.tar")).write_bytes(first.read_bytes())
    with tarfile.open(second) as src, tarfile.open(folder / "shard-000001.tar", "w", format=tarfile.GNU_FORMAT,
                                                   encoding="utf-8", errors="surrogateescape") as out:
        members = src.getmembers()
        renamed = sorted({m.name.split(".")[0] for m in members})[:2]
        for m in members:
            body = src.extractfile(m).read()
            stem, ext = m.name.split(".", 1)
            if stem in renamed:
                m.name = f"{BAD_KEY}{renamed.index(stem)}.{ext}"
                if renamed.index(stem) == 1 and ext in ("jpg", "png"):
                    body = b"not an image"
                    m.size = len(body)
            out.addfile(m, io.BytesIO(body))
    return folder


@pytest.mark.slow
def test_a_run_on_names_that_are_not_utf8_ends_and_shows_them_escaped(small_demo, tmp_path):
    """Training on a shard whose file name is not UTF-8 and on samples whose keys are not: every step runs, the
    skipped sample is named escaped in the end-of-run summary, out.log holds the same escaped lines, rc 0."""
    from helpers import short_run

    shards = _bad_name_shards(small_demo, tmp_path / "shards")
    run = tmp_path / "run"
    args = short_run(small_demo, run, f"data.train={shards}", "train.steps=8", "train.save_every=0")
    done = subprocess.run([sys.executable, "-m", "mmcl", *args], capture_output=True, timeout=300,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    out, err = done.stdout.decode("utf-8"), done.stderr.decode("utf-8")  # strict: only valid UTF-8 was written
    assert done.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "shard-\\udcff\\udcfe.tar" in out
    assert "k\\udcff\\udcfe\\x1b[31m\\r1" in out and "skipped: 1 samples" in out, out
    assert not any(c in out + err for c in "\x1b\r")
    log = (run / "out.log").read_bytes().decode("utf-8")
    assert "k\\udcff\\udcfe\\x1b[31m\\r1" in log and "run finished" in log


@pytest.mark.slow
def test_search_shows_keys_captions_and_urls_from_an_index_escaped(tmp_path, capsys):
    """An index whose keys, captions and source URLs hold control characters and bytes that are not UTF-8:
    `mmcl search` prints each escaped, and --json is valid JSON of the same strings."""
    import webdataset as wds
    from PIL import Image

    from mmcl import models
    from mmcl.storage import weights

    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    model_dir = weights.save_model_dir(models.create(cfg), cfg, models.preprocess_config(cfg), tmp_path / "model")
    shard = tmp_path / "shard-000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i in range(3):
            sink.write({"__key__": f"{BAD_KEY}{i}", "png": Image.new("RGB", (32, 32), (80 * i, 20, 40)),
                        "txt": f"caption {i}\x1b]0;title\x07", "json": {"url": f"http://host/{i}\x1b[2J\u202e.jpg"}})
    assert main(["index", "--model", str(model_dir), "--data", str(shard), "--out", str(tmp_path / "index")]) == 0
    capsys.readouterr()
    assert main(["search", "--index", str(tmp_path / "index"), "caption", "-k", "3"]) == 0
    shown = capsys.readouterr().out
    assert len(shown.splitlines()) == 3 and not any(c in shown for c in "\x1b\r\x07\u202e"), repr(shown)
    assert "k\\udcff\\udcfe\\x1b[31m\\r0" in shown and "\\x1b[2J\\u202e.jpg" in shown
    shown.encode("utf-8")
    assert main(["search", "--index", str(tmp_path / "index"), "caption", "-k", "3", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out.encode("utf-8"))
    assert sorted(h["key"] for h in hits) == [f"{BAD_KEY}{i}" for i in range(3)]


# ------------------------------------------------------------------------------- bounds declared before work
# `mmcl ARGS` in a process that may grow by EXTRA bytes of address space once mmcl, torch and the command's heavy
# modules are imported: what a file declares must be checked before memory is spent on it.
_UNDER_A_LIMIT = r"""
import resource, sys
import faiss, torch, torchvision, open_clip, pyarrow.parquet  # the command's modules, before the limit
from mmcl.cli import main
vm = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_AS)[1]))
sys.exit(main(sys.argv[2:]))
"""
_MiB = 1 << 20


def mmcl_within(extra: int, *args, timeout: int = 300):
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    done = subprocess.run([sys.executable, "-c", _UNDER_A_LIMIT, str(extra), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr[-3000:]
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from mmcl import models
    from mmcl.storage import weights

    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    return weights.save_model_dir(models.create(cfg), cfg, models.preprocess_config(cfg),
                                  tmp_path_factory.mktemp("tiny") / "model")


def test_a_zero_shot_classifier_encodes_a_bounded_number_of_texts_at_once(tiny_model):
    """900 templates of 10 class names: open_clip's classifier (float64 reference of its formula), built from
    forward passes of at most `MAX_TEXTS_AT_ONCE` texts, not 9,000 at once."""
    from mmcl.evaluation.evaluate import zero_shot_classifier
    from mmcl.storage import weights

    model, _, tokenizer = weights.load(tiny_model)
    names = [f"shade {i}" for i in range(10)]
    templates = [f"a photo {i} of a {{}}." for i in range(900)]
    sizes = []
    encode = model.encode_text

    def counted(tokens, normalize=False):
        sizes.append(len(tokens))
        return encode(tokens, normalize=normalize)

    model.encode_text = counted
    got = zero_shot_classifier(model, tokenizer, names, templates, "cpu")
    assert max(sizes) <= limits.MAX_TEXTS_AT_ONCE and sum(sizes) == 9000
    with torch.no_grad():
        feats = encode(tokenizer([t.format(n) for n in names for t in templates]), normalize=True).double()
    means = feats.reshape(10, 900, -1).mean(dim=1)
    want = (means / means.norm(dim=1, keepdim=True)).T
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)


def test_a_templates_file_past_the_bound_is_one_line_before_any_is_encoded(small_demo, tiny_model, tmp_path):
    data = tmp_path / "colour"
    import shutil

    shutil.copytree(small_demo["zeroshot_colour"], data)
    (data / "templates.txt").write_text("{}\n" * 20_000)
    start = time.perf_counter()
    rc, _, err = mmcl_within(512 * _MiB, "zeroshot", "--model", tiny_model, "--data", data)
    assert rc == 2 and err.strip().startswith("mmcl: error: templates ") and "20,000 templates" in err, err
    assert "\n" not in err.strip() and time.perf_counter() - start < 60


@pytest.mark.slow
def test_a_model_folder_asking_for_a_larger_model_than_its_weights_is_refused_before_it_is_built(tiny_model,
                                                                                             tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    meta = json.loads((model / "open_clip_config.json").read_text())
    meta["model_cfg"]["vision_cfg"].update(width=1536, layers=40, head_width=64)  # about 1.1 billion parameters
    (model / "open_clip_config.json").write_text(json.dumps(meta))
    rc, _, err = mmcl_within(1024 * _MiB, "export", "--model", model, "--format", "open_clip", "--out",
                             tmp_path / "export")
    assert rc == 2 and err.strip().startswith("mmcl: error: ") and "parameters" in err and "\n" not in err.strip()
    assert not (tmp_path / "export").exists()


def test_an_index_declaring_a_huge_vector_length_is_refused_before_faiss_reads_it(tiny_model, small_demo, tmp_path):
    import struct

    index = tmp_path / "index"
    assert main(["index", "--model", str(tiny_model), "--data", small_demo["val"], "--out", str(index)]) == 0
    body = bytearray((index / "index.faiss").read_bytes())
    struct.pack_into("<i", body, 4, 1 << 30)  # the header's vector length
    (index / "index.faiss").write_bytes(bytes(body) + bytes(16_000))
    rc, _, err = mmcl_within(512 * _MiB, "search", "--index", index, "a red square")
    assert rc == 2 and err.strip().startswith("mmcl: error: ") and "index.faiss" in err and "\n" not in err.strip()
    assert "vectors of length 1,073,741,824" in err  # refused from the header, not after faiss ran out of memory


def _caption_folder(root: Path) -> Path:
    from PIL import Image

    root.mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(root / f"{i:06d}.jpg")
        (root / f"{i:06d}.txt").write_text(f"caption {i}")
    return root


def test_shards_skips_a_caption_file_or_image_over_its_bound_without_reading_it(tmp_path):
    folder = _caption_folder(tmp_path / "in")
    with open(folder / "000000.txt", "wb") as f:  # sparse: 2 GiB that take no disk
        f.truncate(2 << 30)
    with open(folder / "000001.jpg", "wb") as f:
        f.truncate(64 << 30)
    out = tmp_path / "out"
    rc, stdout, err = mmcl_within(512 * _MiB, "shards", "--input", folder, "--out", out)
    assert rc == 0, err
    skipped = {(s["member"], s["reason"]) for s in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
    assert skipped == {("000000.txt", "too_large"), ("000001.jpg", "too_large")}, skipped
    assert json.loads((out / "sizes.json").read_text()) == {"shard-000000.tar": 1}


_COUNT_ROWS = r"""
import resource, sys
import pyarrow.parquet
from mmcl.data.shard_inputs import input_items
vm = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2 ** 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
items, _ = input_items(sys.argv[1], "{}", None, None, None)
print(sum(1 for _ in items))
"""


@pytest.mark.slow
def test_shards_streams_a_parquet_table_by_row_groups(tmp_path):
    """A parquet file of a few KB declaring 2,000,000 dictionary-encoded rows in one row group: `mmcl shards`
    reads its rows a batch at a time, in a process that may grow by 256 MiB (the whole table as Python rows takes
    gigabytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2_000_000
    table = pa.table({"image": pa.array(["images/000000.jpg"] * n).dictionary_encode(),
                      "caption": pa.array(["the same caption, " * 16] * n).dictionary_encode()})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=n)
    assert (tmp_path / "rows.parquet").stat().st_size < 1 << 20
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    done = subprocess.run([sys.executable, "-c", _COUNT_ROWS, str(tmp_path / "rows.parquet")], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == n


# ------------------------------------------------------------------------------------------------ class names
def _zeroshot_error(capsys, *args) -> str:
    rc = main(["zeroshot", *map(str, args)])
    lines = error_lines(capsys)
    assert rc == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("lines,what", [(10_000_000, "bytes, over the 16,777,216"),
                                        (100_001, "100,001 class names, more than the 100,000")])
def test_a_classnames_file_past_its_bound_is_one_line_before_it_is_kept(small_demo, tiny_model, tmp_path, capsys,
                                                                         lines, what):
    """10^7 lines (20 MB) are refused by the file's size before a byte is read; 100,001 short lines by their
    count, at most 100,000 of them kept (`limits.MAX_CLASSES`; ImageNet-21k has 21,841)."""
    path = tmp_path / "names.txt"
    path.write_bytes(b"a\n" * lines)
    start = time.perf_counter()
    line = _zeroshot_error(capsys, "--model", tiny_model, "--data", small_demo["zeroshot_colour"], "--classnames",
                           path)
    assert "names.txt" in line and what in line, line
    assert time.perf_counter() - start < 30


def test_a_classnames_file_in_a_dataset_folder_past_its_bound_is_one_line(small_demo, tiny_model, tmp_path, capsys):
    import shutil

    data = tmp_path / "colour"
    shutil.copytree(small_demo["zeroshot_colour"], data)
    with open(data / "classnames.txt", "wb") as f:  # sparse: 17 MiB that take no disk
        f.truncate(17 << 20)
    line = _zeroshot_error(capsys, "--model", tiny_model, "--data", data)
    assert "classnames.txt" in line and "over the 16,777,216" in line, line


def test_real_class_name_lists_are_within_the_bound(tmp_path):
    """ImageNet-21k's 21,841 class names (as long as its longest synset names) are read whole."""
    from mmcl.data.eval_data import read_classnames

    names = [f"class {i} " + "x" * 120 for i in range(21_841)]
    (tmp_path / "in21k.txt").write_text("\n".join(names) + "\n")
    assert read_classnames(str(tmp_path / "in21k.txt")) == names


def test_an_image_folder_with_too_many_class_folders_is_one_line(tmp_path, capsys, tiny_model):
    """100,001 class folders: refused while listed (at most 100,000 names kept), before any image is looked for.
    (In memory where the machine has /dev/shm: 100,001 folders take minutes to delete on some disks.)"""
    import shutil
    import tempfile

    from mmcl.data.limits import MAX_CLASSES

    data = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path))
    try:
        for i in range(MAX_CLASSES + 1):
            os.mkdir(data / f"c{i:06d}")
        (data / "c000000" / "0.png").write_bytes(b"")
        line = _zeroshot_error(capsys, "--model", tiny_model, "--data", data)
    finally:
        shutil.rmtree(data)
    assert "more than 100,000 class folders" in line and str(data) in line, line
