"""The global contrastive term (SogCLR / FastCLIP): a float64 reference of the papers' update and gradient over
several steps, CLIP's gradients when the estimate is the batch's, tiled = dense, float32 under bf16 autocast, logit
scales 1-100, libauc's bimodal loss where the definitions coincide, and 2 gloo processes = 1."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mmcl.losses import Gathered, clip_loss, gather_batch
from mmcl.losses.errors import LossInputError
from mmcl.losses.global_contrastive import GlobalEstimates, gamma_at, global_contrastive_loss

from spawned import end_worker, free_port, spawn


def _pairs(m, d=8, seed=0, aligned=0.0, dtype=torch.float64):
    """m unit image/text pairs; ``aligned`` > 0 puts each text near its image (a trained model's geometry)."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(m, d, generator=g, dtype=torch.float64), dim=1)
    txt = F.normalize(torch.randn(m, d, generator=g, dtype=torch.float64), dim=1)
    if aligned:
        txt = F.normalize(img + (1 - aligned) * txt, dim=1)
    return img.to(dtype), txt.to(dtype)


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


class Reference:
    """The papers' estimator in float64, written from their formulas with plain (not log) estimates.

    Per direction, g_i = 1/(M-1) sum_{j != i} exp(L_ij - L_ii); u_i <- (1 - gamma) u_i + gamma g_i (the batch's g_i
    when the sample was never seen); the step follows mean_i grad g_i / (eps + u_i); the reported value is
    mean_i log(eps + u_i). Both directions averaged.
    """

    def __init__(self, n_samples, gamma, eps):
        self.u = {"image": torch.zeros(n_samples, dtype=torch.float64),
                  "text": torch.zeros(n_samples, dtype=torch.float64)}
        self.seen = torch.zeros(n_samples, dtype=torch.bool)
        self.gamma, self.eps = gamma, eps

    def step(self, img, txt, scale, ids, gamma=None):
        gamma = self.gamma if gamma is None else gamma
        logits = scale * img @ txt.T
        m = logits.shape[0]
        negatives = ~torch.eye(m, dtype=torch.bool)
        surrogate, value = 0.0, 0.0
        for name, diffs in (("image", logits - logits.diagonal()[:, None]),
                            ("text", logits.T - logits.diagonal()[:, None])):
            g = (torch.exp(diffs) * negatives).sum(dim=1) / (m - 1)
            old = self.u[name][ids]
            new = torch.where(self.seen[ids], (1 - gamma) * old + gamma * g.detach(), g.detach())
            self.u[name][ids] = new
            surrogate = surrogate + (g / (self.eps + new)).mean() / 2
            value = value + torch.log(self.eps + new).mean() / 2
        self.seen[ids] = True
        return surrogate, value


@pytest.mark.parametrize("eps", [1e-14, 0.05])
def test_several_steps_match_a_float64_reference_of_the_papers_formulas(eps):
    n_samples, batch, gamma = 12, 4, 0.6
    reference = Reference(n_samples, gamma, eps)
    estimates = GlobalEstimates(table_size=64, gamma=gamma, eps=eps, dtype=torch.float64).train()
    g = torch.Generator().manual_seed(3)
    for step in range(9):  # three epochs of 3 batches: the second and third use the stored estimates
        if step % 3 == 0:
            order = torch.randperm(n_samples, generator=g)
        ids = order[(step % 3) * batch:(step % 3 + 1) * batch]
        img, txt = _pairs(batch, seed=step, aligned=0.5)
        scale = torch.tensor(7.0 + step, dtype=torch.float64)
        ri, rt, rs = _leaves(img, txt, scale)
        surrogate, value = reference.step(ri, rt, rs, ids)
        surrogate.backward()
        mi, mt, ms = _leaves(img, txt, scale)
        loss = estimates(mi, mt, ms, ids * 5 + 1)  # any ids: slots are id % table_size (here all distinct)
        loss.backward()
        assert loss.item() == pytest.approx(value.item(), rel=1e-12)
        for got, want in ((mi, ri), (mt, rt), (ms, rs)):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-13)
        slots = (ids * 5 + 1) % 64
        torch.testing.assert_close(estimates.log_u_image[slots].exp(), reference.u["image"][ids], rtol=1e-12, atol=0)
        torch.testing.assert_close(estimates.log_u_text[slots].exp(), reference.u["text"][ids], rtol=1e-12, atol=0)
    assert estimates.updates == 9


