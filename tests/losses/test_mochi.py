"""MoCHi (Kalantidis et al. 2020) against a float64 reference in the documented order of draws: tiled equal to
dense, the memory of the tiled backward, rows split over simulated ranks, the synthetic logits, the feature queue."""

import pytest
import torch
import torch.nn.functional as F

from mmcl.losses import FeatureQueue, Gathered, LossInputError, clip_loss, infonce_rows, mochi_loss

from helpers import fresh_leaves, grads_wrt, pair_features


def ref_mochi_direction(q, k, queue, s, n_hard, n_mix, n_query_mix, mix_max, gen):
    """Kalantidis et al. (2020) for one direction, per query in float64; draws in the documented order."""
    m = k.shape[0]
    cand = k if queue is None else torch.cat([k, queue])
    n_cand = cand.shape[0]
    hard_k = min(n_hard, n_cand - 1)
    pairs = torch.randint(0, hard_k, (m, n_mix, 2), generator=gen)
    alpha = torch.rand(m, n_mix, 1, generator=gen).double()
    picks = torch.randint(0, hard_k, (m, n_query_mix), generator=gen)
    beta = (torch.rand(m, n_query_mix, 1, generator=gen) * mix_max).double()
    total = 0.0
    for i in range(m):
        negatives = [j for j in range(n_cand) if j != i]
        sims = torch.stack([cand[j] @ q[i] for j in negatives])
        hard = [negatives[o] for o in torch.argsort(sims, descending=True)[:hard_k].tolist()]
        synthetic = []
        for t in range(n_mix):
            mix = alpha[i, t] * cand[hard[pairs[i, t, 0]]] + (1 - alpha[i, t]) * cand[hard[pairs[i, t, 1]]]
            synthetic.append(mix / mix.norm())
        for t in range(n_query_mix):
            mix = beta[i, t] * q[i] + (1 - beta[i, t]) * cand[hard[picks[i, t]]]
            synthetic.append(mix / mix.norm())
        keys = torch.cat([cand] + ([torch.stack(synthetic).detach()] if synthetic else []))
        logits = s * keys @ q[i]
        total = total + torch.logsumexp(logits, 0) - logits[i]
    return total / m


@pytest.mark.parametrize("with_queue", [False, True])
def test_mochi_matches_float64_reference(with_queue):
    img, txt = pair_features(10, 8, torch.float64, seed=20, correlated=False)
    iq, tq = pair_features(7, 8, torch.float64, seed=21) if with_queue else (None, None)
    s = torch.tensor(7.0, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    got = mochi_loss(a[0], a[1], a[2], 5, 4, 3, 0.5, torch.Generator().manual_seed(3), iq, tq)
    gen = torch.Generator().manual_seed(3)
    ref = (ref_mochi_direction(b[0], b[1], tq, b[2], 5, 4, 3, 0.5, gen)
           + ref_mochi_direction(b[1], b[0], iq, b[2], 5, 4, 3, 0.5, gen)) / 2
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)  # float64 both
    # The reference detaches the synthetic features too, so matching gradients shows none flows through them.
    for ga, gb in zip(grads_wrt(got, a), grads_wrt(ref, b)):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("with_queue,synth", [(False, (4, 3)), (True, (4, 3)), (True, (0, 0)), (False, (0, 2))])
