"""open_clip_train's flags: the table (mmcl/cli/open_clip_flags.py) covers open_clip_train's own parser, names
real config keys and is the source of docs/migration.md; `mmcl train` answers such flags with the keys they map to,
and `mmcl from-open-clip` turns a command line into a config file."""

import argparse
import copy
import fnmatch
import importlib.util
import math
import types
from pathlib import Path

import pytest
import torch

from mmcl.cli import main
from mmcl.cli.open_clip_flags import DEFAULTS, FLAGS, explain, overrides_for, parse, translate, write_config
from mmcl.config import load_config
from mmcl.data.decode import sample_keys
from mmcl.training.optim import build_optimizer, lr_at, no_weight_decay

ROOT = Path(__file__).resolve().parents[2]


def open_clip_parser() -> argparse.ArgumentParser:
    """The parser `open_clip_train.params.parse_args` builds, taken before it parses."""
    params = pytest.importorskip("open_clip_train.params")

    class Taken(Exception):
        pass

    class Parser(argparse.ArgumentParser):
        def parse_args(self, *a, **k):
            raise Taken(self)

    real = params.argparse
    params.argparse = types.SimpleNamespace(ArgumentParser=Parser, Action=argparse.Action)
    try:
        params.parse_args([])
    except Taken as taken:
        return taken.args[0]
    finally:
        params.argparse = real
    raise AssertionError("open_clip_train.params.parse_args built no parser")


def open_clip_actions():
    """The installed open_clip_train's (3.3) flags, each option string with its action."""
    return {s: a for a in open_clip_parser()._actions if not isinstance(a, argparse._HelpAction)
            for s in a.option_strings}


def test_every_open_clip_train_3_3_flag_is_in_the_table_with_its_arity():
    actions = open_clip_actions()
    assert len(actions) > 80
    assert sorted(set(actions) - set(FLAGS)) == [], "flags of open_clip_train missing from the table"
    for flag, action in actions.items():
        assert FLAGS[flag].nargs == (1 if action.nargs is None else action.nargs), flag
        to = FLAGS[flag].to
        if isinstance(to, dict) and action.choices:
            assert set(action.choices) <= set(to), flag
        assert to is not None or FLAGS[flag].note, f"{flag} has no mapping and no note"


def test_defaults_carried_are_open_clip_trains():
    actions = open_clip_actions()
    for flag, value in DEFAULTS.items():
        default = actions[flag].default
        assert value == ("null" if default is None else str(default)), flag


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_migration_page_is_generated_from_the_table():
    page = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    assert page == _generator().migration_page(), "docs/migration.md is stale: run python docs/gen_reference.py"
    for flag in FLAGS:
        assert f"| `{flag}` |" in page


