"""Exports load in their own runtimes (open_clip, transformers, onnxruntime, mmcl.load) and agree with mmcl.load."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from mmcl import export as export_mod
from mmcl import models, weights
from mmcl.errors import ConfigError

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


def test_safetensors_export_loads_without_training_code(model_dir, reference, tmp_path):
    out = export_mod.export(model_dir, "safetensors", tmp_path / "st")
    from safetensors import safe_open

    with safe_open(str(out / models.WEIGHTS_FILE), "pt") as f:
        assert json.loads(f.metadata()["mmcl_model_cfg"]) == json.loads((model_dir / models.CONFIG_FILE).read_text())[
            "model_cfg"]
    script = (
        "import sys, json, torch, mmcl\n"
        f"m, pre, tok = mmcl.load({str(out)!r})\n"
        "assert not any(n in sys.modules for n in ('mmcl.train', 'accelerate', 'mmcl.losses')), 'training code'\n"
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

    import open_clip
    import onnxruntime as ort
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
