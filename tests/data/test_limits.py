"""mmcl.data.limits: texts cut before tokenizing (ordinary captions unchanged, the cut counted and said once),
JSON nested too deeply as a ValueError, and expanding lists bounded without being read past the bound."""

import itertools
import pickle
import warnings

import pytest

from mmcl.data import limits
from mmcl.errors import DataError


def test_bound_text_cuts_long_texts_and_long_words_and_keeps_ordinary_captions():
    caption = "a photo of a red circle on grass, taken at dusk"
    assert limits.bound_text(caption) == caption
    long_word = "x" * (limits.MAX_WORD_CHARS + 50)
    assert limits.bound_text(f"a {long_word} b") == f"a {'x' * limits.MAX_WORD_CHARS} b"
    long_text = "word " * limits.MAX_TEXT_CHARS
    assert len(limits.bound_text(long_text)) == limits.MAX_TEXT_CHARS


def test_the_bounded_tokenizer_counts_cut_texts_warns_once_and_pickles():
    seen = []
    tok = limits.BoundedTokenizer(lambda texts, **kw: seen.append((texts, kw)) or len(texts))
    long_word = "y" * (limits.MAX_WORD_CHARS + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tok(["short", long_word], context_length=77) == 2
        tok([long_word])
        tok("one text")
    assert tok.cut == 2 and len(caught) == 1 and "cut" in str(caught[0].message)
    assert seen[0] == (["short", long_word[:-1]], {"context_length": 77}) and seen[2][0] == "one text"
    again = pickle.loads(pickle.dumps(limits.BoundedTokenizer(len)))
    assert again("abc") == 3 and again.cut == 0


def test_load_json_turns_too_deep_nesting_into_a_value_error():
    assert limits.load_json('{"url": "http://example.com/1.jpg"}') == {"url": "http://example.com/1.jpg"}
    with pytest.raises(ValueError, match="nested too deeply"):
        limits.load_json("[" * 100_000 + "]" * 100_000)


def test_bounded_reads_at_most_one_entry_past_the_bound(monkeypatch):
    monkeypatch.setattr(limits, "MAX_LIST_ENTRIES", 5)
    assert limits.bounded(iter(range(5)), "a list") == [0, 1, 2, 3, 4]
    endless = itertools.count()
    with pytest.raises(DataError, match="a brace range expands to more than 5 entries"):
        limits.bounded(endless, "a brace range")
    assert next(endless) == 6  # entries 0..5 were read, no more