def test_with_the_batch_estimate_and_eps_one_over_b_minus_one_the_gradients_are_clips():
    """gamma = 1 and eps = 1/(B-1): log(eps + g_i) is InfoNCE - log(B-1), so value and gradients are CLIP's."""
    b = 10
    img, txt = _pairs(b, seed=1, aligned=0.3)
    scale = torch.tensor(20.0, dtype=torch.float64)
    ci, ct, cs = _leaves(img, txt, scale)
    want = clip_loss(ci, ct, cs)
    want.backward()
    gi, gt, gs = _leaves(img, txt, scale)
    unseen = torch.full((b,), -math.inf, dtype=torch.float64)
    got, _, _ = global_contrastive_loss(gi, gt, gs, unseen, unseen, 1.0, 1 / (b - 1))
    got.backward()
    assert got.item() == pytest.approx(want.item() - math.log(b - 1), rel=1e-12)
    for a, r in ((gi, ci), (gt, ct), (gs, cs)):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-10, atol=1e-13)


def _run_loss(img, txt, scale, log_u_i, log_u_t, chunk, **cols):
    li, lt, ls = _leaves(img, txt, scale)
    extra = {}
    if cols:
        ai, at = _leaves(cols["all_image"], cols["all_text"])
        extra = dict(gathered=Gathered(ai, at, offset=cols["offset"], world_size=2))
    loss, new_i, new_t = global_contrastive_loss(li, lt, ls, log_u_i, log_u_t, 0.5, 1e-14, chunk, **extra)
    loss.backward()
    grads = [li.grad, lt.grad, ls.grad] + ([ai.grad, at.grad] if cols else [])
    return loss.detach(), new_i, new_t, grads