def run_main(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def test_train_answers_open_clip_flags_with_mmcl_keys_in_one_line(capsys):
    code, _, err = run_main(capsys, "train", "--train-data", "x.csv", "--batch-size", "32", "--epochs", "1")
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert line.startswith("mmcl: error: open_clip_train flags: --train-data x.csv -> data.train=x.csv"), line
    assert "mmcl shards --input x.csv" in line
    assert "--batch-size 32 -> data.batch_size=32" in line and "--epochs 1 -> train.epochs=1" in line


def test_train_takes_a_first_positional_as_the_config_only_when_it_is_yaml(capsys, tmp_path):
    table = tmp_path / "x.csv"
    table.write_text("filepath\ttitle\nimages/a.jpg\ta cat\n", encoding="utf-8")
    code, out, err = run_main(capsys, "train", str(table), "--print-config")
    assert code == 2 and len(err) == 1 and err[0].startswith("mmcl: error: "), err
    assert "not a config file" in err[0] and f"mmcl shards --input {table}" in err[0], err
    code, out, err = run_main(capsys, "train", "shards/{000..009}.tar", "--print-config")
    assert code == 2 and len(err) == 1 and "data.train=shards/{000..009}.tar" in err[0], err
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  steps: 7\n", encoding="utf-8")
    code, out, err = run_main(capsys, "train", str(config), "--print-config")
    assert code == 0 and "steps: 7" in out, err


def test_from_open_clip_writes_a_config_and_lists_what_it_could_not_map(capsys, tmp_path):
    out_file = tmp_path / "config.yaml"
    code, out, err = run_main(
        capsys, "from-open-clip", "--out", str(out_file), "--", "--train-data", "data/{000..009}.tar",
        "--train-num-samples", "1000000", "--batch-size", "32", "--epochs", "2", "--lr", "1e-4", "--model",
        "ViT-B-32", "--siglip", "--report-to", "wandb,tensorboard", "--logs", "/runs", "--name", "exp1",
        "--aug-cfg", "scale=(0.4,1.0)", "--dist-url", "env://", "--csv-separator", ",", "--zeroshot-frequency", "1")
    assert code == 0, err
    cfg = load_config(str(out_file))
    assert cfg.data.train == "data/{000..009}.tar" and cfg.data.train_num_samples == 1000000
    assert (cfg.data.batch_size, cfg.train.epochs, cfg.optim.lr, cfg.model.name) == (32, 2, 1e-4, "ViT-B-32")
    assert cfg.loss.siglip == 1.0 and cfg.loss.clip == 0.0 and cfg.model.init_logit_bias == -10.0
    assert list(cfg.train.log_with) == ["wandb", "tensorboard"] and cfg.train.output_dir == "/runs/exp1"
    assert list(cfg.data.aug.scale) == [0.4, 1.0]
    assert cfg.optim.warmup_steps == 10000 and cfg.optim.grad_clip is None  # open_clip_train's defaults
    for flag in ("--dist-url env://", "--csv-separator ,", "--zeroshot-frequency 1"):
        assert flag in out, out
    assert "mmcl shards --sep ," in out


def test_from_open_clip_errors_are_one_line(capsys, tmp_path):
    taken = tmp_path / "taken.yaml"
    taken.write_text("{}\n", encoding="utf-8")
    for argv in (["--out", str(taken), "--", "--epochs", "1"],
                 ["--out", str(tmp_path / "c.yaml"), "--", "--batch-size"],
                 ["--out", str(tmp_path / "c.yaml"), "--", "--batch-size", "-3"]):
        code, _, err = run_main(capsys, "from-open-clip", *argv)
        assert code == 2 and len(err) == 1 and err[0].startswith("mmcl: error: "), (argv, err)
    assert taken.read_text(encoding="utf-8") == "{}\n"


def _config(tmp_path, *flags):
    """The config `mmcl from-open-clip` writes for open_clip_train `flags`, loaded; and the lines not mapped."""
    out = tmp_path / f"c{len(list(tmp_path.iterdir()))}.yaml"
    _, left, _ = write_config(list(flags), str(out))
    return load_config(str(out)), left


def _one_step(optimizer, params):
    for p in params:
        p.grad = torch.full_like(p, 0.5) + torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) / 7
    optimizer.step()


