"""Two gloo processes on CPU, each holding half of a global batch inside DDP, must reproduce one process on the
whole batch: the logged loss terms and every parameter gradient after DDP's averaging. Without a process group,
gather_features returns its inputs."""


import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mmcl.config import LossConfig, MochiConfig
from mmcl.losses import gather_batch, gather_features
from mmcl.training.step import objective_from_config

from helpers import TinyTowers, pair_features
from spawned import end_worker, spawn
from spawned import free_port as _free_port

WORLD = 2
GLOBAL_BATCH = 12
STEPS = 2  # the second step sees the MoCHi queue filled by the first

CONFIGS = {
    "clip_dense": LossConfig(),
    "clip_tiled": LossConfig(chunk_size=5),  # 5 does not divide the 6 local / 12 global rows
    "supcon": LossConfig(clip=0.0, supcon=1.0),
    "supcon_tiled": LossConfig(clip=0.0, supcon=1.0, chunk_size=4),
    "siglip": LossConfig(clip=0.0, siglip=1.0),
    "mochi": LossConfig(clip=0.5, mochi=MochiConfig(weight=1.0, n_hard=5, s=4, s_prime=3, queue_size=9)),
    "mochi_tiled": LossConfig(clip=0.0, chunk_size=4,
                              mochi=MochiConfig(weight=1.0, n_hard=5, s=4, s_prime=3, queue_size=9)),
    "hard_negative_tiled": LossConfig(clip=0.0, hard_negative=1.0, tau_plus=0.1, hn_beta=2.0, chunk_size=5),
    "regularisers": LossConfig(clip=1.0, align=0.3, uniform=0.5, debiased=0.2, hard_negative=0.2, hn_beta=0.5,
                               chunk_size=4),
}


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        labels = torch.randint(-1, 4, (GLOBAL_BATCH,), generator=g)  # repeats and unlabelled pairs
        out.append((torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64),
                    torch.randn(GLOBAL_BATCH, 7, generator=g, dtype=torch.float64), labels))
    return out


def _run(wrap, rank, world):
    """Per config: the logged terms and parameter gradients of each step."""
    results = {}
    per = GLOBAL_BATCH // world
    for name, cfg in CONFIGS.items():
        raw = TinyTowers(with_bias=cfg.siglip > 0)
        wrapped = wrap(raw)
        objective = objective_from_config(cfg)
        objective.reseed(0)
        for step, (images, texts, labels) in enumerate(_batches()):
            rows = slice(rank * per, (rank + 1) * per)
            img, txt, scale, bias = wrapped(images[rows], texts[rows])
            # The caller gathers (None with one process, where the local batch is the global one).
            gathered = gather_batch(img, txt, labels[rows])
            loss, terms = objective(img, txt, scale, bias, labels[rows], gathered=gathered)
            raw.zero_grad()
            loss.backward()
            results[(name, step)] = (terms, {k: p.grad.clone() for k, p in raw.named_parameters()})
    return results


def _worker(rank, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    _check_gather(rank, path)
    torch.save(_run(DistributedDataParallel, rank, WORLD), f"{path}/rank{rank}.pt")
    end_worker()  # only after success: an exception must reach spawn's error file


def _check_gather(rank, path):
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = torch.full((2, 3), float(10 * (rank + 1)), dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([rank, -1])
    all_x, all_y, all_labels, offset = gather_features(x, y, labels)
    # Each rank weights the gathered rows differently; the owner's gradient must be the sum over ranks.
    weight = torch.arange(4, dtype=torch.float64)[:, None] * (rank + 1)
    ((all_x * weight).sum() + (all_y * weight).sum()).backward()
    torch.save({"x": all_x.detach(), "labels": all_labels, "offset": offset, "gx": x.grad, "gy": y.grad},
               f"{path}/gather{rank}.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One 2-process run shared by the tests below (process start-up dominates their cost)."""
    path = tmp_path_factory.mktemp("ranks")
    spawn(_worker, args=(_free_port(), str(path)), nprocs=WORLD)
    return path


def test_two_ranks_match_one_process(spawned):
    reference = _run(lambda m: m, 0, 1)
    for rank in range(WORLD):
        got = torch.load(spawned / f"rank{rank}.pt")
        assert set(got) == set(reference)
        for key, (terms, grads) in reference.items():
            got_terms, got_grads = got[key]
            # Uniformity metrics are per-rank statistics averaged over ranks, not global ones; the losses and the
            # alignment metric (a plain mean over pairs) must be global.
            assert set(got_terms) == set(terms)
            for name, value in terms.items():
                if not name.startswith("uniform_"):
                    # float64 throughout; only summation order and DDP's sum-then-divide differ.
                    assert got_terms[name] == pytest.approx(value, rel=1e-10, abs=1e-12), (key, name)
            for name, grad in grads.items():
                torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-12, msg=f"{key} {name}")


def test_gather_features_sums_gradients_to_the_owner(spawned):
    for rank in range(WORLD):
        got = torch.load(spawned / f"gather{rank}.pt")
        assert got["offset"] == 2 * rank
        assert torch.equal(got["x"][:, 0], torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=torch.float64))
        assert torch.equal(got["labels"], torch.tensor([0, -1, 1, -1]))
        # Row r of the gathered tensor gets weight r * (k + 1) on rank k; summed over k = 0, 1: 3r.
        expected = 3 * torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float64)[:, None].expand(2, 3)
        assert torch.equal(got["gx"], expected) and torch.equal(got["gy"], expected)


def test_gather_features_is_identity_without_process_group():
    img, txt = pair_features(4, 3)
    labels = torch.arange(4)
    a, b, c, offset = gather_features(img, txt, labels)
    assert a is img and b is txt and c is labels and offset == 0