@pytest.mark.parametrize("scale", [1.0, 14.3, 100.0])
@pytest.mark.parametrize("aligned", [0.0, 0.9])
def test_tiled_equals_dense_at_every_scale_and_layout(scale, aligned):
    m = 11
    img, txt = _pairs(m, seed=2, aligned=aligned, dtype=torch.float32)
    s = torch.tensor(scale)
    g = torch.Generator().manual_seed(4)
    log_u_i = torch.randn(m, generator=g) * 3
    log_u_t = torch.randn(m, generator=g) * 3
    log_u_i[::4] = -math.inf  # some rows never seen
    dense = _run_loss(img, txt, s, log_u_i, log_u_t, None)
    tiled = _run_loss(img, txt, s, log_u_i, log_u_t, 3)
    torch.testing.assert_close(tiled[0], dense[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(tiled[1:3] + tuple(tiled[3]), dense[1:3] + tuple(dense[3])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert torch.isfinite(a).all()
    # Rows of a split global batch (the distributed layout): each part's loss is the mean over its rows.
    for chunk in (None, 2):
        parts = [(0, 5), (5, 11)]
        total_i = torch.zeros_like(img)
        for lo, hi in parts:
            loss, new_i, new_t, grads = _run_loss(img[lo:hi], txt[lo:hi], s, log_u_i[lo:hi], log_u_t[lo:hi], chunk,
                                                  all_image=img, all_text=txt, offset=lo)
            torch.testing.assert_close(new_i, dense[1][lo:hi], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(new_t, dense[2][lo:hi], rtol=1e-5, atol=1e-6)
            total_i[lo:hi] += grads[0] * (hi - lo) / m
            total_i += grads[3] * (hi - lo) / m
        torch.testing.assert_close(total_i, dense[3][0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 50.0, 100.0])
def test_float32_matches_the_float64_reference_from_scale_1_to_100(scale):
    m = 16
    img, txt = _pairs(m, seed=5, aligned=0.95)
    log_u = torch.randn(m, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 20
    results = {}
    for dtype in (torch.float64, torch.float32):
        li, lt, ls = _leaves(img.to(dtype), txt.to(dtype), torch.tensor(scale, dtype=dtype))
        loss, new_i, _ = global_contrastive_loss(li, lt, ls, log_u.to(dtype), log_u.to(dtype), 0.3, 1e-14, 4)
        loss.backward()
        results[dtype] = (loss.detach().double(), new_i.double(), li.grad.double(), ls.grad.double())
    for a, b in zip(results[torch.float32], results[torch.float64]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4 * float(b.abs().max()) + 1e-6)


def test_bf16_autocast_computes_in_float32():
    m = 9
    img, txt = _pairs(m, seed=7, aligned=0.5, dtype=torch.bfloat16)
    log_u = torch.zeros(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bi, bt = _leaves(img, txt)
        loss, new_i, new_t = global_contrastive_loss(bi, bt, torch.tensor(50.0), log_u, log_u, 0.5, 1e-14, 4)
        loss.backward()
    fi, ft = _leaves(img.float(), txt.float())
    want, want_i, _ = global_contrastive_loss(fi, ft, torch.tensor(50.0), log_u, log_u, 0.5, 1e-14, 4)
    want.backward()
    assert loss.dtype == new_i.dtype == new_t.dtype == torch.float32
    assert bi.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_i, want_i, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bi.grad.float(), fi.grad.bfloat16().float(), rtol=0, atol=0)


def test_gamma_schedules():
    assert gamma_at(0, 0.2) == gamma_at(500, 0.2) == 0.2
    assert gamma_at(0, 0.2, "cosine", 100) == pytest.approx(1.0)
    assert gamma_at(50, 0.2, "cosine", 100) == pytest.approx(0.6)
    assert gamma_at(100, 0.2, "cosine", 100) == gamma_at(1000, 0.2, "cosine", 100) == 0.2
    estimates = GlobalEstimates(table_size=8, gamma=0.2, schedule="cosine", decay_steps=4)
    img, txt = _pairs(4, dtype=torch.float32)
    seen = []
    for _ in range(5):
        seen.append(estimates.current_gamma())
        estimates(img, txt, torch.tensor(10.0), torch.arange(4))
    assert seen == pytest.approx([1.0, 0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2, 0.6,
                                  0.2 + 0.8 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.2])


def test_repeated_slots_keep_the_last_rows_update_and_evaluation_writes_nothing():
    estimates = GlobalEstimates(table_size=4, gamma=0.5, dtype=torch.float64)
    img, txt = _pairs(6, seed=8)
    ids = torch.tensor([1, 5, 2, 9, 3, 7])  # 1, 5, 9 share slot 1; 3 and 7 slot 3
    loss, new_i, new_t = global_contrastive_loss(img, txt, torch.tensor(10.0, dtype=torch.float64),
                                                 torch.full((6,), -math.inf, dtype=torch.float64),
                                                 torch.full((6,), -math.inf, dtype=torch.float64), 1.0, 1e-14)
    estimates(img, txt, torch.tensor(10.0, dtype=torch.float64), ids)
    assert torch.equal(estimates.log_u_image, torch.stack([torch.tensor(-math.inf, dtype=torch.float64),
                                                           new_i[3], new_i[2], new_i[5]]))
    before = {k: v.clone() if torch.is_tensor(v) else dict(v) for k, v in estimates.state_dict().items()}
    estimates.eval()
    estimates(img, txt, torch.tensor(10.0, dtype=torch.float64), ids)
    after = estimates.state_dict()
    assert after["_extra_state"] == before["_extra_state"] == {"updates": 1}
    assert all(torch.equal(before[k], after[k]) for k in ("log_u_image", "log_u_text"))


def test_an_evaluation_loss_needs_no_ids_and_is_infonce_minus_log_b_minus_one():
    """Out of training mode (``eval.val_loss`` scores held-out shards with a fresh objective) the estimates are the
    batch's: with the default eps the term is InfoNCE - log(B - 1), and nothing is written."""
    from mmcl.losses import ContrastiveObjective

    img, txt = _pairs(12, seed=12)
    scale = torch.tensor(30.0, dtype=torch.float64)
    objective = ContrastiveObjective({"clip": 0.0, "global_contrastive": 1.0}, table_size=16).eval()
    total, terms = objective(img, txt, scale)
    assert total.item() == pytest.approx(clip_loss(img, txt, scale).item() - math.log(11), rel=1e-12)
    assert terms["loss/global_contrastive"] == pytest.approx(total.item(), rel=1e-12)
    assert objective.global_estimates.updates == 0 and torch.isneginf(objective.global_estimates.log_u_image).all()
    with pytest.raises(LossInputError, match="sample ids"):
        objective.train()(img, txt, scale)


def test_a_compiled_objective_compiles_once_and_matches_the_eager_one():
    """``train.compile`` compiles the objective: the term runs eagerly inside it, so the per-step gamma of the
    cosine schedule and the update counter do not compile the objective again at every step."""
    from torch._dynamo.testing import CompileCounter

    from mmcl.losses import ContrastiveObjective

    def build():
        return ContrastiveObjective({"clip": 0.5, "global_contrastive": 1.0}, table_size=64, gamma=0.2,
                                    gamma_schedule="cosine", gamma_decay_steps=10)

    torch._dynamo.reset()
    frames = CompileCounter()
    eager, compiled_objective = build(), build()
    compiled = torch.compile(compiled_objective, backend=frames)
    counts = []
    for step in range(6):
        img, txt = _pairs(8, d=16, seed=30 + step, aligned=0.5, dtype=torch.float32)
        ids = torch.randint(0, 40, (8,), generator=torch.Generator().manual_seed(step))
        want = eager(img, txt, torch.tensor(10.0), sample_ids=ids, with_metrics=False)[0]
        got = compiled(img, txt, torch.tensor(10.0), sample_ids=ids, with_metrics=False)[0]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        counts.append(frames.frame_count)
    assert counts[1:] == [counts[0]] * 5, counts
    torch.testing.assert_close(compiled_objective.global_estimates.log_u_image, eager.global_estimates.log_u_image)


def test_bad_arguments_are_loss_input_errors():
    img, txt = _pairs(3, dtype=torch.float32)
    u = torch.zeros(3)
    with pytest.raises(LossInputError, match="gamma"):
        global_contrastive_loss(img, txt, torch.tensor(1.0), u, u, 0.0)
    with pytest.raises(LossInputError, match="shape"):
        global_contrastive_loss(img, txt, torch.tensor(1.0), u[:2], u, 0.5)
    with pytest.raises(LossInputError, match="at least 2"):
        global_contrastive_loss(img[:1], txt[:1], torch.tensor(1.0), u[:1], u[:1], 0.5)
    with pytest.raises(LossInputError, match="sample ids"):
        GlobalEstimates(table_size=4)(img, txt, torch.tensor(1.0), None)


# ------------------------------------------------------------------------------------------------------------------
# libauc (the SogCLR / FastCLIP authors' library), where the definitions coincide
# ------------------------------------------------------------------------------------------------------------------


def test_matches_libauc_bimodal_global_contrastive_loss():
    """libauc's GCLoss_v2 ('bimodal', fixed temperature tau, constant gamma) keeps the same estimates (its u times
    exp(b), b its running shift) and its gradient is (M - 1) * tau times mmcl's with eps = 0. It starts a batch
    whose samples were never seen with gamma = 1 for the whole batch, where mmcl decides per row: the epochs below
    visit every sample once each, so the two rules coincide."""
    from libauc.losses import contrastive  # installed by `make install` (Makefile: without its own requirements)

    n_samples, batch, gamma, tau = 12, 4, 0.7, 0.1
    peer = contrastive.GCLoss_v2(N=n_samples, tau=tau, gamma=gamma, temperature_scheme="global_constant",
                                 gamma_schedule="constant")
    ours = GlobalEstimates(table_size=n_samples, gamma=gamma, eps=0.0).train()
    g = torch.Generator().manual_seed(9)
    for step in range(9):
        if step % 3 == 0:
            order = torch.randperm(n_samples, generator=g)
        ids = order[(step % 3) * batch:(step % 3 + 1) * batch]
        img, txt = _pairs(batch, seed=20 + step, aligned=0.4, dtype=torch.float32)
        pi, pt = _leaves(img, txt)
        peer_loss, _ = peer(pi, pt, ids)
        peer_loss.backward()
        oi, ot = _leaves(img, txt)
        ours(oi, ot, torch.tensor(1 / tau), ids).backward()
        factor = (batch - 1) * tau
        torch.testing.assert_close(oi.grad * factor, pi.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ot.grad * factor, pt.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ours.log_u_image[ids].exp(), (peer.u1[ids] * peer.b1[ids].exp()).reshape(-1),
                                   rtol=1e-4, atol=0)
        torch.testing.assert_close(ours.log_u_text[ids].exp(), (peer.u2[ids] * peer.b2[ids].exp()).reshape(-1),
                                   rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------------------------------------------
# 2 processes = 1
# ------------------------------------------------------------------------------------------------------------------

WORLD, GLOBAL_BATCH, SAMPLES, STEPS = 2, 8, 16, 5


class TinyTowers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Linear(6, 5).double()
        self.text = nn.Linear(7, 5).double()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0), dtype=torch.float64))

    def forward(self, images, texts):
        return F.normalize(self.image(images), dim=1), F.normalize(self.text(texts), dim=1), self.logit_scale.exp()


def _data():
    g = torch.Generator().manual_seed(11)
    images = torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64)
    texts = torch.randn(SAMPLES, 7, generator=g, dtype=torch.float64)
    steps = [torch.randperm(SAMPLES, generator=g)[:GLOBAL_BATCH] for _ in range(STEPS)]
    return images, texts, steps


def _train(wrap, rank, world, chunk):
    raw = TinyTowers()
    model = wrap(raw)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.5)
    estimates = GlobalEstimates(table_size=13, gamma=0.5, schedule="cosine", decay_steps=3,
                                dtype=torch.float64).train()
    images, texts, steps = _data()
    per = GLOBAL_BATCH // world
    losses = []
    for ids in steps:
        mine = ids[rank * per:(rank + 1) * per]
        img, txt, scale = model(images[mine], texts[mine])
        loss = estimates(img, txt, scale, mine * 1000 + 7, gather_batch(img, txt), chunk)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"params": {k: v.detach().clone() for k, v in raw.named_parameters()},
            "estimates": estimates.state_dict(), "losses": torch.stack(losses)}


