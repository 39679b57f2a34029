"""Run plots: files written from a synthetic metrics.jsonl, the plotted data, and clean errors on bad logs."""

import json
import math
import struct

import pytest

from mmcl import cli
from mmcl.errors import DataError
from mmcl.evaluation.plot import load_metrics, make_figures, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _record(step, n_steps, with_eval):
    p = step / n_steps
    r = {
        "step": step, "samples": 64 * step, "loss": 4.0 * math.exp(-2 * p) + 0.1 * math.sin(step),
        "loss/clip": 3.9 * math.exp(-2 * p), "loss/align": 1.5 - p, "lr": 1e-3 * (1 - p),
        "logit_scale": 14.3 + 20 * p, "samples_per_s": 250.0 + step % 7, "data_time_frac": 0.05,
        "data/skipped": 0, "grad_norm": 2.0 - p, "align": 1.8 - 1.2 * p, "uniform_image": -0.5 - 2.5 * p,
        "uniform_text": -0.3 - 2.0 * p,
    }
    if with_eval and step % 20 == 0:
        r["eval/zeroshot_classification/colour/acc1"] = 0.2 + 0.7 * p
        r["eval/zeroshot_classification/colour/acc5"] = 0.6 + 0.4 * p
        r["eval/zero_shot_retrieval/pairs/image_retrieval_recall@1"] = 0.1 + 0.5 * p
    return r


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"  # the PNG spec puts IHDR first
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def run_dir(tmp_path):
    n = 80
    records = [_record(s, n, with_eval=True) for s in range(1, n + 1)]
    # A run being tailed: the last line is cut off mid-record.
    _write(tmp_path / "metrics.jsonl", records, tail='{"step": 81, "loss": 0.9, "lr"')
    return tmp_path, records


def test_plot_run_writes_valid_pngs(run_dir):
    from matplotlib import image as mimage

    path, _ = run_dir
    written = plot_run(path)
    names = [p.name for p in written]
    assert names == ["loss.png", "lr_scale.png", "align_uniform.png", "throughput.png", "eval.png"]
    for p in written:
        assert p.parent == path / "plots"
        width, height = _png_size(p)
        # 120 dpi figures of 7-13 inches: anything outside means a broken layout or a wrong dpi.
        assert 600 <= width <= 2000 and 500 <= height <= 1400, (p.name, width, height)
        assert p.stat().st_size > 20_000, p.name  # a plot with curves, text and ticks, not a blank canvas
        pixels = mimage.imread(p)[..., :3]
        assert pixels.std() > 0.05, p.name  # something other than background is drawn
    assert not list((path / "plots").glob(".*tmp*")), "temporary files must be renamed into place"


def test_plotted_data_match_the_log(run_dir):
    path, records = run_dir
    figs = make_figures(load_metrics(path / "metrics.jsonl"), "t")
    steps = [r["step"] for r in records]

    def line(fig, gid):
        found = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == gid]
        assert len(found) == 1, gid
        return list(found[0].get_xdata()), list(found[0].get_ydata())

    assert line(figs["loss.png"], "raw:total") == (steps, [r["loss"] for r in records])
    assert line(figs["loss.png"], "raw:clip") == (steps, [r["loss/clip"] for r in records])
    assert line(figs["lr_scale.png"], "lr") == (steps, [r["lr"] for r in records])
    assert line(figs["lr_scale.png"], "logit_scale") == (steps, [r["logit_scale"] for r in records])
    eval_steps, acc1 = line(figs["eval.png"], "eval/zeroshot_classification/colour/acc1")
    assert eval_steps == [20, 40, 60, 80]
    assert acc1 == [records[s - 1]["eval/zeroshot_classification/colour/acc1"] for s in eval_steps]

    # The Wang & Isola plane: x = -uniform, y = align, colour = step.
    ax = figs["align_uniform.png"].axes[0]
    assert ax.get_xlabel().endswith("(-l_uniform, t=2)") and "l_align" in ax.get_ylabel()
    for modality in ("image", "text"):
        pts = [c for c in ax.collections if c.get_gid() == f"points:{modality}"]
        assert len(pts) == 1
        offsets = pts[0].get_offsets()
        assert [tuple(map(float, o)) for o in offsets] == [(-r[f"uniform_{modality}"], r["align"]) for r in records]
        assert list(pts[0].get_array()) == steps
        start = [c for c in ax.collections if c.get_gid() == f"start:{modality}"][0].get_offsets()[0]
        end = [c for c in ax.collections if c.get_gid() == f"end:{modality}"][0].get_offsets()[0]
        assert tuple(map(float, start)) == (-records[0][f"uniform_{modality}"], records[0]["align"])
        assert tuple(map(float, end)) == (-records[-1][f"uniform_{modality}"], records[-1]["align"])


