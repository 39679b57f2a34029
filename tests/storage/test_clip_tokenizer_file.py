"""The tokenizer.json files an export writes (mmcl/storage/clip_tokenizer_file.py): open_clip's CLIP tokenizer as a
Hugging Face `tokenizers` file, and a Hugging Face tokenizer's file made to give open_clip's `HFTokenizer` ids; both
checked id for id against open_clip."""

import json

import open_clip
import pytest
import torch
from open_clip.tokenizer import HFTokenizer
from tokenizers import Tokenizer

from mmcl.storage import clip_tokenizer_file as ctf

TEXTS = ["a photo of a cat.", "A Photo Of  A   DOG!!", "it's the dog's ball, isn't it?", "", "naïve café résumé",
         "tokens: 12345 and 3.14", "  leading and trailing spaces  ", "a very long caption " * 40]


@pytest.mark.parametrize("context_length", [77, 16])
def test_the_clip_tokenizer_file_gives_open_clips_ids(context_length, tmp_path):
    path = tmp_path / "tokenizer.json"
    ctf.write_tokenizer_json(path, context_length)
    assert json.loads(path.read_text()) == json.loads(ctf.tokenizer_json(context_length))
    tok = Tokenizer.from_file(str(path))
    got = torch.tensor([e.ids for e in tok.encode_batch(TEXTS)])
    want = open_clip.tokenize(TEXTS, context_length=context_length)
    assert got.shape == want.shape == (len(TEXTS), context_length)
    assert torch.equal(got, want.to(got.dtype))


@pytest.mark.parametrize("clean", ["whitespace", "lower", "canonicalize"])
@pytest.mark.parametrize("strip_sep_token", [False, True])
def test_a_hugging_face_tokenizer_file_gives_open_clips_hf_tokenizer_ids(tokenizer_dir, clean, strip_sep_token):
    text = (tokenizer_dir / "tokenizer.json").read_text()
    file_text, not_expressed = ctf.open_clip_hf_tokenizer_json(text, 24, clean=clean,
                                                                strip_sep_token=strip_sep_token, sep_token="[SEP]")
    assert not_expressed == []
    tok = Tokenizer.from_str(file_text)
    got = torch.tensor([e.ids for e in tok.encode_batch(TEXTS)])
    want = HFTokenizer(str(tokenizer_dir), context_length=24, clean=clean, strip_sep_token=strip_sep_token)(TEXTS)
    assert torch.equal(got, want.to(got.dtype))


def test_what_a_tokenizer_file_cannot_express_is_named(tokenizer_dir):
    text = (tokenizer_dir / "tokenizer.json").read_text()
    _, not_expressed = ctf.open_clip_hf_tokenizer_json(text, 24, strip_sep_token=True, sep_token="[SEP]", pad_id=3)
    assert len(not_expressed) == 1 and not_expressed[0].startswith("strip_sep_token")