def _worker(rank, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.save({chunk: _train(DistributedDataParallel, rank, WORLD, chunk) for chunk in (None, 3)},
               f"{path}/rank{rank}.pt")
    end_worker()


@pytest.mark.slow
def test_two_processes_train_to_the_weights_and_estimates_of_one(tmp_path):
    spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    for chunk in (None, 3):
        reference = _train(lambda m: m, 0, 1, chunk)
        for rank in range(WORLD):
            got = torch.load(tmp_path / f"rank{rank}.pt")[chunk]
            for name, value in reference["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=1e-9, atol=1e-12)
            for name, value in reference["estimates"].items():
                torch.testing.assert_close(got["estimates"][name], value, rtol=1e-9, atol=1e-12)
        # each rank's loss is its rows' mean; their mean is the global batch's
        both = [torch.load(tmp_path / f"rank{r}.pt")[chunk]["losses"] for r in range(WORLD)]
        torch.testing.assert_close((both[0] + both[1]) / 2, reference["losses"], rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------------------------------
# In training: sample ids from the shards, estimates in checkpoints, exact resume
# ------------------------------------------------------------------------------------------------------------------

GLOBAL = ["loss.clip=0", "loss.global_contrastive.weight=1.0", "loss.global_contrastive.table_size=4096",
          "loss.global_contrastive.gamma=0.5", "loss.global_contrastive.gamma_schedule=cosine",
          "loss.global_contrastive.gamma_decay_steps=6"]


def _estimates(ckpt):
    from mmcl.storage.checkpoints import load_plain, rank_state_file

    state = load_plain(rank_state_file(ckpt, 0))["objective"]
    return {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("global_estimates.")}


@pytest.mark.slow
def test_a_run_keys_the_estimates_by_sample_and_saves_them(demo, tmp_path):
    from mmcl.config import load_config
    from mmcl.data.pipeline import sample_id
    from mmcl.storage.checkpoints import latest_checkpoint
    from mmcl.training.loop import train

    from helpers import metrics, run_args

    out = tmp_path / "run"
    train(load_config(None, run_args(demo, out, "train.steps=6", "train.save_every=6", "data.batch_size=16",
                                     "data.workers=0", "train.log_every=1", *GLOBAL)[2:]))
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["loss"] == rows[0]["loss/global_contrastive"]
    saved = _estimates(latest_checkpoint(out / "checkpoints"))
    assert saved["_extra_state"] == {"updates": 6}
    # 6 steps x 16 pairs of 768 samples in 4096 slots: at most 96 slots written (fewer where samples share one)
    written = torch.isfinite(saved["log_u_image"])
    assert torch.equal(written, torch.isfinite(saved["log_u_text"])) and 80 <= int(written.sum()) <= 96
    assert sample_id("a/000.tar", "000001") == sample_id("a/000.tar", "000001") != sample_id("b/000.tar", "000001")


def test_gradient_accumulation_gives_the_gradients_and_estimates_of_the_whole_batch():
    """``train.accum_steps``: the micro-batches' sample ids join in the one contrastive problem (GradCache)."""
    from accelerate import Accelerator

    from mmcl.config import GlobalContrastiveConfig, LossConfig
    from mmcl.training.step import backward, forward_loss, objective_from_config

    from helpers import fake_batch, grads_of, micro_model

    batch = dict(fake_batch(12, seed=1), sample_id=torch.tensor([3, 40, 7, 81, 5, 9, 11, 13, 17, 19, 23, 29]))
    halves = [{k: v[:6] for k, v in batch.items()}, {k: v[6:] for k, v in batch.items()}]
    results = []
    for batches in ([batch], halves):
        model = micro_model()
        objective = objective_from_config(LossConfig(clip=0.0, global_contrastive=GlobalContrastiveConfig(
            weight=1.0, gamma=0.3, table_size=32)))
        for _ in range(2):  # the second step divides by the estimates the first one wrote
            model.zero_grad()
            acc = Accelerator(cpu=True)
            loss, terms, cache = forward_loss(model, objective, batches, acc)
            backward(acc, model, loss, batches, cache)
        results.append((terms["loss"], grads_of(model), objective.global_estimates.state_dict()))
    (loss_a, grads_a, est_a), (loss_b, grads_b, est_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)
    assert est_a["_extra_state"] == est_b["_extra_state"] == {"updates": 2}
    assert int(torch.isfinite(est_a["log_u_image"]).sum()) == 11  # ids 81 and 17 share slot 17 of 32
    torch.testing.assert_close(est_b["log_u_image"], est_a["log_u_image"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(est_b["log_u_text"], est_a["log_u_text"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_changed_table_size_is_refused_on_resume(demo, tmp_path):
    from mmcl.config import load_config
    from mmcl.errors import CheckpointError
    from mmcl.training.loop import train

    from helpers import run_args

    out = tmp_path / "run"
    args = ["train.steps=2", "train.save_every=1", "data.batch_size=8", "data.workers=0", *GLOBAL]
    train(load_config(None, run_args(demo, out, *args)[2:]))
    with pytest.raises(CheckpointError, match="table_size changed"):
        train(load_config(None, run_args(demo, out, *args, "train.steps=3", "train.resume=force",
                                         "loss.global_contrastive.table_size=512")[2:]))


@pytest.mark.slow
def test_sigkill_and_resume_gives_the_weights_and_estimates_of_an_uninterrupted_run(demo, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from mmcl.storage.checkpoints import latest_checkpoint

    from helpers import final_weights, run_args

    def launch(out):
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        return subprocess.Popen([sys.executable, "-m", "mmcl", "train", *run_args(demo, out, *common)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    common = ["train.steps=12", "train.save_every=2", "train.keep_checkpoints=2", "data.batch_size=16",
              "data.workers=2", "train.log_every=2", *GLOBAL]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    p = launch(ref)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    p = launch(killed)
    deadline = time.time() + 600
    while latest_checkpoint(killed / "checkpoints") is None and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (killed / "model").exists(), "the run finished before it could be killed"
    p = launch(killed)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert sum("resuming from" in line for line in out.splitlines()) == 1, out
    a, b = final_weights(ref), final_weights(killed)
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    ea, eb = (_estimates(latest_checkpoint(r / "checkpoints")) for r in (ref, killed))
    assert ea["_extra_state"] == eb["_extra_state"] == {"updates": 12}
    for name in ("log_u_image", "log_u_text"):
        assert torch.equal(torch.isfinite(ea[name]), torch.isfinite(eb[name]))
        finite = torch.isfinite(ea[name])
        torch.testing.assert_close(eb[name][finite], ea[name][finite], rtol=1e-5, atol=1e-5)
