"""Model folders (mmcl/storage/weights.py): open_clip's local-dir layout written atomically, read back bit for bit,
with the weights' size and SHA-256 recorded so that a truncated or altered file is named at load."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mmcl import models
from mmcl.errors import CheckpointError
from mmcl.storage import weights


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
