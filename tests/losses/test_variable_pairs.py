"""A variable number of pairs per process (`pad_pairs`, ``valid``): the padded losses against float64 formulas and
open_clip on the real pairs alone, ranks of different sizes against one process over all their real pairs (in one
process with a hand-built `Gathered`, and in two gloo processes under DDP), the errors, and no host sync."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.loss import ClipLoss, SigLipLoss
from torch.nn.parallel import DistributedDataParallel

from mmcl.losses import (
    VARIABLE_PAIR_TERMS,
    ContrastiveObjective,
    Gathered,
    LossInputError,
    clip_loss,
    gather_batch,
    pad_pairs,
    siglip_loss,
)

from helpers import TinyTowers
from spawned import end_worker, free_port, spawn
from syncwatch import SyncWatch

D = 5
# (term, chunk_size): clip dense and tiled (chunks smaller than the capacity, not dividing it), siglip both ways
CASES = [("clip", None), ("clip", 3), ("siglip", None), ("siglip", 4)]


def _features(n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, D, generator=g, dtype=torch.float64), dim=1).to(dtype)
    text = F.normalize(image.double() + torch.randn(n, D, generator=g, dtype=torch.float64), dim=1).to(dtype)
    return image.requires_grad_(), text.requires_grad_()


def _params(dtype=torch.float64):
    t = torch.tensor(math.log(12.0), dtype=dtype, requires_grad=True)
    b = torch.tensor(-3.0, dtype=dtype, requires_grad=True)
    return t, b


def _reference(term, image, text, t, b):
    """The loss of the n pairs alone, in float64, from the plain formula."""
    image, text, s, b = image.double(), text.double(), t.double().exp(), b.double()
    logits = s * image @ text.T
    n = logits.shape[0]
    if term == "clip":
        labels = torch.arange(n)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    z = 2 * torch.eye(n, dtype=torch.float64) - 1
    return -F.logsigmoid(z * (logits + b)).sum() / n


def _mmcl(term, image, text, t, b, chunk, **kw):
    if term == "clip":
        return clip_loss(image, text, t.exp(), chunk, **kw)
    return siglip_loss(image, text, t.exp(), b, chunk_size=chunk, **kw)


def _grads(loss, *leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("term, chunk", CASES)
@pytest.mark.parametrize("n", [1, 5, 8])
def test_padded_loss_and_gradients_equal_the_real_pairs_alone(term, chunk, n, dtype, tol):
    image, text = _features(n, dtype)
    t, b = _params(dtype)
    padded_image, padded_text, valid = pad_pairs(image, text, 8)
    assert valid.tolist() == [True] * n + [False] * (8 - n)
    got = _mmcl(term, padded_image, padded_text, t, b, chunk, valid=valid)
    want = _reference(term, image, text, t, b)
    assert got.item() == pytest.approx(want.item(), rel=tol, abs=tol)
    leaves = (image, text, t, b) if term == "siglip" else (image, text, t)
    for g, r in zip(_grads(got, *leaves), _grads(want, *leaves)):
        torch.testing.assert_close(g.double(), r.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("term, chunk", CASES)
def test_padded_loss_matches_open_clip_on_the_unpadded_pairs(term, chunk):
    image, text = _features(6, torch.float32, seed=3)
    t, b = _params(torch.float32)
    padded_image, padded_text, valid = pad_pairs(image, text, 11)
    got = _mmcl(term, padded_image, padded_text, t, b, chunk, valid=valid)
    theirs = (ClipLoss()(image, text, t.exp()) if term == "clip" else SigLipLoss()(image, text, t.exp(), b))
    assert got.item() == pytest.approx(theirs.item(), rel=1e-6)
    for g, r in zip(_grads(got, image, text, t), _grads(theirs, image, text, t)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def _fake_ranks(term, chunk, sizes, capacity):
    """Every rank's padded loss with a hand-built `Gathered` in one process, and the one-process loss of all the real
    pairs: (sum over ranks / W, reference, the leaves). The sum's gradient is what the summing all-gather gives each
    rank's features; divided by W, what DDP's averaging leaves."""
    feats = [_features(n, seed=10 + r) for r, n in enumerate(sizes)]
    t, b = _params()
    padded = [pad_pairs(i, x, capacity) for i, x in feats]
    all_image = torch.cat([p[0] for p in padded])
    all_text = torch.cat([p[1] for p in padded])
    all_valid = torch.cat([p[2] for p in padded])
    world = len(sizes)
    total = 0
    for r, (image, text, valid) in enumerate(padded):
        gathered = Gathered(all_image, all_text, offset=r * capacity, world_size=world, all_valid=all_valid)
        total = total + _mmcl(term, image, text, t, b, chunk, gathered=gathered, valid=valid)
    image = torch.cat([i for i, _ in feats])
    text = torch.cat([x for _, x in feats])
    leaves = [x for pair in feats for x in pair] + [t, b]
    return total / world, _reference(term, image, text, t, b), leaves


@pytest.mark.parametrize("term, chunk", CASES)
@pytest.mark.parametrize("sizes", [(3, 5), (3, 0, 6, 1)])
def test_ranks_of_different_sizes_sum_to_one_process(term, chunk, sizes):
    got, want, leaves = _fake_ranks(term, chunk, sizes, capacity=6)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    for g, r in zip(_grads(got, *leaves), _grads(want, *leaves)):
        if r is None:  # the clip term has no bias
            assert g is None
        else:
            torch.testing.assert_close(g, r, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("chunk", [None, 3])
def test_full_ranks_equal_the_unmasked_path(chunk):
    image, text = _features(12)
    t, _ = _params()
    gathered = Gathered(image, text, offset=6, world_size=2, all_valid=torch.ones(12, dtype=torch.bool))
    masked = clip_loss(image[6:], text[6:], t.exp(), chunk, gathered=gathered, valid=torch.ones(6, dtype=torch.bool))
    plain = clip_loss(image[6:], text[6:], t.exp(), chunk, gathered=gathered._replace(all_valid=None))
    assert masked.item() == pytest.approx(plain.item(), rel=1e-13)
    for g, r in zip(_grads(masked, image, text, t), _grads(plain, image, text, t)):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)


def test_objective_logs_the_real_pairs_and_their_metrics():
    image, text = _features(5)
    t, _ = _params()
    objective = ContrastiveObjective({"clip": 1.0}, chunk_size=2)
    padded_image, padded_text, valid = pad_pairs(image, text, 9)
    loss, terms = objective(padded_image, padded_text, t.exp(), valid=valid)
    _, plain = objective(image, text, t.exp())
    assert set(terms) == set(plain)
    for name, value in plain.items():
        assert terms[name] == pytest.approx(value, rel=1e-12), name
    assert loss.item() == pytest.approx(_reference("clip", image, text, t, torch.zeros(())).item(), rel=1e-12)
    assert VARIABLE_PAIR_TERMS == ("clip", "siglip")


def test_errors_are_one_line():
    image, text = _features(7)
    with pytest.raises(LossInputError, match=r"holds 7 pairs, more than the capacity of 6") as e:
        pad_pairs(image, text, 6)
    assert "\n" not in str(e.value)
    padded_image, padded_text, valid = pad_pairs(image, text, 8)
    scale = torch.tensor(10.0, dtype=torch.float64)
    for weights in ({"clip": 1.0, "align": 0.1}, {"mochi": 1.0}, {"supcon": 1.0}):
        name = next(k for k in weights if k not in VARIABLE_PAIR_TERMS)
        with pytest.raises(LossInputError, match=rf"the {name} term does not take a variable number of pairs per "
                                                 r"process \(NaFlex\); use loss.clip or loss.siglip$") as e:
            ContrastiveObjective(weights)(padded_image, padded_text, scale, valid=valid)
        assert "\n" not in str(e.value)
    with pytest.raises(LossInputError, match=r"valid must be a bool tensor of shape \(8,\)"):
        clip_loss(padded_image, padded_text, scale, valid=valid[:5])
    with pytest.raises(LossInputError, match=r"gathered.all_valid"):
        clip_loss(padded_image, padded_text, scale, valid=valid, gathered=Gathered(padded_image, padded_text))
    both = Gathered(padded_image.repeat(2, 1), padded_text.repeat(2, 1), world_size=2, all_valid=valid)
    with pytest.raises(LossInputError, match=r"gathered.all_valid must be a bool tensor of shape \(16,\)"):
        siglip_loss(padded_image, padded_text, scale, scale, valid=valid, gathered=both)


@pytest.mark.parametrize("term, chunk", CASES)
def test_masked_path_makes_no_host_sync(term, chunk):
    """Forward and backward of a rank's masked loss against a hand-built 2-rank `Gathered`, as an ordinary
    training step runs it (no logged numbers), read no device value on the host."""
    feats = [_features(n, torch.float32, seed=r) for r, n in enumerate((4, 2))]
    t, b = _params(torch.float32)
    with SyncWatch() as watch:
        padded = [pad_pairs(i, x, 5) for i, x in feats]
        all_image, all_text, all_valid = (torch.cat([p[k] for p in padded]) for k in range(3))
        gathered = Gathered(all_image, all_text, offset=5, world_size=2, all_valid=all_valid)
        objective = ContrastiveObjective({term: 1.0}, chunk_size=chunk)
        loss, _ = objective(padded[1][0], padded[1][1], t.exp(), b, gathered=gathered, with_metrics=False,
                            valid=padded[1][2])
        loss.backward()
    assert watch.count == 0, watch.summary()
    assert feats[0][1].grad is not None and t.grad is not None  # through the gathered texts


# ---------------------------------------------------------------------- two gloo processes under DDP
WORLD, CAPACITY, SIZES = 2, 6, (3, 5)
DDP_CASES = {"clip": ({"clip": 1.0}, None), "clip_tiled": ({"clip": 1.0}, 4), "siglip": ({"siglip": 1.0}, None),
             "siglip_tiled": ({"siglip": 1.0}, 4)}


def inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(sum(SIZES), 6, generator=g, dtype=torch.float64),
            torch.randn(sum(SIZES), 7, generator=g, dtype=torch.float64))


def _step(model, raw, weights, chunk, images, texts, capacity=None):
    """One objective step: (logged terms, parameter gradients). With `capacity` the rows are padded to it."""
    img, txt, scale, bias = model(images, texts)
    valid = None
    if capacity is not None:
        img, txt, valid = pad_pairs(img, txt, capacity)
    gathered = gather_batch(img, txt, valid=valid)
    objective = ContrastiveObjective(weights, chunk_size=chunk)
    loss, terms = objective(img, txt, scale, bias, gathered=gathered, valid=valid)
    raw.zero_grad()
    loss.backward()
    return terms, {k: p.grad.clone() for k, p in raw.named_parameters()}


def _worker(rank, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    images, texts = inputs()
    start = sum(SIZES[:rank])
    rows = slice(start, start + SIZES[rank])
    results = {}
    for name, (weights, chunk) in DDP_CASES.items():
        raw = TinyTowers(with_bias="siglip" in weights, dim=D)
        model = DistributedDataParallel(raw)
        results[name] = _step(model, raw, weights, chunk, images[rows], texts[rows], CAPACITY)
        full = slice(rank * CAPACITY, (rank + 1) * CAPACITY)  # both ranks full: 12 pairs, masked and unmasked
        wide = inputs()[0].repeat(2, 1)[full], inputs()[1].repeat(2, 1)[full]
        results[name + "/full"] = _step(model, raw, weights, chunk, *wide, CAPACITY)
        results[name + "/unmasked"] = _step(model, raw, weights, chunk, *wide)
    valid = torch.arange(CAPACITY) < SIZES[rank]
    results["all_valid"] = gather_batch(torch.zeros(CAPACITY, D), torch.zeros(CAPACITY, D), valid=valid).all_valid
    torch.save(results, f"{path}/rank{rank}.pt")
    end_worker()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("ranks")
    spawn(_worker, args=(free_port(), str(path)), nprocs=WORLD)
    return [torch.load(path / f"rank{r}.pt") for r in range(WORLD)]


def _assert_same(got, want, rel):
    got_terms, got_grads = got
    terms, grads = want
    for name in ("loss", *(k for k in terms if k.startswith("loss/")), "align"):
        assert got_terms[name] == pytest.approx(terms[name], rel=rel), name
    assert set(got_grads) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=rel, atol=rel, msg=name)


@pytest.mark.slow
def test_two_ranks_of_different_sizes_equal_one_process(two_ranks):
    images, texts = inputs()
    for name, (weights, chunk) in DDP_CASES.items():
        raw = TinyTowers(with_bias="siglip" in weights, dim=D)
        reference = _step(raw, raw, weights, chunk, images, texts)  # one process, the 8 pairs, no padding
        for rank in range(WORLD):
            _assert_same(two_ranks[rank][name], reference, rel=1e-10)


@pytest.mark.slow
def test_two_full_ranks_equal_the_unmasked_path(two_ranks):
    for name in DDP_CASES:
        for rank in range(WORLD):
            _assert_same(two_ranks[rank][name + "/full"], two_ranks[rank][name + "/unmasked"], rel=1e-12)


@pytest.mark.slow
def test_gather_batch_gathers_the_mask(two_ranks):
    for rank in range(WORLD):
        assert two_ranks[rank]["all_valid"].tolist() == [True] * 3 + [False] * 3 + [True] * 5 + [False]
