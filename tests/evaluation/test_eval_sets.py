"""Several named evaluation sets during training, each on its own steps; the validation loss on held-out shards;
evaluation sets opened and checked before step 1 by the loader `mmcl zeroshot` uses."""

import contextlib
import json
import math
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from test_evaluate import COLOURS, write_folder, write_shard

from mmcl import models
from mmcl.cli import main
from mmcl.config import load_config
from mmcl.errors import ConfigError, DataError
from mmcl.evaluation import in_run as eval_sets

from helpers import ACCELERATE_LAUNCH, ROOT, TRAINING_TOWERS, inputs_of, metrics, run_args

# ---------------------------------------------------------------------------------------------------------
# eval.zeroshot / eval.retrieval: one path, or a list of named sets


def test_a_single_path_is_one_set_named_after_its_data(tmp_path):
    (tmp_path / "imagenet" / "val").mkdir(parents=True)  # a split folder: named after the folder above it
    cfg = load_config(None, [f"eval.zeroshot={tmp_path}/imagenet/val", "eval.every=7", "eval.templates=simple"])
    [s] = eval_sets.named_sets(cfg.eval)
    assert (s.task, s.name, s.data, s.every, s.templates) == ("zeroshot", "imagenet", f"{tmp_path}/imagenet/val", 7,
                                                             "simple")


def test_a_list_of_named_sets_each_with_its_own_frequency(tmp_path):
    cfg = load_config(None, [
        "eval.every=10", "eval.classnames=/names.txt",
        "eval.zeroshot=[{name: imagenet, data: /d/imagenet/val, every: 500, templates: openai}, "
        "{name: v2, data: /d/v2, classnames: /v2.txt}, /d/sketch]",
        "eval.retrieval=[{name: coco, data: '/d/coco/{0..4}.tar', every: 0}]"])
    sets = eval_sets.named_sets(cfg.eval)
    assert [(s.task, s.name, s.every, s.classnames, s.templates) for s in sets] == [
        ("zeroshot", "imagenet", 500, "/names.txt", "openai"),
        ("zeroshot", "v2", 10, "/v2.txt", "auto"),
        ("zeroshot", "sketch", 10, "/names.txt", "auto"),  # a bare path: named after it, with eval.*
        ("retrieval", "coco", 0, None, "auto")]
    assert [s.where for s in sets] == ["eval.zeroshot[0]", "eval.zeroshot[1]", "eval.zeroshot[2]",
                                       "eval.retrieval[0]"]
    # Each set on its own steps; the validation loss on eval.val_loss_every; the last step has the final one.
    assert not eval_sets.any_due(cfg.eval, 7, 100)
    due, val = eval_sets.due(cfg.eval, 20)
    assert [s.name for s in due] == ["v2", "sketch"] and not val
    due, _ = eval_sets.due(cfg.eval, 500)
    assert [s.name for s in due] == ["imagenet", "v2", "sketch"]
    assert not eval_sets.any_due(cfg.eval, 500, 500)  # the last step: the final evaluation, of everything
    assert [s.name for s in eval_sets.due(cfg.eval, None)[0]] == ["imagenet", "v2", "sketch", "coco"]
    cfg = load_config(None, ["eval.every=4", "eval.val_loss=/d/val.tar", "eval.val_loss_every=3"])
    assert [eval_sets.any_due(cfg.eval, s, 100) for s in (3, 4, 6)] == [True, False, True]
    assert eval_sets.due(cfg.eval, 3) == ([], True) and eval_sets.due(cfg.eval, None) == ([], True)


