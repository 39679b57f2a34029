"""Captions longer than a trained text tower's positions (Long-CLIP): a longer ``model.context_length`` loads trained
weights (``model.init_from``, ``model.pretrained``) with the text positions stretched, the first 20 as trained and
the rest interpolated; the causal mask is the new length's; exports carry the new length."""

import json

import open_clip
import pytest
import torch

from mmcl import models
from mmcl.config import ModelConfig
from mmcl.models.resize import LONG_CLIP_KEEP, stretch_text_positions
from mmcl.storage import export as export_mod
from mmcl.storage import weights
from mmcl.storage.pretrained import build_pretrained

SHORT = ["a red circle", "two blue squares"]  # well under 20 tokens
LONG = ["a photo of " + "a small red circle next to a large blue square and " * 6 + "a star"]


def test_stretching_keeps_the_first_positions_and_every_fourth_row_is_a_trained_one():
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(77, 8, generator=g, dtype=torch.float64)
    out = stretch_text_positions(pos, 248)
    assert out.shape == (248, 8) and out.dtype == pos.dtype
    assert torch.equal(out[:LONG_CLIP_KEEP], pos[:LONG_CLIP_KEEP])
    torch.testing.assert_close(out[LONG_CLIP_KEEP::4], pos[LONG_CLIP_KEEP:], rtol=0, atol=1e-15)  # 57 -> 228
    # In between: on the segment between the two trained rows around it (linear), and beyond the last one along
    # the last two.
    torch.testing.assert_close(out[22], (pos[20] + pos[21]) / 2, rtol=0, atol=1e-14)
    torch.testing.assert_close(out[247], pos[76] + 0.75 * (pos[76] - pos[75]), rtol=0, atol=1e-14)
    with pytest.raises(ValueError):
        stretch_text_positions(pos, 77)


