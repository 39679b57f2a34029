"""Plots of a training run, drawn from its ``metrics.jsonl``.

``plot_run(run_dir)`` writes PNGs into ``run_dir/plots/``:

    loss.png            total loss, every ``loss/<term>`` and ``val/loss`` over steps
    lr_scale.png        learning rate, logit scale (and bias), gradient norm
    align_uniform.png   the alignment-uniformity plane of Wang & Isola (2020), a trajectory coloured by step
    throughput.png      samples/s and the fraction of time spent waiting for data
    eval.png            every ``eval/<task>/<dataset>/<metric>`` over steps

A figure whose keys are absent from the log is not written. The figures are drawn on matplotlib's Agg canvas
directly (``Figure`` + ``FigureCanvasAgg``), so plotting neither needs a display nor changes the process's
pyplot backend, which a notebook or GUI application that calls this function keeps using.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..errors import DataError
from ..storage.fsutil import holding, make_folder, new_file, replace_inside, unlink_inside
from ..storage.layout import RunLayout

PLOTS_DIR = "plots"
# Below this many points a smoothed curve adds nothing the raw points do not show.
_SMOOTH_MIN_POINTS = 25
_DPI = 120


# --------------------------------------------------------------------------------------------------- reading
def load_metrics(path: Union[str, os.PathLike]) -> List[Dict[str, Any]]:
    """Read a ``metrics.jsonl`` into a list of records sorted by ``step``.

    A last line that does not parse is dropped: the training process may be writing it right now. Any other
    unparsable line, a line that is not a JSON object with an integer ``step``, a missing file or a file with no
    record raises `DataError`. When a step appears more than once (a run resumed from an older checkpoint), the
    later record wins.

    Returns:
        list of dicts, one per logged step, ascending ``step``.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no metrics file at {path} (expected the metrics.jsonl that `mmcl train` writes into "
                        f"train.output_dir)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read {path} ({type(err).__name__}: {err})")
    lines = text.split("\n")
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    by_step: Dict[int, Dict[str, Any]] = {}
    for pos, (lineno, line) in enumerate(numbered):
        last = pos == len(numbered) - 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if last:
                continue  # partially written by a running training process
            raise DataError(f"line {lineno} of {path} is not valid JSON ({err.msg} at column {err.colno}; "
                            f"got {line[:60]!r}, expected one JSON object per line)")
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step):
            got = line[:60] if not isinstance(record, dict) else f"step={step!r}"
            raise DataError(f"line {lineno} of {path} is not a metrics record (got {got}, expected a JSON object "
                            f"with an integer 'step')")
        by_step[int(step)] = record
    if not by_step:
        raise DataError(f"{path} holds no metrics records yet (got an empty file, expected one JSON object per "
                        f"logged step)")
    return [by_step[s] for s in sorted(by_step)]


def _number(value: Any) -> Optional[float]:
    """A finite float, or None for anything else (absent, null, NaN, inf, strings, booleans)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def series(records: Sequence[Dict[str, Any]], key: str) -> Tuple[List[int], List[float]]:
    """(steps, values) of `key` over the records where it holds a finite number."""
    steps, values = [], []
    for r in records:
        v = _number(r.get(key))
        if v is not None:
            steps.append(int(r["step"]))
            values.append(v)
    return steps, values


def ema(values: Sequence[float], weight: float) -> List[float]:
    """Exponential moving average with the zero-start bias removed (as Adam corrects its moments)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1.0 - weight) * v
        out.append(acc / (1.0 - weight ** (i + 1)))
    return out


def _smoothing_weight(n: int) -> float:
    # About 1/20 of the run in the averaging window, capped so a long run is not flattened.
    return min(0.95, max(0.0, 1.0 - 20.0 / max(n, 1)))


# --------------------------------------------------------------------------------------------------- drawing
def _new_figure(nrows: int = 1, ncols: int = 1, size: Tuple[float, float] = (8.0, 4.8), sharex: bool = True):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, sharex=sharex, squeeze=False)
    return fig, axes


def _style(ax, xlabel: Optional[str] = None, ylabel: Optional[str] = None) -> None:
    ax.grid(True, which="major", alpha=0.3, linewidth=0.7)
    ax.grid(True, which="minor", alpha=0.12, linewidth=0.5)
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)


