"""What `mmcl curate` tells about its decision: ``report.json`` (counts per rule, the CLIP-score histogram, examples
at each threshold), ``report.png`` (the histogram and the counts) and ``dropped.jsonl`` (every dropped sample with
its reason)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from ..errors import DataError
from ..storage.fsutil import atomic_write_text, new_file, os_error_text, replace_inside
from .rules import KEPT, REASONS, Decision

HISTOGRAM_BINS = 40
EXAMPLES = 5  # samples shown on each side of a threshold

REPORT_FILE, PLOT_FILE, DROPPED_FILE = "report.json", "report.png", "dropped.jsonl"


def _sample(i: int, names: List[str], shard_of: np.ndarray, cat: Dict[str, np.ndarray]) -> Dict[str, Any]:
    score = float(cat["score"][i])
    return {"key": str(cat["key"][i]), "shard": names[int(shard_of[i])], "caption": str(cat["caption"][i]),
            "score": None if np.isnan(score) else round(score, 6)}


def _examples(decision: Decision, cat: Dict[str, np.ndarray], names, shard_of) -> Dict[str, Any]:
    """For each score rule, the kept samples just above its threshold and the dropped ones just below; for
    duplicates and decontamination, the closest calls (lowest cosines still dropped)."""
    out: Dict[str, Any] = {}
    score = cat["score"].astype(np.float64)
    kept = np.flatnonzero(decision.reason == KEPT)
    for rule in ("clip_score_min", "clip_score_top"):
        dropped = np.flatnonzero(decision.reason == REASONS.index(rule))
        if rule not in decision.fails:
            continue
        above = kept[np.argsort(score[kept], kind="stable")][:EXAMPLES]
        below = dropped[np.argsort(-score[dropped], kind="stable")][:EXAMPLES]
        out[rule] = {"kept_lowest": [_sample(int(i), names, shard_of, cat) for i in above],
                     "dropped_highest": [_sample(int(i), names, shard_of, cat) for i in below]}
    for rule in ("duplicate", "decontaminated"):
        dropped = np.flatnonzero(decision.reason == REASONS.index(rule))
        if rule not in decision.fails:
            continue
        closest = dropped[np.argsort(decision.similarity[dropped], kind="stable")][:EXAMPLES]
        out[rule] = [{**_sample(int(i), names, shard_of, cat), "cosine": round(float(decision.similarity[i]), 6),
                      "matches": int(decision.other[i])} for i in closest]
    return out


def _histogram(decision: Decision, score: np.ndarray) -> Dict[str, Any]:
    ok = ~np.isnan(score)
    if not ok.any():
        return {"edges": [], "kept": [], "dropped": []}
    lo, hi = float(score[ok].min()), float(score[ok].max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1e-6, HISTOGRAM_BINS + 1)
    kept = ok & (decision.reason == KEPT)
    return {"edges": [round(float(e), 6) for e in edges],
            "kept": np.histogram(score[kept], edges)[0].tolist(),
            "dropped": np.histogram(score[ok & ~kept], edges)[0].tolist()}


def build_report(identity: Dict[str, Any], names: List[str], tables: List[Dict[str, np.ndarray]],
                 cat: Dict[str, np.ndarray], shard_of: np.ndarray, decision: Decision) -> Dict[str, Any]:
    score = cat["score"].astype(np.float64)
    ok = ~np.isnan(score)
    kept = decision.reason == KEPT
    per_shard = {}
    for i, name in enumerate(names):
        mine = shard_of == i
        per_shard[name] = {"samples": int(mine.sum()), "kept": int((mine & kept).sum()),
                           "shard_errors": int(tables[i]["shard_errors"])}
    quantiles = {f"p{q}": round(float(np.quantile(score[ok], q / 100)), 6) for q in (1, 5, 10, 25, 50, 75, 90, 95, 99)
                 } if ok.any() else {}
    return {
        "model": identity["model"], "inputs": identity["inputs"], "rules": identity["rules"],
        "order": list(REASONS),
        "samples": int(len(kept)), "kept": int(kept.sum()),
        "dropped": {r: int((decision.reason == REASONS.index(r)).sum()) for r in REASONS},
        "fails": decision.fails,  # samples failing each rule, whether or not an earlier rule dropped them first
        "from_stored_embeddings": int(cat["stored"].sum()),
        "shard_errors": sum(s["shard_errors"] for s in per_shard.values()),
        "clip_score": {"mean": round(float(score[ok].mean()), 6) if ok.any() else None, **quantiles,
                       "top_threshold": decision.top_threshold, "histogram": _histogram(decision, score)},
        "examples": _examples(decision, cat, names, shard_of),
        "shards": per_shard,
    }


def _plot(report: Dict[str, Any], path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    hist = report["clip_score"]["histogram"]
    if hist["edges"]:
        edges = np.asarray(hist["edges"])
        width, left = np.diff(edges), edges[:-1]
        ax.bar(left, hist["kept"], width=width, align="edge", label="kept", color="tab:green")
        ax.bar(left, hist["dropped"], width=width, align="edge", bottom=hist["kept"], label="dropped",
               color="tab:red", alpha=0.7)
        rules = report["rules"]
        for name, value in (("clip-score-min", rules.get("clip_score_min")),
                            ("clip-score-top", report["clip_score"]["top_threshold"])):
            if value is not None:
                ax.axvline(value, color="k", linestyle="--", linewidth=1)
                ax.annotate(name, (value, ax.get_ylim()[1] * 0.95), rotation=90, ha="right", va="top", fontsize=8)
        ax.legend()
    ax.set_xlabel("CLIP score (image-caption cosine)")
    ax.set_ylabel("samples")
    ax.set_title(f"{report['kept']} of {report['samples']} samples kept")
    labels = ["kept"] + [r for r in REASONS if report["dropped"][r]]
    counts = [report["kept"]] + [report["dropped"][r] for r in labels[1:]]
    bx.barh(labels[::-1], counts[::-1], color=["tab:red"] * (len(labels) - 1) + ["tab:green"])
    for y, c in enumerate(counts[::-1]):
        bx.annotate(str(c), (c, y), va="center", fontsize=8)
    bx.set_xlabel("samples")
    bx.set_title("dropped by (first failing rule)")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")


def write_report(out: Path, identity: Dict[str, Any], names: List[str], tables: List[Dict[str, np.ndarray]],
                 cat: Dict[str, np.ndarray], shard_of: np.ndarray, decision: Decision,
                 eval_keys: Optional[np.ndarray], temp_suffix: str) -> Dict[str, Any]:
    """Write report.json, report.png and dropped.jsonl into `out` (each atomically); returns the report."""

    report = build_report(identity, names, tables, cat, shard_of, decision)
    lines = []
    for i in np.flatnonzero(decision.reason != KEPT).tolist():
        reason = REASONS[decision.reason[i]]
        line = {"key": str(cat["key"][i]), "shard": names[int(shard_of[i])], "reason": reason}
        if not np.isnan(cat["score"][i]):
            line["score"] = round(float(cat["score"][i]), 6)
        if reason == "language":
            line["language"] = str(cat["language"][i])
        if reason == "duplicate":
            j = int(decision.other[i])
            line.update(duplicate_of=str(cat["key"][j]), duplicate_shard=names[int(shard_of[j])],
                        cosine=round(float(decision.similarity[i]), 6))
        elif reason == "decontaminated" and eval_keys is not None:
            line.update(matches=str(eval_keys[int(decision.other[i])]), cosine=round(float(decision.similarity[i]), 6))
        lines.append(json.dumps(line))
    for rule in ("duplicate", "decontaminated"):  # examples name the sample matched, not its row
        for ex in report["examples"].get(rule, []):
            j = ex.pop("matches")
            ex["matches"] = str(cat["key"][j]) if rule == "duplicate" else str(eval_keys[j])
    try:
        atomic_write_text(out / REPORT_FILE, json.dumps(report, indent=1) + "\n")
        atomic_write_text(out / DROPPED_FILE, "".join(line + "\n" for line in lines))
        with new_file(out, PLOT_FILE + temp_suffix) as f:
            _plot(report, f)
        replace_inside(out, PLOT_FILE + temp_suffix, PLOT_FILE)
    except OSError as err:
        raise DataError(f"cannot write the report in {out}: {os_error_text(err)}") from None
    return report
