"""What evaluation scores and under which names: ImageNet WordNet-id folders, class-name files, the results JSON's
record of names and templates, dataset names, and the steps `eval.every` evaluates at."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.functional import to_tensor

from mmcl.data import build_eval_dataset
from mmcl.errors import DataError
from mmcl.evaluation import evaluate

from helpers import TRAINING_TOWERS, inputs_of, write_folder, write_shard

ROOT = Path(__file__).resolve().parents[2]

# Ten ImageNet-1k classes spread over the 1000, with the names of CLIP's list (open_clip's IMAGENET_CLASSNAMES).
IMAGENET_TEN = {"n01440764": "tench", "n01443537": "goldfish", "n01530575": "brambling",
                "n02099601": "Golden Retriever", "n02123045": "tabby cat", "n03792782": "mountain bike",
                "n04037443": "race car", "n07747607": "orange", "n09472597": "volcano", "n15075141": "toilet paper"}
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


class ColourModel(nn.Module):
    """An image is its mean RGB; a text is the one-hot of the colour word in it (similarities known by hand)."""

    def encode_image(self, images, normalize=False):
        f = images.float().mean(dim=(2, 3))
        return F.normalize(f, dim=-1) if normalize else f

    def encode_text(self, tokens, normalize=False):
        f = tokens.float()
        return F.normalize(f, dim=-1) if normalize else f


class RecordingTokenizer:
    """The colour tokenizer, keeping every text it was given."""

    def __init__(self):
        self.texts = []

    def __call__(self, texts):
        self.texts += list(texts)
        out = torch.zeros(len(texts), 3)
        for i, text in enumerate(texts):
            for j, word in enumerate(COLOURS):
                out[i, j] = float(word in text.lower())
        return out


# ---------------------------------------------------------------------------------------------------------
# ImageNet WordNet-id folders


def test_wordnet_id_folders_score_imagenet_names_and_openai_templates(tmp_path):
    # A subset of ImageNet-1k (ten classes from all over the 1000) maps each folder to its own readable name.
    root = write_folder(tmp_path / "imagenet-val", {wnid: [(i * 20, 0, 0)] for i, wnid in enumerate(IMAGENET_TEN)})
    ds = build_eval_dataset(str(root), to_tensor)
    assert ds.classnames == [IMAGENET_TEN[w] for w in sorted(IMAGENET_TEN)]
    assert ds.classnames_source == "imagenet-1k"

    tokenizer = RecordingTokenizer()
    res = evaluate.zeroshot(ColourModel(), to_tensor, tokenizer, str(root), batch_size=4, progress=False)
    assert res["classnames"] == [IMAGENET_TEN[w] for w in sorted(IMAGENET_TEN)]
    # No template "auto" file beside the data: CLIP's 80 ImageNet prompts, recorded as text.
    assert len(res["templates"]) == 80 and res["templates"][0] == "a bad photo of a {}."
    assert "a bad photo of a tench." in tokenizer.texts and "a photo of a Golden Retriever." in tokenizer.texts
    assert not any("n0" in text or "n1" in text for text in tokenizer.texts)
    assert len(tokenizer.texts) == 80 * 10
    json.dumps(res)


def test_wordnet_ids_outside_imagenet_1k_keep_their_ids_with_a_warning(tmp_path, capsys):
    root = write_folder(tmp_path / "in21k", {"n00004475": [(255, 0, 0)], "n01440764": [(0, 255, 0)]})
    ds = build_eval_dataset(str(root), to_tensor)
    assert ds.classnames == ["n00004475", "n01440764"] and ds.classnames_source == "folders"
    err = capsys.readouterr().err
    assert "1 class folders" in err and "outside ImageNet-1k (first n00004475)" in err


def test_classnames_file_wins_over_wordnet_ids(tmp_path):
    root = write_folder(tmp_path / "set", {"n01440764": [(255, 0, 0)], "n01443537": [(0, 255, 0)]})
    (root / "classnames.txt").write_text("fish one\nfish two\n")
    ds = build_eval_dataset(str(root), to_tensor)
    assert ds.classnames == ["fish one", "fish two"] and ds.classnames_source == "classnames.txt"


# ---------------------------------------------------------------------------------------------------------
# Class-name files that do not fit


def test_classnames_file_with_wrong_line_count_is_one_error(tmp_path):
    root = write_folder(tmp_path / "colours", {c: [rgb] for c, rgb in COLOURS.items()})
    (root / "classnames.txt").write_text("red\ngreen\n")  # 2 names, 3 folders
    with pytest.raises(DataError, match=r"classnames.txt has 2 class names but .* has 3 class folders"):
        evaluate.zeroshot(ColourModel(), to_tensor, RecordingTokenizer(), str(root), progress=False)


def test_classnames_given_with_wrong_count_for_a_folder_is_an_error(tmp_path):
    root = write_folder(tmp_path / "colours", {c: [rgb] for c, rgb in COLOURS.items()})
    names = tmp_path / "names.txt"
    names.write_text("blue\ngreen\nred\nyellow\n")  # an extra class would compete with the real ones
    with pytest.raises(DataError, match="4 class names given for the 3 class folders"):
        evaluate.zeroshot(ColourModel(), to_tensor, RecordingTokenizer(), str(root), classnames=str(names),
                          progress=False)


def test_cli_reports_a_wrong_classnames_file_in_one_line(tmp_path, capsys):
    from mmcl import models
    from mmcl.cli import main
    from mmcl.storage import weights

    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    model_dir = weights.save_model_dir(models.create(cfg), cfg, models.preprocess_config(cfg), tmp_path / "model")
    root = write_folder(tmp_path / "colours", {c: [rgb] for c, rgb in COLOURS.items()})
    (root / "classnames.txt").write_text("red\n")
    capsys.readouterr()
    code = main(["zeroshot", "--model", str(model_dir), "--data", str(root), "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("mmcl: error: ") and "classnames.txt has 1 class names but" in err[0]
    assert not (tmp_path / "r.json").exists()


def test_preflight_refuses_a_wrong_classnames_file_before_training(tmp_path):
    from mmcl.config import load_config
    from mmcl.training.preflight import input_problems

    root = write_folder(tmp_path / "colours", {c: [rgb] for c, rgb in COLOURS.items()})
    (root / "classnames.txt").write_text("red\ngreen\n")
    shard = write_shard(tmp_path / "train" / "shard-000000.tar", [("a", (255, 0, 0), "red", None)])
    cfg = load_config(None, [f"data.train={shard}", f"eval.zeroshot={root}"])
    problems = input_problems(*inputs_of(cfg))
    assert any(p.startswith("eval.zeroshot: ") and "has 2 class names" in p for p in problems), problems
    (root / "classnames.txt").write_text("red\ngreen\nblue\n")
    assert input_problems(*inputs_of(cfg)) == []
    names = tmp_path / "names.txt"
    names.write_text("blue\ngreen\nred\nyellow\n")
    cfg = load_config(None, [f"data.train={shard}", f"eval.zeroshot={root}", f"eval.classnames={names}"])
    problems = input_problems(*inputs_of(cfg))
    # The words `mmcl zeroshot --classnames` uses for the same mistake (one loader, one message).
    assert any(p.startswith("eval.classnames: ") and "4 class names given for the 3 class folders" in p
               for p in problems), problems


# ---------------------------------------------------------------------------------------------------------
# The results JSON: what was scored, and the dataset's name


def test_results_record_classnames_and_templates(tmp_path):
    root = write_folder(tmp_path / "colours", {c: [rgb] for c, rgb in COLOURS.items()})
    res = evaluate.zeroshot(ColourModel(), to_tensor, RecordingTokenizer(), str(root),
                            templates=["a {} thing", "the colour {}"], progress=False)
    assert res["classnames"] == ["blue", "green", "red"]
    assert res["templates"] == ["a {} thing", "the colour {}"]
    assert res["metrics"]["acc1"] == 1.0


def test_a_retrieval_tar_is_named_after_its_file(tmp_path):
    shard = write_shard(tmp_path / "eval-sets" / "coco_val.tar",
                        [(c, rgb, f"a {c} square", None) for c, rgb in COLOURS.items()])
    res = evaluate.retrieval(ColourModel(), to_tensor, RecordingTokenizer(), str(shard), progress=False)
    assert res["dataset"] == "coco_val"
    assert res["metrics"]["image_retrieval_recall@1"] == 1.0 and res["metrics"]["text_retrieval_recall@1"] == 1.0


@pytest.mark.parametrize("spec, name", [
    ("sets/flickr30k_test.tar", "flickr30k_test"),
    ("sets/mine.tar.gz", "mine"),
    ("coco/shard-{000000..000003}.tar", "coco"),  # a range: the folder
    ("coco/*.tar", "coco"),  # a glob: the folder
    ("cbset/test/0.tar", "cbset"),  # CLIP_benchmark's layout: a numbered shard in a split folder
    ("laion/shard-000004.tar", "laion"),  # one shard of a set, named by its number: the folder
    ("coco/a.tar::coco/b.tar", "coco"),  # several files: their folder
])
def test_dataset_names(tmp_path, spec, name):
    assert evaluate.dataset_name(str(tmp_path / spec).replace("::", f"::{tmp_path}/")) == name


def test_an_image_folder_is_named_after_the_folder(tmp_path):
    root = write_folder(tmp_path / "pets", {c: [rgb] for c, rgb in COLOURS.items()})
    assert evaluate.dataset_name(str(root)) == "pets"


# ---------------------------------------------------------------------------------------------------------
# eval.every on its own steps


@pytest.mark.slow
def test_eval_every_fires_on_its_own_steps(small_demo, tmp_path):
    from mmcl.cli import main

    out = tmp_path / "run"
    code = main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={small_demo['train']}",
                 f"train.output_dir={out}", "train.progress=false", "train.plot=false", "data.shuffle_buffer=16",
                 *TRAINING_TOWERS, "train.steps=7", "data.batch_size=8", "data.workers=0", "train.save_every=0",
                 "train.log_every=3", "eval.every=2", f"eval.zeroshot={small_demo['zeroshot_colour']}"])
    assert code == 0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    key = "eval/zeroshot_classification/colour/acc1"
    # Logged every 3 steps and at each evaluation (2, 4, 6) and the end (7, the final evaluation).
    assert [r["step"] for r in rows] == [2, 3, 4, 6, 7]
    assert [r["step"] for r in rows if key in r] == [2, 4, 6, 7]
    for r in rows:  # an evaluation step's record is a whole metrics record
        assert {"loss", "lr", "samples", "logit_scale"} <= set(r)