def _curve(ax, steps: List[int], values: List[float], color, label: str, lw: float = 1.8) -> None:
    """Raw values as a faint line with the smoothed curve over it, or a plain line when there are few points."""
    if len(values) >= _SMOOTH_MIN_POINTS:
        ax.plot(steps, values, color=color, alpha=0.28, linewidth=0.9, gid=f"raw:{label}")
        ax.plot(steps, ema(values, _smoothing_weight(len(values))), color=color, linewidth=lw, label=label,
                gid=f"smooth:{label}")
    else:
        marker = "o" if len(values) <= 12 else None
        ax.plot(steps, values, color=color, linewidth=lw, marker=marker, markersize=3.5, label=label,
                gid=f"raw:{label}")


def _want_log(values: Sequence[float]) -> bool:
    """Log scale when every value is positive and they span more than a decade."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > 10.0


def loss_figure(records: Sequence[Dict[str, Any]], title: str):
    """Total loss, each ``loss/<term>`` and the validation loss (``val/loss``); None when no loss was logged."""
    terms = sorted({k for r in records for k in r if k.startswith("loss/")})
    curves = [("loss", "total")] + [(k, k.split("/", 1)[1]) for k in terms]
    data = [(key, label, *series(records, key)) for key, label in curves]
    data = [d for d in data if d[3]]
    if not data:
        return None
    # A single term equal to the total adds a second identical line; show the total only.
    if len(data) == 2 and data[0][0] == "loss" and data[0][3] == data[1][3]:
        data = [(data[0][0], f"total ({data[1][1]})", data[0][2], data[0][3])]
    val_steps, val_values = series(records, "val/loss")  # eval.val_loss: the held-out loss beside the training loss
    if val_values:
        data.append(("val/loss", "validation", val_steps, val_values))
    fig, axes = _new_figure()
    ax = axes[0, 0]
    colors = _palette(len(data))
    for (key, label, steps, values), color in zip(data, colors):
        _curve(ax, steps, values, color, label, lw=2.2 if key == "loss" else 1.6)
    all_values = [v for d in data for v in d[3]]
    if _want_log(all_values):
        ax.set_yscale("log")
    _style(ax, "step", "loss")
    if len(data) > 1 or any(len(d[3]) >= _SMOOTH_MIN_POINTS for d in data):
        ax.legend(frameon=False, ncols=min(len(data), 4))
    last = data[0]
    ax.set_title(f"{title}: loss (last {last[1]} = {last[3][-1]:.4g} at step {last[2][-1]})", fontsize=11)
    return fig


def lr_scale_figure(records: Sequence[Dict[str, Any]], title: str):
    """Learning rate, logit scale (with the logit bias on a second axis when present) and gradient norm."""
    lr = series(records, "lr")
    scale = series(records, "logit_scale")
    bias = series(records, "logit_bias")
    gnorm = series(records, "grad_norm")
    panels = [p for p in ("lr", "scale", "gnorm") if {"lr": lr, "scale": scale, "gnorm": gnorm}[p][1]]
    if not lr[1] and not scale[1]:
        return None
    fig, axes = _new_figure(len(panels), 1, size=(8.0, 2.3 + 2.0 * len(panels)))
    c = _palette(4)
    for ax, panel in zip(axes[:, 0], panels):
        if panel == "lr":
            ax.plot(*lr, color=c[0], linewidth=1.8, gid="lr")
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
            _style(ax, None, "learning rate")
        elif panel == "scale":
            ax.plot(*scale, color=c[1], linewidth=1.8, gid="logit_scale", label="logit scale s = exp(t)")
            _style(ax, None, "logit scale")
            if bias[1]:
                ax2 = ax.twinx()
                ax2.plot(*bias, color=c[2], linewidth=1.4, linestyle="--", gid="logit_bias", label="logit bias")
                ax2.set_ylabel("logit bias", color=c[2])
                ax2.spines["top"].set_visible(False)
                handles = ax.get_lines() + ax2.get_lines()
                ax.legend(handles, [h.get_label() for h in handles], frameon=False, loc="best")
        else:
            _curve(ax, *gnorm, c[3], "grad norm")
            if _want_log(gnorm[1]):
                ax.set_yscale("log")
            _style(ax, None, "grad norm (before clip)")
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(f"{title}: optimisation", fontsize=11)
    return fig


def align_uniform_figure(records: Sequence[Dict[str, Any]], title: str):
    """Wang & Isola (2020), Fig. 1/5: x = -l_uniform, y = l_align; a trajectory per modality coloured by step.

    Lower-right is better: aligned positives (small l_align) on a uniformly covered sphere (large -l_uniform).
    None when ``align`` and no ``uniform_*`` were logged.
    """
    from matplotlib import colors as mcolors
    from matplotlib.collections import LineCollection

    paths = []
    for key, name, marker in (("uniform_image", "image", "o"), ("uniform_text", "text", "^")):
        steps, xs, ys = [], [], []
        for r in records:
            u, a = _number(r.get(key)), _number(r.get("align"))
            if u is not None and a is not None:
                steps.append(int(r["step"]))
                xs.append(-u)
                ys.append(a)
        if steps:
            paths.append((name, marker, steps, xs, ys))
    if not paths:
        return None
    fig, axes = _new_figure(size=(7.2, 5.6))
    ax = axes[0, 0]
    all_steps = [s for p in paths for s in p[2]]
    norm = mcolors.Normalize(vmin=min(all_steps), vmax=max(max(all_steps), min(all_steps) + 1))
    cmap = "viridis"
    mappable = None
    for name, marker, steps, xs, ys in paths:
        if len(xs) > 1:
            segments = [[(xs[i], ys[i]), (xs[i + 1], ys[i + 1])] for i in range(len(xs) - 1)]
            mids = [(steps[i] + steps[i + 1]) / 2 for i in range(len(steps) - 1)]
            lc = LineCollection(segments, cmap=cmap, norm=norm, linewidths=1.6, alpha=0.8, zorder=2)
            lc.set_array(mids)
            ax.add_collection(lc)
        n = len(xs)
        size = 22 if n <= 60 else 10
        mappable = ax.scatter(xs, ys, c=steps, cmap=cmap, norm=norm, marker=marker, s=size, zorder=3,
                              edgecolors="none", label=name, gid=f"points:{name}")
        ax.scatter([xs[0]], [ys[0]], marker=marker, s=130, facecolors="none", edgecolors="black",
                   linewidths=1.4, zorder=4, gid=f"start:{name}")
        ax.scatter([xs[-1]], [ys[-1]], marker="*", s=220, color="crimson", edgecolors="black", linewidths=0.8,
                   zorder=5, gid=f"end:{name}")
    ax.autoscale_view()
    _pad_limits(ax, [x for p in paths for x in p[3]], [y for p in paths for y in p[4]])
    cbar = fig.colorbar(mappable, ax=ax, pad=0.02)
    cbar.set_label("step")
    _style(ax, r"$-\mathcal{L}_{\mathrm{uniform}}$  (-l_uniform, t=2)",
           r"$\mathcal{L}_{\mathrm{align}}$  (l_align, $\alpha$=2)")
    # Wang & Isola's reading aid: perfectly aligned, uniformly spread features sit at the lower right.
    ax.annotate("better", xy=(0.16, 0.04), xytext=(0.04, 0.15), xycoords="axes fraction",
                textcoords="axes fraction", ha="left", va="bottom", fontsize=9, color="0.35",
                arrowprops=dict(arrowstyle="->", color="0.45", lw=1.2))
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker=m, linestyle="none", color="0.3",
                      label=f"{n}: end at ({xs[-1]:.2f}, {ys[-1]:.2f})") for n, m, _, xs, ys in paths]
    handles += [Line2D([], [], marker="o", linestyle="none", markerfacecolor="none", markeredgecolor="black",
                       markersize=9, label=f"start (step {min(all_steps)})"),
                Line2D([], [], marker="*", linestyle="none", color="crimson", markeredgecolor="black",
                       markersize=12, label=f"end (step {max(all_steps)})")]
    ax.legend(handles=handles, frameon=True, framealpha=0.85, edgecolor="none", loc="upper right", fontsize=8.5)
    ax.set_title(f"{title}: alignment and uniformity (Wang & Isola 2020)", fontsize=11)
    return fig


def _pad_limits(ax, xs: Sequence[float], ys: Sequence[float]) -> None:
    """Fit the data with a margin, and never a zero-width range (a single point)."""
    for values, setter in ((xs, ax.set_xlim), (ys, ax.set_ylim)):
        lo, hi = min(values), max(values)
        span = hi - lo if hi > lo else max(abs(hi), 1.0) * 0.1
        setter(lo - 0.12 * span, hi + 0.12 * span)


def throughput_figure(records: Sequence[Dict[str, Any]], title: str):
    """Training samples/s and the fraction of wall time spent waiting for data; None if neither was logged."""
    sps = series(records, "samples_per_s")
    wait = series(records, "data_time_frac")
    if not sps[1] and not wait[1]:
        return None
    panels = [p for p, d in (("sps", sps), ("wait", wait)) if d[1]]
    fig, axes = _new_figure(len(panels), 1, size=(8.0, 2.3 + 2.0 * len(panels)))
    c = _palette(2)
    for ax, panel in zip(axes[:, 0], panels):
        if panel == "sps":
            ax.plot(*sps, color=c[0], linewidth=1.6, marker="o" if len(sps[1]) <= 12 else None, markersize=3.5,
                    gid="samples_per_s")
            ax.set_ylim(bottom=0)
            _style(ax, None, "samples / s")
        else:
            ax.plot(*wait, color=c[1], linewidth=1.6, marker="o" if len(wait[1]) <= 12 else None, markersize=3.5,
                    gid="data_time_frac")
            ax.set_ylim(0, max(1.0, max(wait[1]) * 1.05))
            _style(ax, None, "data wait / wall time")
    axes[-1, 0].set_xlabel("step")
    sub = f" (median {_median(sps[1]):.4g} samples/s)" if sps[1] else ""
    axes[0, 0].set_title(f"{title}: throughput{sub}", fontsize=11)
    return fig


def eval_figure(records: Sequence[Dict[str, Any]], title: str):
    """One panel per evaluation task, one line per dataset/metric; None when no ``eval/`` key was logged."""
    # First-seen order keeps the task order of the training loop (classification before retrieval).
    keys = list(dict.fromkeys(k for r in records for k in r if k.startswith("eval/") and _number(r.get(k)) is not None))
    if not keys:
        return None
    tasks: Dict[str, List[str]] = {}
    for k in keys:
        parts = k.split("/")
        task = parts[1] if len(parts) > 2 else "eval"
        tasks.setdefault(task, []).append(k)
    fig, axes = _new_figure(1, len(tasks), size=(6.4 * len(tasks), 4.6), sharex=False)
    for ax, (task, task_keys) in zip(axes[0], tasks.items()):
        colors = _palette(len(task_keys))
        values_all = []
        for k, color in zip(task_keys, colors):
            steps, values = series(records, k)
            values_all += values
            label = "/".join(k.split("/")[2:]) or k
            ax.plot(steps, values, color=color, linewidth=1.6, marker="o", markersize=4, label=label, gid=k)
        if values_all and min(values_all) >= 0.0 and max(values_all) <= 1.0:
            ax.set_ylim(0.0, 1.02)  # accuracies and recalls are fractions; a fixed range shows their true size
        _style(ax, "step", task.replace("_", " "))
        ax.legend(frameon=False, fontsize=8.5, loc="best")
    fig.suptitle(f"{title}: evaluation", fontsize=11)
    return fig


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _palette(n: int) -> List[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(max(n, 1))]


FIGURES = (
    ("loss.png", loss_figure),
    ("lr_scale.png", lr_scale_figure),
    ("align_uniform.png", align_uniform_figure),
    ("throughput.png", throughput_figure),
    ("eval.png", eval_figure),
)


def make_figures(records: Sequence[Dict[str, Any]], title: str = "run") -> Dict[str, Any]:
    """Build the figures for `records` (as returned by `load_metrics`): {file name: matplotlib Figure}.

    Figures whose metrics are absent are left out.
    """
    out = {}
    for name, build in FIGURES:
        fig = build(records, title)
        if fig is not None:
            out[name] = fig
    return out


def plot_run(run_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike, None] = None) -> List[Path]:
    """Plot the run in `run_dir` from its metrics.jsonl; return the PNG paths written.

    Args:
        run_dir: a training output directory (``train.output_dir``) holding ``metrics.jsonl``.
        out_dir: where to write the PNGs; default ``run_dir/plots``.
    Returns:
        paths of the written files, among loss.png, lr_scale.png, align_uniform.png, throughput.png, eval.png.
    Raises:
        DataError when metrics.jsonl is missing, empty or malformed.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run directory {run_dir} does not exist (expected a train.output_dir of `mmcl train`)")
    records = load_metrics(RunLayout(run_dir).metrics)
    out = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    make_folder(out)
    title = run_dir.resolve().name
    written = []
    with holding(out):  # every plot relative to the folder as it was opened: a link swapped in is refused
        for name, fig in make_figures(records, title).items():
            # Written beside and renamed, so a viewer refreshing the file never reads a half-written PNG.
            tmp = f".{name}.tmp-{os.getpid()}.png"
            try:
                with new_file(out, tmp) as f:
                    fig.savefig(f, format="png", dpi=_DPI, facecolor="white")
                replace_inside(out, tmp, name)
            finally:
                unlink_inside(out, tmp, quiet=True)
            written.append(out / name)
    return written
