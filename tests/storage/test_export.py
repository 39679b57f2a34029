"""Exports load in their own runtimes (open_clip, transformers, onnxruntime, mmcl.load) and agree with mmcl.load."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from mmcl import models
from mmcl.errors import ConfigError
from mmcl.storage import export as export_mod
from mmcl.storage import weights

# Minimum cosine between an export's normalised embeddings and mmcl.load's on the same inputs. Float32 math done
# by another implementation differs by accumulation order only; ONNX Runtime fuses kernels (looser bound).
COS_SAME_MATH = 0.9999
COS_ONNX = 0.999

CAPTIONS = ["a red circle", "Two BLUE squares, side by side!", "a photo of 3 green triangles.",
            "an extremely long caption " + "that keeps going and going " * 12, "e-mail: shape@example.com; 100%"]


def _tiny_cfg(**vision):
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=2, **vision)
    cfg["text_cfg"].update(layers=2)
    return cfg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = _tiny_cfg()
    torch.manual_seed(0)
    model = models.create(cfg)
    with torch.no_grad():  # a trained-like logit scale, so the mapping of logit_scale is checked too
        model.logit_scale.fill_(3.5)
    return weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path_factory.mktemp("src") / "m")


@pytest.fixture(scope="module")
def reference(model_dir):
    """mmcl.load's embeddings for real images (preprocessed) and CAPTIONS."""
    model, preprocess, tokenizer = weights.load(model_dir)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((64, 64), (80, 96))]
    pixels = torch.stack([preprocess(im) for im in images])
    tokens = tokenizer(CAPTIONS)
    with torch.no_grad():
        img = model.encode_image(pixels, normalize=True)
        txt = model.encode_text(tokens, normalize=True)
    return {"images": images, "pixels": pixels, "tokens": tokens, "img": img, "txt": txt,
            "logit_scale": model.logit_scale.item()}


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a).float(), b.float(), dim=-1)


def test_open_clip_export_loads_in_open_clip(model_dir, reference, tmp_path):
    import open_clip

    out = export_mod.export(model_dir, "open_clip", tmp_path / "oc")
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    model.eval()
    pixels = torch.stack([preprocess(im) for im in reference["images"]])
    assert torch.equal(pixels, reference["pixels"])  # the same eval transform
    assert torch.equal(tokenizer(CAPTIONS), reference["tokens"])
    with torch.no_grad():
        assert _cos(model.encode_image(pixels, normalize=True), reference["img"]).min() >= COS_SAME_MATH
        assert _cos(model.encode_text(reference["tokens"], normalize=True), reference["txt"]).min() >= COS_SAME_MATH
    assert json.loads((out / export_mod.MARKER_FILE).read_text())["format"] == "open_clip"


@pytest.mark.slow
def test_safetensors_export_loads_without_training_code(model_dir, reference, tmp_path):
    out = export_mod.export(model_dir, "safetensors", tmp_path / "st")
    from safetensors import safe_open

    with safe_open(str(out / weights.WEIGHTS_FILE), "pt") as f:
        assert json.loads(f.metadata()["mmcl_model_cfg"]) == json.loads((model_dir / weights.CONFIG_FILE).read_text())[
            "model_cfg"]
    script = (
        "import sys, json, torch, mmcl\n"
        f"m, pre, tok = mmcl.load({str(out)!r})\n"
        "assert not any(n in sys.modules for n in ('mmcl.training.loop', 'accelerate', 'mmcl.losses')), "
        "'training code'\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        "with torch.no_grad():\n"
        "    i = m.encode_image(x['pixels'], normalize=True); t = m.encode_text(x['tokens'], normalize=True)\n"
        f"torch.save({{'img': i, 'txt': t}}, {str(tmp_path / 'y.pt')!r})\n")
    torch.save({"pixels": reference["pixels"], "tokens": reference["tokens"]}, tmp_path / "x.pt")
    subprocess.run([sys.executable, "-c", script], check=True)
    y = torch.load(tmp_path / "y.pt")
    assert _cos(y["img"], reference["img"]).min() >= COS_SAME_MATH
    assert _cos(y["txt"], reference["txt"]).min() >= COS_SAME_MATH