def test_opt_nadamw_is_torchs_nadam_with_decoupled_decay_and_open_clips_adam_defaults(tmp_path):
    cfg, _ = _config(tmp_path, "--opt", "nadamw", "--model", "ViT-B-32", "--lr", "1e-2", "--wd", "0.1")
    assert (cfg.optim.name, dict(cfg.optim.kwargs)) == ("nadam", {"decoupled_weight_decay": True,
                                                                  "betas": [0.9, 0.98], "eps": 1e-6})
    torch.manual_seed(0)
    ours = torch.nn.Linear(4, 3)
    theirs, start = copy.deepcopy(ours), ours.weight.detach().clone()
    optimizer = build_optimizer(ours, cfg.optim)
    # open_clip main's create_optimizer for --opt nadamw: torch's NAdam over the weight-decay split
    reference = torch.optim.NAdam([{"params": [theirs.weight], "weight_decay": 0.1},
                                   {"params": [theirs.bias], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.98), eps=1e-6, decoupled_weight_decay=True)
    assert type(optimizer) is torch.optim.NAdam
    for _ in range(3):
        _one_step(optimizer, list(ours.parameters()))
        _one_step(reference, list(theirs.parameters()))
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
    assert (ours.weight - start).abs().min() > 1e-3  # three steps moved every weight


def test_a_timm_optimiser_gets_betas_eps_momentum_and_kwargs_as_open_clip_passes_them(tmp_path):
    cfg, _ = _config(tmp_path, "--opt", "timm/lamb", "--beta1", "0.8", "--beta2", "0.95", "--eps", "1e-7")
    assert cfg.optim.name == "lamb" and dict(cfg.optim.kwargs) == {"betas": [0.8, 0.95], "eps": 1e-7}
    defaults = build_optimizer(torch.nn.Linear(4, 3), cfg.optim).defaults
    assert (defaults["betas"], defaults["eps"]) == ((0.8, 0.95), 1e-7)
    cfg, _ = _config(tmp_path, "--opt", "timm/sgd", "--momentum", "0.8", "--opt-kwargs", "nesterov=False")
    assert cfg.optim.name == "sgd" and dict(cfg.optim.kwargs) == {"momentum": 0.8, "nesterov": False}
    defaults = build_optimizer(torch.nn.Linear(4, 3), cfg.optim).defaults
    assert (defaults["momentum"], defaults["nesterov"]) == (0.8, False)
    # open_clip_train ignores --momentum with adamw; AdamW's betas stay mmcl's optim.beta1/beta2
    cfg, _ = _config(tmp_path, "--opt", "adamw", "--momentum", "0.9", "--beta1", "0.85", "--model", "ViT-B-32")
    assert (cfg.optim.name, dict(cfg.optim.kwargs), cfg.optim.beta1) == ("adamw", {}, 0.85)


def test_optimiser_flags_explained_and_refused_in_one_line(capsys, tmp_path):
    line = explain(["--opt", "timm/lion", "--beta1", "0.9", "--beta2", "0.99"])
    assert "--opt timm/lion -> optim.name=lion" in line and "--beta1 0.9 -> optim.kwargs.betas=[0.9, 0.99]" in line
    code, _, err = run_main(capsys, "from-open-clip", "--out", str(tmp_path / "c.yaml"), "--", "--opt", "timm/lion",
                            "--beta1", "0.9")
    assert code == 2 and err == ["mmcl: error: open_clip_train's --opt timm/lion takes --beta1 and --beta2 together "
                                 "(got --beta1 alone)"], err
    assert not (tmp_path / "c.yaml").exists()


def test_wd_exclude_spares_exactly_the_names_open_clips_fnmatch_matches(tmp_path):
    patterns = ["*.bias", "visual.proj*", "*pos_embed*", "text.?"]
    cfg, _ = _config(tmp_path, "--wd-exclude", *patterns)
    names = ["visual.conv1.bias", "visual.bias_table", "visual.proj", "visual.projection.weight", "a.visual.proj",
             "visual.trunk.pos_embed", "pos_embed", "text.a", "text.ab", "xtext.a", "token_embedding.weight"]
    weight = torch.zeros(2, 2)
    for name in names:
        expected = any(fnmatch.fnmatchcase(name, p) for p in patterns)
        assert no_weight_decay(name, weight, cfg.optim.no_decay_pattern) == expected, name
    assert [n for n in names if no_weight_decay(n, weight, cfg.optim.no_decay_pattern)] == [
        "visual.conv1.bias", "visual.proj", "visual.projection.weight", "visual.trunk.pos_embed", "pos_embed", "text.a"]


def test_epochs_cooldown_gives_open_clips_const_cooldown_rate_at_every_step(tmp_path):
    scheduler = pytest.importorskip("open_clip_train.scheduler")
    for epochs, cooldown, per_epoch in ((10, 2, 7), (3, 1, 7), (32, 5, 13)):
        cfg, _ = _config(tmp_path, "--lr-scheduler", "const-cooldown", "--epochs", str(epochs), "--epochs-cooldown",
                         str(cooldown), "--warmup", "3", "--lr", "1e-3", "--lr-cooldown-end", "1e-5",
                         "--lr-cooldown-power", "2")
        total = epochs * per_epoch
        theirs = scheduler.const_lr_cooldown(types.SimpleNamespace(param_groups=[]), 1e-3, 3, total,
                                             per_epoch * cooldown, 2.0, 1e-5)
        for step in range(total):
            assert math.isclose(lr_at(step, cfg.optim, total), theirs(step), rel_tol=1e-12), (epochs, step)


def test_layer_decay_and_log_interval_flags(tmp_path):
    cfg, _ = _config(tmp_path, "--visual-layer-decay", "0.7", "--text-layer-decay", "0.65",
                     "--log-metric-every-n-steps", "5", "--log-every-n-steps", "50")
    assert (cfg.optim.image_layer_decay, cfg.optim.text_layer_decay, cfg.train.log_every) == (0.7, 0.65, 5)
    cfg, _ = _config(tmp_path, "--image-layer-decay", "0.8")
    assert (cfg.optim.image_layer_decay, cfg.train.log_every) == (0.8, 100)  # open_clip's console default


def test_naflex_flags_make_a_naflex_run(tmp_path):
    cfg, left = _config(tmp_path, "--use-naflex", "--model", "ViT-B-16", "--epochs", "2")
    assert list(cfg.data.naflex.seq_lens) == [128, 256, 576, 784, 1024] and cfg.data.naflex.seq_len_probs is None
    assert cfg.data.naflex.max_tokens_per_batch == 16384 and cfg.train.epochs is None  # open_clip main's budget
    assert any(line.startswith("--epochs 2: ") and "train.steps" in line for line in left), left
    cfg, _ = _config(tmp_path, "--use-naflex", "--naflex-seq-lens", "256", "576", "--naflex-seq-len-probs", "1", "3",
                     "--naflex-max-tokens-per-batch", "4096", "--naflex-patch-sizes", "16")
    assert (list(cfg.data.naflex.seq_lens), list(cfg.data.naflex.seq_len_probs)) == ([256, 576], [1.0, 3.0])
    assert (cfg.data.naflex.max_tokens_per_batch, cfg.data.naflex.patch_size) == (4096, 16)
    _, left = translate(parse(["--force-naflex-vision", "--naflex-batch-divisor", "16", "--length-bucketing"])[0])
    assert [line.split(":")[0] for line in left] == ["--force-naflex-vision", "--naflex-batch-divisor 16",
                                                     "--length-bucketing"]


def test_caption_and_image_key_flags(tmp_path):
    cfg, _ = _config(tmp_path, "--text-key", "txt", "--json-text-key", "a;b;c", "--json-text-key-probs", "0.7", "0.3")
    assert list(cfg.data.caption_key) == ["json:a", "json:b", "json:c"]
    assert list(cfg.data.caption_key_weights) == [0.7, 0.3, 0.0]
    # open_clip draws a priority order by the weights and takes the first key present: with a and b present, a
    # comes first with probability 0.7 / (0.7 + 0.3), mmcl's draw among the present sources
    keys = sample_keys(cfg.data)
    drawn = [keys.choose([["from a"], ["from b"], []], draw) for draw in range(4000)]
    assert abs(drawn.count("from a") / 4000 - 0.7) < 0.03
    cfg, left = _config(tmp_path, "--text-key", "txt;caption", "--image-key", "webp", "--max-image-pixels", "1000")
    assert (list(cfg.data.caption_key), cfg.data.image_key, cfg.data.max_image_pixels) == (["txt", "caption"],
                                                                                          "webp", 1000)
    cfg, left = _config(tmp_path, "--image-key", "jpg;png;jpeg;webp", "--max-image-pixels", "0")
    assert cfg.data.image_key is None and cfg.data.max_image_pixels == 89_478_485
    assert [line.split(":")[0] for line in left] == ["--max-image-pixels 0"]
    assert overrides_for("--image-key", "jpg;png") is None


def test_coca_flags_map_to_the_caption_and_clip_weights_with_open_clips_default(tmp_path):
    cfg, left = _config(tmp_path, "--model", "coca_ViT-B-32")
    assert (cfg.model.name, cfg.loss.caption, cfg.loss.clip) == ("coca_ViT-B-32", 2.0, 1.0) and not left
    cfg, left = _config(tmp_path, "--model", "coca_ViT-B-32", "--coca-caption-loss-weight", "0.5",
                        "--coca-contrastive-loss-weight", "2")
    assert (cfg.loss.caption, cfg.loss.clip) == (0.5, 2.0) and not left
    cfg, _ = _config(tmp_path, "--model", "ViT-B-32")
    assert cfg.loss.caption == 0.0


def test_launch_flags_are_listed_as_accelerate_commands():
    overrides, left = translate(parse(["--fsdp", "--fsdp-offload-cpu", "--fsdp-checkpoint", "full", "--torchcompile",
                                       "--torchcompile-strategy", "task"])[0])
    assert overrides == ["train.compile=true"]
    assert left == ["--fsdp: accelerate launch --config_file launch/fsdp.yaml",
                    "--fsdp-offload-cpu: accelerate launch --fsdp_offload_params true",
                    "--fsdp-checkpoint full: accelerate launch --fsdp_state_dict_type FULL_STATE_DICT"]


def test_migration_page_names_versions_and_mains_unsupported_features():
    page = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    assert "| `--fsdp` | main (4.2.0.dev0) |" in page and "| `--horovod` | 3.3 (removed on main) |" in page
    assert "| `--lr` |  | `optim.lr={}` |" in page
    assert "## open_clip main's features that mmcl does not support" in page
    assert "- Length bucketing (--length-bucketing, --bucket-*): " in page


@pytest.mark.parametrize("warmup", [None, "700"])
def test_a_warmup_longer_than_the_whole_run_is_refused(tmp_path, capsys, warmup):
    """10,000 samples in batches of 32 for 2 epochs: 626 steps on one process, fewer on more. open_clip's default
    --warmup 10000 (or a given one) longer than that would train every step in warm-up."""
    flags = ["--train-data", "data/{000..009}.tar", "--train-num-samples", "10000", "--batch-size", "32", "--epochs",
             "2", *(["--warmup", warmup] if warmup else [])]
    code, _, err = run_main(capsys, "from-open-clip", "--out", str(tmp_path / "c.yaml"), "--", *flags)
    what = "--warmup 700" if warmup else "open_clip_train's default --warmup 10000"
    assert code == 2 and err == [f"mmcl: error: {what} is longer than the whole run (626 steps on one process, "
                                 f"fewer on more): every step would be warm-up, the rate never at its peak --lr; "
                                 f"give --warmup below 626"], err
    assert not (tmp_path / "c.yaml").exists()
    cfg, _ = _config(tmp_path, *flags[:-2] if warmup else flags, "--warmup", "600")
    assert cfg.optim.warmup_steps == 600
    cfg, _ = _config(tmp_path, "--train-data", "data/{000..009}.tar", "--epochs", "2")  # length unknown here
    assert cfg.optim.warmup_steps == 10000


def test_lr_cooldown_end_sets_min_lr_under_const_cooldown_only(tmp_path):
    """open_clip_train's cosine_lr ends at 0 whatever --lr-cooldown-end says; its const_lr_cooldown ends there."""
    scheduler = pytest.importorskip("open_clip_train.scheduler")
    cosine, _ = _config(tmp_path, "--lr-cooldown-end", "1e-5", "--lr", "1e-3", "--warmup", "3", "--epochs", "1")
    assert cosine.optim.min_lr == 0.0 and cosine.optim.schedule == "cosine"
    theirs = scheduler.cosine_lr(types.SimpleNamespace(param_groups=[]), 1e-3, 3, 20)
    for step in range(20):
        assert math.isclose(lr_at(step, cosine.optim, 20), theirs(step), rel_tol=1e-12, abs_tol=1e-15), step
    cool, _ = _config(tmp_path, "--lr-scheduler", "const-cooldown", "--lr-cooldown-end", "1e-5", "--epochs", "1")
    assert cool.optim.min_lr == 1e-5


def test_val_data_scores_the_loss_and_retrieval_as_open_clip_does(tmp_path):
    cfg, _ = _config(tmp_path, "--val-data", "val/{0..3}.tar", "--epochs", "1")
    assert cfg.eval.val_loss == "val/{0..3}.tar" and cfg.eval.retrieval == "val/{0..3}.tar"
