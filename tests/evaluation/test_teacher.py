"""The distillation teacher (mmcl/evaluation/teacher.py): loaded frozen from a model folder, its view of a sample
prepared in the data loader as uint8 pixels and its own tokens, and its features those of its own evaluation
transform and tokenizer, bit for bit."""

import json

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mmcl import models
from mmcl.errors import ConfigError
from mmcl.evaluation.teacher import Teacher
from mmcl.storage import weights

CAPTIONS = ["a red square", "a photo of a small green circle", "x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    model = models.create(cfg)
    model.logit_scale.data.fill_(2.5)
    return weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path_factory.mktemp("t") / "m")


def test_the_teachers_features_are_its_own_models_bit_for_bit(model_dir):
    teacher = Teacher.load(str(model_dir))
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    assert teacher.name == str(model_dir)
    images = [Image.new("RGB", (50 + 7 * i, 40), (40 * i, 200, 90)) for i in range(3)]
    pixels = torch.stack([teacher.view.image(im) for im in images])
    tokens = teacher.view.tokenize(CAPTIONS)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 3, 32, 32) and tokens.dtype == torch.long
    got = teacher.embed(pixels, tokens)
    model, eval_tf, tokenizer = weights.load(model_dir)
    model.eval().requires_grad_(False)  # as a teacher runs (torch's attention takes its inference path)
    with torch.no_grad():
        want_img = F.normalize(model.encode_image(torch.stack([eval_tf(im) for im in images])).float(), dim=-1)
        want_txt = F.normalize(model.encode_text(tokenizer(CAPTIONS)).float(), dim=-1)
    assert torch.equal(tokens, tokenizer(CAPTIONS).long())
    assert got.image.dtype == got.text.dtype == torch.float32
    assert torch.equal(got.image, want_img) and torch.equal(got.text, want_txt)
    assert got.scale.shape == () and torch.equal(got.scale, torch.tensor(2.5).exp())
    assert not got.image.requires_grad


def test_a_teacher_that_cannot_be_read_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"distill.teacher: cannot load .*nothing"):
        Teacher.load(str(tmp_path / "nothing"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "open_clip_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="distill.teacher: cannot load .*junk"):
        Teacher.load(str(tmp_path / "junk"))
