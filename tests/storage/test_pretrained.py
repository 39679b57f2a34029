"""`model.pretrained`: published weights by open_clip tag, hf-hub name, local file or directory, open_clip_train run.

Nothing is downloaded: each test builds the Hugging Face cache a download would leave (models--ORG--NAME/snapshots/
<commit>/..., refs/main) holding a small model mmcl saved, and reads it offline through open_clip's and
huggingface_hub's own functions, as a user's download is read.
"""

import json
from pathlib import Path

import pytest
import torch

from mmcl import models
from mmcl.cli import main
from mmcl.config import ModelConfig, load_config
from mmcl.errors import CheckpointError, ConfigError
from mmcl.storage import pretrained, weights

ROOT = Path(__file__).resolve().parents[2]
# ViT-B-32's layout at a test's size: the tag's weights in the cache are of this model.
SMALL_B32 = dict(name="ViT-B-32", embed_dim=32, vision_cfg={"width": 64, "layers": 1, "head_width": 32,
                                                          "image_size": 32, "patch_size": 16},
                 text_cfg={"width": 32, "heads": 2, "layers": 1, "context_length": 16})
SMALL_B32_ARGS = ["model.name=ViT-B-32", "model.embed_dim=32",
                  "model.vision_cfg={width: 64, layers: 1, head_width: 32, image_size: 32, patch_size: 16}",
                  "model.text_cfg={width: 32, heads: 2, layers: 1, context_length: 16}"]
HUB_REPO = "mmcl-test/tiny-clip"
TAG_REPO = "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"  # where open_clip's ViT-B-32 laion2b_s34b_b79k tag lives


def _saved(tmp_path, cfg: ModelConfig, preprocess=None):
    """A model mmcl built and saved (open_clip's local-dir layout): (directory, its state dict)."""
    torch.manual_seed(3)
    model, model_cfg, pp, *_ = models.build(cfg)
    with torch.no_grad():  # weights no initialiser would give, so that a fresh model never matches by chance
        for name, p in model.named_parameters():
            if "logit" not in name:  # the scale stays under its clamp
                p.add_(torch.randn_like(p))
    out = weights.save_model_dir(model, model_cfg, {**pp, **(preprocess or {})}, tmp_path / "saved")
    return out, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(model, state):
    own = model.state_dict()
    assert sorted(own) == sorted(state)
    for key, value in state.items():
        assert torch.equal(own[key], value), key


def test_hf_hub_name_gives_exactly_the_saved_weights_architecture_and_preprocessing(tmp_path, hf_cache):
    saved, state = _saved(tmp_path, ModelConfig(name="tiny", embed_dim=24),
                          preprocess={"mean": [0.5, 0.25, 0.125], "interpolation": "bilinear"})
    snapshot = hf_cache(HUB_REPO, {"open_clip_config.json": saved / "open_clip_config.json",
                                   "open_clip_model.safetensors": saved / "open_clip_model.safetensors"})
    source = pretrained.resolve_pretrained(f"hf-hub:{HUB_REPO}", "tiny")
    assert source.weights == snapshot / "open_clip_model.safetensors"  # read from the cache, as downloaded
    # model.name is the default; the hub's config brings the architecture (embed_dim 24, not tiny's) and its
    # preprocessing.
    model, model_cfg, pp, tokenizer, report = pretrained.build_pretrained(ModelConfig(pretrained=f"hf-hub:{HUB_REPO}"))
    assert model_cfg["embed_dim"] == 24
    _assert_same(model, state)
    assert pp["mean"] == [0.5, 0.25, 0.125] and pp["interpolation"] == "bilinear"
    assert f"model.pretrained=hf-hub:{HUB_REPO}" in report and "missing 0; unexpected 0" in report
    assert tokenizer(["a photo"]).shape[0] == 1


def test_hf_hub_name_not_cached_is_one_line_naming_repo_and_cache(hf_cache):
    with pytest.raises(CheckpointError) as err:
        pretrained.build_pretrained(ModelConfig(pretrained="hf-hub:mmcl-test/absent"))
    text = str(err.value)
    assert "\n" not in text and "open_clip_config.json of mmcl-test/absent" in text
    assert str(hf_cache.cache) in text and "HF_HUB_OFFLINE=1" in text


