"""Model folders (mmcl/storage/weights.py): open_clip's local-dir layout written atomically, read back bit for bit,
with the weights' size and SHA-256 recorded so that a truncated or altered file is named at load; and `init_from`,
weights from open_clip, transformers and mmcl files loaded into a model exactly."""

import hashlib
import json
from pathlib import Path

import open_clip
import pytest
import torch
from open_clip.model import CLIP
from safetensors.torch import load_file

from mmcl import models
from mmcl.config import ModelConfig, TextTowerConfig
from mmcl.errors import CheckpointError
from mmcl.storage import checkpoints, weights


def _json(value):
    return json.loads(json.dumps(value))  # tuples as the JSON file gives them back: lists


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 1-layer tiny model saved to a folder: (model, its config, the folder)."""
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    model = models.create(cfg)
    out = weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path_factory.mktemp("m") / "model",
                                 extra={"note": "x"})
    return model, cfg, out


def test_saving_writes_open_clips_layout_with_the_weights_record(saved):
    model, cfg, out = saved
    assert sorted(p.name for p in out.iterdir()) == sorted([weights.WEIGHTS_FILE, weights.CONFIG_FILE])
    meta = json.loads((out / weights.CONFIG_FILE).read_text())
    assert meta["model_cfg"] == cfg and meta["preprocess_cfg"] == _json(models.preprocess_config(cfg))
    assert meta["mmcl"]["note"] == "x"
    record = weights.recorded_weights(meta)
    assert record == weights.weights_record(out / weights.WEIGHTS_FILE)
    assert record["size"] == (out / weights.WEIGHTS_FILE).stat().st_size and len(record["sha256"]) == 64
    state = load_file(str(out / weights.WEIGHTS_FILE))
    assert sorted(state) == sorted(model.state_dict())


def test_a_saved_model_loads_back_bit_for_bit(saved):
    model, cfg, out = saved
    loaded, model_cfg, pp = weights.load_model_dir(out)
    assert model_cfg == cfg and pp == _json(models.preprocess_config(cfg)) and not loaded.training
    want, got = model.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    model.eval()
    g = torch.Generator().manual_seed(1)
    image = torch.randn(2, 3, 32, 32, generator=g)
    text = torch.randint(1, 400, (2, cfg["text_cfg"]["context_length"]), generator=g)
    with torch.no_grad():
        assert torch.equal(model.encode_image(image), loaded.encode_image(image))
        assert torch.equal(model.encode_text(text), loaded.encode_text(text))


@pytest.mark.parametrize("damage,message", [("truncate", "truncated"), ("grow", "longer than written"),
                                            ("flip", "its SHA-256 differs")])
def test_damaged_weights_are_named_at_load(saved, tmp_path, damage, message):
    model, cfg, _ = saved
    out = weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path / "model")
    path = out / weights.WEIGHTS_FILE
    raw = path.read_bytes()
    path.write_bytes({"truncate": raw[:-8], "grow": raw + b"\0", "flip": raw[:-1] + bytes([raw[-1] ^ 1])}[damage])
    with pytest.raises(CheckpointError, match=message) as info:
        weights.load_model_dir(out)
    assert weights.WEIGHTS_FILE in str(info.value)


def test_saving_again_replaces_the_model_and_keeps_the_users_files(saved, tmp_path):
    model, cfg, _ = saved
    out = weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path / "model")
    (out / "NOTES.md").write_text("mine")
    other = models.create(cfg)
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(0.5)
    weights.save_model_dir(other, cfg, models.preprocess_config(cfg), out)
    assert (out / "NOTES.md").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name != "model"]  # no temporary folder left beside it
    loaded, _, _ = weights.load_model_dir(out)
    assert all(torch.equal(t, torch.full_like(t, 0.5)) for n, t in loaded.state_dict().items()
               if t.is_floating_point() and n in dict(other.named_parameters()))


def test_weights_that_do_not_fit_the_config_name_the_keys(saved, tmp_path):
    model, cfg, _ = saved
    out = weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path / "model")
    meta = json.loads((out / weights.CONFIG_FILE).read_text())
    meta["model_cfg"]["embed_dim"] = cfg["embed_dim"] * 2
    meta.pop("mmcl")
    (out / weights.CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"weights in .* do not fit .*: \d+ of another shape \(e.g. "):
        weights.load_model_dir(out)


def test_model_file_names_and_the_safetensors_state_share_no_memory():
    assert weights.is_model_file_name(weights.WEIGHTS_FILE) and weights.is_model_file_name("open_clip_config.json")
    assert not weights.is_model_file_name("NOTES.md")
    tied = torch.nn.Linear(2, 2)
    module = torch.nn.Sequential(tied, tied)  # one tensor under two names
    state = weights.state_dict_for_safetensors(module)
    assert sorted(state) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert state["0.weight"].data_ptr() != state["1.weight"].data_ptr()
    assert torch.equal(state["0.weight"], tied.weight) and all(t.is_contiguous() for t in state.values())


# ------------------------------------------------------------------------------------------------- init_from
TINY = json.loads((models.CONFIG_DIR / "tiny.json").read_text())


@pytest.fixture(scope="module")
def minilm_dir(tokenizer_dir) -> str:
    return str(tokenizer_dir)


def lit_config(hf: str, **kw) -> ModelConfig:
    text = TextTowerConfig(hf=hf, pooling=kw.pop("pooling", "mean"), projection=kw.pop("projection", "none"))
    return ModelConfig(name="tiny", embed_dim=kw.pop("embed_dim", 384), context_length=16, text=text, **kw)


SENTENCES = ["the digit seven", "handwriting: 7", "a photo of a small red circle on a blue background"]


def images(n=2, size=64, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def open_clip_reference():
    torch.manual_seed(123)
    ref = CLIP(**TINY).eval()  # open_clip's own class and init
    tokens = open_clip.tokenizer.SimpleTokenizer(context_length=32)(SENTENCES)
    with torch.no_grad():
        return ref, tokens, ref.encode_image(images()), ref.encode_text(tokens)


def _write(kind, ref, tmp_path) -> Path:
    state = ref.state_dict()
    if kind == "open_clip_train .pt":  # what open_clip_train.main saves under DDP
        path = tmp_path / "epoch_1.pt"
        torch.save({"epoch": 1, "name": "run", "state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
    elif kind == ".safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "weights.safetensors"
        save_file(state, str(path))
    elif kind == ".bin":
        path = tmp_path / "open_clip_pytorch_model.bin"
        torch.save(state, path)
    else:  # open_clip local-dir, as its hub exports lay it out
        from safetensors.torch import save_file

        path = tmp_path / "local"
        path.mkdir()
        save_file(state, str(path / "open_clip_model.safetensors"))
        (path / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY, "preprocess_cfg": {}}))
    return path


@pytest.mark.parametrize("kind", ["open_clip_train .pt", ".safetensors", ".bin", "local-dir"])
def test_init_from_open_clip_checkpoint_is_exact(kind, tmp_path, open_clip_reference):
    ref, tokens, ref_img, ref_txt = open_clip_reference
    path = _write(kind, ref, tmp_path)
    model = models.build(ModelConfig(name="tiny"))[0].eval()
    report = weights.init_from(model, path)
    n = len(model.state_dict())
    assert f"loaded {n}/{n} tensors; missing 0; unexpected 0" in report
    with torch.no_grad():
        assert torch.equal(model.encode_image(images()), ref_img)
        assert torch.equal(model.encode_text(tokens), ref_txt)
    if kind == "local-dir":  # open_clip reads the directory to the same model
        with torch.no_grad():
            assert torch.equal(open_clip.create_model(f"local-dir:{path}").eval().encode_image(images()), ref_img)


def test_init_from_mmcl_run_and_export(tmp_path, open_clip_reference):
    ref, tokens, ref_img, ref_txt = open_clip_reference
    weights.save_model_dir(ref, TINY, {}, tmp_path / "run" / "model")
    for path in (tmp_path / "run", tmp_path / "run" / "model"):
        model = models.build(ModelConfig(name="tiny"))[0].eval()
        assert "missing 0; unexpected 0" in weights.init_from(model, path)
        with torch.no_grad():
            assert torch.equal(model.encode_text(tokens), ref_txt)


def test_init_from_training_checkpoint(tmp_path, open_clip_reference):
    from safetensors.torch import save_file

    ref, tokens, ref_img, _ = open_clip_reference
    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    weights_file = step / checkpoints.MODEL_WEIGHTS  # accelerate's save_state name
    save_file(ref.state_dict(), str(weights_file))
    record = {"size": weights_file.stat().st_size, "sha256": hashlib.sha256(weights_file.read_bytes()).hexdigest()}
    (step / checkpoints.COMPLETE).write_text(json.dumps({"step": 10, "files": {weights_file.name: record}}))
    (step.parent / checkpoints.LATEST).write_text(step.name)
    newer = step.with_name("step-00000020")  # newer, but its weights were altered after its marker was written
    newer.mkdir()
    save_file({k: v + 1 for k, v in ref.state_dict().items()}, str(newer / weights_file.name))
    (newer / checkpoints.COMPLETE).write_text(json.dumps({"step": 20, "files": {weights_file.name: record}}))
    model = models.build(ModelConfig(name="tiny"))[0].eval()
    assert "mmcl training checkpoint" in weights.init_from(model, tmp_path / "run")
    with torch.no_grad():
        assert torch.equal(model.encode_image(images()), ref_img)


def test_init_from_transformers_clip(tmp_path):
    from transformers import CLIPConfig, CLIPModel

    hf_cfg = CLIPConfig(
        text_config=dict(vocab_size=49408, hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, max_position_embeddings=32, hidden_act="gelu",
                         bos_token_id=49406, eos_token_id=49407, pad_token_id=0),
        vision_config=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           image_size=64, patch_size=8, hidden_act="gelu"),
        projection_dim=128)
    torch.manual_seed(0)
    hf = CLIPModel(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf-clip")
    model = models.build(ModelConfig(name="tiny"))[0].eval()
    report = weights.init_from(model, tmp_path / "hf-clip")
    assert "transformers CLIP" in report and "missing 0; unexpected 0" in report and "WARNING" not in report
    tokens = open_clip.tokenizer.SimpleTokenizer(context_length=32)(SENTENCES)
    with torch.no_grad():
        expected_img = hf.get_image_features(pixel_values=images()).pooler_output
        expected_txt = hf.get_text_features(input_ids=tokens).pooler_output
        # Same math; open_clip's fused q/k/v projection and transformers' three matmuls round differently in fp32.
        assert torch.allclose(model.encode_image(images()), expected_img, atol=1e-5, rtol=1e-4)
        assert torch.allclose(model.encode_text(tokens), expected_txt, atol=1e-5, rtol=1e-4)
    assert torch.equal(model.logit_scale.detach(), hf.logit_scale.detach())


def test_init_from_reports_missing_and_unexpected(tmp_path, open_clip_reference, minilm_dir):
    ref = open_clip_reference[0]
    path = _write(".safetensors", ref, tmp_path)
    model = models.build(lit_config(minilm_dir, embed_dim=128, projection="linear"))[0]
    minilm_before = model.text.transformer.embeddings.word_embeddings.weight.detach().clone()
    report = weights.init_from(model, path)
    # The image tower and scale come from the CLIP checkpoint; the Hugging Face tower keeps its weights.
    n_visual = sum(1 for k in model.state_dict() if k.startswith("visual."))
    assert f"loaded {n_visual + 1}/" in report and "missing" in report and "text.transformer." in report
    assert "unexpected" in report and "text.token_embedding.weight" in report
    assert torch.equal(model.visual.proj, ref.visual.proj)
    assert torch.equal(model.text.transformer.embeddings.word_embeddings.weight, minilm_before)


def test_init_from_shape_mismatch_is_a_checkpoint_error(tmp_path):
    other = models.build(ModelConfig(name="tiny", embed_dim=64))[0]
    path = tmp_path / "small.safetensors"
    from safetensors.torch import save_file

    save_file(other.state_dict(), str(path))
    model = models.build(ModelConfig(name="tiny"))[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"has shape \(128, 64\) in the checkpoint, expected \(128, 128\)"):
        weights.init_from(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing half-loaded


def test_init_from_bad_paths(tmp_path):
    model = models.build(ModelConfig(name="tiny"))[0]
    with pytest.raises(CheckpointError, match="init_from path not found"):
        weights.init_from(model, tmp_path / "missing.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no weights found in"):
        weights.init_from(model, tmp_path / "empty")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        weights.init_from(model, tmp_path / "junk.pt")
    torch.save({"a": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="none of its 1 tensors matches"):
        weights.init_from(model, tmp_path / "other.pt")


def test_image_position_grid_is_resized(tmp_path, open_clip_reference):
    ref = open_clip_reference[0]
    path = _write(".safetensors", ref, tmp_path)
    model = models.build(ModelConfig(name="tiny", image_size=96))[0]
    report = weights.init_from(model, path)
    assert "resized image position grid (65, 128) -> (145, 128)" in report