def _tiny(context_length, **kw):
    return ModelConfig(name="tiny", embed_dim=16, context_length=context_length,
                       vision_cfg={"layers": 1, "width": 32, "head_width": 16},
                       text_cfg={"layers": 2, "width": 32, "heads": 2}, **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model at 32 positions, saved as an mmcl model directory."""
    torch.manual_seed(0)
    model, model_cfg, pp, *_ = models.build(_tiny(32))
    return weights.save_model_dir(model.eval(), model_cfg, pp, tmp_path_factory.mktemp("m") / "model"), model


def _features(model, tokenizer, texts):
    model.eval()
    with torch.no_grad():
        return model.encode_text(tokenizer(texts), normalize=True)


def test_init_from_a_run_stretches_the_positions_and_keeps_short_captions(trained):
    path, original = trained
    model, model_cfg, _, _, _, tokenizer = models.build(_tiny(96))
    report = weights.init_from(model, path)
    assert "stretched text positions (32, 32) -> (96, 32)" in report, report
    assert model.positional_embedding.shape == (96, 32)
    assert torch.equal(model.positional_embedding[:LONG_CLIP_KEEP].detach(),
                       original.positional_embedding[:LONG_CLIP_KEEP].detach())
    assert model.attn_mask.shape == (96, 96)  # the causal mask of the new length
    assert torch.equal(model.attn_mask, torch.full((96, 96), float("-inf")).triu(1))
    short = _features(model, tokenizer, SHORT)
    before = _features(original, models.build_tokenizer(models.resolve_model_config(_tiny(32))), SHORT)
    torch.testing.assert_close(short, before, rtol=1e-5, atol=1e-6)  # positions < 20 only: the same features
    tokens = tokenizer(LONG)
    assert int((tokens != 0).sum()) > 32  # the long caption is read past the old context


def test_model_pretrained_from_a_file_stretches_too(trained, tmp_path):
    path, original = trained
    file = tmp_path / "weights.pt"
    torch.save(original.state_dict(), file)
    model, model_cfg, _, tokenizer, report = build_pretrained(_tiny(80, pretrained=str(file)))
    assert "stretched text positions (32, 32) -> (80, 32)" in report, report
    assert model_cfg["text_cfg"]["context_length"] == 80 and tokenizer.context_length == 80
    assert torch.equal(model.positional_embedding[:LONG_CLIP_KEEP].detach(),
                       original.positional_embedding[:LONG_CLIP_KEEP].detach())


@pytest.fixture(scope="module")
def stretched_dir(trained, tmp_path_factory):
    path, _ = trained
    model, model_cfg, pp, *_ = models.build(_tiny(96))
    weights.init_from(model, path)
    return weights.save_model_dir(model.eval(), model_cfg, pp, tmp_path_factory.mktemp("long") / "model"), model


def test_open_clip_loads_the_export_with_the_longer_context(stretched_dir, tmp_path):
    src, model = stretched_dir
    out = export_mod.export(src, "open_clip", tmp_path / "oc")
    assert json.loads((out / "open_clip_config.json").read_text())["model_cfg"]["text_cfg"]["context_length"] == 96
    oc_model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    oc_tok = open_clip.get_tokenizer(f"local-dir:{out}")
    assert oc_tok.context_length == 96 and oc_model.positional_embedding.shape[0] == 96
    ours = _features(model, models.build_tokenizer(models.resolve_model_config(_tiny(96))), LONG + SHORT)
    theirs = _features(oc_model, oc_tok, LONG + SHORT)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_the_hugging_face_export_holds_the_longer_context(stretched_dir, tmp_path):
    from transformers import CLIPModel

    src, model = stretched_dir
    out = export_mod.export(src, "hf", tmp_path / "hf")
    hf = CLIPModel.from_pretrained(str(out)).eval()
    assert hf.config.text_config.max_position_embeddings == 96
    tokens = models.build_tokenizer(models.resolve_model_config(_tiny(96)))(LONG)
    with torch.no_grad():
        theirs = torch.nn.functional.normalize(export_mod._features(hf.get_text_features(input_ids=tokens)), dim=-1)
    torch.testing.assert_close(theirs, _features(model, models.build_tokenizer(
        models.resolve_model_config(_tiny(96))), LONG), rtol=1e-4, atol=1e-4)


def test_a_hugging_face_tower_takes_its_own_positions_up_to_its_limit(tokenizer_dir):
    from mmcl.config import TextTowerConfig
    from mmcl.errors import ConfigError

    def cfg(length):
        return ModelConfig(name="tiny", embed_dim=16, context_length=length,
                           text=TextTowerConfig(hf=str(tokenizer_dir)),
                           vision_cfg={"layers": 1, "width": 32, "head_width": 16})

    model, model_cfg, *_, tokenizer = models.build(cfg(300))  # MiniLM has 512 positions
    assert tokenizer.context_length == 300 and tokenizer(LONG).shape == (1, 300)
    with pytest.raises(ConfigError, match=r"^model.context_length 600 exceeds the text tower's max_position"):
        models.build(cfg(600))


def test_the_onnx_export_reads_the_longer_context_with_its_own_tokenizer_and_runtime(stretched_dir, tmp_path):
    """ONNX Runtime and Hugging Face's `tokenizers` alone (as docs/export.md runs them): the exported tokenizer
    gives the 96 ids mmcl's does, the long caption is read past the old 32, and the text encoder gives the
    model's features."""
    src, model = stretched_dir
    _onnx_reads_the_context(src, model, models.build_tokenizer(models.resolve_model_config(_tiny(96))),
                            LONG + SHORT, 96, 32, tmp_path)


def _onnx_reads_the_context(src, model, tokenizer, texts, context, past, tmp_path):
    """The ONNX export of `src` with ONNX Runtime and Hugging Face's `tokenizers` alone: `context` ids, equal to
    `tokenizer`'s, the first text read past `past` tokens, and the text encoder giving `model`'s features."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    out = export_mod.export(src, "onnx", tmp_path / "onnx")
    assert json.loads((out / export_mod.ONNX_CONFIG_FILE).read_text())["context_length"] == context
    tok = Tokenizer.from_file(str(out / export_mod.ONNX_TOKENIZER_FILE))
    ids = torch.tensor([e.ids for e in tok.encode_batch(texts)])
    assert ids.shape[1] == context and torch.equal(ids, tokenizer(texts)) and int((ids[0] != 0).sum()) > past
    session = ort.InferenceSession(str(out / export_mod.ONNX_TEXT_FILE), providers=["CPUExecutionProvider"])
    theirs = torch.from_numpy(session.run(None, {"text": ids.numpy()})[0])
    torch.testing.assert_close(theirs, _features(model, tokenizer, texts), rtol=1e-4, atol=1e-4)


def test_the_safetensors_export_loads_at_the_longer_context(stretched_dir, tmp_path):
    import mmcl

    src, model = stretched_dir
    out = export_mod.export(src, "safetensors", tmp_path / "st")
    loaded, _, tokenizer = mmcl.load(out)
    assert tokenizer.context_length == 96 and loaded.positional_embedding.shape[0] == 96
    ours = _features(model, models.build_tokenizer(models.resolve_model_config(_tiny(96))), LONG + SHORT)
    torch.testing.assert_close(_features(loaded, tokenizer, LONG + SHORT), ours, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def hf_tower_dir(tokenizer_dir, tmp_path_factory):
    """A model whose text tower is a Hugging Face one (MiniLM, 512 positions) read at 300 tokens, saved as an mmcl
    model directory."""
    from mmcl.config import TextTowerConfig

    torch.manual_seed(0)
    cfg = ModelConfig(name="tiny", embed_dim=16, context_length=300, text=TextTowerConfig(hf=str(tokenizer_dir)),
                      vision_cfg={"layers": 1, "width": 32, "head_width": 16})
    model, model_cfg, pp, *_, tokenizer = models.build(cfg)
    path = weights.save_model_dir(model.eval(), model_cfg, pp, tmp_path_factory.mktemp("hf300") / "model")
    return path, model, tokenizer


VERY_LONG = [LONG[0] * 3]  # about 250 word pieces: past MiniLM's usual 128 and open_clip's 77


def test_a_hugging_face_text_tower_exports_at_its_longer_context(hf_tower_dir, tmp_path):
    """open_clip and safetensors exports of a Hugging Face text tower read at 300 tokens: the loaded tokenizer keeps
    the 300, a caption of about 250 word pieces is read whole, and the features are the model's."""
    import mmcl

    src, model, tokenizer = hf_tower_dir
    tokens = tokenizer(VERY_LONG + SHORT)
    assert tokens.shape == (3, 300) and int((tokens[0] != 0).sum()) > 200
    ours = _features(model, tokenizer, VERY_LONG + SHORT)
    out = export_mod.export(src, "open_clip", tmp_path / "oc")
    assert json.loads((out / "open_clip_config.json").read_text())["model_cfg"]["text_cfg"]["context_length"] == 300
    oc_model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    oc_tok = open_clip.get_tokenizer(f"local-dir:{out}")
    assert oc_tok.context_length == 300 and torch.equal(oc_tok(VERY_LONG + SHORT), tokens)
    torch.testing.assert_close(_features(oc_model, oc_tok, VERY_LONG + SHORT), ours, rtol=1e-5, atol=1e-5)
    loaded, _, st_tok = mmcl.load(export_mod.export(src, "safetensors", tmp_path / "st"))
    assert st_tok.context_length == 300
    torch.testing.assert_close(_features(loaded, st_tok, VERY_LONG + SHORT), ours, rtol=1e-5, atol=1e-5)


def test_the_hugging_face_export_of_a_hugging_face_text_tower_is_one_refusal(hf_tower_dir, tmp_path):
    from mmcl.errors import ConfigError

    src, *_ = hf_tower_dir
    with pytest.raises(ConfigError, match=r"^hf export needs open_clip's own text transformer") as err:
        export_mod.export(src, "hf", tmp_path / "hf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())


def test_the_onnx_export_of_a_hugging_face_text_tower_reads_its_longer_context(hf_tower_dir, tmp_path):
    """ONNX Runtime with the exported tokenizer.json alone: 300 ids, equal to mmcl's, and the model's features."""
    src, model, tokenizer = hf_tower_dir
    _onnx_reads_the_context(src, model, tokenizer, VERY_LONG + SHORT, 300, 200, tmp_path)
