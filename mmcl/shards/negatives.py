"""Negative captions made by rule (NegCLIP's kind, without a model): a caption with two attribute words swapped
between its objects ("a red circle and a blue square" -> "a blue circle and a red square"), with two objects
swapped ("a dog on a sofa" -> "a sofa on a dog"), or with its words shuffled. Each keeps the caption's words and
changes only how they bind, so a model can tell it from the caption only by reading the binding.

`rule_negatives` makes them for one caption; `write_negative_shards` (``mmcl negatives``) copies shards with them
added to every sample as its ``neg.txt`` member (one a line, after the sample's own negatives), which training
reads with ``data.negatives``.

Words are told apart by small closed lists (`ATTRIBUTES`: colours, sizes, materials and a few common qualities;
`DETERMINERS`; `FUNCTION_WORDS`): an object is the last word of the run of other words after a determiner and its
attributes (`_objects`). No tagger is downloaded, so a rule finds nothing to change in some captions; such a
caption gets fewer negatives (and none where no rule applies), never a copy of itself.
"""

from __future__ import annotations

import os
import random
import re
import tarfile
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tqdm import tqdm

from ..data.decode import NEGATIVES_MEMBER, SampleKeys, SkipSample, candidate_captions
from ..data.reading import read_raw_samples
from ..data.sizes import SIZES_FILE
from ..data.sources import expand_urls
from ..errors import DataError
from ..storage.fsutil import new_file, os_error_text, replace_inside, unlink_inside
from ..storage.manifest import OutputManifest
from .writer import add_tar_member, write_sizes

ATTRIBUTES: Dict[str, Tuple[str, ...]] = {  # category -> words; a swap prefers two of one category
    "colour": ("red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white", "grey",
               "gray", "silver", "gold", "golden", "beige", "cyan", "magenta", "violet", "tan", "dark", "light"),
    "size": ("small", "large", "big", "little", "tiny", "huge", "tall", "short", "long", "medium", "giant",
             "thin", "thick", "wide", "narrow"),
    "material": ("wooden", "metal", "metallic", "plastic", "glass", "stone", "leather", "paper", "brick",
                 "concrete", "cotton", "wool", "steel"),
    "quality": ("old", "new", "young", "open", "closed", "empty", "full", "wet", "dry", "hot", "cold", "striped",
                "spotted", "bright", "dirty", "clean"),
}
_CATEGORY = {word: cat for cat, words in ATTRIBUTES.items() for word in words}
DETERMINERS = frozenset("a an the one two three four five six some several many this that these those his her "
                        "their its my our your each every another".split())
FUNCTION_WORDS = frozenset("and or but with without of on in at to from by for near next behind under over above "
                           "below beside between into onto is are was were be being it they there here while who "
                           "which that as up down out off very".split())
RULES = ("attributes", "objects", "order")
# The rules used unless the user names others. A word-order shuffle of a short caption ("the digit seven" -> "digit
# seven the") is a negative no prompt resembles, and training on them cost held-out digits zero-shot 0.773 -> 0.607
# (3 seeds, bench/bench_negatives.py); the swaps alone kept it (0.772). "order" stays available (NegCLIP uses it).
DEFAULT_RULES = ("attributes", "objects")
_CORE = re.compile(r"^(\W*)(.*?)(\W*)$")


def _split(caption: str) -> List[Tuple[str, str, str]]:
    """The caption's words, each as (leading punctuation, the word, trailing punctuation)."""
    return [_CORE.match(w).groups() for w in caption.split()]


def _join(words: Sequence[Tuple[str, str, str]]) -> str:
    return " ".join("".join(w) for w in words)


def _with_cores(words: List[Tuple[str, str, str]], i: int, j: int) -> List[Tuple[str, str, str]]:
    """`words` with the words (not their punctuation) at i and j exchanged."""
    out = list(words)
    out[i] = (words[i][0], words[j][1], words[i][2])
    out[j] = (words[j][0], words[i][1], words[j][2])
    return out


