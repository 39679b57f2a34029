"""The curation rules and the decision they make for every sample, from the samples' embeddings alone.

Every rule but deduplication is a predicate on one sample; deduplication looks at the samples before it. A dropped
sample carries one reason, the first rule it fails in this order:

    unreadable           its image or caption cannot be decoded (no embedding)
    caption_too_short    fewer than ``min_caption_len`` characters (after stripping surrounding white space)
    caption_too_long     more than ``max_caption_len`` characters
    language             its caption's language (identified by py3langid, langid.py's maintained fork: 97
                         languages, offline, numpy only) is not one of ``language``
    clip_score_min       image-caption cosine below ``clip_score_min``
    clip_score_top       not among the ``round(clip_score_top * R)`` highest cosines of all R readable samples
                         (exact: ties go to the sample earlier in shard order)
    decontaminated       its image's cosine with some image of the evaluation set is >= ``decontaminate_threshold``
    duplicate            its image's bytes are those of an earlier *kept* sample (by SHA-256, whatever ``dedup``
                         is), or its image's cosine with one is >= ``dedup``

so the score rules see the whole set (DataComp's CLIP-score baseline ranks the whole pool), and deduplication keeps,
of every group of near-duplicates that survives the other rules, the first in shard order (greedily: a sample is
kept unless a kept sample before it is its near-duplicate). Cosines are of the embeddings renormalised in float32
(they are stored as float16), and byte-identical images never depend on them: the same image embedded in another
batch may differ in its last digits. "Order" is the order of the input shards as given and
of the samples in each, so the decision does not depend on how many processes computed the embeddings.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ConfigError

REASONS = ("unreadable", "caption_too_short", "caption_too_long", "language", "clip_score_min", "clip_score_top",
           "decontaminated", "duplicate")
KEPT = -1  # reason code of a kept sample; a dropped one holds its index in REASONS
_BLOCK = 1024  # rows compared at once by the cosine scans (memory: _BLOCK x kept floats)


@dataclass(frozen=True)
class Rules:
    """What `mmcl curate` keeps (the flags of the same names; None: the rule is off)."""

    clip_score_min: Optional[float] = None
    clip_score_top: Optional[float] = None
    dedup: Optional[float] = None
    decontaminate: Optional[str] = None
    decontaminate_threshold: float = 0.95
    min_caption_len: Optional[int] = None
    max_caption_len: Optional[int] = None
    language: Optional[Tuple[str, ...]] = None

    def check(self) -> "Rules":
        """The rules with the evaluation set's path made absolute; `ConfigError` (one line) for a bad value."""
        for name in ("clip_score_min", "dedup", "decontaminate_threshold"):
            value = getattr(self, name)
            if value is not None and not (-1.0 <= value <= 1.0 and math.isfinite(value)):
                raise ConfigError(f"--{name.replace('_', '-')} is a cosine, between -1 and 1 (got {value})")
        if self.clip_score_top is not None and not 0.0 < self.clip_score_top <= 1.0:
            raise ConfigError(f"--clip-score-top is the fraction kept, in (0, 1] (got {self.clip_score_top})")
        for name in ("min_caption_len", "max_caption_len"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 (got {value})")
        if (self.min_caption_len is not None and self.max_caption_len is not None
                and self.min_caption_len > self.max_caption_len):
            raise ConfigError(f"--min-caption-len {self.min_caption_len} is above --max-caption-len "
                              f"{self.max_caption_len}: nothing would be kept")
        if self.language is not None:
            bad = [c for c in self.language if not (c.isalpha() and c.islower() and 2 <= len(c) <= 3)]
            if bad or not self.language:
                raise ConfigError(f"--language takes ISO 639-1 codes such as en de fr (got {' '.join(bad) or 'none'})")
            language_identifier()
        if not self.active():
            raise ConfigError("mmcl curate needs at least one rule (--clip-score-min, --clip-score-top, --dedup, "
                              "--decontaminate, --min-caption-len or --max-caption-len)")
        decontaminate = self.decontaminate
        if decontaminate is not None and "://" not in decontaminate and not decontaminate.startswith("pipe:"):
            decontaminate = os.path.abspath(decontaminate)
        language = None if self.language is None else tuple(sorted(set(self.language)))
        return Rules(**{**asdict(self), "decontaminate": decontaminate, "language": language})

    def active(self) -> List[str]:
        """The names of the rules that are on."""
        return [k for k, v in asdict(self).items() if v is not None and k != "decontaminate_threshold"]

    def record(self) -> Dict[str, Any]:
        """The rules as the output directory records them (the threshold only with its set)."""
        rec = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v is not None}
        if self.decontaminate is None:
            rec.pop("decontaminate_threshold", None)
        return rec


