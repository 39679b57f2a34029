"""Negative captions from the data (NegCLIP): each adds a column to its own image's row of the image-to-text logits
only. Checked against float64 transcriptions of the definition (value and every gradient), dense against tiled,
a padded batch against the same real pairs unpadded, bf16 autocast against float32, and two gloo processes under
DDP against one process on the whole batch."""


import pytest
import torch
import torch.nn.functional as F

from mmcl.config import LossConfig
from mmcl.losses import (
    ContrastiveObjective,
    DataNegatives,
    LossInputError,
    clip_loss,
    gather_batch,
    pad_pairs,
    siglip_loss,
)
from mmcl.training.step import objective_from_config

from helpers import TinyTowers, fresh_leaves, pair_features
from spawned import ranks_match_one_process


def grads_wrt(loss, tensors):
    """Every gradient, zeros for a leaf the loss does not read (the negatives' features when K = 0)."""
    return torch.autograd.grad(loss, tensors, allow_unused=True, materialize_grads=True)


def _negatives(n, k, d, seed=3, dtype=torch.float64, counts=None):
    """(n, k, d) unit negatives near each row's text (hard ones), and the mask of the first counts[i] of row i."""
    g = torch.Generator().manual_seed(seed)
    feats = F.normalize(torch.randn(n, k, d, generator=g, dtype=torch.float64), dim=2).to(dtype)
    counts = [k] * n if counts is None else counts
    valid = torch.arange(k)[None, :] < torch.tensor(counts)[:, None]
    return feats, valid


def ref_clip_negatives(img, txt, negs, valid, s):
    """The definition, row by row in float64: image i's softmax runs over every text and its own real negatives;
    the text-to-image direction over the images only."""
    img, txt, negs = img.double(), txt.double(), negs.double()
    n = img.shape[0]
    logits = s * img @ txt.T
    i2t = []
    for i in range(n):
        row = torch.cat([logits[i], s * negs[i][valid[i]] @ img[i]])
        i2t.append(torch.logsumexp(row, 0) - logits[i, i])
    t2i = torch.logsumexp(logits, 0) - logits.diagonal()
    return (torch.stack(i2t).mean() + t2i.mean()) / 2


def ref_siglip_negatives(img, txt, negs, valid, s, b):
    img, txt, negs = img.double(), txt.double(), negs.double()
    n = img.shape[0]
    z = 2 * torch.eye(n, dtype=torch.float64) - 1
    total = F.logsigmoid(z * (s * img @ txt.T + b)).sum()
    for i in range(n):
        total = total + F.logsigmoid(-(s * negs[i][valid[i]] @ img[i] + b)).sum()
    return -total / n


CASES = [  # (n, k, counts): full, a varying number per sample (none for some), and K = 0
    (6, 3, None),
    (7, 4, [0, 4, 1, 2, 0, 3, 4]),
    (5, 0, None),
]


@pytest.mark.parametrize("n,k,counts", CASES)
@pytest.mark.parametrize("chunk_size", [None, 2, 3])
@pytest.mark.parametrize("scale", [10.0, 100.0])
def test_clip_with_negatives_matches_the_float64_definition(n, k, counts, chunk_size, scale, tiles):
    img, txt = pair_features(n, 5, torch.float64, seed=n)
    negs, valid = _negatives(n, k, 5, counts=counts)
    s = torch.tensor(scale, dtype=torch.float64)
    a = fresh_leaves(img, txt, negs, s)
    b = fresh_leaves(img, txt, negs, s)
    got = clip_loss(a[0], a[1], a[3], chunk_size, negatives=DataNegatives(a[2], valid))
    want = ref_clip_negatives(b[0], b[1], b[2], valid, b[3])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads_wrt(got, a), grads_wrt(want, b)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n,k,counts", CASES)