def test_hf_export_loads_in_transformers_with_same_tokens_and_embeddings(model_dir, reference, tmp_path):
    from transformers import AutoTokenizer, CLIPModel, CLIPProcessor

    out = export_mod.export(model_dir, "hf", tmp_path / "hf")
    model = CLIPModel.from_pretrained(str(out)).eval()
    processor = CLIPProcessor.from_pretrained(str(out))
    context_length = model.config.text_config.max_position_embeddings
    for tok in (processor.tokenizer, AutoTokenizer.from_pretrained(str(out))):
        ids = tok(CAPTIONS, padding="max_length", truncation=True, max_length=context_length,
                  return_tensors="pt")["input_ids"]
        ref = reference["tokens"]
        # open_clip's ids from the start token through the first end token (49407), truncation included; after it
        # transformers pads with the end token where open_clip writes 0, and neither model reads those positions
        through_eot = (ref == 49407).int().cumsum(1).cumsum(1) <= 1
        assert torch.equal(ids[through_eot], ref[through_eot])
        assert (ids[~through_eot] == 49407).all() and (ref[~through_eot] == 0).all()
    text_in = processor(text=CAPTIONS, padding="max_length", truncation=True, max_length=context_length,
                        return_tensors="pt")
    with torch.no_grad():
        txt = export_mod._features(model.get_text_features(**text_in))
        img = export_mod._features(model.get_image_features(pixel_values=reference["pixels"]))
        # padding to the longest caption only (the usual transformers call) gives the same features
        short = processor(text=CAPTIONS, padding=True, truncation=True, max_length=context_length,
                          return_tensors="pt")
        txt_short = export_mod._features(model.get_text_features(**short))
    assert _cos(txt, reference["txt"]).min() >= COS_SAME_MATH
    assert _cos(txt_short, reference["txt"]).min() >= COS_SAME_MATH
    assert _cos(img, reference["img"]).min() >= COS_SAME_MATH
    assert model.logit_scale.item() == pytest.approx(reference["logit_scale"])
    # The processor's own resize/crop reproduces open_clip's eval transform: a square input at the model's size
    # is only normalised (exact up to float rounding); a larger, non-square one is resized by a different
    # bicubic implementation, so compare the embeddings it leads to.
    pix = processor(images=reference["images"], return_tensors="pt")["pixel_values"]
    assert torch.allclose(pix[0], reference["pixels"][0], atol=1e-5)
    with torch.no_grad():
        img_proc = export_mod._features(model.get_image_features(pixel_values=pix))
    assert _cos(img_proc, reference["img"]).min() >= 0.99  # resampling differences of a few grey levels