def language_identifier() -> Callable[[str], str]:
    """caption -> its language code, by py3langid; `ConfigError` naming the package when it is not installed."""
    try:
        import py3langid
    except ImportError:
        raise ConfigError("--language needs the py3langid package (pip install py3langid, or the mmcl[curate] "
                          "extra)") from None
    return lambda caption: py3langid.classify(caption)[0]


def caption_languages(captions: Sequence[str]) -> np.ndarray:
    """The language code of each caption ("" for an empty one)."""
    identify = language_identifier()
    return np.array([identify(c) if c else "" for c in captions], dtype=str)


def top_count(fraction: float, readable: int) -> int:
    """How many samples ``--clip-score-top fraction`` keeps of `readable` (rounded half up)."""
    return min(readable, int(math.floor(fraction * readable + 0.5)))


def _max_cosine(x: np.ndarray, ref: np.ndarray):
    """Per row of `x`, the largest cosine with a row of `ref` and its index (both unit rows, float32)."""
    best = np.full(len(x), -np.inf, dtype=np.float32)
    arg = np.full(len(x), -1, dtype=np.int64)
    if len(ref) == 0:
        return best, arg
    for start in range(0, len(x), _BLOCK):
        sims = x[start:start + _BLOCK] @ ref.T
        arg[start:start + _BLOCK] = sims.argmax(axis=1)
        best[start:start + _BLOCK] = sims[np.arange(len(sims)), arg[start:start + _BLOCK]]
    return best, arg


def unit_rows(x: np.ndarray) -> np.ndarray:
    """`x` as float32 rows of length 1 (zero rows stay zero)."""
    x = np.asarray(x, dtype=np.float32)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)


def first_copies(hashes: np.ndarray) -> np.ndarray:
    """Per row, the first row with the same hash (itself for a first one; an empty hash is never a copy)."""
    first: Dict[str, int] = {}
    return np.array([first.setdefault(h, i) if h else i for i, h in enumerate(hashes.tolist())], dtype=np.int64)


def greedy_dedup(images: np.ndarray, threshold: float):
    """Keep each row unless a kept row before it has cosine >= `threshold` with it.

    Returns:
        (keep (N,) bool, of (N,) int64: for a dropped row the kept row it duplicates, else -1, sim (N,) float32:
        that cosine). Exact (every pair is compared), in blocks: O(N x kept x D) multiply-adds.
    """
    images = np.ascontiguousarray(images, dtype=np.float32)
    n = len(images)
    keep = np.zeros(n, dtype=bool)
    of = np.full(n, -1, dtype=np.int64)
    sim = np.full(n, np.nan, dtype=np.float32)
    kept_rows: List[int] = []
    kept = np.zeros((0, images.shape[1] if images.ndim == 2 else 0), dtype=np.float32)
    for start in range(0, n, _BLOCK):
        block = images[start:start + _BLOCK]
        best, arg = _max_cosine(block, kept)
        inner = block @ block.T
        new: List[int] = []
        for i in range(len(block)):
            # the most similar kept row, the earlier one on a tie
            hits = [(float(inner[i, j]), -(start + j)) for j in new if inner[i, j] >= threshold]
            if best[i] >= threshold:
                hits.append((float(best[i]), -kept_rows[arg[i]]))
            if hits:
                value, row = max(hits)
                of[start + i], sim[start + i] = -row, value
                continue
            new.append(i)
            keep[start + i] = True
        kept_rows += [start + i for i in new]
        kept = np.concatenate([kept, block[new]])
    return keep, of, sim