@pytest.mark.parametrize("value, message", [
    ("[{name: a, data: /x}, {name: a, data: /y}]",
     "eval.zeroshot: two sets are named 'a' (/x and /y); give each a different name"),
    ("[{nam: a, data: /x}]", "eval.zeroshot[0]: unknown key(s) nam (a zeroshot set has name, data, every, "
                             "classnames, templates)"),
    ("[{name: a}]", "eval.zeroshot[0]: data is not set"),
    ("[{name: 'a/b', data: /x}]", "eval.zeroshot[0]: name must be a non-empty word without '/'"),
    ("[{data: /x, every: -2}]", "eval.zeroshot[0]: every must be an integer >= 0 (got -2)"),
    ("3", "eval.zeroshot must be a path or a mapping of name, data, every, classnames, templates (got 3)"),
])
def test_bad_set_entries_are_one_error_line(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"eval.zeroshot={value}"])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_sets_named_alike_after_their_paths_are_refused_before_the_run(tmp_path, capsys):
    for split in ("a", "b"):
        write_folder(tmp_path / split / "colours", {c: [rgb] for c, rgb in COLOURS.items()})
    shard = write_shard(tmp_path / "train" / "0.tar", [("k", (255, 0, 0), "red", None)])
    out = tmp_path / "run"
    code = main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={shard}",
                 f"train.output_dir={out}", f"eval.zeroshot=[{tmp_path}/a/colours, {tmp_path}/b/colours]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert (f"eval.zeroshot: two sets are named 'colours' ({tmp_path}/a/colours and {tmp_path}/b/colours); give each a "
            f"different name") in err[0]
    assert not (out / "checkpoints").exists()
    # Named apart, they are two sets.
    cfg = load_config(None, [f"eval.zeroshot=[{{name: a, data: {tmp_path}/a/colours}}, {tmp_path}/b/colours]"])
    assert [s.name for s in eval_sets.named_sets(cfg.eval)] == ["a", "colours"]


# ---------------------------------------------------------------------------------------------------------
# Evaluation sets checked before step 1, with the words of `mmcl zeroshot`


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory):
    from mmcl.storage import weights

    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    return weights.save_model_dir(models.create(cfg), cfg, models.preprocess_config(cfg),
                                  tmp_path_factory.mktemp("m") / "model")


def _empty_class(root: Path) -> Path:
    write_folder(root, {"red": [(255, 0, 0)], "green": [(0, 255, 0)]})
    (root / "blue").mkdir()
    (root / "blue" / "notes.txt").write_text("no images here")
    return root


def _flat(root: Path) -> Path:
    root.mkdir(parents=True)
    for name, rgb in COLOURS.items():
        Image.new("RGB", (8, 8), rgb).save(root / f"{name}.png")
    return root


def _nothing(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "README.txt").write_text("images to come")
    return root