def swap_attributes(caption: str, rng: random.Random) -> Optional[str]:
    """Two attribute words that modify different objects exchanged (two of one category when there are: colour
    with colour), or None where the caption has no such pair."""
    words = _split(caption)
    found = [(i, w[1].lower()) for i, w in enumerate(words) if w[1].lower() in _CATEGORY]
    pairs = [(i, j) for a, (i, wi) in enumerate(found) for j, wj in found[a + 1:]
             if wi != wj and any(words[k][1].lower() not in _CATEGORY for k in range(i + 1, j))]
    same = [(i, j) for i, j in pairs if _CATEGORY[words[i][1].lower()] == _CATEGORY[words[j][1].lower()]]
    if not pairs:
        return None
    i, j = rng.choice(same or pairs)
    return _join(_with_cores(words, i, j))


def _content(word: str) -> bool:
    low = word.lower()
    return word.isalpha() and low not in FUNCTION_WORDS and low not in DETERMINERS and low not in _CATEGORY


def _objects(words: List[Tuple[str, str, str]]) -> List[int]:
    """The positions of the objects: after a determiner and its attributes, the last of the run of content words
    (neither attribute, function word nor determiner) that follows, a run ended by punctuation or a word in -ing
    ("a grassy field" -> field, "a dog sitting" -> dog)."""
    heads = []
    for i, (_, word, _) in enumerate(words):
        if word.lower() not in DETERMINERS:
            continue
        k = i + 1
        while k < len(words) and words[k][1].lower() in _CATEGORY:
            k += 1
        if k >= len(words) or not _content(words[k][1]):
            continue
        while (k + 1 < len(words) and not words[k][2] and not words[k + 1][0] and _content(words[k + 1][1])
               and not words[k + 1][1].lower().endswith("ing")):
            k += 1
        heads.append(k)
    return heads


def swap_objects(caption: str, rng: random.Random) -> Optional[str]:
    """Two different objects (`_objects`) exchanged, or None where the caption names fewer than two."""
    words = _split(caption)
    heads = _objects(words)
    pairs = [(i, j) for a, i in enumerate(heads) for j in heads[a + 1:] if words[i][1].lower() != words[j][1].lower()]
    if not pairs:
        return None
    i, j = rng.choice(pairs)
    return _join(_with_cores(words, i, j))


def shuffle_order(caption: str, rng: random.Random) -> Optional[str]:
    """The caption's words in another order (punctuation stays in place), or None for fewer than three words or
    words that are all one."""
    words = _split(caption)
    cores = [w[1] for w in words]
    if len(cores) < 3 or len({c.lower() for c in cores}) < 2:
        return None
    for _ in range(10):
        shuffled = cores[:]
        rng.shuffle(shuffled)
        if [c.lower() for c in shuffled] != [c.lower() for c in cores]:
            return _join([(p, c, s) for (p, _, s), c in zip(words, shuffled)])
    return None


_MAKERS = {"attributes": swap_attributes, "objects": swap_objects, "order": shuffle_order}


def rule_negatives(caption: str, seed: int = 0, rules: Sequence[str] = DEFAULT_RULES) -> List[str]:
    """The negatives of `caption` by `rules` (in that order, each at most one): distinct, none equal to the
    caption (ignoring case and spacing); the same for the same caption and seed."""
    unknown = [r for r in rules if r not in _MAKERS]
    if unknown:
        raise DataError(f"unknown negative rules {unknown} (choose from {', '.join(RULES)})")
    rng = random.Random(zlib.crc32(caption.encode("utf-8")) ^ (seed & 0xFFFFFFFF))
    seen = {" ".join(caption.lower().split())}
    out = []
    for rule in rules:
        made = _MAKERS[rule](caption, rng)
        if made is not None and " ".join(made.lower().split()) not in seen:
            seen.add(" ".join(made.lower().split()))
            out.append(made)
    return out