@pytest.mark.parametrize("chunk_size", [None, 2, 4])
def test_siglip_with_negatives_matches_the_float64_definition(n, k, counts, chunk_size, tiles):
    img, txt = pair_features(n, 5, torch.float64, seed=n)
    negs, valid = _negatives(n, k, 5, counts=counts)
    s, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-3.0, dtype=torch.float64)
    a = fresh_leaves(img, txt, negs, s, bias)
    b = fresh_leaves(img, txt, negs, s, bias)
    got = siglip_loss(a[0], a[1], a[3], a[4], chunk_size=chunk_size, negatives=DataNegatives(a[2], valid))
    want = ref_siglip_negatives(b[0], b[1], b[2], valid, b[3], b[4])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads_wrt(got, a), grads_wrt(want, b)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_negatives_change_only_their_own_images_row():
    """A negative of row 0 moves row 0's image-to-text loss only: no other row, and not the text-to-image side."""
    img, txt = pair_features(5, 4, torch.float64)
    negs, valid = _negatives(5, 1, 4, counts=[1, 0, 0, 0, 0])
    negs[0, 0] = F.normalize(img[0] + txt[0], dim=0)  # a hard one: closer to image 0 than its caption
    with_neg = ref_clip_negatives(img, txt, negs, valid, 10.0)
    without = clip_loss(img, txt, torch.tensor(10.0, dtype=torch.float64))
    got = clip_loss(img, txt, torch.tensor(10.0, dtype=torch.float64), negatives=DataNegatives(negs, valid))
    logits = 10.0 * img @ txt.T
    row0 = torch.logsumexp(torch.cat([logits[0], 10.0 * negs[0, :1] @ img[0]]), 0) - logits[0, 0]
    row0_plain = torch.logsumexp(logits[0], 0) - logits[0, 0]
    torch.testing.assert_close(got - without, (row0 - row0_plain) / 5 / 2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, with_neg, rtol=1e-12, atol=1e-14)
    # Gradient: the negative of row 0 pulls on image 0 only.
    x = img.clone().requires_grad_(True)
    (g_with,) = torch.autograd.grad(clip_loss(x, txt, torch.tensor(10.0, dtype=torch.float64),
                                              negatives=DataNegatives(negs, valid)), x)
    (g_without,) = torch.autograd.grad(clip_loss(x, txt, torch.tensor(10.0, dtype=torch.float64)), x)
    assert (g_with - g_without)[1:].abs().max() < 1e-15
    assert (g_with - g_without)[0].abs().max() > 1e-3


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_padding_negatives_changes_nothing(loss):
    """Padding slots (mask False) hold any values: the loss and the real features' gradients are those of the real
    negatives alone, and the padding gets no gradient."""
    img, txt = pair_features(6, 4, torch.float64)
    negs, valid = _negatives(6, 2, 4, counts=[1, 2, 0, 2, 1, 1])
    junk = torch.randn(6, 3, 4, dtype=torch.float64) * 1e3
    padded = torch.cat([negs, junk], 1)
    padded_valid = torch.cat([valid, torch.zeros(6, 3, dtype=torch.bool)], 1)

    def run(feats, mask):
        leaves = fresh_leaves(img, txt, feats)
        s = torch.tensor(20.0, dtype=torch.float64)
        if loss == "clip":
            value = clip_loss(leaves[0], leaves[1], s, 2, negatives=DataNegatives(leaves[2], mask))
        else:
            value = siglip_loss(leaves[0], leaves[1], s, torch.tensor(-2.0, dtype=torch.float64), chunk_size=2,
                                negatives=DataNegatives(leaves[2], mask))
        return value, grads_wrt(value, leaves)

    v1, g1 = run(negs, valid)
    v2, g2 = run(padded, padded_valid)
    torch.testing.assert_close(v1, v2, rtol=1e-13, atol=0)
    for a, b in zip(g1[:2], g2[:2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g2[2][:, :2], g1[2], rtol=1e-12, atol=1e-15)
    assert torch.count_nonzero(g2[2][:, 2:]) == 0


@pytest.mark.parametrize("term", ["clip", "siglip"])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_negatives_with_padded_pairs_equal_the_real_pairs(term, chunk_size):
    """A variable number of pairs per process (`pad_pairs`, ``valid``) with negatives: the real pairs' loss."""
    img, txt = pair_features(5, 4, torch.float64)
    negs, valid = _negatives(5, 2, 4, counts=[2, 0, 1, 2, 1])
    weights = {term: 1.0}
    obj = ContrastiveObjective(weights, chunk_size=chunk_size)
    s, b = torch.tensor(15.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
    want, _ = obj(img, txt, s, b, with_metrics=False, negatives=DataNegatives(negs, valid))
    p_img, p_txt, rows = pad_pairs(img, txt, 8)
    p_negs = torch.cat([negs, torch.randn(3, 2, 4, dtype=torch.float64)])
    p_valid = torch.cat([valid, torch.ones(3, 2, dtype=torch.bool)])  # padded rows' slots marked real: ignored
    got, _ = obj(p_img, p_txt, s, b, with_metrics=False, valid=rows, negatives=DataNegatives(p_negs, p_valid))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("term", ["clip", "siglip"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_bf16_autocast_matches_float32(term, chunk_size):
    """Called and differentiated inside bf16 autocast on the CPU, the loss and gradients are float32's."""
    img, txt = pair_features(16, 8, torch.float32)
    negs, valid = _negatives(16, 3, 8, dtype=torch.float32, counts=[i % 4 for i in range(16)])
    obj = ContrastiveObjective({term: 1.0}, chunk_size=chunk_size)
    s, b = torch.tensor(50.0), torch.tensor(-5.0)

    def run(autocast):
        leaves = fresh_leaves(img, txt, negs)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value, _ = obj(leaves[0], leaves[1], s, b, with_metrics=False,
                           negatives=DataNegatives(leaves[2], valid))
            grads = grads_wrt(value, leaves)
        return value, grads

    v_half, g_half = run(True)
    v_full, g_full = run(False)
    assert v_half.dtype == torch.float32
    torch.testing.assert_close(v_half, v_full, rtol=1e-6, atol=1e-6)
    for a, b_ in zip(g_half, g_full):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-7)


def test_bad_negatives_are_one_line_errors():
    img, txt = pair_features(4, 3)
    s = torch.tensor(10.0)
    with pytest.raises(LossInputError, match=r"\(n, K, D\) = \(4, K, 3\)"):
        clip_loss(img, txt, s, negatives=DataNegatives(torch.zeros(3, 2, 3), torch.ones(3, 2, dtype=torch.bool)))
    with pytest.raises(LossInputError, match="bool tensor of shape"):
        clip_loss(img, txt, s, negatives=DataNegatives(torch.zeros(4, 2, 3), torch.ones(4, 2)))
    with pytest.raises(LossInputError, match="neither has a positive weight"):
        ContrastiveObjective({"clip": 0.0, "align": 1.0})(
            img, txt, s, negatives=DataNegatives(torch.zeros(4, 1, 3), torch.ones(4, 1, dtype=torch.bool)))


# ------------------------------------------------------------------------------- two processes equal one
WORLD, GLOBAL_BATCH, K = 2, 8, 3
DIST_CONFIGS = {
    "clip_dense": LossConfig(),
    "clip_tiled": LossConfig(chunk_size=3),
    "siglip": LossConfig(clip=0.0, siglip=1.0),
    "siglip_tiled": LossConfig(clip=0.0, siglip=1.0, chunk_size=3),
}


def _dist_batch():
    g = torch.Generator().manual_seed(5)
    images = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    texts = torch.randn(GLOBAL_BATCH, 7, generator=g, dtype=torch.float64)
    negatives = texts[:, None, :] + 0.5 * torch.randn(GLOBAL_BATCH, K, 7, generator=g, dtype=torch.float64)
    valid = torch.arange(K)[None, :] < (torch.arange(GLOBAL_BATCH) % (K + 1))[:, None]  # 0..K per sample
    return images, texts, negatives, valid


def _dist_run(wrap, rank, world):
    results = {}
    per = GLOBAL_BATCH // world
    images, texts, negatives, valid = _dist_batch()
    rows = slice(rank * per, (rank + 1) * per)
    for name, cfg in DIST_CONFIGS.items():
        raw = TinyTowers(with_bias=cfg.siglip > 0)
        wrapped = wrap(raw)
        objective = objective_from_config(cfg)
        # The negatives go through the text tower with the captions, in one forward (as in training).
        n = per if world > 1 else GLOBAL_BATCH
        local_texts = torch.cat([texts[rows], negatives[rows].reshape(-1, 7)])
        img, txt_all, scale, bias = wrapped(images[rows], local_texts)
        txt, neg = txt_all[:n], txt_all[n:].reshape(n, K, -1)
        gathered = gather_batch(img, txt)
        loss, terms = objective(img, txt, scale, bias, gathered=gathered,
                                negatives=DataNegatives(neg, valid[rows]))
        raw.zero_grad()
        loss.backward()
        results[name] = (terms, {k: p.grad.clone() for k, p in raw.named_parameters()})
    return results


def test_two_processes_with_negatives_match_one(tmp_path):
    ranks_match_one_process(_dist_run, WORLD, tmp_path)