BROKEN = {
    "empty class folder": (_empty_class, "1 of 3 class folders hold no images (blue); every class folder needs at "
                                         "least one jpg|jpeg|png|webp|... image, as in torchvision's ImageFolder"),
    "flat folder": (_flat, "holds 3 images but no class folders: an evaluation folder is an ImageFolder"),
    "no images": (_nothing, "no images or shards in"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_evaluation_folder_stops_the_run_before_step_1(kind, tmp_path, capsys, micro_model_dir):
    make, message = BROKEN[kind]
    folder = make(tmp_path / "eval-set")
    shard = write_shard(tmp_path / "train" / "0.tar", [(f"k{i}", (255, 0, 0), "red", None) for i in range(4)])
    out = tmp_path / "run"
    capsys.readouterr()
    code = main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={shard}",
                 f"train.output_dir={out}", "train.steps=2", "data.batch_size=2", "train.save_every=1",
                 "train.progress=false", *TRAINING_TOWERS,
                 f"eval.zeroshot=[{{name: broken, data: {folder}, every: 1}}]"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1, captured.err
    assert err[0].startswith("mmcl: error: missing input") and "eval.zeroshot[0]: " in err[0] and message in err[0]
    assert not (out / "checkpoints").exists() and not (out / "model").exists()  # not a step was taken
    # `mmcl zeroshot --data` opens the folder with the same loader and says the same.
    code = main(["zeroshot", "--model", str(micro_model_dir), "--data", str(folder), "--out", str(tmp_path / "r.json")])
    zs_err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(zs_err) == 1 and zs_err[0].startswith("mmcl: error: "), zs_err
    said = zs_err[0][len("mmcl: error: "):]
    assert message in said and said in err[0]


def test_an_empty_class_folder_is_an_error_as_in_torchvision(tmp_path):
    from torchvision.datasets import ImageFolder

    from mmcl.data import build_eval_dataset

    root = _empty_class(tmp_path / "set")
    with pytest.raises(FileNotFoundError, match="blue"):
        ImageFolder(str(root))
    with pytest.raises(DataError, match=r"class folders hold no images \(blue\)"):
        build_eval_dataset(str(root), None)
    Image.new("RGB", (8, 8), (0, 0, 255)).save(root / "blue" / "0.png")
    assert [label for _, label in build_eval_dataset(str(root), None).items] == [0, 1, 2]  # blue, green, red


def test_retrieval_of_an_image_folder_and_a_missing_val_set_are_named_before_step_1(tmp_path):
    from mmcl.training.preflight import input_problems

    folder = write_folder(tmp_path / "colours", {c: [rgb] for c, rgb in COLOURS.items()})
    shard = write_shard(tmp_path / "train" / "0.tar", [("k", (255, 0, 0), "red", None)])
    cfg = load_config(None, [f"data.train={shard}", f"eval.retrieval={folder}",
                             f"eval.val_loss={tmp_path}/held-out/{{0..1}}.tar"])
    assert input_problems(*inputs_of(cfg)) == [
        f"eval.retrieval: {folder} is an ImageFolder, which has no captions (retrieval needs shards with captions, "
        f"KEY.txt)",
        f"eval.val_loss: all of the 2 paths that '{tmp_path}/held-out/{{0..1}}.tar' names are missing "
        f"({tmp_path}/held-out/0.tar, {tmp_path}/held-out/1.tar)"]


# ---------------------------------------------------------------------------------------------------------
# The validation loss


def _held_out(tmp_path, n=10, seed=0):
    """n samples of random colours with captions and labels, as PIL images (kept for the reference) and a shard."""
    g = torch.Generator().manual_seed(seed)
    names = list(COLOURS)
    samples = []
    for i in range(n):
        rgb = tuple(int(v) for v in torch.randint(0, 256, (3,), generator=g))
        samples.append((f"s{i:03d}", rgb, f"a {names[i % 3]} square number {i}", i % 3))
    write_shard(tmp_path / "held-out" / "0.tar", samples[:6])
    write_shard(tmp_path / "held-out" / "1.tar", samples[6:])
    return samples, f"{tmp_path}/held-out/{{0..1}}.tar"


def _reference_features(model, eval_tf, tokenizer, samples):
    images = torch.stack([eval_tf(Image.new("RGB", (8, 8), rgb)) for _, rgb, _, _ in samples])
    with torch.no_grad():
        out = model(images, tokenizer([caption for _, _, caption, _ in samples]))
    return out["image_features"].double(), out["text_features"].double(), out["logit_scale"].double()


def _info_nce(img, txt, scale):
    logits = scale * img @ txt.t()
    labels = torch.arange(img.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def test_val_loss_is_the_clip_loss_averaged_over_batches_of_the_global_batch(tmp_path):
    from mmcl.training.step import objective_from_config

    torch.manual_seed(0)
    cfg = load_config(None, TRAINING_TOWERS)
    model, _, pp, _, eval_tf, tokenizer = models.build(cfg.model)
    model.eval()
    samples, spec = _held_out(tmp_path)
    img, txt, scale = _reference_features(model, eval_tf, tokenizer, samples)
    # Batches of 4, 4, 2 samples (the global batch, the last one short), averaged over samples, in float64.
    expected = sum(_info_nce(img[s:s + 4], txt[s:s + 4], scale) * len(range(s, min(s + 4, 10)))
                   for s in (0, 4, 8)) / 10
    objective = objective_from_config(cfg.loss).eval()
    # Chunks of 3 through the towers: the batches do not follow the chunks.
    res = eval_sets.validation_loss(model, objective, spec, eval_tf, tokenizer, batch_size=4, chunk=3)
    assert res["n_samples"] == 10 and res["n_batches"] == 3 and res["n_skipped"] == 0
    assert res["metrics"]["loss/clip"] == pytest.approx(float(expected), rel=1e-5)
    assert res["metrics"]["loss"] == pytest.approx(float(expected), rel=1e-5)
    # Not the loss of one batch of 10, nor of batches of 5: the batch is what the value means.
    whole = float(_info_nce(img, txt, scale))
    assert abs(res["metrics"]["loss"] - whole) > 1e-3


def test_val_loss_scores_every_term_of_the_objective_on_the_same_batches(tmp_path):
    from mmcl.training.step import objective_from_config

    torch.manual_seed(1)
    cfg = load_config(None, [*TRAINING_TOWERS, "loss.clip=1.0", "loss.supcon=0.5", "loss.align=0.1",
                             "loss.uniform=0.1"])
    model, _, pp, _, eval_tf, tokenizer = models.build(cfg.model)
    model.eval()
    samples, spec = _held_out(tmp_path, seed=1)
    img, txt, scale = _reference_features(model, eval_tf, tokenizer, samples)
    labels = torch.tensor([label for *_, label in samples])
    reference = objective_from_config(cfg.loss).eval()
    sums = {}
    for s in (0, 5):  # batches of 5
        _, terms = reference(img[s:s + 5].float(), txt[s:s + 5].float(), scale.float(), None, labels[s:s + 5], True)
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + float(v) * 5
    res = eval_sets.validation_loss(model, objective_from_config(cfg.loss).eval(), spec, eval_tf, tokenizer,
                                    batch_size=5, chunk=4)
    assert set(res["metrics"]) == set(sums) >= {"loss", "loss/clip", "loss/supcon", "loss/align", "loss/uniform"}
    for k, v in sums.items():
        assert res["metrics"][k] == pytest.approx(v / 10, rel=1e-5, abs=1e-6), k
    assert res["metrics"]["loss"] == pytest.approx(
        sum(w * res["metrics"][f"loss/{t}"] for t, w in (("clip", 1.0), ("supcon", .5), ("align", .1),
                                                           ("uniform", .1))), rel=1e-6)


def test_val_loss_includes_the_caption_term_as_open_clip_coca_loss_scores_each_batch(tmp_path):
    """A CoCa model's validation loss has its captioning term: per batch of 4 (chunks of 3 through the towers),
    open_clip's CoCaLoss caption part (the mean over the batch's caption tokens), averaged over samples."""
    from open_clip.loss import CoCaLoss

    from mmcl.training.step import objective_from_config

    torch.manual_seed(2)
    cfg = load_config(None, ["model.name=coca_tiny", "loss.clip=1.0", "loss.caption=2.0"])
    model, _, pp, _, eval_tf, tokenizer = models.build(cfg.model)
    model.eval()
    samples, spec = _held_out(tmp_path, seed=2)
    images = torch.stack([eval_tf(Image.new("RGB", (8, 8), rgb)) for _, rgb, _, _ in samples])
    with torch.no_grad():
        out = model(images, tokenizer([caption for _, _, caption, _ in samples]))
    expected = 0.0
    for s in (0, 4, 8):
        rows = slice(s, s + 4)
        clip, caption = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0)(
            out["image_features"][rows], out["text_features"][rows], out["logits"][rows], out["labels"][rows],
            out["logit_scale"])
        expected += float(caption) / 2.0 * len(range(s, min(s + 4, 10)))
    res = eval_sets.validation_loss(model, objective_from_config(cfg.loss).eval(), spec, eval_tf, tokenizer,
                                    batch_size=4, chunk=3)
    assert res["metrics"]["loss/caption"] == pytest.approx(expected / 10, rel=1e-5)
    assert res["metrics"]["loss"] == pytest.approx(res["metrics"]["loss/clip"] + 2 * res["metrics"]["loss/caption"],
                                                   rel=1e-6)


def test_run_eval_logs_val_entries_in_eval_mode_and_restores_training_mode(tmp_path):
    from mmcl.evaluation.in_run import run_eval
    from mmcl.training.setup import evaluation_for
    from mmcl.training.step import objective_from_config

    torch.manual_seed(2)
    samples, spec = _held_out(tmp_path, seed=2)
    cfg = load_config(None, [*TRAINING_TOWERS, f"eval.val_loss={spec}", "eval.every=2", "model.vision_cfg={layers: 2, "
                             "width: 64, head_width: 32, patch_dropout: 0.5}"])
    model, _, pp, _, eval_tf, tokenizer = models.build(cfg.model)
    model.train()  # patch dropout in training mode: the validation loss must not depend on it
    accelerator = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), autocast=contextlib.nullcontext)
    assert run_eval(evaluation_for(cfg), model, tokenizer, pp, accelerator, 1, 4) == {}  # not due at step 1
    results = {}
    first = run_eval(evaluation_for(cfg), model, tokenizer, pp, accelerator, 2, 4, results)
    second = run_eval(evaluation_for(cfg), model, tokenizer, pp, accelerator, None, 4)  # final: everything
    assert model.training
    assert set(first) == {"val/loss", "val/loss/clip", "val/align", "val/uniform_image", "val/uniform_text"}
    assert first == second
    model.eval()
    expected = eval_sets.validation_loss(model, objective_from_config(cfg.loss).eval(), spec, eval_tf, tokenizer, 4)
    assert first["val/loss"] == expected["metrics"]["loss"] and results["val_loss"]["n_samples"] == 10


