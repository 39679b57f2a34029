"""Curation's report (mmcl/curation/report.py): report.json's counts, per shard and per rule, the score's quantiles
and histogram against numpy in float64, and the closest calls shown on each side of a threshold."""

import numpy as np
import pytest

from mmcl.curation import report
from mmcl.curation.rules import KEPT, REASONS, Rules, decide

IDENTITY = {"model": "m", "inputs": ["a", "b"], "rules": {"clip_score_min": 0.25}}


@pytest.fixture
def made():
    n = 12
    score = np.linspace(0.0, 0.55, n).astype(np.float32)
    score[3] = np.nan  # unreadable: no score
    readable = ~np.isnan(score)
    images = np.eye(n, dtype=np.float32)
    images[11] = images[10]
    decision = decide(Rules(clip_score_min=0.25, dedup=0.99), readable, np.full(n, 10), score, images)
    cat = {"score": score, "key": np.array([f"k{i}" for i in range(n)]),
           "caption": np.array([f"c{i}" for i in range(n)]), "stored": np.array([i % 2 == 0 for i in range(n)])}
    shard_of = np.array([0] * 5 + [1] * 7)
    tables = [{"shard_errors": 0}, {"shard_errors": 2}]
    return cat, shard_of, tables, decision


def test_the_report_counts_samples_per_rule_and_per_shard(made):
    cat, shard_of, tables, decision = made
    rep = report.build_report(IDENTITY, ["a", "b"], tables, cat, shard_of, decision)
    kept = decision.reason == KEPT
    assert rep["samples"] == 12 and rep["kept"] == int(kept.sum()) == 6  # scores >= 0.25: samples 5..10
    assert rep["dropped"] == {**{r: 0 for r in REASONS}, "unreadable": 1, "clip_score_min": 4, "duplicate": 1}
    assert rep["order"] == list(REASONS) and rep["fails"] == decision.fails
    assert rep["shards"] == {"a": {"samples": 5, "kept": 0, "shard_errors": 0},
                             "b": {"samples": 7, "kept": 6, "shard_errors": 2}}
    assert rep["shard_errors"] == 2 and rep["from_stored_embeddings"] == 6
    assert (rep["model"], rep["inputs"], rep["rules"]) == ("m", ["a", "b"], {"clip_score_min": 0.25})


def test_the_score_statistics_are_numpys_in_float64(made):
    cat, shard_of, tables, decision = made
    rep = report.build_report(IDENTITY, ["a", "b"], tables, cat, shard_of, decision)
    ok = cat["score"][~np.isnan(cat["score"])].astype(np.float64)
    clip = rep["clip_score"]
    assert clip["mean"] == round(float(ok.mean()), 6)
    for q in (1, 5, 10, 25, 50, 75, 90, 95, 99):
        assert clip[f"p{q}"] == round(float(np.quantile(ok, q / 100)), 6)
    hist = clip["histogram"]
    assert len(hist["edges"]) == report.HISTOGRAM_BINS + 1 and hist["edges"][0] == round(float(ok.min()), 6)
    assert sum(hist["kept"]) == 6 and sum(hist["dropped"]) == 5  # the unreadable sample has no score
    assert clip["top_threshold"] is None


def test_the_examples_are_the_closest_calls(made):
    cat, shard_of, tables, decision = made
    ex = report.build_report(IDENTITY, ["a", "b"], tables, cat, shard_of, decision)["examples"]
    low = ex["clip_score_min"]
    assert [s["key"] for s in low["kept_lowest"]] == ["k5", "k6", "k7", "k8", "k9"]
    assert [s["key"] for s in low["dropped_highest"]] == ["k4", "k2", "k1", "k0"]
    assert low["kept_lowest"][0] == {"key": "k5", "shard": "b", "caption": "c5",
                                     "score": round(float(cat["score"][5]), 6)}
    assert [(d["key"], d["matches"], d["cosine"]) for d in ex["duplicate"]] == [("k11", 10, 1.0)]
    assert "clip_score_top" not in ex and "decontaminated" not in ex