@dataclass
class Decision:
    """The outcome for every sample (in order): `reason` (N,) int8, `KEPT` or an index in `REASONS`; `other`
    (N,) int64, for a duplicate the kept sample it duplicates, for a decontaminated one the evaluation image it
    matches (else -1); `similarity` (N,) float32, that cosine; `top_threshold`, the lowest score
    ``--clip-score-top`` keeps (None when off or nothing is kept)."""

    reason: np.ndarray
    other: np.ndarray
    similarity: np.ndarray
    top_threshold: Optional[float]
    fails: Dict[str, int]


def decide(rules: Rules, readable: np.ndarray, caption_len: np.ndarray, score: np.ndarray, images: np.ndarray,
           eval_images: Optional[np.ndarray] = None, languages: Optional[np.ndarray] = None,
           hashes: Optional[np.ndarray] = None) -> Decision:
    """Apply `rules` to N samples, given in order: readable (N,) bool, caption_len (N,) characters, score (N,)
    image-caption cosine, images (N, D) embeddings; `eval_images` (M, D) embeddings for ``decontaminate``;
    `languages` (N,) the captions' language codes for ``language``; `hashes` (N,) str, a digest of each image's
    bytes ("" where unknown) for ``dedup``."""
    n = len(readable)
    images = unit_rows(images)
    reason = np.full(n, KEPT, dtype=np.int8)
    other = np.full(n, -1, dtype=np.int64)
    similarity = np.full(n, np.nan, dtype=np.float32)
    fails: Dict[str, int] = {}

    def drop(name: str, mask: np.ndarray) -> None:
        fails[name] = int(mask.sum())
        reason[(reason == KEPT) & mask] = REASONS.index(name)

    drop("unreadable", ~readable)
    if rules.min_caption_len is not None:
        drop("caption_too_short", readable & (caption_len < rules.min_caption_len))
    if rules.max_caption_len is not None:
        drop("caption_too_long", readable & (caption_len > rules.max_caption_len))
    if rules.language is not None:
        drop("language", readable & ~np.isin(np.asarray(languages, dtype=str), list(rules.language)))
    if rules.clip_score_min is not None:
        drop("clip_score_min", readable & (score < rules.clip_score_min))
    top_threshold = None
    if rules.clip_score_top is not None:
        rows = np.flatnonzero(readable)
        k = top_count(rules.clip_score_top, len(rows))
        order = rows[np.lexsort((rows, -score[rows].astype(np.float64)))]  # score descending, then earlier first
        top = np.zeros(n, dtype=bool)
        top[order[:k]] = True
        top_threshold = float(score[order[k - 1]]) if k else None
        drop("clip_score_top", readable & ~top)
    if rules.decontaminate is not None:
        rows = np.flatnonzero(readable)
        best, arg = _max_cosine(images[rows], unit_rows(eval_images))
        hit = np.zeros(n, dtype=bool)
        hit[rows] = best >= rules.decontaminate_threshold
        first = (reason == KEPT) & hit
        other[rows] = np.where(first[rows], arg, -1)
        similarity[rows] = np.where(first[rows], best, np.nan)
        drop("decontaminated", hit)
    if rules.dedup is not None:
        rows = np.flatnonzero(reason == KEPT)
        first = rows[first_copies(np.full(len(rows), "") if hashes is None else np.asarray(hashes)[rows])]
        unique = rows[first == rows]  # byte-identical copies of an earlier one are left out of the comparison
        keep, of, sim = greedy_dedup(images[unique], rules.dedup)
        dup = np.zeros(n, dtype=bool)
        dup[unique[~keep]] = True
        other[unique[~keep]], similarity[unique[~keep]] = unique[of[~keep]], sim[~keep]
        copies = rows[first != rows]  # a duplicate of the first copy, or of the sample that copy duplicates
        dup[copies] = True
        of_first = other[first[first != rows]]
        other[copies] = np.where(of_first >= 0, of_first, first[first != rows])
        similarity[copies] = np.where(of_first >= 0, similarity[first[first != rows]], 1.0)
        drop("duplicate", dup)
    return Decision(reason, other, similarity, top_threshold, fails)