def test_val_loss_with_distillation_is_refused():
    with pytest.raises(ConfigError, match="eval.val_loss does not score the distillation term"):
        load_config(None, ["eval.val_loss=/d/val.tar", "loss.distill=1.0", "distill.from_shards=true"])


# ---------------------------------------------------------------------------------------------------------
# A training run with several sets


@pytest.mark.slow
def test_several_named_sets_each_on_its_own_steps(demo, tmp_path):
    from mmcl.evaluation.evaluate import dataset_name

    out = tmp_path / "run"
    code = main(["train", *run_args(demo, out, "train.steps=6", "data.batch_size=8", "data.workers=0",
                                    "train.save_every=0", "train.log_every=5", "train.log_with=[tensorboard]",
                                    f"eval.zeroshot=[{{name: colours, data: {demo['zeroshot_colour']}, every: 2}}, "
                                    f"{{name: shapes, data: {demo['zeroshot_shape']}, every: 3}}]",
                                    f"eval.retrieval=[{demo['val']}]", "eval.every=0",
                                    f"eval.val_loss={demo['val']}", "eval.val_loss_every=4")])
    assert code == 0
    rows = {r["step"]: r for r in metrics(out)}
    colours, shapes = ("eval/zeroshot_classification/colours/acc1", "eval/zeroshot_classification/shapes/acc1")
    held_out = dataset_name(demo["val"])  # a bare path: named after it
    retrieval = f"eval/zeroshot_retrieval/{held_out}/image_retrieval_recall@1"
    assert sorted(rows) == [2, 3, 4, 5, 6]  # each set's steps, the logged step 5 and the last
    assert [s for s in sorted(rows) if colours in rows[s]] == [2, 4, 6]
    assert [s for s in sorted(rows) if shapes in rows[s]] == [3, 6]
    assert [s for s in sorted(rows) if "val/loss" in rows[s]] == [4, 6]
    assert [s for s in sorted(rows) if retrieval in rows[s]] == [6]  # every 0: the final evaluation only
    assert "val/loss/clip" in rows[6] and math.isfinite(rows[6]["val/loss"])
    said = (out / "out.log").read_text()  # the end-of-run summary names every set and the validation loss
    assert "final evaluation, zeroshot_classification colours: acc1 " in said
    assert "final evaluation, zeroshot_classification shapes: acc1 " in said
    assert f"final validation loss: {rows[6]['val/loss']:.4f}" in said
    results = json.loads((out / "eval_results.json").read_text())
    assert sorted(results["zeroshot"]) == ["colours", "shapes"] and list(results["retrieval"]) == [held_out]
    assert results["zeroshot"]["colours"]["metrics"]["acc1"] == rows[6][colours]
    assert results["zeroshot"]["shapes"]["dataset"] == "shapes" and results["step"] == 6
    assert {r["model"] for kind in ("zeroshot", "retrieval") for r in results[kind].values()} == {str(out)}
    assert results["val_loss"]["metrics"]["loss"] == rows[6]["val/loss"]
    # The trackers get the same names.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in out.rglob("events.out.tfevents.*"):  # accelerate's tracker writes one file per run name
        tags |= set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    assert {colours, shapes, retrieval, "val/loss", "val/loss/clip"} <= tags


