"""The losses on the GPU path, checked on CPU: exact under mixed precision, no host sync, few ops per tiled step.

Mixed precision: training computes the objective inside ``accelerator.autocast()``; every loss and every term of
`ContrastiveObjective`, dense and tiled, must give its float32 value and gradients there, for float32 and bf16
features, at every logit scale and alignment.

Host syncs: `SyncWatch` (tests/syncwatch.py) sees every data-dependent op and blocking copy through the
dispatcher, on CPU as on a GPU; one forward+backward of each loss records none.
"""

from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F

from mmcl import losses
from mmcl.losses import (
    ContrastiveObjective,
    Gathered,
    TeacherFeatures,
    align_loss,
    clip_loss,
    debiased_clip_loss,
    distill_loss,
    hard_negative_clip_loss,
    infonce_rows,
    logsumexp_rows,
    mochi_loss,
    siglip_loss,
    supcon_loss,
    tiling,
    uniform_loss,
)

from syncwatch import SyncWatch

pytestmark = [pytest.mark.gpu_path, pytest.mark.usefixtures("cpu_device")]  # the same with a GPU


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: one thread avoids the thread pool's barriers, which dominate on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _features(n: int, d: int, aligned: bool, seed: int = 0):
    """(image, text, teacher image, teacher text) float32, L2-normalised; aligned pairs have cosine ~0.99 (a
    trained model: at scale 100 every negative's softmax entry is far below its positive's)."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, d, generator=g, dtype=torch.float64)
    noise = 0.1 if aligned else 0.7
    txt = img + noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    t_img = img + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    t_txt = txt + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    return tuple(F.normalize(x, dim=1).float() for x in (img, txt, t_img, t_txt))


def _labels(n: int) -> torch.Tensor:
    labels = torch.arange(n) % max(2, n // 3)  # classes of about three pairs
    labels[::5] = -1  # and some unlabelled pairs
    return labels


def _cases(n: int, chunk, extra: Dict) -> Dict[str, Callable]:
    """name -> loss(img, txt, scale, bias): every loss function and every term of the objective. ``extra`` holds the
    fixed tensors of a batch (teacher features, queues) so that each case is a function of the learned inputs."""
    labels, t_img, t_txt, q_img, q_txt = (extra[k] for k in ("labels", "t_img", "t_txt", "q_img", "q_txt"))
    half = n // 2

    def gen():
        return torch.Generator().manual_seed(3)

    cases = {
        "clip": lambda i, t, s, b: clip_loss(i, t, s, chunk),
        "clip_gathered": lambda i, t, s, b: clip_loss(i[half:], t[half:], s, chunk,
                                                      gathered=Gathered(i, t, offset=half)),
        "infonce_rows": lambda i, t, s, b: infonce_rows(i[:half], t, s, 0, chunk).mean(),
        "logsumexp_rows": lambda i, t, s, b: sum(x.mean() for x in logsumexp_rows(i, t, s, chunk, with_cols=True)),
        "supcon": lambda i, t, s, b: supcon_loss(i, t, labels, s, chunk),
        "supcon_gathered": lambda i, t, s, b: supcon_loss(i[:half], t[:half], labels[:half], s, chunk,
                                                          gathered=Gathered(i, t, all_labels=labels)),
        "siglip": lambda i, t, s, b: siglip_loss(i, t, s, b, chunk_size=chunk),
        "siglip_gathered": lambda i, t, s, b: siglip_loss(i[half:], t[half:], s, b,
                                                          gathered=Gathered(None, t, offset=half), chunk_size=chunk),
        "debiased": lambda i, t, s, b: debiased_clip_loss(i, t, s, 0.1, chunk),
        "hard_negative": lambda i, t, s, b: hard_negative_clip_loss(i, t, s, 0.1, 1.0, chunk),
        "hard_negative_gathered": lambda i, t, s, b: hard_negative_clip_loss(
            i[:half], t[:half], s, 0.1, 1.0, chunk, gathered=Gathered(i, t)),
        "mochi": lambda i, t, s, b: mochi_loss(i, t, s, 8, 4, 3, 0.5, gen(), chunk_size=chunk),
        "mochi_queue": lambda i, t, s, b: mochi_loss(i, t, s, 8, 4, 3, 0.5, gen(), q_img, q_txt, chunk_size=chunk),
        "distill": lambda i, t, s, b: distill_loss(i, t, s, t_img, t_txt, torch.tensor(30.0), chunk),
        "align": lambda i, t, s, b: align_loss(i, t) + align_loss(i, t, alpha=1.5),
        "uniform": lambda i, t, s, b: uniform_loss(i) + uniform_loss(t),
    }

    def term(name):
        def run(i, t, s, b):
            obj = ContrastiveObjective({name: 1.0}, chunk_size=chunk, n_hard=8, s=4, s_prime=3,
                                       queue_size=2 * n if name == "mochi" else 0, table_size=4 * n)
            if name == "mochi":  # a queue already holding past features
                obj.image_queue.enqueue(q_img)
                obj.text_queue.enqueue(q_txt)
            teacher = TeacherFeatures(t_img, t_txt, torch.tensor(30.0))
            total, logged = obj(i, t, s, b, labels=labels, teacher=teacher, with_metrics=False,
                                sample_ids=torch.arange(n), short_text=t_txt)
            return total
        return run

    # The terms of the features (the sample terms read a model's outputs: their bf16 and host-sync tests are in
    # tests/training/test_caption_training.py, tests/losses/test_self_distill.py, test_masked.py and
    # tests/training/test_no_stalls.py).
    feature_terms = [name for name in losses.TERMS if name not in losses.SAMPLE_TERMS]
    for name in feature_terms:
        cases[f"objective_{name}"] = term(name)
    cases["objective_all_with_metrics"] = lambda i, t, s, b: ContrastiveObjective(
        {name: 1.0 for name in feature_terms}, chunk_size=chunk, n_hard=8, s=4, s_prime=3, queue_size=2 * n,
        table_size=4 * n)(i, t, s, b, labels=labels, teacher=TeacherFeatures(t_img, t_txt, torch.tensor(30.0)),
                          sample_ids=torch.arange(n), short_text=t_txt)[0]
    return cases


N, D, CHUNK = 24, 16, 7  # chunk 7 of 24: a partial last tile
_EXTRA = None


def _extra(n: int, d: int, aligned: bool):
    img, txt, t_img, t_txt = _features(n, d, aligned)
    q_img, q_txt, _, _ = _features(n + 5, d, aligned, seed=1)
    return img, txt, dict(labels=_labels(n), t_img=t_img, t_txt=t_txt, q_img=q_img, q_txt=q_txt)


def _run(fn, img, txt, scale, bias, dtype, autocast: bool):
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (img, txt)]
    s = torch.tensor(scale, requires_grad=True)
    b = torch.tensor(-5.0, requires_grad=True)
    if autocast:
        with torch.autocast("cpu", torch.bfloat16):
            value = fn(leaves[0], leaves[1], s, b)
            value.backward()  # backward inside autocast too: the strictest caller
    else:
        value = fn(leaves[0], leaves[1], s, b)
        value.backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (*leaves, s, b)]
    return value.detach(), grads


CASE_NAMES = list(_cases(N, None, _extra(N, D, False)[2]))


@pytest.mark.parametrize("chunk", [None, CHUNK], ids=["dense", "tiled"])
@pytest.mark.parametrize("scale,aligned", [(1.0, False), (14.3, False), (50.0, False), (100.0, False),
                                           (14.3, True), (100.0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_loss_under_bf16_autocast_equals_float32(dtype, scale, aligned, chunk, monkeypatch):
    """Under ``torch.autocast("cpu", torch.bfloat16)`` (forward and backward), every loss and term gives its float32
    value and the float32 gradients of features, scale and bias; bf16 features are compared with float32 features
    holding the same values (their gradients are bf16: compared to the float32 gradient rounded to bf16)."""
    monkeypatch.setattr(losses.tiling, "_TILE_ELEMENTS", 5 * CHUNK)  # several column tiles per row block
    img, txt, extra = _extra(N, D, aligned)
    img, txt = img.to(dtype).float(), txt.to(dtype).float()  # values representable in bf16 for both runs
    failures = []
    for name, fn in _cases(N, chunk, extra).items():
        want, want_grads = _run(fn, img, txt, scale, None, torch.float32, autocast=False)
        try:
            got, got_grads = _run(fn, img, txt, scale, None, dtype, autocast=True)
        except RuntimeError as e:  # reported with the others: which losses crash under autocast
            failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        assert torch.isfinite(want), name
        if got.dtype != torch.float32:
            failures.append(f"{name}: value in {got.dtype}")
        if not torch.allclose(got.float(), want, rtol=2e-6, atol=1e-6):
            failures.append(f"{name}: value {got.item()} != {want.item()}")
        for which, g, w in zip(("image", "text", "scale", "bias"), got_grads, want_grads):
            tol = dict(rtol=2e-6, atol=1e-6 * float(w.abs().max()) + 1e-9)
            if g.dtype == torch.bfloat16:  # the float32 gradient rounded once to bf16: within one bf16 ulp
                w, tol = w.to(torch.bfloat16).float(), dict(rtol=2 ** -7, atol=2 ** -7 * float(w.abs().max()))
            if not torch.allclose(g.float(), w, **tol):
                err = float((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-30))
                failures.append(f"{name}: d/d{which} off by {err:.2e} (relative to its largest entry)")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------- host syncs


def test_syncwatch_records_each_kind_of_sync_and_counts_backward_ops():
    """The watch itself: every data-dependent op, blocking cross-device copy and host read is recorded once, with
    the line that caused it (the backward of a boolean index, too); shape-static ops are not."""
    x = torch.randn(8, 4, requires_grad=True)
    with SyncWatch() as w:
        y = x * 2
        mask = y > 0
        picked = y[mask].sum()  # 1: index with a bool mask (and 1 more in its backward)
        picked.detach().item()  # 2
        torch.nonzero(mask)  # 3
        torch.unique(mask)  # 4
        torch.equal(x, x)  # 5
        torch.masked_select(y, mask)  # 6
        torch.repeat_interleave(torch.arange(3))  # 7: output size from the data
        torch.repeat_interleave(y, torch.full((8,), 2), dim=0, output_size=16)  # static: not recorded
        y.detach().to("meta")  # 8: a copy to another device, blocking
        y.detach().to("meta", non_blocking=True)  # not recorded
        y.detach().tolist()  # 9
        static = torch.where(mask, y, 0).sum() + y.diagonal().sum() + y[torch.arange(2)].sum()  # none
        ops_before_backward = w.op_count
        (picked + static).backward()  # 10: the bool-index backward (index_put)
    names = [name for name, _ in w.events]
    assert w.count == 10, w.summary()
    assert names.count("aten.index.Tensor") == 1 and names.count("aten.index_put.default") == 1, w.summary()
    assert {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten._unique2.default", "aten.equal.default",
            "aten.masked_select.default", "aten.repeat_interleave.Tensor", "aten._to_copy.default",
            "Tensor.tolist"} <= set(names), w.summary()
    assert all("test_gpu_path_losses.py" in where for _, where in w.events), w.summary()
    assert w.op_count > ops_before_backward + 3  # backward's ops are counted
    assert w.op_count == sum(w.op_counts.values())
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the wrapper is gone after the block


SYNC_N, SYNC_CHUNK = 512, 64


@pytest.mark.parametrize("n,chunk", [(128, None), (SYNC_N, SYNC_CHUNK)], ids=["dense", "tiled"])
def test_no_host_sync_in_any_loss(n, chunk):
    """One forward+backward of every loss and objective term at N = 512 with chunk_size 64 (dense: N = 128, its ops
    do not depend on N) dispatches no data-dependent op, blocking copy or host read. (Before: 16 in the tiled
    InfoNCE, 24 in the tiled SigLIP, 10 in SupCon.) The objective with its logged numbers (a logged step) reads
    them on the host once."""
    img, txt, extra = _extra(n, 16, aligned=False)
    found = {}
    for name, fn in _cases(n, chunk, extra).items():
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        s, b = torch.tensor(14.3, requires_grad=True), torch.tensor(-5.0, requires_grad=True)
        with SyncWatch() as w:
            value = fn(leaves[0], leaves[1], s, b)
            value.backward()
        assert torch.isfinite(value)
        expected = 1 if name == "objective_all_with_metrics" else 0
        if w.count != expected:
            found[name] = w.summary()
    assert not found, "\n".join(f"{name}:\n{summary}" for name, summary in found.items())


def test_objective_logged_step_reads_its_numbers_once():
    """The one host read the objective makes is on logged steps (``with_metrics=True``): the logged numbers, in a
    single ``tolist``; without metrics the terms stay on the device."""
    img, txt, extra = _extra(64, 16, aligned=False)
    obj = ContrastiveObjective({"clip": 1.0, "supcon": 0.5, "uniform": 0.1}, chunk_size=16)
    for with_metrics, expected in ((True, ["Tensor.tolist"]), (False, [])):
        with SyncWatch() as w:
            total, terms = obj(img, txt, torch.tensor(14.3), labels=extra["labels"], with_metrics=with_metrics)
        assert [name for name, _ in w.events] == expected, w.summary()
        assert isinstance(terms["loss/clip"], float) == with_metrics


# ---------------------------------------------------------------------------------------------- tile sizes


def test_tile_elements_per_device():
    """CPU tiles stay cache-sized; GPU tiles grow with the memory, within [2^24, 2^28]."""
    assert tiling.tile_elements(torch.device("cpu")) == 1 << 22
    assert tiling.cuda_tile_elements(80 * 10 ** 9) == 1 << 28  # H100 80 GB
    assert tiling.cuda_tile_elements(24 * 10 ** 9) == 1 << 26
    assert tiling.cuda_tile_elements(4 * 10 ** 9) == 1 << 24
    assert tiling.cuda_tile_elements(10 ** 15) == 1 << 28
    assert tiling.tile_width(1024, 262144, torch.device("cpu")) == 4096
    assert tiling.tile_width(64, 100, torch.device("cpu")) == 100


def test_ops_per_tiled_step_at_32k_per_gpu_on_8_gpus_with_the_gpu_tile(monkeypatch):
    """Dispatched ops (each a kernel launch at most) of one tiled InfoNCE forward+backward of one rank at 32k rows
    per GPU x 8 GPUs, chunk_size 1024, with the tile of an 80 GB GPU, counted at full size on the meta device (no
    memory, no arithmetic: the same ops). The CPU's 2^22-logit tile needed ~195k ops here (2,048 tiles per pass);
    the GPU's tile holds whole rows, 32 tiles per pass."""
    monkeypatch.setattr(tiling, "_TILE_ELEMENTS", tiling.cuda_tile_elements(80 * 10 ** 9))
    n, world, d = 32768, 8, 512
    q = [torch.empty(n, d, device="meta", requires_grad=True) for _ in range(2)]
    k = [torch.empty(n * world, d, device="meta", requires_grad=True) for _ in range(2)]
    s = torch.empty((), device="meta", requires_grad=True)
    with SyncWatch() as w:
        clip_loss(q[0], q[1], s, 1024, gathered=Gathered(k[0], k[1], offset=3 * n)).backward()
    assert w.count == 0, w.summary()
    assert w.op_count <= 5000, w.op_count  # 4,361 measured