def test_hf_export_writes_what_transformers_4_and_5_read_and_tokenizes_like_open_clip(model_dir, tmp_path):
    """transformers 4.x reads the image processor from preprocessor_config.json and fails on transformers 5's
    nested processor_config.json; both read tokenizer.json, which gives open_clip's ids (HTML entities and a
    literal <|endoftext|> included) with this venv's transformers. bench/check_transformers4.py runs 4.46 itself."""
    import open_clip
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPProcessor

    out = export_mod.export(model_dir, "hf", tmp_path / "hf")
    for name in ("preprocessor_config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "config.json", "model.safetensors"):
        assert (out / name).is_file(), name
    assert "image_processor" not in json.loads((out / "processor_config.json").read_text())
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "CLIPImageProcessor" and pre["size"] == {"shortest_edge": 64}
    assert isinstance(CLIPImageProcessor.from_pretrained(str(out)), CLIPImageProcessor)
    context_length = json.loads((out / "config.json").read_text())["text_config"]["max_position_embeddings"]
    ref = open_clip.get_tokenizer("ViT-B-32", context_length=context_length)(TOKENIZER_TEXTS).tolist()
    for tok in (CLIPProcessor.from_pretrained(str(out)).tokenizer, AutoTokenizer.from_pretrained(str(out))):
        ids = tok(TOKENIZER_TEXTS, padding="max_length", truncation=True, max_length=context_length)["input_ids"]
        for text, a, b in zip(TOKENIZER_TEXTS, ids, ref):
            end = len(b) - b[::-1].index(49407)  # through open_clip's final end token; 0-padding after it
            assert a[:end] == b[:end], text
            assert set(a[end:]) <= {49407}, text  # transformers pads with the end token (mask 0)
        assert set(tok(["a cat"])) == {"input_ids", "attention_mask"}  # what CLIPModel.forward accepts


def test_onnx_export_runs_in_onnxruntime_with_dynamic_batch(model_dir, reference, tmp_path):
    import onnxruntime as ort

    out = export_mod.export(model_dir, "onnx", tmp_path / "onnx")
    names = sorted(p.name for p in out.glob("*.onnx"))
    assert len(names) == 2 and "image" in names[0] and "text" in names[1]
    img_sess = ort.InferenceSession(str(out / names[0]), providers=["CPUExecutionProvider"])
    txt_sess = ort.InferenceSession(str(out / names[1]), providers=["CPUExecutionProvider"])
    for n in (1, 2):  # a batch size other than the one used for tracing
        img = img_sess.run(None, {"image": reference["pixels"][:n].numpy()})[0]
        assert img.shape == (n, reference["img"].shape[1])
        assert _cos(img, reference["img"][:n]).min() >= COS_ONNX
    txt = txt_sess.run(None, {"text": reference["tokens"].numpy()})[0]
    assert txt.shape[0] == len(CAPTIONS) and _cos(txt, reference["txt"]).min() >= COS_ONNX
    meta = json.loads((out / export_mod.ONNX_CONFIG_FILE).read_text())
    assert meta["context_length"] == reference["tokens"].shape[1] and meta["preprocess_cfg"]["size"] == 64


def test_unknown_format_and_unsafe_target_are_config_errors(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown export format 'tflite'"):
        export_mod.export(model_dir, "tflite", tmp_path / "x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        export_mod.export(model_dir, "safetensors", busy)
    assert (busy / "notes.txt").read_text() == "keep me"


def test_re_export_replaces_an_earlier_export_and_keeps_the_users_files(model_dir, tmp_path):
    first = export_mod.export(model_dir, "onnx", tmp_path / "e", verify=False)
    assert (first / export_mod.ONNX_IMAGE_FILE).is_file()
    (first / "results.json").write_text('{"acc1": 0.5}\n')
    (first / "notes").mkdir()
    (first / "notes" / "run.txt").write_text("from before")
    (first / "figures").mkdir()  # empty
    second = export_mod.export(model_dir, "safetensors", tmp_path / "e", verify=False)
    assert (second / "figures").is_dir()
    assert first == second
    assert not (second / export_mod.ONNX_IMAGE_FILE).exists()  # the earlier export's own files are replaced
    assert (second / "results.json").read_text() == '{"acc1": 0.5}\n'  # the user's are kept
    assert (second / "notes" / "run.txt").read_text() == "from before"
    marker = json.loads((second / export_mod.MARKER_FILE).read_text())
    assert marker["format"] == "safetensors" and "results.json" not in marker["files"]
    assert weights.load(second)[0] is not None


def test_hf_export_rejects_what_clipmodel_cannot_hold(tmp_path):
    cfg = _tiny_cfg(ls_init_value=0.1)  # layer scale: no CLIPModel counterpart
    model = models.create(cfg)
    src = weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path / "ls")
    with pytest.raises(ConfigError, match="ls_init_value"):
        export_mod.export(src, "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    hf_text = _tiny_cfg()
    hf_text["text_cfg"] = {"hf_model_name": "some/bert", "hf_tokenizer_name": "some/bert", "context_length": 32}
    with pytest.raises(ConfigError, match="Hugging Face text tower"):
        export_mod.check_hf_supported(hf_text, models.preprocess_config(hf_text))
    with pytest.raises(ConfigError, match="pool_type"):
        export_mod.check_hf_supported(_tiny_cfg(pool_type="avg"), {"resize_mode": "shortest"})


def test_cli_export(model_dir, tmp_path, capsys):
    from mmcl import cli

    assert cli.main(["export", "--model", str(model_dir), "--format", "safetensors", "--out",
                     str(tmp_path / "c")]) == 0
    assert "exported safetensors" in capsys.readouterr().out
    assert cli.main(["export", "--model", str(tmp_path / "missing"), "--format", "onnx", "--out",
                     str(tmp_path / "d")]) == 2


def test_hugging_face_text_tower_exports_are_self_contained(tmp_path):
    """A CustomTextCLIP (BERT-like text tower) exports to open_clip and ONNX; the exports outlive their sources."""
    import shutil

    import onnxruntime as ort
    import open_clip
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from mmcl.config import ModelConfig, TextTowerConfig

    bert = tmp_path / "bert"
    bert.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "a red green blue circle square photo of".split()
    (bert / "vocab.txt").write_text("\n".join(words + list("abcdefghijklmnopqrstuvwxyz")) + "\n")
    BertTokenizerFast(vocab_file=str(bert / "vocab.txt")).save_pretrained(str(bert))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words) + 26, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32)).save_pretrained(str(bert))
    cfg = models.resolve_model_config(ModelConfig(name="tiny", text=TextTowerConfig(hf=str(bert)), context_length=16))
    cfg["vision_cfg"].update(layers=1, image_size=32)
    src = weights.save_model_dir(models.create(cfg), cfg, models.preprocess_config(cfg), tmp_path / "src")
    model, preprocess, tokenizer = weights.load(src)
    pixels = torch.rand(2, 3, 32, 32)
    tokens = tokenizer(["a red circle", "blue square photo"])
    with torch.no_grad():
        ref_img, ref_txt = model.encode_image(pixels, normalize=True), model.encode_text(tokens, normalize=True)
    oc_dir = export_mod.export(src, "open_clip", tmp_path / "oc")
    onnx_dir = export_mod.export(src, "onnx", tmp_path / "onnx")
    with pytest.raises(ConfigError, match="Hugging Face text tower"):
        export_mod.export(src, "hf", tmp_path / "hf")
    shutil.rmtree(bert)
    shutil.rmtree(src)
    oc_model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{oc_dir}")
    oc_tok = open_clip.get_tokenizer(f"local-dir:{oc_dir}")
    assert torch.equal(oc_tok(["a red circle", "blue square photo"]), tokens)
    with torch.no_grad():
        oc_model.eval()
        assert _cos(oc_model.encode_text(tokens, normalize=True), ref_txt).min() >= COS_SAME_MATH
        assert _cos(oc_model.encode_image(pixels, normalize=True), ref_img).min() >= COS_SAME_MATH
    txt = ort.InferenceSession(str(onnx_dir / export_mod.ONNX_TEXT_FILE), providers=["CPUExecutionProvider"])
    assert _cos(txt.run(None, {"text": tokens.numpy()})[0], ref_txt).min() >= COS_ONNX


