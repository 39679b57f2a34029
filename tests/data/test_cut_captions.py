"""Captions longer than the text context are counted, never cut silently: exactly those the tokenizer cut (a caption
that exactly fills the context is not one), per run in metrics.jsonl (``data/cut_captions`` and its share) and in
the run's summary."""

import pytest
from open_clip.tokenizer import HFTokenizer, SimpleTokenizer

from mmcl.cli import main
from mmcl.data.batching import collate, tokenize_counting_cut
from mmcl.data.limits import BoundedTokenizer
from mmcl.models import TrimmedTokenizer

from helpers import encode, image_for, metrics, short_run, write_tar

FITS = " ".join(["a"] * 14)  # 14 tokens + start + end: exactly 16
LONGER = " ".join(["a"] * 15)  # one more: cut at 16
LONG = "a photo of " + "a red circle and a blue square " * 4


def _oc(context=16):
    return BoundedTokenizer(SimpleTokenizer(context_length=context))


@pytest.mark.parametrize("wrap", [lambda t: t, TrimmedTokenizer], ids=["full", "trimmed"])
def test_exactly_the_captions_the_tokenizer_cut_are_counted(wrap):
    tok = wrap(_oc())
    assert int((SimpleTokenizer(context_length=40)([FITS]) != 0).sum()) == 16  # the premise: FITS fills 16
    texts = ["a red circle", FITS, LONGER, LONG, "x"]
    tokens, cut = tokenize_counting_cut(tok, texts, len(texts))
    assert cut == 2  # LONGER and LONG
    assert tokens.equal(tok(texts))  # the batch itself is what the tokenizer gives
    assert tokenize_counting_cut(tok, ["short", "captions"], 2)[1] == 0
    assert tokenize_counting_cut(tok, texts, 2)[1] == 0  # only the first `first` texts (the captions) count


def test_a_hugging_face_tokenizer_counts_alike(tokenizer_dir):
    tok = BoundedTokenizer(HFTokenizer(str(tokenizer_dir), context_length=12))
    fits = " ".join(["cat"] * 10)  # [CLS] + 10 + [SEP] = 12
    texts = ["a cat", fits, fits + " cat", LONG]
    assert tokenize_counting_cut(tok, texts, 4)[1] == 2


def test_collate_adds_to_the_counts():
    counts = {"captions": 3, "cut_captions": 1}
    collate(None, ["a", LONG, LONGER], [-1] * 3, ["k0", "k1", "k2"], _oc(), counts=counts,
            negatives=[[LONG], [], []], max_negatives=1)
    assert counts == {"captions": 6, "cut_captions": 3}  # negatives are not captions


def test_a_run_says_how_many_captions_the_context_cut(tmp_path):
    shard = tmp_path / "s.tar"
    members = []
    for i in range(16):
        caption = LONG if i % 4 == 0 else f"a shape number {i}"
        members += [(f"k{i:02d}.png", encode(image_for(i, 32), "PNG")), (f"k{i:02d}.txt", caption.encode())]
    write_tar(shard, members)
    run = tmp_path / "run"
    assert main(short_run(str(shard), run, "model.context_length=16")) == 0
    last = metrics(run)[-1]
    assert last["data/cut_captions"] == 4 and last["data/cut_captions_share"] == pytest.approx(0.25)
    assert "captions cut at the text context: 4 (25.0% of those trained on" in (run / "out.log").read_text()
    first = metrics(run)[0]  # after the first batch of 8: a running count
    assert 0 <= first["data/cut_captions"] <= 4 and first["data/cut_captions_share"] == first["data/cut_captions"] / 8
