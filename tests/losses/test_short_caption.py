"""Long-CLIP's short-caption term: the images rebuilt from the global batch's top principal directions, against the
short captions, by InfoNCE. Checked against float64 transcriptions of Long-CLIP's formula (value; every gradient
with the basis held constant), dense against tiled, the whole rank kept, bf16 autocast against float32, the
objective's row and its refusals, and two gloo processes under DDP against one process on the whole batch."""


import pytest
import torch
import torch.nn.functional as F

from mmcl.config import LossConfig, ShortCaptionConfig
from mmcl.losses import ContrastiveObjective, LossInputError, gather_batch, short_caption_loss
from mmcl.losses.short_caption import principal_basis
from mmcl.training.step import objective_from_config

from helpers import TinyTowers, fresh_leaves, pair_features, ref_clip
from spawned import ranks_match_one_process


def ref_pcm(img, k, basis_grad: bool):
    """Long-CLIP's ``PCA`` in float64: centre, the top-k right singular vectors of the centred rows, project, back,
    add the mean; then L2-normalised as its training normalises it. `basis_grad`: back-propagate through the SVD
    (Long-CLIP's code) or hold the basis constant (mmcl's choice)."""
    img = img.double()
    mean = img.mean(0, keepdim=True)
    xc = img - mean
    if basis_grad:
        _, _, vt = torch.linalg.svd(xc, full_matrices=False)
    else:
        with torch.no_grad():
            _, _, vt = torch.linalg.svd(xc, full_matrices=False)
    v = vt.T[:, :k]
    return F.normalize(xc @ v @ v.T + mean, dim=1)


def ref_short_caption(img, short, s, k, basis_grad=False):
    return ref_clip(ref_pcm(img, k, basis_grad), short.double(), s)


@pytest.mark.parametrize("n,d,k", [(12, 16, 4), (9, 8, 3), (20, 6, 2)])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_matches_long_clip_in_float64_value_and_gradients(n, d, k, chunk_size):
    img, short = pair_features(n, d, torch.float64, seed=n + d)
    s = torch.tensor(20.0, dtype=torch.float64)
    a_img, a_short, a_s = fresh_leaves(img, short, s)
    got = short_caption_loss(a_img, a_short, a_s, k, chunk_size)
    b_img, b_short, b_s = fresh_leaves(img, short, s)
    want = ref_short_caption(b_img, b_short, b_s, k)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, [a_img, a_short, a_s]), torch.autograd.grad(want, [b_img, b_short, b_s])):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
    # the value is Long-CLIP's own, whose basis carries a gradient; only the gradients differ by that term
    torch.testing.assert_close(got, ref_short_caption(img, short, s, k, basis_grad=True), rtol=1e-12, atol=1e-12)


def test_the_basis_is_the_top_principal_directions():
    img, _ = pair_features(30, 10, torch.float64, seed=1)
    v = principal_basis(img, 3)
    assert v.shape == (10, 3) and not v.requires_grad
    torch.testing.assert_close(v.T @ v, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-12)
    xc = img - img.mean(0)
    _, sv, vt = torch.linalg.svd(xc, full_matrices=False)
    torch.testing.assert_close((v @ v.T), vt[:3].T @ vt[:3], rtol=0, atol=1e-10)  # the same subspace
    # the variance it keeps is the top three singular values'
    torch.testing.assert_close((xc @ v).pow(2).sum(), sv[:3].pow(2).sum(), rtol=1e-12, atol=0)


def test_every_direction_kept_leaves_the_features_and_gives_infonce():
    """k at or above the batch's rank rebuilds every image exactly: the term is then InfoNCE on the short captions."""
    img, short = pair_features(6, 10, torch.float64, seed=2)
    s = torch.tensor(15.0, dtype=torch.float64)
    for k in (5, 10, 64):  # rank after centring: 5
        torch.testing.assert_close(short_caption_loss(img, short, s, k), ref_clip(img, short, s), rtol=1e-10,
                                   atol=1e-12)


def test_fewer_directions_make_the_images_coarser():
    """With one direction kept every image is its mean plus a multiple of one vector: the images of a batch of
    unrelated pairs become much alike, and their short captions can no longer be told apart as well."""
    img, short = pair_features(32, 16, torch.float64, seed=4)
    s = torch.tensor(30.0, dtype=torch.float64)
    losses = [float(short_caption_loss(img, short, s, k)) for k in (1, 4, 16)]
    assert losses[0] > losses[1] > losses[2]


