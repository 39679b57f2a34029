"""Zero-shot, retrieval and linear-probe evaluation on hand-built cases with known answers."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.functional import to_tensor

from mmcl import models
from mmcl.errors import DataError
from mmcl.evaluation import evaluate
from mmcl.storage import weights

from helpers import COLOURS, solid, write_folder, write_shard  # noqa: F401 (test_eval_sets.py takes solid from here)

WORDS = ("red", "green", "blue", "yellow", "cyan", "magenta")


class ColourModel(nn.Module):
    """Encoders with known outputs: an image is its mean RGB, a text is the one-hot of the colour word in it.

    Together with `colour_tokenizer` this makes similarities computable by hand: a pure red image and the
    text "a red thing" have cosine 1, a red image and "blue" cosine 0.
    """

    def encode_image(self, images, normalize=False):
        f = images.float().mean(dim=(2, 3))  # (B, 3)
        f = torch.cat([f, torch.zeros(f.shape[0], len(WORDS) - 3)], dim=1)  # (B, 6)
        return F.normalize(f, dim=-1) if normalize else f

    def encode_text(self, tokens, normalize=False):
        f = tokens.float()
        return F.normalize(f, dim=-1) if normalize else f


def colour_tokenizer(texts):
    out = torch.zeros(len(texts), len(WORDS))
    for i, text in enumerate(texts):
        for j, word in enumerate(WORDS):
            if word in text.lower().split() or word in text.lower():
                out[i, j] = 1.0
    return out


# ---------------------------------------------------------------------------------------------------------
# Metrics on hand-built scores


def test_classification_metrics_known_values():
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    logits = torch.zeros(6, 6)
    # rows 0-2 rank their label first; row 3 second; row 4 sixth (last); row 5 fifth
    for i in range(3):
        logits[i, i] = 1.0
    logits[3] = torch.tensor([0.0, 0.0, 0.0, 0.8, 0.9, 0.0])
    logits[4] = torch.tensor([0.5, 0.4, 0.3, 0.2, 0.0, 0.1])
    logits[5] = torch.tensor([0.5, 0.4, 0.3, 0.2, 0.05, 0.1])
    m = evaluate.classification_metrics(logits, labels)
    assert m["acc1"] == pytest.approx(3 / 6)
    assert m["acc5"] == pytest.approx(5 / 6)
    assert m["mean_per_class_recall"] == pytest.approx(3 / 6)


@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
def test_classification_metrics_mean_per_class_recall_is_balanced_accuracy():
    from sklearn.metrics import balanced_accuracy_score

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 7, generator=gen)
    labels = torch.randint(0, 6, (200,), generator=gen)  # class 6 never occurs: left out of the mean
    m = evaluate.classification_metrics(logits, labels)
    assert m["mean_per_class_recall"] == pytest.approx(balanced_accuracy_score(labels, logits.argmax(1)))


def test_acc5_left_out_below_five_classes():
    m = evaluate.classification_metrics(torch.eye(3), torch.tensor([0, 1, 2]))
    assert "acc5" not in m and m["acc1"] == 1.0


def test_retrieval_metrics_hand_computed():
    sim = torch.tensor([[0.9, 0.1, 0.0, 0.2],
                        [0.2, 0.8, 0.1, 0.3],
                        [0.1, 0.3, 0.7, 0.0],
                        [0.0, 0.1, 0.95, 0.9]])
    owner = torch.tensor([0, 0, 1, 2])  # image 3 has no caption: a distractor for text->image only
    m = evaluate.retrieval_metrics(sim, owner, ks=(1, 2))
    # text->image: text0 hits at 1; text1 (img0) ranks img1, img3, img0 -> miss at 2;
    # text2 (img1) ranks img2, img1 -> hit at 2; text3 (img2) hits at 1.
    assert m["image_retrieval_recall@1"] == pytest.approx(2 / 4)
    assert m["image_retrieval_recall@2"] == pytest.approx(3 / 4)
    # image->text over images 0-2: img0 top text0 (own); img1 top text1 (img0's), then text2 (own);
    # img2 top text3 (own).
    assert m["text_retrieval_recall@1"] == pytest.approx(2 / 3)
    assert m["text_retrieval_recall@2"] == pytest.approx(3 / 3)


def _reference_recalls(text_feats, image_feats, owner, ks):
    """float64 loops: rank of the best positive, counted by strictly greater scores."""
    t, i = text_feats.double(), image_feats.double()
    sim = (t @ i.T).numpy()
    owner = owner.numpy()
    out = {}
    for k in ks:
        hits = [(sim[j] > sim[j, owner[j]]).sum() < k for j in range(sim.shape[0])]
        out[f"image_retrieval_recall@{k}"] = float(np.mean(hits))
        img_hits = []
        for img in sorted(set(owner.tolist())):
            best = sim[owner == img, img].max()
            img_hits.append((sim[:, img] > best).sum() < k)
        out[f"text_retrieval_recall@{k}"] = float(np.mean(img_hits))
    return out


def test_chunked_recalls_match_full_matrix_and_float64_reference():
    gen = torch.Generator().manual_seed(1)
    image_feats = F.normalize(torch.randn(23, 16, generator=gen), dim=-1)
    owner = torch.randint(0, 20, (41,), generator=gen)  # images 20-22 have no caption; several have many
    text_feats = F.normalize(image_feats[owner] + 0.9 * torch.randn(41, 16, generator=gen), dim=-1)
    ks = (1, 5, 10)
    chunked = evaluate.retrieval_recalls(text_feats, image_feats, owner, ks, chunk=7)
    full = evaluate.retrieval_metrics(text_feats @ image_feats.T, owner, ks)
    ref = _reference_recalls(text_feats, image_feats, owner, ks)
    assert chunked == full  # same top-k over the same rows; only the row blocking differs
    for key, value in ref.items():
        # random continuous features have no exact ties, so rank-by-count equals top-k membership
        assert chunked[key] == pytest.approx(value), key
    assert 0 < chunked["image_retrieval_recall@1"] < chunked["image_retrieval_recall@10"] <= 1


def test_split_captions_one_text_per_line():
    texts, owner = evaluate.split_captions(["a red circle\nthe red one\n", "", "blue\n\n  \nsky"])
    assert texts == ["a red circle", "the red one", "blue", "sky"]
    assert owner.tolist() == [0, 0, 2, 2]


# ---------------------------------------------------------------------------------------------------------
# Zero-shot and retrieval end to end on data with known answers


def test_zeroshot_imagefolder_known_accuracy(tmp_path):
    root = write_folder(tmp_path / "colours", {
        "blue": [(0, 0, 255), (0, 0, 200), (250, 0, 0)],  # the last one is red: a known miss
        "green": [(0, 255, 0), (10, 240, 10)],
        "red": [(255, 0, 0), (200, 0, 0), (255, 30, 30)],
    })
    res = evaluate.zeroshot(ColourModel(), to_tensor, colour_tokenizer, str(root), templates=["a {} thing"],
                            batch_size=3, progress=False, model_name="colour")
    assert res["task"] == "zeroshot_classification" and res["dataset"] == "colours" and res["model"] == "colour"
    assert res["n_samples"] == 8 and res["n_classes"] == 3
    assert res["metrics"]["acc1"] == pytest.approx(7 / 8)
    assert res["metrics"]["mean_per_class_recall"] == pytest.approx((2 / 3 + 1 + 1) / 3)
    json.dumps(res)  # the result is plain JSON


def test_zeroshot_shards_with_cls_classnames_and_cb_templates(tmp_path):
    # CLIP_benchmark layout: DIR/test/0.tar with classnames.txt and {c}-templates one level up.
    root = tmp_path / "cbset"
    write_shard(root / "test" / "0.tar", [
        (f"s{i}", rgb, None, lab) for i, (rgb, lab) in enumerate(
            [((255, 0, 0), 0), ((0, 255, 0), 1), ((0, 0, 255), 2), ((0, 0, 255), 0), ((0, 250, 0), 1)])])
    (root / "test" / "nshards.txt").write_text("1\n")
    (root / "classnames.txt").write_text("red\ngreen\nblue\n")
    (root / "zeroshot_classification_templates.txt").write_text("a photo of {c}.\n")
    res = evaluate.zeroshot(ColourModel(), to_tensor, colour_tokenizer, str(root / "test" / "0.tar"),
                            batch_size=2, progress=False)
    assert res["dataset"] == "cbset" and res["n_classes"] == 3
    assert res["metrics"]["acc1"] == pytest.approx(4 / 5)  # the blue image labelled red is the miss
    assert res["metrics"]["mean_per_class_recall"] == pytest.approx((1 / 2 + 1 + 1) / 3)


def test_zeroshot_errors_name_the_problem(tmp_path):
    shard = write_shard(tmp_path / "s" / "0.tar", [("a", (255, 0, 0), "red", None), ("b", (0, 255, 0), "g", 1)])
    with pytest.raises(DataError, match="no class names"):
        evaluate.zeroshot(ColourModel(), to_tensor, colour_tokenizer, str(shard), progress=False)
    with pytest.raises(DataError, match="have no label"):
        evaluate.zeroshot(ColourModel(), to_tensor, colour_tokenizer, str(shard), classnames=["red", "green"],
                          templates=["{}"], progress=False)
    with pytest.raises(DataError, match="needs '\\{\\}'"):
        evaluate.zeroshot(ColourModel(), to_tensor, colour_tokenizer, str(shard), classnames=["red", "green"],
                          templates=["no slot"], progress=False)
    with pytest.raises(DataError, match="unknown templates .*one template holding '\\{\\}'"):
        evaluate.load_templates("no_such_template_set")


def test_one_template_given_as_text(tmp_path):
    """`--templates 'a photo of a {}.'` (or CLIP_benchmark's {c}) is one template; the in-run preflight does not
    look for it as a file, and a file of that name is still read as a file."""
    assert evaluate.load_templates("a handwritten digit {}") == ["a handwritten digit {}"]
    assert evaluate.load_templates(" a {c} ") == ["a {}"]
    assert evaluate.is_template_name_or_text("a photo of a {}.")
    assert not evaluate.is_template_name_or_text("prompts.txt")
    with pytest.raises(DataError, match="needs '\\{\\}'"):
        evaluate.load_templates("a {name} photo {}")
    path = tmp_path / "{}.txt"
    path.write_text("a sketch of {}\n")
    assert evaluate.load_templates(str(path)) == ["a sketch of {}"]
    assert not evaluate.is_template_name_or_text(str(path))
    root = write_folder(tmp_path / "colours", {"red": [(255, 0, 0)], "green": [(0, 255, 0)]})
    res = evaluate.zeroshot(ColourModel(), to_tensor, colour_tokenizer, str(root), templates="a {} thing",
                            progress=False)
    assert res["templates"] == ["a {} thing"] and res["metrics"]["acc1"] == 1.0


def test_retrieval_multi_caption_known_recalls(tmp_path):
    shard = write_shard(tmp_path / "ret" / "shard-000000.tar", [
        ("img0", (255, 0, 0), "a red square\nsomething red", None),
        ("img1", (0, 255, 0), "a green one", None),
        ("img2", (0, 0, 255), "blue", None),
        ("img3", (0, 200, 255), "green and blue", None),  # text (0,1,1) is closest to img3 (0,.78,1)
        ("img4", (255, 255, 0), "", None),  # no caption: only a text->image distractor
    ])
    res = evaluate.retrieval(ColourModel(), to_tensor, colour_tokenizer, str(shard), batch_size=2, progress=False,
                             ks=(1, 2, 5))
    m = res["metrics"]
    assert res["n_images"] == 5 and res["n_texts"] == 5 and res["task"] == "zeroshot_retrieval"
    # text->image: red texts -> img0 (cos 1) vs img4 (cos .71); "a green one" -> img1 (1) vs img4 (.71), img3
    # (.62); "blue" -> img2 (1) vs img3 (.79); "green and blue" -> img3 (.99) vs img1, img2 (.71). All top-1.
    assert m["image_retrieval_recall@1"] == 1.0
    # image->text: img0 -> a red text (1); img1 -> "a green one" (1) before "green and blue" (.71); img2 -> "blue"
    # (1) before "green and blue" (.71); img3 -> "green and blue" (.99). The captionless img4 is not scored.
    assert m["text_retrieval_recall@1"] == 1.0
    assert res["n_distinct_texts"] == 5


def test_retrieval_over_class_labels_as_captions_says_why_its_recalls_are_low(tmp_path, capsys):
    """Captions that repeat (an ImageFolder made into shards: one caption per class) cannot tell their images
    apart: the recalls stay low with a model that matches every colour exactly, and the run says why."""
    rows = [(f"img{i}", rgb, f"a {name} thing", None) for i, (name, rgb) in enumerate(list(COLOURS.items()) * 4)]
    shard = write_shard(tmp_path / "ret" / "shard-000000.tar", rows)
    res = evaluate.retrieval(ColourModel(), to_tensor, colour_tokenizer, str(shard), progress=False, ks=(1,))
    assert res["n_texts"] == 12 and res["n_distinct_texts"] == 3
    assert res["metrics"]["image_retrieval_recall@1"] <= 0.5  # 4 equal images per text: one of them is its own
    err = capsys.readouterr().err
    assert f"mmcl: warning: retrieval of {shard}: 12 captions, 3 of them distinct;" in err, err
    distinct = write_shard(tmp_path / "ok" / "shard-000000.tar", rows[:3])
    evaluate.retrieval(ColourModel(), to_tensor, colour_tokenizer, str(distinct), progress=False, ks=(1,))
    assert "warning" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Linear probe


def _clusters(n_per_class, n_classes, dim, seed, spread=0.05):
    gen = torch.Generator().manual_seed(seed)
    # one fixed set of centres (torch.randn of another shape would draw different numbers)
    centres = F.normalize(torch.randn(8, dim, generator=torch.Generator().manual_seed(123)), dim=-1)[:n_classes]
    y = torch.arange(n_classes).repeat_interleave(n_per_class)
    x = centres[y] + spread * torch.randn(len(y), dim, generator=gen)
    return F.normalize(x, dim=-1), y


def test_linear_probe_separable_clusters_are_perfect():
    train_x, train_y = _clusters(12, 6, 8, seed=0)
    test_x, test_y = _clusters(5, 6, 8, seed=1)
    fit = evaluate.fit_linear_probe(train_x, train_y, test_x, test_y, n_classes=6)
    assert fit["metrics"] == {"acc1": 1.0, "acc5": 1.0, "mean_per_class_recall": 1.0}
    assert fit["C"] in evaluate.DEFAULT_CS and set(fit["val_acc1"]) == set(evaluate.DEFAULT_CS)


def test_linear_probe_matches_sklearn_refit_with_chosen_c():
    from sklearn.linear_model import LogisticRegression

    train_x, train_y = _clusters(15, 4, 6, seed=2, spread=0.6)  # overlapping: accuracy well below 1
    test_x, test_y = _clusters(20, 4, 6, seed=3, spread=0.6)
    fit = evaluate.fit_linear_probe(train_x, train_y, test_x, test_y, n_classes=4, Cs=(0.1, 1.0, 10.0))
    best = max(fit["val_acc1"].values())
    assert fit["C"] == min(c for c, acc in fit["val_acc1"].items() if acc == best)  # ties -> stronger penalty
    ref = LogisticRegression(C=fit["C"], max_iter=1000, random_state=0).fit(train_x.double().numpy(), train_y)
    expected = float((ref.predict(test_x.double().numpy()) == test_y.numpy()).mean())
    assert fit["metrics"]["acc1"] == pytest.approx(expected)
    assert 0.3 < expected < 1.0


def test_linear_probe_class_missing_from_train_counts_as_wrong():
    train_x, train_y = _clusters(6, 3, 5, seed=4)
    test_x, test_y = _clusters(4, 4, 5, seed=5)  # class 3 is never seen in training
    fit = evaluate.fit_linear_probe(train_x, train_y, test_x, test_y, n_classes=4)
    assert fit["metrics"]["acc1"] == pytest.approx(12 / 16)
    assert fit["metrics"]["mean_per_class_recall"] == pytest.approx(3 / 4)


def test_linear_probe_end_to_end_on_imagefolders(tmp_path):
    rng = np.random.default_rng(0)

    def shades(base, n):
        return [tuple(int(np.clip(c + rng.integers(-40, 40), 0, 255)) for c in base) for _ in range(n)]

    layout = lambda n: {name: shades(rgb, n) for name, rgb in COLOURS.items()}  # noqa: E731
    train = write_folder(tmp_path / "train", layout(8))
    test = write_folder(tmp_path / "test", layout(4))
    res = evaluate.linear_probe(ColourModel(), to_tensor, str(train), str(test), batch_size=5, progress=False,
                                model_name="colour")
    assert res["task"] == "linear_probe" and res["n_train"] == 24 and res["n_test"] == 12 and res["n_classes"] == 3
    assert res["metrics"]["acc1"] == 1.0 and res["metrics"]["mean_per_class_recall"] == 1.0
    json.dumps(res)


def test_linear_probe_rejects_unlabelled_data(tmp_path):
    train = write_shard(tmp_path / "a" / "0.tar", [(f"k{i}", (255, 0, 0), "red", None) for i in range(5)])
    with pytest.raises(DataError, match="no label"):
        evaluate.linear_probe(ColourModel(), to_tensor, str(train), str(train), progress=False)


# ---------------------------------------------------------------------------------------------------------
# A real (tiny, random) open_clip model through the training-loop call and the CLI


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(0)
    model = models.create(cfg)
    return weights.save_model_dir(model, cfg, models.preprocess_config(cfg), tmp_path_factory.mktemp("m") / "model")


def test_training_loop_call_and_cli(tiny_model_dir, tmp_path):
    from mmcl import cli

    folder = write_folder(tmp_path / "zs", {name: [rgb, rgb] for name, rgb in COLOURS.items()})
    shard = write_shard(tmp_path / "ret" / "0.tar", [(f"k{i}", rgb, f"a {name} image\n{name}", i)
                                                     for i, (name, rgb) in enumerate(COLOURS.items())])
    model, eval_tf, tokenizer = weights.load(tiny_model_dir)
    model.train()
    res = evaluate.zeroshot(model, eval_tf, tokenizer, str(folder), classnames=None,
                            templates="openai_imagenet_template", batch_size=4, device="cpu", progress=False)
    probs = res["metrics"]
    assert set(probs) == {"acc1", "mean_per_class_recall"} and 0 <= probs["acc1"] <= 1
    res = evaluate.retrieval(model, eval_tf, tokenizer, str(shard), batch_size=4, device="cpu", progress=False)
    assert res["n_texts"] == 6 and res["metrics"]["image_retrieval_recall@10"] == 1.0  # 3 images: all in top 10

    out = tmp_path / "zs.json"
    assert cli.main(["zeroshot", "--model", str(tiny_model_dir), "--data", str(folder), "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert set(saved) >= {"dataset", "model", "task", "metrics"} and saved["task"] == "zeroshot_classification"
    out = tmp_path / "lp.json"
    assert cli.main(["linear-probe", "--model", str(tiny_model_dir), "--train", str(folder), "--test", str(folder),
                     "--out", str(out)]) == 0
    assert json.loads(out.read_text())["task"] == "linear_probe"
    assert cli.main(["retrieval", "--model", str(tiny_model_dir), "--data", str(tmp_path / "nothing.tar")]) == 2


def test_classnames_given_in_another_order_follow_the_folder_labels(tmp_path):
    from types import SimpleNamespace

    from mmcl.evaluation.evaluate import resolve_classnames

    ds = SimpleNamespace(folders=["blue", "green", "red"], classnames=["blue", "green", "red"])
    # Labels index the sorted folders; names given as red, blue, green must not be paired by position.
    assert resolve_classnames(str(tmp_path), ds, ["red", "blue", "green"]) == ["blue", "green", "red"]
    # Human-readable names that are not the folder names are taken in the order given.
    assert resolve_classnames(str(tmp_path), ds, ["sky", "grass", "fire"]) == ["sky", "grass", "fire"]


def test_zeroshot_over_ten_classes_equals_open_clips_classifier_and_labels_its_bar(tiny_model_dir, tmp_path, capsys):
    """12 class names are encoded 10 at a time under a bar labelled "class names" (open_clip's own bar has no
    label): the accuracy is that of open_clip's classifier built in one call."""
    import open_clip
    from PIL import Image

    rng = np.random.default_rng(0)
    names = [f"shade{i}" for i in range(12)]
    folder = write_folder(tmp_path / "zs", {n: [tuple(int(v) for v in rng.integers(0, 255, 3)) for _ in range(3)]
                                            for n in names})
    model, eval_tf, tokenizer = weights.load(tiny_model_dir)
    templates = ["a photo of {}.", "{} in a picture."]
    res = evaluate.zeroshot(model, eval_tf, tokenizer, str(folder), templates=templates, batch_size=8,
                            device="cpu", progress=True)
    bars = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "%|" in line]
    assert bars and all(line.startswith(("class names:", "zeroshot:")) for line in bars), bars
    assert any(line.startswith("class names: 100%") and "2/2" in line for line in bars), bars

    classifier = open_clip.build_zero_shot_classifier(model, tokenizer, sorted(names), templates, device="cpu")
    images, labels = [], []
    for label, name in enumerate(sorted(names)):
        for path in sorted((folder / name).iterdir()):
            images.append(eval_tf(Image.open(path).convert("RGB")))
            labels.append(label)
    with torch.no_grad():
        predicted = (model.encode_image(torch.stack(images), normalize=True) @ classifier).argmax(dim=1)
    assert res["n_classes"] == 12
    assert res["metrics"]["acc1"] == pytest.approx((predicted == torch.tensor(labels)).float().mean().item())