def test_open_clip_tag_reads_the_cached_download(tmp_path, hf_cache):
    saved, state = _saved(tmp_path, ModelConfig(**SMALL_B32))
    # open_clip's download for this tag prefers the safetensors file of the tag's hub repo.
    hf_cache(TAG_REPO, {"open_clip_model.safetensors": saved / "open_clip_model.safetensors"})
    cfg = ModelConfig(**SMALL_B32, pretrained="laion2b_s34b_b79k")
    model, model_cfg, pp, _, report = pretrained.build_pretrained(cfg)
    _assert_same(model, state)
    assert model_cfg["vision_cfg"]["width"] == 64  # model.name's architecture with its overrides
    assert "ViT-B-32 'laion2b_s34b_b79k'" in report and "WARNING" not in report


def test_openai_tag_warns_of_quickgelu(tmp_path, hf_cache):
    saved, _ = _saved(tmp_path, ModelConfig(**SMALL_B32))
    hf_cache("timm/vit_base_patch32_clip_224.openai", {"open_clip_model.safetensors":
                                                       saved / "open_clip_model.safetensors"})
    *_, report = pretrained.build_pretrained(ModelConfig(**SMALL_B32, pretrained="openai"))
    assert "WARNING: these weights were trained with QuickGELU" in report and "ViT-B-32-quickgelu" in report


def test_tag_not_cached_is_one_error_line_before_the_run(tmp_path, hf_cache, capsys):
    code = main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={tmp_path}/s-{{0..1}}.tar",
                 f"train.output_dir={tmp_path / 'run'}", *SMALL_B32_ARGS, "model.pretrained=laion2b_s34b_b79k"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("mmcl: error:"), err
    assert "model.pretrained: ViT-B-32 'laion2b_s34b_b79k'" in err and TAG_REPO in err
    assert str(hf_cache.cache) in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_unknown_tag_lists_the_tags_open_clip_knows(tmp_path, hf_cache, capsys):
    code = main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={tmp_path}/s-{{0..1}}.tar",
                 f"train.output_dir={tmp_path / 'run'}", "model.name=ViT-B-32", "model.pretrained=laion2b_nope"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "'laion2b_nope' is not a published tag of ViT-B-32; open_clip knows: openai, laion400m_e31" in err
    assert "laion2b_s34b_b79k" in err and "metaclip_fullcc" in err
    # An architecture without published weights says so, and names where the tag is published.
    problem = pretrained.pretrained_problem("openai", "tiny")
    assert "no weights for model.name=tiny" in problem and "ViT-B-32" in problem


def test_pretrained_and_init_from_together_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model.pretrained and model.init_from are both set"):
        load_config(str(ROOT / "configs" / "tiny.yaml"), ["model.pretrained=openai", f"model.init_from={tmp_path}"])


def _open_clip_train_run(tmp_path, model: str, state, prefix: str = "module.") -> Path:
    """What open_clip_train leaves: logs/NAME/params.txt and checkpoints/epoch_N.pt (a plain dict)."""
    run = tmp_path / "logs" / "my-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "params.txt").write_text(f"batch_size: 8\nepochs: 2\nlr: 0.0005\nmodel: {model}\nname: my-run\n"
                                    f"pretrained: laion2b_s34b_b79k\nprecision: amp\n")
    for epoch, scale in ((1, 0.0), (2, 1.0)):
        sd = {prefix + k: v * scale for k, v in state.items()}
        torch.save({"epoch": epoch, "name": "my-run", "state_dict": sd,
                    "optimizer": {"state": {}, "param_groups": [{"lr": 0.0005, "betas": (0.9, 0.98),
                                                                 "params": [0, 1]}]}},
                   run / "checkpoints" / f"epoch_{epoch}.pt")
    return run