def test_bf16_autocast_stays_near_float32():
    img, short = pair_features(64, 32, torch.float32, seed=5)
    s = torch.tensor(30.0)
    want = short_caption_loss(img, short, s, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = short_caption_loss(img.bfloat16(), short.bfloat16(), s, 8)
    assert got.dtype == torch.float32 and abs(float(got) - float(want)) / float(want) < 0.02


def test_the_objective_scores_it_as_a_term_of_its_own():
    img, txt = pair_features(10, 12, torch.float64, seed=6)
    short, _ = pair_features(10, 12, torch.float64, seed=7)
    s = torch.tensor(10.0, dtype=torch.float64)
    obj = objective_from_config(LossConfig(short_caption=ShortCaptionConfig(weight=0.5, components=3)))
    assert obj.short_caption_components == 3
    total, terms = obj(img, txt, s, short_text=short)
    want = ref_clip(img, txt, s) + 0.5 * ref_short_caption(img, short, s, 3)
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)
    assert terms["loss/short_caption"] == pytest.approx(float(ref_short_caption(img, short, s, 3)), rel=1e-12)
    # the validation loss leaves it out: a held-out batch carries one caption per image
    assert "short_caption" not in objective_from_config(
        LossConfig(short_caption=ShortCaptionConfig(weight=0.5)), validation=True).active_terms()


def test_refusals_are_one_line():
    img, txt = pair_features(4, 6)
    s = torch.tensor(10.0)
    with pytest.raises(LossInputError, match=r"^the short_caption term needs each image's short caption"):
        ContrastiveObjective({"clip": 1.0, "short_caption": 1.0})(img, txt, s)
    with pytest.raises(LossInputError, match="at least 1"):
        ContrastiveObjective({"short_caption": 1.0}, short_caption_components=0)
    with pytest.raises(LossInputError):
        short_caption_loss(img, txt[:3], s)


# ------------------------------------------------------------------------------- two processes equal one
WORLD, GLOBAL_BATCH = 2, 8
DIST_CONFIGS = {
    "dense": LossConfig(short_caption=ShortCaptionConfig(weight=1.0, components=3)),
    "tiled": LossConfig(chunk_size=3, short_caption=ShortCaptionConfig(weight=0.7, components=2)),
    "alone": LossConfig(clip=0.0, short_caption=ShortCaptionConfig(weight=1.0, components=4)),
}


def _dist_batch():
    g = torch.Generator().manual_seed(5)
    images = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    texts = torch.randn(GLOBAL_BATCH, 7, generator=g, dtype=torch.float64)
    shorts = texts + 0.5 * torch.randn(GLOBAL_BATCH, 7, generator=g, dtype=torch.float64)
    return images, texts, shorts


def _dist_run(wrap, rank, world):
    results = {}
    per = GLOBAL_BATCH // world
    images, texts, shorts = _dist_batch()
    rows = slice(rank * per, (rank + 1) * per)
    for name, cfg in DIST_CONFIGS.items():
        raw = TinyTowers(with_bias=False, dim=8)
        wrapped = wrap(raw)
        objective = objective_from_config(cfg)
        n = per if world > 1 else GLOBAL_BATCH
        # The short captions go through the text tower with the captions, in one forward (as in training).
        img, txt_all, scale, bias = wrapped(images[rows], torch.cat([texts[rows], shorts[rows]]))
        txt, short = txt_all[:n], txt_all[n:]
        gathered = gather_batch(img, txt, short_text=short)
        loss, terms = objective(img, txt, scale, bias, gathered=gathered, short_text=short)
        raw.zero_grad()
        loss.backward()
        results[name] = (terms, {k: p.grad.clone() for k, p in raw.named_parameters()})
    return results


def test_two_processes_match_one(tmp_path):
    """The basis and the mean are the global batch's: every rank finds them from the gathered features, and DDP's
    average of the ranks' gradients is one process's on the whole batch."""
    reference = ranks_match_one_process(_dist_run, WORLD, tmp_path)
    assert all(terms["loss/short_caption"] > 0 for terms, _ in reference.values())