@pytest.mark.slow
def test_val_loss_under_two_processes_equals_one_process(demo, tmp_path):
    """The same weights (optim.lr=0: the processes shard the training data differently) and the same global batch
    of 8, on 2 processes x 4 and 1 x 8: the same validation loss; on 1 x 4 another one (its batch is the run's)."""
    args = ("train.steps=2", "train.log_every=1", "data.workers=0", "train.save_every=0", "train.log_with=[]",
            "optim.lr=0", f"eval.val_loss={demo['val']}", "eval.val_loss_every=1")
    one, two, small = tmp_path / "one", tmp_path / "two", tmp_path / "small"
    assert main(["train", *run_args(demo, one, "data.batch_size=8", *args)]) == 0
    assert main(["train", *run_args(demo, small, "data.batch_size=4", *args)]) == 0
    cmd = [*ACCELERATE_LAUNCH, "--config_file",
           str(ROOT / "launch" / "cpu-2proc.yaml"), "-m", "mmcl", "train",
           *run_args(demo, two, "data.batch_size=4", *args)]
    p = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows_one, rows_two, rows_small = metrics(one), metrics(two), metrics(small)
    assert [r["step"] for r in rows_two] == [1, 2] and all("val/loss" in r for r in rows_two)
    for a, b in zip(rows_one, rows_two):
        assert b["val/loss"] == pytest.approx(a["val/loss"], rel=1e-6)
        assert b["val/loss/clip"] == pytest.approx(a["val/loss/clip"], rel=1e-6)
    assert abs(rows_small[0]["val/loss"] - rows_one[0]["val/loss"]) > 1e-3  # batches of 4: another value