def test_open_clip_train_checkpoint_is_a_model(tmp_path, hf_cache):
    # An mmcl model name keeps the test small; an open_clip name resolves through the same lookup.
    _, state = _saved(tmp_path, ModelConfig(name="tiny"))
    run = _open_clip_train_run(tmp_path, "tiny", state)
    ckpt = run / "checkpoints" / "epoch_2.pt"
    # model.pretrained: the architecture from params.txt (not model.name's ViT-B-32), the weights exact.
    model, model_cfg, pp, _, report = pretrained.build_pretrained(ModelConfig(name="ViT-B-32", pretrained=str(ckpt)))
    _assert_same(model, state)
    assert model_cfg["embed_dim"] == 128 and "architecture tiny from" in report
    assert "open_clip_train checkpoint epoch_2.pt" in report
    # The run folder means its newest checkpoint; mmcl.load reads it too (zeroshot, retrieval, export).
    for path in (run, ckpt):
        loaded, preprocess, tokenizer = weights.load(path)
        _assert_same(loaded, state)
    assert weights.find_model_dir(ckpt) == run / "checkpoints"
    assert main(["export", "--model", str(ckpt), "--format", "open_clip", "--out", str(tmp_path / "export")]) == 0
    _assert_same(weights.load(tmp_path / "export")[0], state)
    loaded, model_cfg, pp = weights.load_model_dir(run / "checkpoints" / "epoch_1.pt")
    assert all(torch.count_nonzero(v) == 0 for v in loaded.state_dict().values())  # that epoch, not the newest
    assert tuple(pp["mean"]) == (0.48145466, 0.4578275, 0.40821073)


def test_mmcl_model_directory_brings_its_architecture(tmp_path, hf_cache):
    saved, state = _saved(tmp_path, ModelConfig(name="tiny", embed_dim=24))
    model, model_cfg, *_ = pretrained.build_pretrained(ModelConfig(pretrained=str(saved)))
    assert model_cfg["embed_dim"] == 24
    _assert_same(model, state)


def _finetune(demo, out, *extra):
    return main(["train", "--config", str(ROOT / "configs" / "finetune.yaml"), f"data.train={demo['train']}",
                 f"train.output_dir={out}", "eval.zeroshot=null", "train.progress=false", "train.plot=false",
                 "data.batch_size=8", "data.workers=0", "data.shuffle_buffer=8", "train.steps=1",
                 "train.save_every=0", "optim.warmup_steps=0", *extra])


@pytest.mark.slow
def test_training_starts_from_a_hub_model(tmp_path, hf_cache, small_demo, capsys):
    saved, state = _saved(tmp_path, ModelConfig(name="tiny", embed_dim=24))
    hf_cache(HUB_REPO, {"open_clip_config.json": saved / "open_clip_config.json",
                        "open_clip_model.safetensors": saved / "open_clip_model.safetensors"})
    out = tmp_path / "run"
    code = _finetune(small_demo, out, f"model.pretrained=hf-hub:{HUB_REPO}", "optim.lr=0", "train.ema_decay=null")
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert f"model.pretrained=hf-hub:{HUB_REPO}" in printed.out + printed.err
    model, _, _ = weights.load(out / "model")
    assert json.loads((out / "model" / "open_clip_config.json").read_text())["model_cfg"]["embed_dim"] == 24
    _assert_same(model, state)  # lr 0: the final model is the published one


@pytest.mark.slow
def test_readme_finetune_from_a_tag_then_zeroshot(tmp_path, hf_cache, small_demo, capsys):
    # docs/finetuning.md's example (configs/finetune.yaml, model.name=ViT-B-32 model.pretrained=laion2b_s34b_b79k) at a
    # test's size, offline from the cache a download leaves, then evaluated zero-shot.
    saved, state = _saved(tmp_path, ModelConfig(**SMALL_B32))
    hf_cache(TAG_REPO, {"open_clip_model.safetensors": saved / "open_clip_model.safetensors"})
    out = tmp_path / "ft-b32"
    assert _finetune(small_demo, out, *SMALL_B32_ARGS, "model.pretrained=laion2b_s34b_b79k") == 0
    printed = capsys.readouterr()
    said = printed.out + printed.err
    assert "model.pretrained=laion2b_s34b_b79k" in said and "missing 0" in said
    model, _, _ = weights.load(out / "model")
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in state.items())  # it trained
    results = tmp_path / "zs.json"
    assert main(["zeroshot", "--model", str(out), "--data", small_demo["zeroshot_colour"], "--out", str(results)]) == 0
    assert 0.0 <= json.loads(results.read_text())["metrics"]["acc1"] <= 1.0
