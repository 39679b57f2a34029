"""bench/siglip2_digits.py and its dense probe (bench/dense_probe.py): mIoU and the patches' labels against
hand-computed examples, the labelled scenes against their captions, the patch tokens against the image tower's
last block, the arms' availability check, the equal-wall-time step count, and (slow) the whole bench on a few
steps."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
try:
    import dense_probe
    import siglip2_digits
finally:
    sys.path.remove(str(ROOT / "bench"))


def test_miou_against_a_hand_computed_example():
    target = np.array([0, 0, 1, 1, 2, 2, 2])
    pred = np.array([0, 1, 1, 1, 2, 2, 0])
    conf = dense_probe.confusion(pred, target, n_classes=4)
    assert conf.tolist() == [[1, 1, 0, 0], [0, 2, 0, 0], [1, 0, 2, 0], [0, 0, 0, 0]]
    mean, per_class = dense_probe.miou(conf)
    # class 0: 1 / (2 true + 2 predicted - 1) = 1/3; class 1: 2 / (2 + 3 - 2) = 2/3; class 2: 2 / (3 + 2 - 2) = 2/3;
    # class 3 is neither true nor predicted: nan, left out of the mean.
    assert per_class[:3] == pytest.approx([1 / 3, 2 / 3, 2 / 3])
    assert np.isnan(per_class[3])
    assert mean == pytest.approx((1 / 3 + 2 / 3 + 2 / 3) / 3)
    # A class predicted but never true counts, with IoU 0.
    mean, per_class = dense_probe.miou(dense_probe.confusion(np.array([3, 0]), np.array([0, 0]), 4))
    assert per_class[0] == pytest.approx(0.5) and per_class[3] == 0.0 and mean == pytest.approx(0.25)


def test_each_patch_takes_the_majority_label_of_its_pixels_ties_to_the_smallest():
    labels = np.array([[10, 10, 3, 3, 7, 7],
                       [10, 3, 3, 3, 7, 10],
                       [10, 10, 10, 10, 5, 5],
                       [10, 10, 10, 4, 10, 10]])
    # patches of 2x2: (3 of 10, 1 of 3) -> 10; (4 of 3) -> 3; (3 of 7, 1 of 10) -> 7;
    # (4 of 10) -> 10; (3 of 10, 1 of 4) -> 10; (2 of 5, 2 of 10) -> tie -> 5.
    assert dense_probe.patch_labels(labels, 2).tolist() == [[10, 3, 7], [10, 10, 5]]
    with pytest.raises(ValueError, match="does not split"):
        dense_probe.patch_labels(labels, 4)


def test_a_scene_labels_each_pasted_square_with_its_digit_and_its_caption_names_them_and_their_places():
    digits = dense_probe.Digits.load()
    assert len(digits.train) == 1437 and len(digits.test) == 360
    assert not set(digits.train) & set(digits.test) and all(i % 5 == 0 for i in digits.test)
    rng = np.random.default_rng(3)
    for _ in range(20):
        image, labels, caption = dense_probe.scene(rng, digits, digits.test, 64, 2, (16, 32))
        assert image.size == (64, 64) and labels.shape == (64, 64)
        parts = caption.split(" and ")
        classes = [c for c in np.unique(labels) if c != dense_probe.BACKGROUND]
        assert 1 <= len(parts) == len(classes) or (len(parts) == 2 and len(classes) == 1)  # two of one digit
        for part in parts:
            naming, place = part.split(" at the ")
            assert place in dense_probe.PLACES.values()
            named = [k for k, w in enumerate(dense_probe.WORDS) if naming.endswith(f" {w}") or naming.endswith(f" {k}")]
            assert len(named) == 1 and named[0] in classes, (part, classes)
        for c in classes:  # each digit's region is a filled square of a side within the range
            rows, cols = np.nonzero(labels == c)
            h, w = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
            if len(parts) == len(classes):
                assert h == w and 16 <= h <= 32 and len(rows) == h * w
    assert dense_probe.place_words((0, 0, 16, 16), 64) == "top left"
    assert dense_probe.place_words((24, 24, 16, 16), 64) == "centre"
    assert dense_probe.place_words((48, 0, 16, 16), 64) == "bottom left"
    assert dense_probe.place_words((0, 0, 64, 64), 64) == "centre"


def tiny_model():
    from mmcl import models
    from mmcl.config import load_config

    cfg = load_config(str(siglip2_digits.CONFIG), [*siglip2_digits.TOWERS, "model.image_size=32"])
    torch.manual_seed(0)
    model, _, _, _, preprocess, tokenizer = models.build(cfg.model)
    return model.eval(), preprocess, tokenizer


def test_patch_tokens_are_the_image_towers_last_block_output_on_its_patch_grid():
    model, _, _ = tiny_model()
    images = torch.randn(3, 3, 32, 32)
    seen = []
    hook = model.visual.transformer.resblocks[-1].register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        model.visual(images)
    hook.remove()
    tokens = dense_probe.patch_tokens(model, images, batch_size=2)
    assert tokens.shape == (3, 4, 4, 64)  # 32 px in 8 px patches, width 64
    expected = seen[0][:, 1:].reshape(3, 4, 4, 64)  # after the class token, row by row
    torch.testing.assert_close(tokens, expected)
    with pytest.raises(TypeError, match="no patch tokens"):
        dense_probe.image_tower(torch.nn.Linear(2, 2))


def test_the_probe_separates_separable_patches_and_the_dense_probe_reads_a_models_patches():
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 5, size=(3, 8))
    y = rng.integers(0, 3, size=600)
    x = centres[y] + rng.normal(0, 0.5, size=(600, 8))
    predict = dense_probe.fit_probe(x[:400], y[:400], n_classes=3, steps=200)
    mean, _ = dense_probe.miou(dense_probe.confusion(predict(x[400:]).numpy(), y[400:], 3))
    assert mean == 1.0

    model, preprocess, _ = tiny_model()
    digits = dense_probe.Digits.load()
    train = dense_probe.labelled_set(rng, digits, digits.train, 6, 32)
    test = dense_probe.labelled_set(rng, digits, digits.test, 4, 32)
    res = dense_probe.dense_probe(model, preprocess, train, test, steps=20)
    patches = np.stack([dense_probe.patch_labels(m, 8) for m in test[1]])
    assert res["dense_background_share"] == pytest.approx((patches == dense_probe.BACKGROUND).mean(), abs=1e-4)
    assert 0.0 <= res["dense_miou"] <= 1.0 and 0.0 <= res["dense_patch_acc"] <= 1.0


def test_an_arm_is_available_only_when_this_build_has_its_keys_and_model():
    assert siglip2_digits.availability(siglip2_digits.ARMS["siglip"]) == (True, "")
    ok, why = siglip2_digits.availability(["loss.no_such_term=1.0"])
    assert not ok and "loss.no_such_term" in why
    ok, why = siglip2_digits.availability(["model.name=no_such_model"])
    assert not ok and "no_such_model" in why
    # The recipe's arms name their terms as the config does, so they become available when those terms exist.
    from mmcl.config.schema import LOSS_TERMS

    for arm, needs in (("caption", {"caption"}), ("stage2", {"self_distill", "masked"}),
                       ("full", {"caption", "self_distill", "masked"})):
        if not needs <= set(LOSS_TERMS):
            assert not siglip2_digits.availability(siglip2_digits.ARMS[arm])[0], arm


def test_equal_wall_time_counts_the_steps_at_each_windows_own_rate(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 5, "samples_per_s": 10.0}, {"step": 10, "samples_per_s": 64.0},
            {"step": 20, "samples_per_s": 32.0}]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # After the first window: 5 steps of batch 64 at 64 samples/s (5 s), 10 at 32 (20 s): 25 s over 15 steps.
    per_step, steps = siglip2_digits.step_seconds(metrics, 64)
    assert per_step == pytest.approx(25 / 15) and steps == 15
    assert siglip2_digits.logged_train_seconds(metrics, 64) == pytest.approx(5 * 64 / 10 + 25)


def test_the_summary_gives_mean_and_std_over_seeds_and_says_why_an_arm_is_missing():
    results = [{"arm": "siglip", "seed": s, **{k: v for k in siglip2_digits.METRICS}}
               for s, v in ((0, 0.2), (1, 0.4))]
    table = siglip2_digits.summary_table(results, ["siglip", "full"], {"full": "unknown config key 'loss.masked'"}, {})
    lines = table.splitlines()
    assert lines[2].startswith("| siglip | 0,1 | 0.300 ± 0.141 |")  # std with n - 1: 0.1 * sqrt(2)
    assert "| full | - | not available in this build: unknown config key 'loss.masked' |" in lines[3]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


@pytest.mark.slow
def test_the_bench_runs_every_available_arm_and_reports_the_others(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "siglip2_digits.py"), "--work-dir", str(tmp_path),
                           "--steps", "3", "--seeds", "0", "--n-train", "128", "--n-retrieval", "20",
                           "--n-probe-train", "6", "--n-probe-test", "4", "--probe-steps", "5", "--batch-size", "16",
                           "--image-size", "32", "--untrained"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    runs = {x["arm"]: x for x in lines if "zeroshot_top1" in x}
    missing = {x["arm"] for x in lines if x.get("status") == "not available in this build"}
    assert set(runs) | missing >= set(siglip2_digits.ARMS) and "siglip" in runs and "siglip@init" in runs
    for arm in set(siglip2_digits.ARMS) - missing:
        r = runs[arm]
        assert r["steps"] == 3 and 0 <= r["zeroshot_top1"] <= 1 and 0 <= r["dense_miou"] <= 1, r
        assert (tmp_path / f"{arm}-seed0" / "model").is_dir()
    assert (tmp_path / "summary.md").read_text().count("\n| ") >= 3