def test_chunked_mochi_equals_dense(chunk, with_queue, synth, tiles):
    img, txt = pair_features(10, 8, torch.float64, seed=27, correlated=False)
    iq, tq = pair_features(7, 8, torch.float64, seed=28) if with_queue else (None, None)
    s = torch.tensor(7.0, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    dense = mochi_loss(*a, 5, *synth, 0.5, torch.Generator().manual_seed(3), iq, tq)
    chunked = mochi_loss(*b, 5, *synth, 0.5, torch.Generator().manual_seed(3), iq, tq, chunk_size=chunk)
    torch.testing.assert_close(chunked, dense, rtol=1e-12, atol=1e-12)  # float64: summation order only
    for gc, gd in zip(grads_wrt(chunked, b), grads_wrt(dense, a)):
        torch.testing.assert_close(gc, gd, rtol=1e-10, atol=1e-12)
    # Local rows against gathered columns (the distributed layout), chunked, still equal the global batch.
    c = fresh_leaves(img, txt, s)
    parts = [mochi_loss(c[0][sl], c[1][sl], c[2], 5, *synth, 0.5, torch.Generator().manual_seed(3), iq, tq,
                        gathered=Gathered(c[0], c[1], offset=sl.start), chunk_size=chunk)
             for sl in (slice(0, 5), slice(5, 10))]
    torch.testing.assert_close(torch.stack(parts).mean(), dense, rtol=1e-12, atol=1e-12)


def test_chunked_mochi_keeps_no_logit_matrix_for_backward():
    n, q_len, d = 1024, 2048, 16
    img, txt = pair_features(n, d, torch.float32, seed=29)
    iq, tq = pair_features(q_len, d, torch.float32, seed=30)
    s = torch.tensor(10.0)

    def largest_saved(**kw):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            mochi_loss(*fresh_leaves(img, txt, s), 8, 4, 3, 0.5, torch.Generator().manual_seed(0), iq, tq, **kw)
        return max(sizes)

    assert largest_saved() >= n * (n + q_len)  # the dense (n, M + Q) logits
    # No (n, M + Q) logits and no (n, s + s', D) synthetic features: at most the (M + Q, D) keys and queue.
    assert largest_saved(chunk_size=128) <= (n + q_len) * d


def test_mochi_without_synthesis_is_infonce():
    img, txt = pair_features(16, 8, torch.float32, seed=22)
    s = torch.tensor(20.0)
    g = torch.Generator().manual_seed(0)
    plain = mochi_loss(img, txt, s, 4, 0, 0, 0.5, g)
    torch.testing.assert_close(plain, clip_loss(img, txt, s), rtol=1e-6, atol=1e-6)  # float32, same CE
    iq, tq = pair_features(5, 8, torch.float32, seed=23)
    queued = mochi_loss(img, txt, s, 4, 0, 0, 0.5, g, iq, tq)
    expected = (infonce_rows(img, torch.cat([txt, tq]), s).mean()
                + infonce_rows(txt, torch.cat([img, iq]), s).mean()) / 2
    torch.testing.assert_close(queued, expected, rtol=1e-6, atol=1e-6)  # float32, same CE


def test_mochi_hard_negatives_raise_the_loss():
    img, txt = pair_features(64, 16, torch.float32, seed=24)
    s = torch.tensor(20.0)
    plain = clip_loss(img, txt, s)
    harder = mochi_loss(img, txt, s, 8, 16, 8, 0.5, torch.Generator().manual_seed(0))
    assert harder.item() > plain.item() + 1e-3  # extra negatives, some near the query, can only add mass


def test_mochi_local_rows_split_reproduces_global_batch():
    img, txt = pair_features(12, 8, torch.float64, seed=25, correlated=False)
    iq, tq = pair_features(5, 8, torch.float64, seed=26)
    s = torch.tensor(6.0, dtype=torch.float64)
    a, b = fresh_leaves(img, txt, s), fresh_leaves(img, txt, s)
    ref = mochi_loss(*a, 4, 3, 2, 0.5, torch.Generator().manual_seed(5), iq, tq)
    parts = []
    for r in range(3):  # every rank seeds its generator identically
        sl = slice(r * 4, (r + 1) * 4)
        parts.append(mochi_loss(b[0][sl], b[1][sl], b[2], 4, 3, 2, 0.5, torch.Generator().manual_seed(5), iq, tq,
                                gathered=Gathered(b[0], b[1], offset=r * 4)))
    split = torch.stack(parts).mean()
    torch.testing.assert_close(split, ref, rtol=1e-12, atol=1e-12)  # float64
    for ga, gb in zip(grads_wrt(ref, a), grads_wrt(split, b)):
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)


