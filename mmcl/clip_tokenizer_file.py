"""open_clip's CLIP BPE tokenizer as a Hugging Face ``tokenizers`` file (``tokenizer.json``), for runtimes without
Python (``tokenizers`` has Rust, Node and other bindings) and without torch.

open_clip's ``SimpleTokenizer`` (the ``lower`` clean) does, per text: ``ftfy.fix_text``, ``html.unescape`` twice,
strip, collapse whitespace, lower-case; then it splits words with a regular expression, byte-encodes them and
applies BPE with a ``</w>`` end-of-word suffix; the ids are framed by ``<start_of_text>`` (49406) and
``<end_of_text>`` (49407), cut to the context length (the last kept id replaced by 49407) and padded with 0.

A ``tokenizers`` pipeline is data, not code, so every step is expressed with its building blocks:

* ftfy's per-character repairs (control characters removed, Windows-1252 C1 bytes, curly quotes, ligatures,
  full-width forms, ...) as one ``Replace`` per distinct result, computed from the installed ftfy over the Basic
  Multilingual Plane, then ``NFC`` (ftfy's final normalisation);
* HTML character references, twice (open_clip unescapes twice): every named entity of HTML5 (with ``;``, and the
  legacy names Python also accepts without it) and numeric references (``&#65;``, ``&#x41;``) of U+0000..U+00FF;
* Python's ``str.split`` whitespace collapsed to one space, stripped, lower-cased;
* open_clip's split pattern, byte-level mapping, BPE with ``</w>``; ``<start_of_text>``/``<end_of_text>`` are the
  special tokens (so a literal ``<|endoftext|>`` in a caption is ordinary text, as in open_clip), truncation and
  padding to the context length.

Where it differs from open_clip (measured by tests/test_export.py against ``open_clip.get_tokenizer``): ftfy's
context-dependent repairs (mojibake such as ``Ã©`` for ``é``, which needs the surrounding bytes) are not
reproduced; numeric character references above U+00FF stay as text; characters above U+FFFF that ftfy would
change are left as they are. ftfy decodes HTML references before its repairs only when the text holds no ``<``, and
open_clip decodes them twice more after; this file always does the three rounds, so in text that holds a ``<``, a
reference to a character ftfy repairs (``&rsquo;``: ``'`` here, ``’`` in open_clip) and text HTML-escaped three
times decode differently.
"""

from __future__ import annotations

import functools
import html
import html.entities
import json
import re
import unicodedata
from typing import Dict, List, Tuple

SOT_TOKEN, EOT_TOKEN = "<start_of_text>", "<end_of_text>"
SOT_ID, EOT_ID, PAD_ID = 49406, 49407, 0
# open_clip's word pattern without its special-token alternatives (those are added tokens here).
_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _char_class(chars) -> str:
    return "[" + "".join(f"\\x{{{ord(c):X}}}" for c in sorted(chars)) + "]"


@functools.lru_cache(maxsize=1)
def ftfy_char_map() -> Tuple[Tuple[str, str], ...]:
    """(characters class pattern, replacement) for every BMP character that ``ftfy.fix_text`` changes on its own
    to something other than its NFC form, grouped by replacement (about 330 characters, 270 groups)."""
    import ftfy

    groups: Dict[str, List[str]] = {}
    for cp in range(0x10000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        fixed = ftfy.fix_text(c)
        if fixed != c and unicodedata.normalize("NFC", c) != fixed:
            groups.setdefault(fixed, []).append(c)
    return tuple((_char_class(chars), fixed) for fixed, chars in sorted(groups.items()))


def _entity_replacements() -> List[Tuple[str, str]]:
    """(pattern, text) pairs that decode HTML character references as one ``html.unescape`` pass does.

    Each pair is one ``Replace`` pass, so the order keeps the passes from seeing each other's output as Python's
    single left-to-right scan would not: names that need their ``;`` come first, then the legacy names Python also
    accepts without it, longest first (``&notin;`` is never read as ``&not`` + ``in;``); every reference that
    decodes to ``&`` comes last, so ``&amp;lt;`` becomes ``&lt;``, not ``<``.
    """
    legacy = {name for name in html.entities.html5 if not name.endswith(";")}
    by_value: Dict[str, List[str]] = {}
    legacy_pairs, amp_pairs = [], []
    for name, value in html.entities.html5.items():
        if not name.endswith(";"):
            continue
        name = name[:-1]
        if name in legacy:
            pair = ("&" + re.escape(name) + ";?", value)
            (amp_pairs if value == "&" else legacy_pairs).append((len(name), pair))
        elif value == "&":
            amp_pairs.append((len(name), ("&" + re.escape(name) + ";", value)))
        else:
            by_value.setdefault(value, []).append(name)
    out = [("&(?:" + "|".join(re.escape(n) for n in sorted(names, key=lambda n: (-len(n), n))) + ");", value)
           for value, names in sorted(by_value.items())]
    out += [pair for _, pair in sorted(legacy_pairs, key=lambda item: (-item[0], item[1]))]
    numeric = []
    for cp in range(0x100):
        pair = (f"&#(?:0*{cp}(?![0-9])|[xX]0*{cp:x}(?![0-9a-fA-F]));?", html.unescape(f"&#{cp};"))
        (amp_pairs if pair[1] == "&" else numeric).append((0, pair))
    out += [pair for _, pair in numeric]
    out += [pair for _, pair in sorted(amp_pairs, key=lambda item: (-item[0], item[1]))]
    return out


@functools.lru_cache(maxsize=4)
def tokenizer_json(context_length: int = 77) -> str:
    """The ``tokenizer.json`` text of open_clip's ``SimpleTokenizer(context_length)`` (see the module doc).

    Building it compiles a few thousand patterns (seconds); the text is kept per context length."""
    from open_clip.tokenizer import SimpleTokenizer
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    oc = SimpleTokenizer(context_length=context_length)
    if oc.encoder.get(SOT_TOKEN) != SOT_ID or oc.encoder.get(EOT_TOKEN) != EOT_ID:
        raise RuntimeError("open_clip's CLIP vocabulary changed its special-token ids")
    merges = [pair for pair, _ in sorted(oc.bpe_ranks.items(), key=lambda item: item[1])]
    bpe = models.BPE(vocab=dict(oc.encoder), merges=merges, end_of_word_suffix="</w>", continuing_subword_prefix="",
                     fuse_unk=False)
    tok = Tokenizer(bpe)
    entities = [normalizers.Replace(Regex(p), v) for p, v in _entity_replacements()]
    spaces = [chr(cp) for cp in range(0x110000) if chr(cp).isspace()]  # Python's str.split() whitespace
    tok.normalizer = normalizers.Sequence(
        # ftfy unescapes HTML before its character repairs (when the text holds no "<"), open_clip twice after.
        entities + [normalizers.Replace(Regex(p), v) for p, v in ftfy_char_map()] + [normalizers.NFC()]
        + entities + entities
        + [normalizers.Replace(Regex(_char_class(spaces) + "+"), " "), normalizers.Strip(),
           # Python's str.lower() writes a word-final capital sigma as final sigma; Lowercase maps each character
           normalizers.Replace(Regex(r"(?<=\p{L})\x{3A3}(?!\p{L})"), "\u03c2"), normalizers.Lowercase()])
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
