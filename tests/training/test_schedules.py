"""The run's length (train.steps / train.samples / train.epochs), the learning-rate schedules against open_clip's and
transformers' own functions, the weight-decay exclusion pattern, and the optimiser's found_inf fallback line."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmcl import models
from mmcl.cli import main
from mmcl.config import OptimConfig, load_config
from mmcl.errors import ConfigError, DataError
from mmcl.training import optim
from mmcl.training.optim import lr_at
from mmcl.training.plan import run_length, total_steps
from mmcl.training.step import FiniteChecks

from helpers import TRAINING_TOWERS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _sections(cfg):
    return cfg.data, cfg.train


def _sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


# ------------------------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize("warmup,total", [(0, 37), (5, 37), (10, 11)])
def test_cosine_and_constant_match_open_clip_step_by_step(warmup, total):
    from open_clip_train.scheduler import const_lr, cosine_lr

    cos = cosine_lr(_sgd(), 5e-4, warmup, total)
    const = const_lr(_sgd(), 5e-4, warmup, total)
    for step in range(total):
        assert lr_at(step, OptimConfig(lr=5e-4, warmup_steps=warmup, schedule="cosine"), total) == pytest.approx(
            cos(step), rel=1e-12, abs=1e-18)
        assert lr_at(step, OptimConfig(lr=5e-4, warmup_steps=warmup, schedule="constant"), total) == pytest.approx(
            const(step), rel=1e-12)


@pytest.mark.parametrize("power,end_lr", [(1.0, 0.0), (0.5, 0.0), (2.0, 1e-5)])
@pytest.mark.parametrize("warmup,cooldown,total", [(4, 10, 40), (0, 1, 9), (3, 37, 40)])
def test_const_cooldown_matches_open_clip_step_by_step(power, end_lr, warmup, cooldown, total):
    from open_clip_train.scheduler import const_lr_cooldown

    ref = const_lr_cooldown(_sgd(), 5e-4, warmup, total, cooldown, power, end_lr)
    cfg = OptimConfig(lr=5e-4, warmup_steps=warmup, schedule="const-cooldown", cooldown_steps=cooldown,
                      cooldown_power=power, min_lr=end_lr)
    optim.check_schedule(cfg, total)  # fits
    lrs = [lr_at(step, cfg, total) for step in range(total)]
    assert lrs == pytest.approx([ref(step) for step in range(total)], rel=1e-12, abs=1e-18)
    # The peak up to the cooldown's first step; below it from the second (as open_clip, min_lr is reached at the
    # step after the last).
    assert lrs[total - cooldown] == pytest.approx(5e-4) and (cooldown < 2 or lrs[-1] < 5e-4)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt", "cosine"])
@pytest.mark.parametrize("warmup,decay,total,min_lr", [(5, 8, 30, 0.0), (0, 30, 30, 1e-4), (2, 1, 10, 5e-5)])
def test_wsd_matches_transformers_after_the_warmup(shape, warmup, decay, total, min_lr):
    transformers_optimization = pytest.importorskip("transformers.optimization")
    if not hasattr(transformers_optimization, "get_wsd_schedule"):
        pytest.skip("this transformers has no get_wsd_schedule")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = transformers_optimization.get_wsd_schedule(opt, num_warmup_steps=warmup, num_decay_steps=decay,
                                                       num_training_steps=total, decay_type=shape,
                                                       min_lr_ratio=min_lr / 1e-3)
    ref = []
    for _ in range(total):
        ref.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    cfg = OptimConfig(lr=1e-3, warmup_steps=warmup, schedule="wsd", cooldown_steps=decay, cooldown_shape=shape,
                      min_lr=min_lr)
    # The warmup is open_clip's ((step + 1) / warmup: the peak on the warmup's last step); stable and decay match.
    assert [lr_at(s, cfg, total) for s in range(warmup, total)] == pytest.approx(ref[warmup:], rel=1e-9, abs=1e-15)
    assert [lr_at(s, cfg, total) for s in range(warmup)] == pytest.approx(
        [1e-3 * (s + 1) / warmup for s in range(warmup)])


def test_wsd_cooldown_fraction_and_its_checks():
    cfg = load_config(None, ["optim.schedule=wsd", "optim.cooldown_fraction=0.25", "optim.warmup_steps=2",
                             "optim.lr=1.0", "optim.cooldown_shape=1-sqrt"]).optim
    assert optim.cooldown_steps(cfg, 40) == 10
    lrs = [lr_at(s, cfg, 40) for s in range(40)]
    assert lrs[2:30] == [1.0] * 28  # stable from the warmup's end to the cooldown
    assert lrs[30:] == pytest.approx([1.0 - math.sqrt(k / 10) for k in range(10)])
    with pytest.raises(ConfigError, match=r"warmup_steps \(8\) \+ the cooldown \(5 steps\) exceed the run's 12"):
        optim.check_schedule(OptimConfig(schedule="const-cooldown", warmup_steps=8, cooldown_steps=5), 12)
    with pytest.raises(ConfigError, match="needs a cooldown"):
        optim.check_schedule(OptimConfig(schedule="wsd", cooldown_fraction=0.0), 100)
    with pytest.raises(ConfigError, match="optim.cooldown_shape must be one of"):
        load_config(None, ["optim.cooldown_shape=sqrt"])
    with pytest.raises(ConfigError, match="optim.schedule must be one of"):
        load_config(None, ["optim.schedule=wsdd"])


# ------------------------------------------------------------------------------------------------ weight decay
def test_no_decay_pattern_adds_to_the_exclusions():
    torch.manual_seed(0)
    cfg = load_config(None, TRAINING_TOWERS + ["optim.no_decay_pattern=positional_embedding|token_embedding"])
    model, *_ = models.build(cfg.model)
    groups = optim.param_groups(model, cfg.optim)
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    plain = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    assert {"positional_embedding", "token_embedding.weight", "visual.positional_embedding"} <= plain
    assert "logit_scale" in plain and not any(n.endswith(".bias") for n in decayed)
    assert decayed and all("positional_embedding" not in n and "token_embedding" not in n for n in decayed)
    # Without the pattern those matrices are decayed.
    default = optim.param_groups(model, load_config(None, TRAINING_TOWERS).optim)
    assert "token_embedding.weight" in {n for g in default if g["weight_decay"] > 0 for n in g["names"]}
    with pytest.raises(ConfigError, match="optim.no_decay_pattern is not a regular expression"):
        load_config(None, ["optim.no_decay_pattern=(unclosed"])


# ------------------------------------------------------------------------------------------------ run length
def _shards(folder, n):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"shard-{i:06d}.tar").write_bytes(b"")
    return str(folder / f"shard-{{000000..{n - 1:06d}}}.tar")


def test_epochs_from_train_num_samples_as_open_clip():
    # open_clip: ceil(samples / global batch) steps per epoch, times the epochs.
    cfg = load_config(None, ["train.epochs=3", "data.train_num_samples=1000", "data.batch_size=32",
                             "train.accum_steps=2"])
    steps, line = run_length(cfg.data, cfg.train, 4)  # global batch 256: 4 steps per epoch
    assert steps == 12 == total_steps(cfg.data, cfg.train, 4)
    assert line == "train.epochs=3 of 1,000 samples (data.train_num_samples): 12 steps of 256 samples (4 per epoch)"
    half = load_config(None, ["train.epochs=0.5", "data.train_num_samples=1000", "data.batch_size=100"])
    assert run_length(half.data, half.train, 1)[0] == 5


def test_epochs_from_sizes_json_beside_the_shards(tmp_path):
    spec = _shards(tmp_path / "a", 3)
    (tmp_path / "a" / "sizes.json").write_text(json.dumps(
        {"shard-000000.tar": 100, "shard-000001.tar": 90, "shard-000002.tar": 10, "other.tar": 5000}))
    cfg = load_config(None, [f"data.train={spec}", "train.epochs=2", "data.batch_size=64"])
    steps, line = run_length(cfg.data, cfg.train, 1)
    assert steps == 2 * math.ceil(200 / 64) and "200 samples (sizes.json)" in line
    # A range with a hole: the shards that exist count (the data layer trains on them).
    cfg = load_config(None, [f"data.train={str(tmp_path / 'a' / 'shard-{000000..000003}.tar')}", "train.epochs=1",
                             "data.batch_size=64"])
    assert run_length(cfg.data, cfg.train, 1)[0] == math.ceil(200 / 64)


def test_epochs_from_img2dataset_stats_and_len_files(tmp_path):
    spec = _shards(tmp_path / "b", 2)
    for i, n in enumerate((7, 5)):
        (tmp_path / "b" / f"shard-{i:06d}_stats.json").write_text(json.dumps({"successes": n, "count": 10}))
    cfg = load_config(None, [f"data.train={spec}", "train.epochs=1", "data.batch_size=4"])
    assert run_length(cfg.data, cfg.train, 1)[0] == 3  # 12 samples
    spec = _shards(tmp_path / "c", 2)
    (tmp_path / "c" / "__len__").write_text("41\n")
    cfg = load_config(None, [f"data.train={spec}::{tmp_path / 'b'}", "train.epochs=1", "data.batch_size=4"])
    steps, line = run_length(cfg.data, cfg.train, 1)
    assert steps == math.ceil((41 + 12) / 4) and "__len__" in line


def test_epochs_with_unknown_counts_or_two_lengths_is_one_error(tmp_path):
    spec = _shards(tmp_path / "d", 2)
    cfg = load_config(None, [f"data.train={spec}", "train.epochs=1"])
    with pytest.raises(DataError, match=r"shard-000000.tar is unknown .*data.train_num_samples"):
        run_length(cfg.data, cfg.train, 1)
    # __len__ is a folder's total: it cannot count for part of the folder.
    (tmp_path / "d" / "__len__").write_text("50")
    cfg = load_config(None, [f"data.train={tmp_path / 'd' / 'shard-000000.tar'}", "train.epochs=1"])
    with pytest.raises(DataError, match="unknown"):
        run_length(cfg.data, cfg.train, 1)
    remote = load_config(None, ["data.train=https://example.com/shard-{0..3}.tar", "train.epochs=1"])
    with pytest.raises(DataError, match="URL or pipe: command has no sizes file"):
        run_length(remote.data, remote.train, 1)
    with pytest.raises(ConfigError, match=r"train.samples \(100\) and train.epochs \(2.0\) both set"):
        load_config(None, ["train.samples=100", "train.epochs=2"])
    with pytest.raises(ConfigError, match="data.train_num_samples is set but train.epochs is not"):
        load_config(None, ["data.train_num_samples=100"])
    with pytest.raises(ConfigError, match="train.epochs must be > 0"):
        load_config(None, ["train.epochs=0"])


def test_steps_and_samples_keep_their_meaning():
    assert run_length(*_sections(load_config(None, ["train.steps=7", "data.batch_size=8"])), 2) == (
        7, "train.steps=7: 7 steps of 16 samples")
    assert run_length(*_sections(load_config(None, ["train.samples=100", "data.batch_size=8"])), 2)[0] == 7


# ------------------------------------------------------------------------------------------------ found_inf
def test_an_optimiser_without_found_inf_falls_back_with_one_line():
    accelerator = SimpleNamespace(num_processes=1, scaler=None)
    model = torch.nn.Linear(4, 4)
    fused = optim.build_optimizer(model, OptimConfig())
    assert fused.defaults["fused"] and optim.host_check_line(fused, None) is None
    assert FiniteChecks(accelerator, fused).on_device
    # Parameters bound for a device without a fused kernel (torch itself would fail only at the first step): the
    # per-tensor AdamW, and the reason in the line.
    plain = optim.build_optimizer(model, OptimConfig(), device=torch.device("meta"))
    assert not plain.defaults.get("fused") and not FiniteChecks(accelerator, plain).on_device
    line = optim.host_check_line(plain, None)
    assert line.startswith("a step with a non-finite loss is detected on the host (one device sync per step): "
                           "the fused AdamW is not available here (no fused kernel for meta") and "\n" not in line
    complex_params = optim.build_optimizer(torch.nn.Linear(4, 4, dtype=torch.complex64), OptimConfig())
    assert "parameters of dtype torch.complex64" in optim.host_check_line(complex_params, None)
    wrapped = SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # accelerate's wrapper
    assert "the optimiser (SGD) cannot take found_inf" in optim.host_check_line(wrapped, None)
    scaler = object()
    assert not FiniteChecks(SimpleNamespace(num_processes=1, scaler=scaler), fused).on_device
    assert "fp16's loss scaler sets found_inf itself" in optim.host_check_line(fused, scaler)


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_a_run_of_epochs_with_a_cooldown(tmp_path, capsys):
    import tarfile
    from pathlib import Path

    from open_clip_train.scheduler import const_lr_cooldown

    from mmcl.cli import main
    from mmcl.shards.demo import make_demo_data

    demo = make_demo_data(str(tmp_path / "demo"), n_train=80, n_val=8, n_zeroshot=2, shard_size=48, progress=False)
    folder = Path(demo["train"].split("{")[0]).parent
    sizes = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            sizes[shard.name] = len({m.name.split(".")[0] for m in tar.getmembers()})
    assert sorted(sizes.values()) == [32, 48]
    (folder / "sizes.json").write_text(json.dumps(sizes))
    out = tmp_path / "run"
    root = Path(__file__).resolve().parents[2]
    assert main(["train", "--config", str(root / "configs" / "tiny.yaml"), f"data.train={demo['train']}",
                 f"train.output_dir={out}", "eval.zeroshot=null", "train.progress=false", "train.plot=false",
                 "data.shuffle_buffer=16", *TRAINING_TOWERS, "data.batch_size=16", "train.epochs=2",
                 "train.log_every=1",
                 "train.save_every=0", "optim.warmup_steps=2", "optim.schedule=const-cooldown",
                 "optim.cooldown_steps=4", "optim.lr=1e-3"]) == 0
    printed = capsys.readouterr().out
    assert "mmcl: train.epochs=2 of 80 samples (sizes.json): 10 steps of 16 samples (5 per epoch)" in printed
    assert "detected on the host" not in printed  # the fused AdamW on the CPU: the check stays on the device
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[-1]["samples"] == 160
    ref = const_lr_cooldown(_sgd(), 1e-3, 2, 10, 4)
    assert [r["lr"] for r in rows] == pytest.approx([ref(s) for s in range(10)], rel=1e-12)


def test_shards_written_by_mmcl_carry_their_sizes(tmp_path):
    """`mmcl shards`/`demo-data` write sizes.json beside the shards, so train.epochs needs no hand-made count; a
    second writer into the same folder (another prefix) keeps the first one's entries."""
    from PIL import Image

    from mmcl.data.sizes import shard_samples
    from mmcl.shards.writer import write_shards

    def samples(n, key):
        return [{"key": f"{key}{i}", "image": Image.new("RGB", (4, 4)), "caption": "c"} for i in range(n)]

    write_shards(samples(5, "a"), str(tmp_path), shard_size=2, prefix="shard")
    write_shards(samples(3, "b"), str(tmp_path), shard_size=3, prefix="other")
    assert json.loads((tmp_path / "sizes.json").read_text()) == {
        "other-000000.tar": 3, "shard-000000.tar": 2, "shard-000001.tar": 2, "shard-000002.tar": 1}
    assert shard_samples(str(tmp_path / "shard-{000000..000002}.tar"))[0] == 5