def test_the_loss_plot_shows_the_validation_loss():
    from mmcl.evaluation.plot import loss_figure

    records = [{"step": s, "loss": 3.0 - 0.1 * s, "loss/clip": 3.0 - 0.1 * s} for s in range(1, 9)]
    records[3]["val/loss"], records[7]["val/loss"] = 2.9, 2.5
    fig = loss_figure(records, "run")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["validation"].get_ydata()) == [2.9, 2.5] and list(lines["validation"].get_xdata()) == [4, 8]


# ---------------------------------------------------------------------------------------------------------
# classnames.txt of an ImageFolder: the folders' own names in another order are matched by name

def test_classnames_txt_listing_the_folders_in_another_order_scores_as_the_right_order(tmp_path, capsys):
    from test_evaluate import ColourModel, colour_tokenizer, solid, to_tensor

    from mmcl.evaluation.evaluate import zeroshot

    results = {}
    for order in ("blue\ngreen\nred\n", "red\nblue\ngreen\n"):
        root = tmp_path / order.split()[0]
        for cls in COLOURS:
            (root / cls).mkdir(parents=True)
            solid(COLOURS[cls]).save(root / cls / "0.png")
        solid((250, 10, 10)).save(root / "green" / "1.png")  # a red image in the green folder: the one miss
        (root / "classnames.txt").write_text(order)
        results[order] = zeroshot(ColourModel(), to_tensor, colour_tokenizer, str(root), templates=["a {} thing"],
                                  progress=False)["metrics"]
    assert results["blue\ngreen\nred\n"]["acc1"] == pytest.approx(3 / 4)
    assert results["red\nblue\ngreen\n"] == results["blue\ngreen\nred\n"]
    said = capsys.readouterr().err
    assert "class names are the class folders' names in another order" in said


def test_classnames_txt_naming_another_folder_at_a_line_is_refused(tmp_path):
    from mmcl.data.eval_data import folder_classnames

    for cls in ("blue", "green", "red"):
        (tmp_path / cls).mkdir()
    (tmp_path / "classnames.txt").write_text("red\nsky\ngrass\n")
    with pytest.raises(DataError, match=r"line 1 'red' is the name of class folder 3 in sorted order, not of "
                                        r"folder 1 \('blue'\)"):
        folder_classnames(str(tmp_path), ["blue", "green", "red"])
    (tmp_path / "classnames.txt").write_text("sky\ngrass\nfire\n")  # readable names, in folder order
    assert folder_classnames(str(tmp_path), ["blue", "green", "red"]) == (["sky", "grass", "fire"], "classnames.txt")


def _held_out_with_negatives(tmp_path, n=10, seed=3):
    """n samples as `_held_out`'s, each with 0, 1 or 2 negative captions in its JSON (sample i: i % 3 of them)."""
    from mmcl.shards.writer import write_shards

    g = torch.Generator().manual_seed(seed)
    names = list(COLOURS)
    samples = []
    for i in range(n):
        rgb = tuple(int(v) for v in torch.randint(0, 256, (3,), generator=g))
        negs = [f"a {names[(i + 1 + j) % 3]} square number {i}" for j in range(i % 3)]
        samples.append((f"s{i:03d}", rgb, f"a {names[i % 3]} square number {i}", i % 3, negs))
    write_shards([{"key": k, "image": Image.new("RGB", (8, 8), rgb), "caption": c, "label": lab,
                   "json": {"negatives": negs}} for k, rgb, c, lab, negs in samples],
                 str(tmp_path / "neg-held-out"), shard_size=6, prefix="val")
    return samples, f"{tmp_path}/neg-held-out/val-{{000000..000001}}.tar"


