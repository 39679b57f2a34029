"""Curation's rules (mmcl/curation/rules.py): which samples `mmcl curate` keeps and why the others go, against
hand-computed decisions and a brute-force float64 greedy deduplication."""

import numpy as np
import pytest

from mmcl.curation import rules as r
from mmcl.errors import ConfigError


def _brute_dedup(x, threshold):
    """Row by row: kept unless a kept row before it has cosine >= threshold (the most similar, earlier on a tie)."""
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    kept, of = [], []
    for i in range(len(x)):
        sims = [(float(x[i] @ x[j]), -j) for j in kept if x[i] @ x[j] >= threshold]
        of.append(-max(sims)[1] if sims else -1)
        if not sims:
            kept.append(i)
    return np.array([o == -1 for o in of]), np.array(of)


@pytest.mark.parametrize("n,threshold", [(60, 0.5), (300, 0.3), (2100, 0.6)])  # 2100: across _BLOCK's blocks
def test_greedy_dedup_is_the_brute_force_scan(n, threshold):
    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, 4)).astype(np.float64)
    keep, of, sim = r.greedy_dedup(r.unit_rows(x), threshold)
    if n <= 300:
        want_keep, want_of = _brute_dedup(x, threshold)
        assert np.array_equal(keep, want_keep) and np.array_equal(of, want_of)
    units = x / np.linalg.norm(x, axis=1, keepdims=True)
    assert keep.sum() > 0 and np.all(of[keep] == -1) and np.all(of[~keep] < np.flatnonzero(~keep))
    np.testing.assert_allclose(sim[~keep], np.einsum("ij,ij->i", units[~keep], units[of[~keep]]), atol=1e-5)
    assert np.all(sim[~keep] >= threshold - 1e-6) and np.all(np.isnan(sim[keep]))
    kept = units[keep]
    cos = kept @ kept.T
    assert np.all(cos[np.triu_indices(len(kept), 1)] < threshold + 1e-6)  # no two kept rows are duplicates


def test_decide_gives_each_dropped_sample_its_first_failing_rule():
    rules = r.Rules(clip_score_min=0.2, min_caption_len=3, max_caption_len=20, clip_score_top=0.5, dedup=0.99)
    readable = np.array([True, False, True, True, True, True, True, True])
    caption_len = np.array([10, 10, 2, 30, 10, 10, 10, 10])
    score = np.array([0.9, 0.9, 0.9, 0.9, 0.1, 0.5, 0.3, 0.8], dtype=np.float32)
    images = np.eye(8, dtype=np.float32)
    images[7] = images[0]  # sample 7 looks like sample 0
    d = r.decide(rules, readable, caption_len, score, images)
    names = ["kept" if c == r.KEPT else r.REASONS[c] for c in d.reason]
    # top half of the 7 readable (rounded half up: 4): scores 0.9 (0, 2, 3) and 0.8 (7) -> 5, 6 go
    assert names == ["kept", "unreadable", "caption_too_short", "caption_too_long", "clip_score_min",
                     "clip_score_top", "clip_score_top", "duplicate"]
    assert d.top_threshold == pytest.approx(0.8)
    assert d.other.tolist() == [-1] * 7 + [0] and d.similarity[7] == pytest.approx(1.0)
    assert d.fails == {"unreadable": 1, "caption_too_short": 1, "caption_too_long": 1, "clip_score_min": 1,
                       "clip_score_top": 3, "duplicate": 1}
    assert r.top_count(0.5, 7) == 4 and r.top_count(0.5, 5) == 3 and r.top_count(1.0, 3) == 3


def test_decontamination_names_the_evaluation_image_and_byte_copies_are_duplicates():
    images = np.array([[1, 0], [0, 1], [1, 0], [0.8, -0.6]], dtype=np.float32)
    eval_images = np.array([[0, 1], [0.8, 0.6]], dtype=np.float32)
    rules = r.Rules(decontaminate="evalset", decontaminate_threshold=0.95, dedup=0.999)
    d = r.decide(rules, np.ones(4, bool), np.full(4, 5), np.zeros(4), images, eval_images=eval_images,
                 hashes=np.array(["h0", "", "h0", ""]))
    assert [r.REASONS[c] if c >= 0 else "kept" for c in d.reason] == ["kept", "decontaminated", "duplicate", "kept"]
    assert d.other.tolist() == [-1, 0, 0, -1] and d.similarity[1] == pytest.approx(1.0)
    assert r.first_copies(np.array(["a", "b", "a", "", ""])).tolist() == [0, 1, 0, 3, 4]


@pytest.mark.parametrize("rules,message", [
    (r.Rules(), "needs at least one rule"),
    (r.Rules(clip_score_min=1.5), "--clip-score-min is a cosine, between -1 and 1"),
    (r.Rules(dedup=float("nan")), "--dedup is a cosine"),
    (r.Rules(clip_score_top=0.0), r"--clip-score-top is the fraction kept, in \(0, 1\]"),
    (r.Rules(min_caption_len=-1), "--min-caption-len must be >= 0"),
    (r.Rules(min_caption_len=9, max_caption_len=3), "nothing would be kept"),
    (r.Rules(language=("EN",)), "--language takes ISO 639-1 codes"),
])
def test_bad_rules_are_one_config_error(rules, message):
    with pytest.raises(ConfigError, match=message):
        rules.check()


def test_checked_rules_and_their_record(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checked = r.Rules(decontaminate="evalset", dedup=0.9).check()
    assert checked.decontaminate == str(tmp_path / "evalset") and checked.active() == ["dedup", "decontaminate"]
    assert checked.record() == {"dedup": 0.9, "decontaminate": str(tmp_path / "evalset"),
                                "decontaminate_threshold": 0.95}
    assert r.Rules(dedup=0.9).record() == {"dedup": 0.9}
    assert r.Rules(decontaminate="pipe:cat x").check().decontaminate == "pipe:cat x"