def test_feature_queue_fifo_and_state_dict():
    q = FeatureQueue(5)
    assert q.get() is None and len(q) == 0
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    q.enqueue(x[:3])
    assert torch.equal(q.get(), x[:3])
    q.enqueue(x[3:])  # 6 items into 5 slots: the oldest is overwritten
    assert len(q) == 5 and sorted(q.get()[:, 0].tolist()) == [2.0, 4.0, 6.0, 8.0, 10.0]
    fresh = FeatureQueue(5)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh.get(), q.get()) and int(fresh.ptr) == int(q.ptr)
    q.enqueue(x[:2])
    fresh.enqueue(x[:2])
    assert torch.equal(fresh.get(), q.get())
    with pytest.raises(LossInputError, match="width"):
        q.enqueue(torch.zeros(1, 3))


@pytest.mark.parametrize("s,s_prime", [(3, 2), (0, 2), (3, 0)])
def test_mochi_synthetic_logits_gradcheck_and_match_explicit_mixes(s, s_prime):
    """MoCHi's synthetic logits from dot products and norms (no mixed features formed): values and query and
    scale gradients equal to normalising the explicit mixes and taking s * q . u with u detached. (No
    gradcheck: the values read q . h from the ranking's dot products, fixed inputs of the function.)"""
    from mmcl.losses.mochi import SyntheticLogits

    g = torch.Generator().manual_seed(11)
    n, c, d, k = 4, 9, 5, 4
    q = F.normalize(torch.randn(n, d, dtype=torch.float64, generator=g), dim=1).requires_grad_(True)
    cand = F.normalize(torch.randn(c, d, dtype=torch.float64, generator=g), dim=1)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    hard = torch.stack([torch.randperm(c, generator=g)[:k] for _ in range(n)])
    hard_sims = (q.detach() @ cand.T).gather(1, hard)
    draws = (torch.randint(0, k, (n, s, 2), generator=g), torch.rand(n, s, 1, generator=g, dtype=torch.float64),
             torch.randint(0, k, (n, s_prime), generator=g),
             0.5 * torch.rand(n, s_prime, 1, generator=g, dtype=torch.float64))
    fn = lambda q, scale: SyntheticLogits.apply(q, scale, cand, hard, hard_sims, draws, 3)  # noqa: E731
    pairs, a, picks, b = draws
    qd = q.detach()
    first, second = cand[hard.gather(1, pairs[..., 0])], cand[hard.gather(1, pairs[..., 1])]
    mixes = [F.normalize(a * first + (1 - a) * second, dim=-1),
             F.normalize(b * qd[:, None] + (1 - b) * cand[hard.gather(1, picks)], dim=-1)]
    ref = scale * torch.einsum("nd,nkd->nk", q, torch.cat(mixes, dim=1))
    ours = fn(q, scale)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(ours.shape, dtype=torch.float64, generator=g)
    ours_grads = torch.autograd.grad((ours * w).sum(), (q, scale))
    for go, gr in zip(ours_grads, torch.autograd.grad((ref * w).sum(), (q, scale))):
        torch.testing.assert_close(go, gr, rtol=1e-10, atol=1e-12)


def test_feature_queue_reads_nothing_from_the_device_and_restores_its_position(monkeypatch):
    """The MoCHi queue keeps its write position on the host (no `.item()`/`int()` of a buffer per training step)
    and takes it back from a loaded state dict: the queue continues where the saved one would have."""
    from mmcl.losses import FeatureQueue

    torch.manual_seed(0)
    batches = [torch.randn(3, 4) for _ in range(5)]
    q, reads = FeatureQueue(7), []
    for name in ("item", "__int__", "__index__", "tolist", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k))
    for x in batches[:3]:
        q.enqueue(x)
        q.get()
    monkeypatch.undo()
    assert reads == [] and len(q) == 7
    restored = FeatureQueue(7)
    restored.load_state_dict(q.state_dict())
    assert len(restored) == 7 and int(restored.ptr) == 2
    for x in batches[3:]:
        q.enqueue(x)
        restored.enqueue(x)
    assert torch.equal(q.get(), restored.get())
    # the oldest rows were overwritten in order: batch 3 went to rows 2..4, batch 4 to rows 5, 6 and 0
    assert torch.equal(restored.get()[2:5], batches[3]) and torch.equal(restored.get()[5:7], batches[4][:2])
