"""`generate` against a search written out here on a tiny-vocabulary CoCa (greedy: the argmax at each place; beam
search with as many beams as tokens: the exhaustive best), and the output format checks of `mmcl caption`."""

import pytest
import torch
import torch.nn.functional as F

from mmcl import models
from mmcl.config import load_config
from mmcl.errors import ConfigError
from mmcl.evaluation.captioning import generate, output_format

VOCAB, SOT, EOT = 12, 10, 11


@pytest.fixture(scope="module")
def coca():
    torch.manual_seed(0)
    cfg = load_config(None, ["model.name=coca_tiny", f"model.text_cfg={{vocab_size: {VOCAB}}}"]).model
    model, *_ = models.build(cfg)
    return model.eval()


def _logp(model, images, prefix):
    with torch.no_grad():
        return F.log_softmax(model(images, prefix, output_labels=False)["logits"][:, -1].float(), dim=-1)


def test_greedy_takes_the_most_probable_token_at_each_place(coca):
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    got = generate(coca, images, SOT, EOT, max_length=5)
    for i in range(3):
        prefix = torch.tensor([[SOT]])
        for _ in range(4):
            token = int(_logp(coca, images[i:i + 1], prefix).argmax())
            if token == EOT:
                break
            prefix = torch.cat([prefix, torch.tensor([[token]])], dim=1)
        assert got[i] == prefix[0, 1:].tolist()


def test_beam_search_with_a_beam_per_token_finds_the_best_caption_of_two_places(coca):
    """At most two tokens (the second is the end): every caption is [t, EOT] or [EOT]; the best by log-probability
    over length is the exhaustive search's."""
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    got = generate(coca, images, SOT, EOT, max_length=2, beams=VOCAB)
    for i in range(2):
        first = _logp(coca, images[i:i + 1], torch.tensor([[SOT]]))[0]
        best, best_caption = float(first[EOT]) / 1, []
        for t in range(VOCAB):
            if t == EOT:
                continue
            second = _logp(coca, images[i:i + 1], torch.tensor([[SOT, t]]))[0]
            value = (float(first[t]) + float(second[EOT])) / 2
            if value > best:
                best, best_caption = value, [t]
        assert got[i] == best_caption


def test_one_beam_is_greedy(coca):
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    assert generate(coca, images, SOT, EOT, max_length=6, beams=1) == generate(coca, images, SOT, EOT, max_length=6)


@pytest.mark.parametrize("kw, says", [({"max_length": 0}, "--max-length must be in 1..32"),
                                      ({"max_length": 33}, "--max-length must be in 1..32"),
                                      ({"beams": 0}, "--beams must be >= 1")])
def test_bad_decoding_settings_are_one_config_error(coca, kw, says):
    with pytest.raises(ConfigError, match=says):
        generate(coca, torch.zeros(1, 3, 64, 64), SOT, EOT, **kw)


def test_the_output_format_follows_the_suffix():
    assert output_format("out/c.jsonl") == "jsonl" and output_format("C.CSV") == "csv"
    with pytest.raises(ConfigError, match="--out must end in .jsonl or .csv"):
        output_format("c.json")