# ------------------------------------------------------------------------------------------------------------
# The ONNX export's tokenizer.json and preprocess.json, used without torch

TOKENIZER_TEXTS = [
    "a photo of a cat", "Hello,  World!!  It's 2024... and   more", "I'LL DON'T we'd you've she's",
    "café naïve Ünïcödé 東京 Ελληνικά кириллица 🙂 👍🏽 👨‍👩‍👧", "ΟΔΟΣ ΣΑΣ σας", "Straße İstanbul ǅemal",
    "&amp; &lt;b&gt;bold&lt;/b&gt; &quot;q&quot; &#39;s &apos; &nbsp;x &copy; &eacute;t&eacute;",
    "&amp;amp; &amp;lt; &ampx &notin; &notit; &#65;&#x42;&#0067 &#145;quoted&#146;",
    "a literal <|endoftext|> and <|startoftext|> in text", "x <start_of_text> y <END_OF_TEXT> z",
    "numbers 1234567 3.14 -42 1e10 ½ ² ٣", "ﬁne “curly” ‘single’ ＦＵＬＬ ｗｉｄｔｈ „low“",
    "tab\there\nnew\r\nline\u00a0nbsp\u2028",
    "\x00ctrl\x07chars\x7f\x85", "it&rsquo;s it’s", "e-mail: shape@example.com; 100% #hashtag @user",
    "long " * 100, "pneumonoultramicroscopicsilicovolcanoconiosis " * 20, " leading and trailing ", "", "   ",
    "!!!???...", "'s 't 're", "a\u0301 e\u0308 (combining)", "Ⅻ ㎏ ﬀ ﬃ", "日本語の文章です。句読点、あり！",
]


@pytest.fixture(scope="module")
def onnx_dir(model_dir, tmp_path_factory):
    return export_mod.export(model_dir, "onnx", tmp_path_factory.mktemp("onnx") / "onnx")


def test_onnx_tokenizer_json_gives_open_clip_token_ids(onnx_dir):
    """tokenizer.json, loaded by Hugging Face `tokenizers`, gives open_clip.get_tokenizer's ids on punctuation,
    unicode, numbers, HTML entities, literal special-token text, and long text cut at the context length."""
    import open_clip
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(onnx_dir / "tokenizer.json"))
    context_length = json.loads((onnx_dir / export_mod.ONNX_CONFIG_FILE).read_text())["context_length"]
    oc = open_clip.get_tokenizer("ViT-B-32", context_length=context_length)
    ids = np.array([e.ids for e in tok.encode_batch(TOKENIZER_TEXTS)])
    ref = oc(TOKENIZER_TEXTS).numpy()
    assert ids.shape == ref.shape == (len(TOKENIZER_TEXTS), context_length)
    for text, a, b in zip(TOKENIZER_TEXTS, ids, ref):
        assert a.tolist() == b.tolist(), text
    # the cases the hf export's tokenizer gets wrong are right here: '&amp;' is '&', '<|endoftext|>' is text
    amp, eot = tok.encode("&amp;").ids, tok.encode("<|endoftext|>").ids
    assert amp[:3] == [49406, oc.encoder["&</w>"], 49407]
    assert 49407 not in eot[1:eot.index(49407)] and eot.index(49407) > 2
    assert ids[TOKENIZER_TEXTS.index("long " * 100)][-1] == 49407  # truncated, ends with the end token


