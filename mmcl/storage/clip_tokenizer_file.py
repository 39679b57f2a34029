"""open_clip's CLIP BPE tokenizer as a Hugging Face ``tokenizers`` file (``tokenizer.json``), for runtimes without
Python (``tokenizers`` has Rust, Node and other bindings) and without torch.

open_clip's ``SimpleTokenizer`` (the ``lower`` clean) does, per text: ``ftfy.fix_text``, ``html.unescape`` twice,
strip, collapse whitespace, lower-case; then it splits words with a regular expression, byte-encodes them and
applies BPE with a ``</w>`` end-of-word suffix; the ids are framed by ``<start_of_text>`` (49406) and
``<end_of_text>`` (49407), cut to the context length (the last kept id replaced by 49407) and padded with 0.

A ``tokenizers`` pipeline is data, not code, so every step is expressed with its building blocks:

* ftfy's per-character repairs (control characters removed, Windows-1252 C1 bytes, curly quotes, ligatures,
  full-width forms, ...) as one ``Replace`` per character, computed from the installed ftfy over the Basic
  Multilingual Plane, then ``NFC`` (ftfy's final normalisation);
* HTML character references in three rounds (ftfy's and open_clip's two): HTML 4's 252 names and ``&apos;``
  (with the legacy forms without ``;`` that Python accepts) and numeric references up to U+00FF
  (``&#233;``, ``&#xE9;``), see `_entity_replacements`;
* Python's ``str.split`` whitespace collapsed to one space, stripped, lower-cased (a word-final capital sigma as
  final sigma, as ``str.lower`` does);
* open_clip's split pattern, byte-level mapping, BPE with ``</w>``; ``<start_of_text>``/``<end_of_text>`` are the
  special tokens (so a literal ``<|endoftext|>`` in a caption is ordinary text, as in open_clip), truncation and
  padding to the context length.

The hf export ships the same file (`mmcl.storage.export.write_hf_tokenizer`). Where it differs from open_clip (tests in
tests/storage/test_export.py compare with ``open_clip.get_tokenizer``): ftfy's context-dependent repairs (mojibake such
as ``Ã©`` for ``é``, which needs the surrounding bytes) are not reproduced; HTML5-only names (``&NotLessLess;``, about
2,000 rarely seen ones) and numeric references above U+00FF stay as text; characters above U+FFFF that ftfy would change
are left as they are. ftfy decodes HTML references before its repairs only when the text holds no ``<``; this file
always does, so in text that holds a ``<``, a reference to a character ftfy repairs (``&rsquo;``: ``'`` here, ``’`` in
open_clip) and text HTML-escaped three times decode differently.

Cost: about 1,400 normalizer passes, each about a microsecond on a caption: 1.8 ms per caption on one thread of
a loaded 2-core CPU host, against open_clip's 0.44 ms on the same host (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import html
import html.entities
import json
import re
import string
import unicodedata
from typing import Dict, List, Optional, Tuple

import ftfy
from open_clip.tokenizer import SimpleTokenizer
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SOT_TOKEN, EOT_TOKEN = "<start_of_text>", "<end_of_text>"
SOT_ID, EOT_ID, PAD_ID = 49406, 49407, 0
# open_clip's word pattern without its special-token alternatives (those are added tokens here).
_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _char_class(chars) -> str:
    return "[" + "".join(f"\\x{{{ord(c):X}}}" for c in sorted(chars)) + "]"


@functools.lru_cache(maxsize=1)
def ftfy_char_map() -> Tuple[Tuple[str, str], ...]:
    """(character, replacement) for every BMP character that ``ftfy.fix_text`` changes on its own to something
    other than its NFC form (about 330: control characters, Windows-1252 C1 bytes, quotes, ligatures, widths)."""

    out = []
    for cp in range(0x10000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        fixed = ftfy.fix_text(c)
        if fixed != c and unicodedata.normalize("NFC", c) != fixed:
            out.append((c, fixed))
    return tuple(out)


# Named references decoded: HTML 4's 252 (every name seen in practice: &amp; &quot; &nbsp; &eacute; &rsquo;
# &mdash; &hellip; &euro; ...) and &apos;, with the legacy forms Python also accepts without the ";".
# Each distinct value costs one normalizer pass (about a microsecond per caption), which is why HTML5's 2,000
# further names are left out.
_EXTRA_NAMES = ("apos",)


def _entity_replacements() -> List[Tuple[str, str]]:
    """(pattern, text) pairs that decode HTML character references as one ``html.unescape`` pass does.

    One pattern per decoded value, holding its names (``&eacute;``, also ``&eacute`` where Python accepts the
    legacy form) and its numeric references (``&#233;``, ``&#xe9;``, ``;`` optional) for values up to U+00FF.
    The order keeps the passes from seeing each other's output where Python's single left-to-right scan would
    not: values with no legacy name first, then those with one by decreasing name length (``&notin;`` is never
    read as ``&not`` + ``in;``), and ``&`` last (``&amp;lt;`` becomes ``&lt;``, not ``<``).
    """
    legacy = {name for name in html.entities.html5 if not name.endswith(";")}
    names: Dict[str, List[str]] = {}
    for name in list(html.entities.name2codepoint) + list(_EXTRA_NAMES):
        for variant in {name, name.upper()} if name.upper() in legacy else {name}:
            names.setdefault(html.entities.html5[variant + ";"], []).append(variant)
    numeric: Dict[str, List[int]] = {}
    for cp in range(0x100):
        numeric.setdefault(html.unescape(f"&#{cp};"), []).append(cp)
    groups = []
    for value in sorted(set(names) | set(numeric)):
        by_length = sorted(names.get(value, []), key=lambda n: (-len(n), n))
        alts = [re.escape(n) + (";?" if n in legacy else ";") for n in by_length]
        for cp in numeric.get(value, []):
            alts.append(f"#0*{cp}(?![0-9]);?")
            alts.append(f"#[xX]0*(?i:{cp:x})(?![0-9a-fA-F]);?")
        longest_legacy = max((len(n) for n in names.get(value, []) if n in legacy), default=0)
        rank = (2, 0) if value == "&" else (1, -longest_legacy) if longest_legacy else (0, 0)
        groups.append((rank, value, "&(?:" + "|".join(alts) + ")"))
    return [(pattern, value) for _, value, pattern in sorted(groups, key=lambda g: (g[0], g[1]))]


def _clean_normalizers(clean: str) -> list:
    """open_clip's text cleaning `clean` (``get_clean_fn``: ``whitespace``, ``lower`` or ``canonicalize``, each
    after ``basic_clean``) as ``tokenizers`` normalizers."""

    if clean not in ("whitespace", "lower", "canonicalize"):
        raise ValueError(f"unknown open_clip clean function {clean!r}")
    entities = [normalizers.Replace(Regex(p), v) for p, v in _entity_replacements()]
    spaces = [chr(cp) for cp in range(0x110000) if chr(cp).isspace()]  # Python's str.split() whitespace
    collapse = [normalizers.Replace(Regex(_char_class(spaces) + "+"), " "), normalizers.Strip()]
    # Python's str.lower() writes a word-final capital sigma as final sigma; Lowercase maps each character
    lower = [normalizers.Replace(Regex(r"(?<=\p{L})\x{3A3}(?!\p{L})"), "\u03c2"), normalizers.Lowercase()]
    # ftfy unescapes HTML before its character repairs (when the text holds no "<"), open_clip twice after.
    steps = (entities + [normalizers.Replace(c, v) for c, v in ftfy_char_map()] + [normalizers.NFC()]
             + entities + entities)
    if clean == "canonicalize":  # big_vision's: "_" as a space, ASCII punctuation removed, lower-cased, collapsed
        punctuation = _char_class(set(string.punctuation))
        return steps + [normalizers.Replace("_", " "), normalizers.Replace(Regex(punctuation), "")] + lower + collapse
    return steps + collapse + (lower if clean == "lower" else [])


def open_clip_hf_tokenizer_json(text: str, context_length: int, clean: str = "whitespace",
                                strip_sep_token: bool = False, sep_token: Optional[str] = None,
                                pad_id: int = 0) -> Tuple[str, List[str]]:
    """A Hugging Face tokenizer's ``tokenizer.json`` (`text`) made to give the ids of open_clip's ``HFTokenizer``
    with ``tokenizer_kwargs`` `clean` and `strip_sep_token` at `context_length`: open_clip's cleaning before the
    tokenizer's own normalizer, truncation and padding to the context length, and with `strip_sep_token` the
    separator token (`sep_token`) left out of the template (open_clip writes id 0 in its place, which equals
    padding with `pad_id` 0 after one fewer token). Returns (the new file's text, what it could not express)."""

    tok = Tokenizer.from_str(text)
    own = tok.normalizer
    tok.normalizer = normalizers.Sequence(_clean_normalizers(clean) + ([own] if own is not None else []))
    not_expressed: List[str] = []
    length = context_length
    if strip_sep_token:
        meta = json.loads(tok.to_str())
        post = meta.get("post_processor") or {}
        if post.get("type") == "BertProcessing" and post.get("cls"):
            post = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": post["cls"][0], "type_id": 0}},
                                                              {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": post["cls"][0], "type_id": 0}},
                             {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {post["cls"][0]: {"id": post["cls"][0], "ids": [post["cls"][1]],
                                                        "tokens": [post["cls"][0]]}}}
        elif post.get("type") == "TemplateProcessing":
            for key in ("single", "pair"):
                post[key] = [p for p in post.get(key, []) if p.get("SpecialToken", {}).get("id") != sep_token]
        if pad_id != 0 or not sep_token or post.get("type") != "TemplateProcessing":
            not_expressed.append("strip_sep_token (needs a template post-processor, a separator token and padding "
                                 "id 0)")
        else:
            meta["post_processor"] = post
            tok = Tokenizer.from_str(json.dumps(meta))
            length = context_length - 1  # the separator's place, padded with id 0 below
    tok.enable_truncation(max_length=length)
    tok.enable_padding(length=context_length, pad_id=pad_id, pad_token=tok.id_to_token(pad_id) or "[PAD]")
    return tok.to_str(), not_expressed


@functools.lru_cache(maxsize=4)
def tokenizer_json(context_length: int = 77) -> str:
    """The ``tokenizer.json`` text of open_clip's ``SimpleTokenizer(context_length)`` (see the module doc).

    Building it compiles a few thousand patterns (seconds); the text is kept per context length."""

    oc = SimpleTokenizer(context_length=context_length)
    if oc.encoder.get(SOT_TOKEN) != SOT_ID or oc.encoder.get(EOT_TOKEN) != EOT_ID:
        raise RuntimeError("open_clip's CLIP vocabulary changed its special-token ids")
    merges = [pair for pair, _ in sorted(oc.bpe_ranks.items(), key=lambda item: item[1])]
    bpe = models.BPE(vocab=dict(oc.encoder), merges=merges, end_of_word_suffix="</w>", continuing_subword_prefix="",
                     fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence(_clean_normalizers("lower"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    # The vocabulary holds them already (ids 49406, 49407); declaring them special matches them before the split.
    tok.add_special_tokens([AddedToken(SOT_TOKEN, normalized=True, special=True),
                            AddedToken(EOT_TOKEN, normalized=True, special=True)])
    if tok.token_to_id(SOT_TOKEN) != SOT_ID or tok.token_to_id(EOT_TOKEN) != EOT_ID:
        raise RuntimeError("special tokens did not get open_clip's ids")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SOT_TOKEN} $A {EOT_TOKEN}", special_tokens=[(SOT_TOKEN, SOT_ID), (EOT_TOKEN, EOT_ID)])
    # open_clip keeps the first context_length - 1 ids and ends with <end_of_text>: the same as cutting the text's
    # ids to context_length - 2 and framing them. Padding id 0 is the vocabulary's "!", as in open_clip.
    tok.enable_truncation(max_length=context_length)
    tok.enable_padding(length=context_length, pad_id=PAD_ID, pad_token=oc.decoder[PAD_ID])
    return tok.to_str()


def write_tokenizer_json(path, context_length: int = 77) -> None:
    """Write `tokenizer_json` to `path`."""
    text = tokenizer_json(context_length)
    json.loads(text)  # a sanity check that the file is complete JSON before it is written
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