def _negatives_member(files: Dict[str, bytes], keys: Optional[SampleKeys], seed: int,
                      rules: Sequence[str]) -> Optional[bytes]:
    """The sample's new ``neg.txt``: its own lines, then the rule negatives of each of its captions; None when it
    has no readable caption or nothing to add."""
    try:
        captions = candidate_captions(files, keys)
    except SkipSample:
        return None
    made = [neg for caption in captions for neg in rule_negatives(caption, seed, rules)]
    if not made:
        return None
    own = files.get(NEGATIVES_MEMBER, b"").decode("utf-8", errors="replace").splitlines()
    return ("\n".join([line for line in own if line.strip()] + made) + "\n").encode("utf-8")


def _negatives_shard(url: str, dest: Path, keys: Optional[SampleKeys], seed: int,
                     rules: Sequence[str]) -> Dict[str, int]:
    """One output shard: every member as it was, and each sample's `_negatives_member` (replacing its neg.txt)."""
    tmp = dest.with_name(dest.name + ".partial")
    counts = {"samples": 0, "with_negatives": 0, "negatives": 0, "errors": 0}
    f = new_file(dest.parent, tmp.name)
    try:
        with f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for item in read_raw_samples([(url, None)]):
                if item.error is not None:
                    counts["errors"] += 1
                    continue
                member = _negatives_member(item.files, keys, seed, rules)
                for ext, data in item.files.items():
                    if not (ext == NEGATIVES_MEMBER and member is not None):
                        add_tar_member(tar, f"{item.key}.{ext}", data)
                if member is not None:
                    add_tar_member(tar, f"{item.key}.{NEGATIVES_MEMBER}", member)
                    counts["with_negatives"] += 1
                    counts["negatives"] += member.count(b"\n")
                counts["samples"] += 1
        replace_inside(dest.parent, tmp.name, dest.name)
    except BaseException:
        unlink_inside(dest.parent, tmp.name, quiet=True)
        raise
    return counts


def write_negative_shards(data: str, out_dir: str, rules: Sequence[str] = DEFAULT_RULES, seed: int = 0,
                          keys: Optional[SampleKeys] = None, progress: bool = True) -> Dict[str, Any]:
    """Copy the shards of `data` into `out_dir`, one output shard of the same name per input shard, with each
    sample's rule negatives (`rule_negatives` of each of its captions) in its ``neg.txt``; a sample without a
    readable caption or without a negative is copied unchanged. `out_dir` is new, empty or this command's earlier
    output (`OutputManifest`). Returns the counts: shards, samples, samples with negatives, negatives."""
    rule_negatives("", seed, rules)  # the rules' names, before anything is written
    urls = expand_urls(data)
    if not urls:
        raise DataError(f"no shards match {data}")
    names = [os.path.basename(u.rstrip("/")) for u in urls]
    if len(set(names)) != len(names):
        raise DataError("several input shards share a file name; write them into separate output folders")
    out = Path(out_dir)
    owned = OutputManifest.claim(out, "negatives")
    totals = {"samples": 0, "with_negatives": 0, "negatives": 0, "errors": 0}
    todo: Any = list(zip(urls, names))
    if progress:
        todo = tqdm(todo, desc="negatives", unit="shard")
    for url, name in todo:
        owned.will_write([name, name + ".partial", SIZES_FILE, SIZES_FILE + ".tmp"])
        try:
            counts = _negatives_shard(url, out / name, keys, seed, rules)
        except OSError as err:
            raise DataError(f"cannot write {out / name}: {os_error_text(err)}") from None
        owned.files.discard(name + ".partial")
        write_sizes(out, {name: counts["samples"]})
        owned.save()
        for k in totals:
            totals[k] += counts[k]
    return {"out_dir": str(out), "shards": len(urls), **totals}