def test_onnx_tokenizer_json_documented_differences(onnx_dir):
    """Where tokenizer.json and open_clip differ, as mmcl/clip_tokenizer_file.py says: numeric references above
    U+00FF, mojibake repair (ftfy needs the surrounding text), and a reference to a character ftfy would change in
    text that holds a '<' (ftfy then leaves HTML alone). Each is a difference only for such input."""
    import open_clip
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(onnx_dir / "tokenizer.json"))
    oc = open_clip.get_tokenizer("ViT-B-32", context_length=len(tok.encode("").ids))
    for text in ("&#1234;", "cafÃ©", "<b>it&rsquo;s</b>"):
        assert tok.encode(text).ids != oc([text])[0].tolist()
    for text in ("&#233;", "café", "<b>it's</b>", "it&rsquo;s"):
        assert tok.encode(text).ids == oc([text])[0].tolist()


def test_onnx_preprocess_json_describes_the_eval_transform(onnx_dir, model_dir):
    pre = json.loads((onnx_dir / "preprocess.json").read_text())
    pp = models.preprocess_config(json.loads((model_dir / weights.CONFIG_FILE).read_text())["model_cfg"])
    assert pre["crop_size"] == [pp["size"], pp["size"]] and pre["resize_mode"] == pp["resize_mode"]
    assert pre["mean"] == pytest.approx(list(pp["mean"])) and pre["std"] == pytest.approx(list(pp["std"]))
    assert pre["interpolation"] == pp["interpolation"] and pre["rescale_factor"] == pytest.approx(1 / 255)


def _readme_onnx_example() -> str:
    """The onnxruntime example of docs/export.md (the ```python block after its ``<!-- onnx-example -->`` marker)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    after = page.split("<!-- onnx-example -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_onnx_example_runs_without_torch_and_matches_mmcl_load(onnx_dir, model_dir, tmp_path):
    """The onnxruntime + tokenizers example of docs/export.md, run in a process where importing torch (or mmcl,
    open_clip) fails, gives mmcl.load's embeddings for real image files of several shapes and for captions."""
    example = tmp_path / "onnx_clip.py"
    example.write_text(_readme_onnx_example())
    rng = np.random.default_rng(3)
    paths = []
    for i, (h, w) in enumerate(((64, 64), (80, 120), (150, 90), (33, 47))):
        p = tmp_path / f"im{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    texts = CAPTIONS + ["&amp; <|endoftext|>", "it&rsquo;s ΟΔΟΣ 東京 ＦＵＬＬ"]
    harness = (
        "import json, runpy, sys\n"
        "for name in ('torch', 'torchvision', 'open_clip', 'mmcl', 'transformers'):\n"
        "    sys.modules[name] = None  # import fails\n"
        "import numpy as np\n"
        f"ex = runpy.run_path({str(example)!r}, run_name='onnx_example')\n"
        f"pre, tok, isess, tsess = ex['load']({str(onnx_dir)!r})\n"
        f"img = ex['embed_images']({paths!r}, pre, isess)\n"
        f"txt = ex['embed_texts']({texts!r}, tok, tsess)\n"
        "assert not any(m.startswith('torch') for m in sys.modules if sys.modules[m] is not None)\n"
        f"np.savez({str(tmp_path / 'out.npz')!r}, img=img, txt=txt)\n")
    subprocess.run([sys.executable, "-c", harness], check=True)
    cli = subprocess.run([sys.executable, str(example), str(onnx_dir), *paths[:2], "--", "a red circle", "a cat"],
                         check=True, capture_output=True, text=True)
    assert cli.stdout.count("->") == 2
    out = np.load(tmp_path / "out.npz")
    model, preprocess, tokenizer = weights.load(model_dir)
    with torch.no_grad():
        ref_img = model.encode_image(torch.stack([preprocess(Image.open(p).convert("RGB")) for p in paths]),
                                     normalize=True)
        ref_txt = model.encode_text(tokenizer(texts), normalize=True)
    assert _cos(out["img"], ref_img).min() >= COS_ONNX
    assert _cos(out["txt"], ref_txt).min() >= COS_ONNX