@pytest.mark.parametrize("length", [["train.epochs=2"], ["train.epochs=2", "data.train_num_samples=10"],
                                    ["train.samples=64"], ["train.steps=3"]])
def test_a_table_given_as_data_train_is_recognised_first_whatever_the_length_key(tmp_path, monkeypatch, capsys,
                                                                               length):
    """open_clip's CSV named as data.train: the first line names `mmcl shards`, before any question about its size."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.csv").write_text("filepath\ttitle\nimages/0.png\ta cat\n")
    cfg = load_config(None, ["data.train=train.csv", *length])
    if "train.epochs=2" in length and len(length) == 1:
        with pytest.raises(DataError, match=r"train.csv is a table, not WebDataset shards: make shards of it with "
                                            r"`mmcl shards --input train.csv --out DIR`"):
            run_length(cfg.data, cfg.train, 1)
    code = main(["train", "--config", str(CONFIGS / "tiny.yaml"), "data.train=train.csv", *length,
                 "train.output_dir=run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == ("mmcl: error: data.train: train.csv is a table, not WebDataset shards: make shards of it with "
                      "`mmcl shards --input train.csv --out DIR`, then train with data.train=DIR")


@pytest.mark.parametrize("schedule", ["cosine", "constant", "linear"])
def test_a_warmup_longer_than_the_run_is_said_with_the_last_rate_reached(schedule):
    """configs/tiny.yaml's 15 warm-up steps on a 6-step run: the last step's rate is 6/15 of the peak."""
    cfg = OptimConfig(lr=5e-4, warmup_steps=15, schedule=schedule)
    line = optim.warmup_line(cfg, 6)
    assert lr_at(5, cfg, 6) == 5e-4 * 6 / 15
    assert line == ("warning: optim.warmup_steps=15 is longer than the run's 6 steps: the whole run is warm-up, its "
                    "last step at lr 0.0002 of the peak optim.lr=0.0005 (40 %); set optim.warmup_steps below 6")
    assert optim.warmup_line(OptimConfig(lr=5e-4, warmup_steps=6, schedule=schedule), 6) is None  # peak at the last
    assert optim.warmup_line(cfg, 15) is None


def test_a_run_at_lr_zero_has_no_warm_up_line():
    """optim.lr=0 (a run that only evaluates or records): no peak to reach, so no warm-up line (it divided by 0)."""
    assert optim.warmup_line(OptimConfig(lr=0.0, warmup_steps=100), 1) is None
