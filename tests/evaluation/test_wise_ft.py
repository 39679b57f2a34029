"""WiSE-FT (mmcl/evaluation/wise_ft.py): each alpha's model written between two models and its results gathered in
wise_ft.json, for two model folders (`mmcl interpolate`) and at the end of a run (`train.wise_ft`)."""

import json

import pytest
import torch

from mmcl import models
from mmcl.evaluation import wise_ft as wf
from mmcl.storage import weights
from mmcl.storage.layout import RunLayout


def _tiny(seed):
    cfg = json.loads((models.CONFIG_DIR / "tiny.json").read_text())
    cfg["vision_cfg"].update(layers=1, image_size=32)
    cfg["text_cfg"].update(layers=1)
    torch.manual_seed(seed)
    return models.create(cfg), cfg


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("wise")
    (a, cfg), (b, _) = _tiny(0), _tiny(1)
    pp = models.preprocess_config(cfg)
    return (a, b, cfg, pp, weights.save_model_dir(a, cfg, pp, root / "init"),
            weights.save_model_dir(b, cfg, pp, root / "ft"))


def _mixed(a, b, alpha):
    return {k: ((1 - alpha) * a[k].double() + alpha * b[k].double()) for k in a if a[k].is_floating_point()}


def test_each_alpha_is_written_and_listed_in_order(two, tmp_path):
    a, b, cfg, pp, init, ft = two
    out = wf.wise_ft(init, ft, [1.0, 0.0, 0.25], tmp_path / "out")
    assert [r["alpha"] for r in out["results"]] == [1.0, 0.0, 0.25]
    assert (out["task"], out["from"], out["to"], out["dataset"]) == ("wise_ft", str(init), str(ft), None)
    assert all("metrics" not in r for r in out["results"])
    assert json.loads((tmp_path / "out" / wf.RESULTS_FILE).read_text()) == out
    sa, sb = a.state_dict(), b.state_dict()
    for r in out["results"]:
        model, _, _ = weights.load_model_dir(r["model"])
        got = model.state_dict()
        if r["alpha"] in (0.0, 1.0):  # the two models themselves, exactly
            want = sa if r["alpha"] == 0.0 else sb
            assert all(torch.equal(got[k], want[k]) for k in want)
        else:
            for k, ref in _mixed(sa, sb, r["alpha"]).items():
                torch.testing.assert_close(got[k].double(), ref, rtol=1e-6, atol=1e-7)


def test_a_runs_alphas_are_scored_by_its_evaluation(two, tmp_path):
    a, b, cfg, pp, _, _ = two
    seen = []

    def evaluate(model):
        seen.append(float(model.logit_scale))
        return {"zeroshot/set/acc1": float(model.logit_scale), "zeroshot/set/loss": 0.0}

    b.logit_scale.data.fill_(3.0)
    init_state = {k: v.clone() for k, v in a.state_dict().items()}
    init_state["logit_scale"] = torch.tensor(1.0)
    lines = wf.wise_ft_of_run(init_state, "the run's start", b, cfg, pp, [0.5, 1.0], tmp_path / "run", evaluate)
    folder = RunLayout(tmp_path / "run").wise_ft
    assert seen == pytest.approx([2.0, 3.0])
    assert lines == [f"WiSE-FT alpha 0.5: {folder / 'alpha_0.5'} (zeroshot/set/acc1 2.0000)",
                     f"WiSE-FT alpha 1: {folder / 'alpha_1'} (zeroshot/set/acc1 3.0000)"]
    saved = json.loads((folder / wf.RESULTS_FILE).read_text())
    assert saved["from"] == "the run's start" and saved["to"] == str(RunLayout(tmp_path / "run").model)
    assert [r["metrics"]["zeroshot/set/acc1"] for r in saved["results"]] == pytest.approx([2.0, 3.0])
    assert float(b.logit_scale) == 3.0  # the run's model is not changed
