"""LoRA fine-tuning (model.lora, mmcl.models.lora): what trains, the wrapped model against the plain one and the
merged one, open_clip loading the merged weights, a run stopped and resumed exactly, a checkpoint read as a model,
accumulation, and the adapters exported in peft's format and loaded back with peft."""

import copy
import functools
import json
import re
import subprocess
import sys

import pytest
import torch

from mmcl.config import load_config
from mmcl.errors import ConfigError
from mmcl.models import lora

from helpers import ROOT, TRAINING_TOWERS, fake_batch, final_weights, metrics, micro_model, run_args
from preempt import sigterm_during_step

LORA = ["model.lora.r=4", "model.lora.alpha=8"]


def _lora_cfg(*extra):
    return load_config(None, [*TRAINING_TOWERS, *LORA, *extra]).model.lora


def _features(model, batch):
    out = model(batch["image"], batch["text"])
    return out["image_features"], out["text_features"]


def _close(a, b, atol=1e-5):
    return all(torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a, b))


def _trained(model, steps=3):
    """A few AdamW steps on the features' sum: every adapter moves off its zero start."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for s in range(steps):
        img, txt = _features(model, fake_batch(4, s))
        (img.sum() + (txt * txt).sum()).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_only_the_adapters_and_the_logit_scale_train():
    model = micro_model()
    line = lora.apply_lora(model, _lora_cfg())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "logit_scale" in trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable if n != "logit_scale")
    # every block's attention (its packed q/k/v projection) and MLP, in both towers
    for tower in ("visual.transformer", "transformer"):
        for part in ("attn.lora_A", "mlp.c_fc.lora_A", "mlp.c_proj.lora_B"):
            assert any(n.startswith(f"{tower}.resblocks.1.{part}") for n in trainable), (tower, part)
    assert not any("out_proj.lora" in n for n in trainable)  # held at zero (peft 0.21 applies it twice)
    assert "12 layers adapted" in line and "parameters train" in line, line
    text_only = micro_model()
    lora.apply_lora(text_only, _lora_cfg("model.lora.towers=[text]"))
    assert not any(p.requires_grad for p in text_only.visual.parameters())


def test_a_fresh_adapter_changes_nothing_and_a_trained_one_merges_into_plain_weights(tmp_path):
    import open_clip

    from mmcl import models
    from mmcl.storage import weights

    plain = micro_model().eval()
    model = copy.deepcopy(plain)
    lora.apply_lora(model, _lora_cfg())
    batch = fake_batch(3, 9)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(_features(model, batch), _features(plain, batch)))
    _trained(model)
    # the frozen weights are exactly the plain model's, however many forwards ran (peft's attention folds its
    # adapter in and out of them in each one)
    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if ".lora_" not in k}
    assert base.keys() == plain.state_dict().keys()
    assert all(torch.equal(base[k], v) for k, v in plain.state_dict().items() if k != "logit_scale")
    merged = lora.merged(model)
    assert merged is not model and lora.is_wrapped(model) and not lora.is_wrapped(merged)
    assert set(merged.state_dict()) == set(plain.state_dict())
    with torch.no_grad():
        wrapped_out = _features(model, batch)
        assert _close(wrapped_out, _features(merged, batch))
        assert not _close(wrapped_out, _features(plain, batch), atol=1e-3)  # training moved the adapters
    # a checkpoint's state dict merged without peft gives the same tensors
    by_state = lora.merge_state(model.state_dict(), lora.settings(_lora_cfg()))
    assert all(torch.equal(by_state[k], v) for k, v in merged.state_dict().items())
    # open_clip's own model loads the merged weights as they are
    model_cfg = models.resolve_model_config(load_config(None, TRAINING_TOWERS).model)
    out = weights.save_model_dir(merged, model_cfg, models.preprocess_config(model_cfg), tmp_path / "m")
    oc = open_clip.create_model(f"local-dir:{out}").eval()
    with torch.no_grad():
        oc_img = oc.encode_image(batch["image"], normalize=True)
        assert torch.allclose(oc_img, wrapped_out[0], atol=1e-5, rtol=0)


def test_lora_settings_that_cannot_work_are_one_line_each():
    for overrides, message in ((["model.lock_image=true"], "drop image from model.lora.towers"),
                               (["model.lora.towers=[audio]"], "model.lora.towers must list image and/or text"),
                               (["model.lora.dropout=1.0"], "model.lora.dropout must be in [0, 1)"),
                               (["model.lora.r=-1"], "model.lora.r must be >= 0")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [*TRAINING_TOWERS, *LORA, *overrides])
    with pytest.raises(ConfigError) as err:
        lora.apply_lora(micro_model(), _lora_cfg("model.lora.target_modules=[query,value]"))
    assert "image tower" in str(err.value) and "c_fc" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="out_proj of an nn.MultiheadAttention"):
        lora.apply_lora(micro_model(), _lora_cfg("model.lora.target_modules=[out_proj]"))


def _args(demo, out, *extra):
    return ["train", *run_args(demo, out, "train.steps=6", "data.batch_size=16", "train.save_every=2",
                               "train.log_every=1", "optim.lr=5e-3", *LORA, *extra)]


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_and_its_model_checkpoint_and_adapters_load(demo, tmp_path, monkeypatch, capsys):
    import mmcl.training.step as step_mod
    from mmcl.cli import main

    ref, out = tmp_path / "ref", tmp_path / "run"
    assert main(_args(demo, ref)) == 0
    assert "LoRA r=4 alpha=8 on the image and text towers" in capsys.readouterr().out
    real = sigterm_during_step(3, monkeypatch)
    assert main(_args(demo, out)) == 75
    monkeypatch.setattr(step_mod, "forward_loss", real)
    assert main(_args(demo, out)) == 0
    a, b = final_weights(ref), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)]
    assert not any("lora" in k or "base_layer" in k for k in a)  # model/ holds plain weights

    # model/ loads with mmcl.load without peft; the last checkpoint reads as the same model
    batch = fake_batch(2, 5)
    code = ("import sys, torch, mmcl; m = mmcl.load(sys.argv[1])[0]; assert 'peft' not in sys.modules; "
            "print(m.encode_image(torch.load(sys.argv[2]), normalize=True).tolist())")
    torch.save(batch["image"], tmp_path / "images.pt")
    done = subprocess.run([sys.executable, "-c", code, str(out), str(tmp_path / "images.pt")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from_model = torch.tensor(json.loads(done.stdout))
    import mmcl

    ckpt = sorted((out / "checkpoints").glob("step-*"))[-1]
    assert json.loads((ckpt / "model_config.json").read_text())["lora"]["r"] == 4
    with torch.no_grad():
        from_ckpt = mmcl.load(ckpt)[0].encode_image(batch["image"], normalize=True)
    assert torch.allclose(from_ckpt, from_model, atol=1e-5, rtol=0)

    # the adapters alone, loaded with peft onto the run's base weights
    _adapters_load_with_peft(out, tmp_path / "adapters", ckpt, batch, from_model, capsys)


def _adapters_load_with_peft(run, target, ckpt, batch, expected, capsys):
    import peft
    from safetensors.torch import load_file

    from mmcl import models
    from mmcl.cli import main
    from mmcl.storage import checkpoints

    assert main(["export", "--model", str(run), "--adapters-only", "--out", str(target)]) == 0
    assert "exported the LoRA adapters" in capsys.readouterr().out
    state, meta = checkpoints.model_of_checkpoint(ckpt, merge_lora=False)
    base = {k.replace(".base_layer", ""): v for k, v in state.items() if ".lora_" not in k}
    model = models.create(meta["model_cfg"])
    model.load_state_dict(base)
    config = peft.LoraConfig.from_pretrained(str(target))
    peft.inject_adapter_in_model(config, model)
    result = peft.set_peft_model_state_dict(model, load_file(str(target / "adapter_model.safetensors")))
    assert not [k for k in result.unexpected_keys]
    with torch.no_grad():
        got = model.eval().encode_image(batch["image"], normalize=True)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_lora_with_accumulation_and_the_export_refusals(demo, tmp_path, capsys):
    from mmcl.cli import main

    out = tmp_path / "accum"
    assert main(_args(demo, out, "train.accum_steps=2", "train.steps=2")) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] == r["loss"] for r in rows)
    plain = tmp_path / "plain"
    assert main(["train", *run_args(demo, plain, "train.steps=1", "data.batch_size=8", "train.save_every=1")]) == 0
    capsys.readouterr()
    for args, message in (([str(plain), "--adapters-only"], "was not trained with LoRA"),
                          ([str(out), "--adapters-only", "--format", "hf"],
                           "takes one of --format and --adapters-only"),
                          ([str(out)], "takes one of --format and --adapters-only"),
                          ([str(tmp_path / "nowhere"), "--adapters-only"], "is not a run folder")):
        assert main(["export", "--model", *args, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mmcl: error:") and message in err and "\n" not in err, err


def test_fsdp_with_lora_is_refused_in_one_line(demo, tmp_path, monkeypatch, capsys):
    from mmcl.cli import main
    from mmcl.training import setup as build

    monkeypatch.setattr(build.fsdp, "in_effect", lambda accelerator: True)
    assert main(_args(demo, tmp_path / "r")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmcl: error: model.lora is not supported with FSDP") and "\n" not in err, err


def test_the_lora_recipe_trains_adapters_on_both_towers():
    cfg = load_config(str(ROOT / "configs" / "lora.yaml"))
    assert cfg.model.lora.r > 0 and list(cfg.model.lora.towers) == ["image", "text"]
    assert "model.pretrained=" in (ROOT / "configs" / "lora.yaml").read_text()  # the start point, as finetune.yaml


def test_with_an_ema_the_model_and_the_adapters_export_both_carry_the_averaged_adapters(demo, tmp_path, capsys):
    """train.ema_decay with LoRA: the average covers the adapters (the trainable weights), model/ merges the
    averaged adapters, and the adapters-only export writes the same averaged adapters (peft's base + adapters
    embeds as model/ does); the raw, last-step adapters give other embeddings."""
    import mmcl
    from mmcl.cli import main

    out = tmp_path / "ema"
    assert main(_args(demo, out, "train.ema_decay=0.5", "train.steps=4")) == 0
    batch = fake_batch(2, 5)
    with torch.no_grad():
        from_model = mmcl.load(out)[0].encode_image(batch["image"], normalize=True)
    assert not any("lora" in k or "base_layer" in k for k in final_weights(out))
    ckpt = sorted((out / "checkpoints").glob("step-*"))[-1]
    _adapters_load_with_peft(out, tmp_path / "adapters", ckpt, batch, from_model, capsys)
    raw = tmp_path / "raw"
    assert main(_args(demo, raw, "train.steps=4")) == 0
    with torch.no_grad():
        from_raw = mmcl.load(raw)[0].encode_image(batch["image"], normalize=True)
    assert not torch.allclose(from_raw, from_model, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_lora_on_linear_layers_gives_the_eager_losses_and_on_attention_is_refused(demo, tmp_path, capsys,
                                                                                          monkeypatch):
    """train.compile with LoRA: adapters on linear layers compile and give the eager run's losses; adapters on
    open_clip's attention (the default targets), whose weights peft swaps in each forward, are refused in one line
    before the first step (they failed in AOTAutograd, under inductor, with a traceback). The backend is aot_eager:
    AOTAutograd's tracing without inductor's code generation (tests/training/test_compile_inductor.py has that)."""
    from mmcl.cli import main

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    assert main(_args(demo, tmp_path / "attn", "train.compile=true")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmcl: error: train.compile cannot trace LoRA on attention layers") and "\n" not in err, err
    assert main(_args(demo, tmp_path / "attn", "train.steps=1")) == 0  # the refused run's folder takes its fix
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    linear = "model.lora.target_modules=[c_fc,c_proj]"
    assert main(_args(demo, eager, "train.steps=3", linear)) == 0
    assert main(_args(demo, compiled, "train.steps=3", "train.compile=true", linear)) == 0
    a, b = [r["loss"] for r in metrics(eager)], [r["loss"] for r in metrics(compiled)]
    assert len(a) == len(b) == 3 and all(abs(x - y) < 1e-4 * max(1.0, abs(x)) for x, y in zip(a, b)), (a, b)


@pytest.mark.slow
def test_lora_on_a_hugging_face_text_tower_trains_its_adapters_and_model_loads_without_peft(demo, tmp_path,
                                                                                           tokenizer_dir):
    """LoRA on MiniLM's query and value projections (a transformers BertModel as the text tower) beside open_clip's
    image tower: only adapters and the logit scale train, model/ holds plain transformers weights that mmcl.load
    reads without peft, and its text embeddings are the merged model's, not the base MiniLM's."""
    from mmcl.cli import main

    out = tmp_path / "lit"
    extra = [f"model.text.hf={tokenizer_dir}", "model.text.pooling=mean", "model.text.projection=none",
             "model.embed_dim=384", "model.lora.target_modules=[attn,c_fc,c_proj,query,value]", "optim.lr=5e-2"]
    assert main(_args(demo, out, "train.steps=3", *extra)) == 0
    weights = final_weights(out)
    assert not any("lora" in k or "base_layer" in k for k in weights)
    code = ("import sys, torch, mmcl; m, _, tok = mmcl.load(sys.argv[1]); assert 'peft' not in sys.modules; "
            "print(m.encode_text(tok(['a red circle']), normalize=True).tolist())")
    runs = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
            for path in (out, sorted((out / "checkpoints").glob("step-*"))[-1])]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    merged, from_ckpt = (torch.tensor(json.loads(r.stdout)) for r in runs)
    assert torch.allclose(merged, from_ckpt, atol=1e-5, rtol=0)
    from transformers import AutoModel, AutoTokenizer

    base = AutoModel.from_pretrained(str(tokenizer_dir)).eval()
    batch = AutoTokenizer.from_pretrained(str(tokenizer_dir))(["a red circle"], return_tensors="pt")
    with torch.no_grad():
        hidden = base(**batch).last_hidden_state.mean(1)
    assert not torch.allclose(torch.nn.functional.normalize(hidden, dim=-1), merged, atol=1e-3)