def test_smoothed_curve_is_a_bias_corrected_ema(run_dir):
    from mmcl.evaluation.plot import _smoothing_weight

    path, records = run_dir
    fig = make_figures(load_metrics(path / "metrics.jsonl"), "t")["loss.png"]
    smooth = [ln for ln in fig.axes[0].get_lines() if ln.get_gid() == "smooth:total"][0].get_ydata()
    w = _smoothing_weight(len(records))
    acc, expected = 0.0, []
    for i, r in enumerate(records):  # float64 reference of the debiased EMA
        acc = w * acc + (1 - w) * r["loss"]
        expected.append(acc / (1 - w ** (i + 1)))
    assert smooth[0] == pytest.approx(records[0]["loss"], rel=1e-12)  # debiasing makes the first value exact
    assert list(smooth) == pytest.approx(expected, rel=1e-12)  # same operations in the same order


def test_missing_optional_keys(tmp_path):
    # Only the required keys: a loss plot and nothing else.
    _write(tmp_path / "metrics.jsonl", [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)])
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png"]

    # NaN uniformity (batch of one), text uniformity absent, a null lr and a single eval point.
    other = tmp_path / "other"
    other.mkdir()
    records = [
        {"step": 1, "loss": 4.0, "lr": None, "align": 1.9, "uniform_image": float("nan"), "uniform_text": float("nan")},
        {"step": 2, "loss": 3.0, "lr": 1e-3, "align": 1.5, "uniform_image": -1.0},
        {"step": 3, "loss": 2.5, "align": 1.2, "uniform_image": -1.5, "eval/zeroshot_classification/c/acc1": 0.5},
    ]
    _write(other / "metrics.jsonl", records)
    written = plot_run(other, out_dir=other / "figs")
    assert [p.name for p in written] == ["loss.png", "lr_scale.png", "align_uniform.png", "eval.png"]
    assert all(p.parent == other / "figs" and _png_size(p)[0] >= 600 for p in written)
    ax = make_figures(load_metrics(other / "metrics.jsonl"))["align_uniform.png"].axes[0]
    pts = {c.get_gid(): c for c in ax.collections}
    assert "points:text" not in pts
    assert [tuple(map(float, o)) for o in pts["points:image"].get_offsets()] == [(1.0, 1.5), (1.5, 1.2)]


def test_load_metrics_order_duplicates_and_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # A resumed run may re-log a step: the later record wins; records come back sorted by step.
    path.write_text('{"step": 2, "loss": 2.0}\n\n{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.5}\n{"step": 3, "lo')
    assert load_metrics(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.5}]


@pytest.mark.parametrize("content, message", [
    ("", "holds no metrics records"),
    ("\n  \n", "holds no metrics records"),
    ('{"step": 1, "loss"\n', "holds no metrics records"),  # only a partial line: nothing logged yet
    ('{"step": 1, "loss": 1.0}\nnot json at all\n{"step": 3, "loss": 1.0}\n', "line 2 of"),
    ('{"step": 1, "loss": 1.0}\n[1, 2, 3]\n{"step": 3, "loss": 1.0}\n', "line 2 of"),
    ('{"loss": 1.0}\n{"step": 2, "loss": 1.0}\n', "integer 'step'"),
    ('{"step": "ten", "loss": 1.0}\n{"step": 2, "loss": 1.0}\n', "step='ten'"),
])
def test_malformed_metrics_raise_data_error(tmp_path, content, message):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        plot_run(tmp_path)
    assert not (tmp_path / "plots").exists() or not any((tmp_path / "plots").iterdir())


def test_missing_run_or_metrics(tmp_path, capsys):
    with pytest.raises(DataError, match="no metrics file"):
        plot_run(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        plot_run(tmp_path / "nope")
    # The CLI turns the error into one line and exit code 2.
    assert cli.main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmcl: error: no metrics file")


def test_plotting_leaves_the_pyplot_backend_alone(run_dir):
    import matplotlib

    before = matplotlib.get_backend()
    plot_run(run_dir[0])
    assert matplotlib.get_backend() == before