def test_the_validation_loss_scores_the_negatives_the_val_shards_carry_in_entries_of_their_own(tmp_path):
    """With ``data.negatives`` the validation loss reads the held-out samples' negative captions as training
    does (at most data.negatives each): ``val/negatives/loss`` (and ``/loss/<term>``) is the run's objective with
    them (NegCLIP: each a column of its own image's row), in float64 here; ``val/negatives/accuracy`` the share
    of negatives the image scores below its own caption. ``val/loss`` stays the pairs' loss, comparable with a run
    that has no negatives."""
    from mmcl.evaluation.in_run import run_eval
    from mmcl.training.setup import evaluation_for

    torch.manual_seed(3)
    samples, spec = _held_out_with_negatives(tmp_path)
    cfg = load_config(None, [*TRAINING_TOWERS, f"eval.val_loss={spec}", "eval.every=1", "data.negatives=2"])
    model, _, pp, _, eval_tf, tokenizer = models.build(cfg.model)
    model.eval()
    accelerator = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), autocast=contextlib.nullcontext)
    results = {}
    got = run_eval(evaluation_for(cfg), model, tokenizer, pp, accelerator, None, 4, results)
    img, txt, scale = _reference_features(model, eval_tf, tokenizer, [s[:4] for s in samples])
    negs = [s[4] for s in samples]  # data.negatives=2: every one of them
    with torch.no_grad():
        neg_txt = model(None, tokenizer([t for ns in negs for t in ns]))["text_features"].double()
    first = [sum(len(ns) for ns in negs[:i]) for i in range(len(negs))]  # sample i's first row of neg_txt
    loss_sum = pairs_sum = 0.0
    for s in (0, 4, 8):  # batches of 4, 4, 2
        b = range(s, min(s + 4, 10))
        logits = scale * img[s:s + 4] @ txt[s:s + 4].t()
        neg_cols = torch.full((len(b), 2), -math.inf, dtype=torch.float64)
        for r, i in enumerate(b):
            for j in range(len(negs[i])):
                neg_cols[r, j] = scale * img[i] @ neg_txt[first[i] + j]
        labels = torch.arange(len(b))
        i2t = F.cross_entropy(torch.cat([logits, neg_cols], dim=1), labels)
        loss_sum += float((i2t + F.cross_entropy(logits.t(), labels)) / 2) * len(b)
        pairs_sum += float(_info_nce(img[s:s + 4], txt[s:s + 4], scale)) * len(b)
    correct = sum(float(img[i] @ txt[i]) > float(img[i] @ neg_txt[first[i] + j])
                  for i in range(10) for j in range(len(negs[i])))
    assert got["val/negatives/loss"] == pytest.approx(loss_sum / 10, rel=1e-5)
    assert got["val/negatives/loss/clip"] == pytest.approx(loss_sum / 10, rel=1e-5)
    assert got["val/negatives/accuracy"] == pytest.approx(correct / 9, abs=1e-9)
    assert got["val/loss"] == pytest.approx(pairs_sum / 10, rel=1e-5) and loss_sum > pairs_sum + 1e-3
    assert results["val_loss"]["n_negatives"] == len(neg_txt) == 9  # 0 + 1 + 2 + 0 + ... + 0
    # The same shards in a run that reads no negatives (data.negatives=0): the pairs' entries only.
    plain = run_eval(evaluation_for(load_config(None, [*TRAINING_TOWERS, f"eval.val_loss={spec}"])), model, tokenizer,
                     pp, accelerator, None, 4)
    assert not [k for k in plain if "negatives" in k] and plain["val/loss"] == got["val/loss"]


def test_val_shards_without_negatives_give_no_negatives_entries(tmp_path):
    from mmcl.evaluation.in_run import run_eval
    from mmcl.training.setup import evaluation_for

    _, spec = _held_out(tmp_path)
    cfg = load_config(None, [*TRAINING_TOWERS, f"eval.val_loss={spec}", "data.negatives=2"])
    model, _, pp, _, eval_tf, tokenizer = models.build(cfg.model)
    accelerator = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), autocast=contextlib.nullcontext)
    got = run_eval(evaluation_for(cfg), model, tokenizer, pp, accelerator, None, 4)
    assert "val/loss" in got and not [k for k in got if "negatives" in k]
