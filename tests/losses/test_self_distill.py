"""SILC's self-distillation term (DINO's form) against float64 formulas written out here: the teacher's centred and
sharpened targets, each sample's cross-entropy over its (view, crop) pairs, the centre's update (two gloo processes
equal one), micro-batches and bf16 autocast."""

import math

import pytest
import torch
import torch.distributed as dist

from mmcl import losses
from mmcl.losses.self_distill import next_center, self_distill_losses, teacher_targets

from spawned import end_worker, free_port, spawn


def _scores(n=5, crops=3, views=2, k=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, crops, k, generator=g) * 3, torch.randn(n, views, k, generator=g) * 3, \
        torch.randn(k, generator=g)


def _reference(student, teacher, center, tau_s, tau_t):
    """Each sample's loss as the sum over its views g and crops l of -sum_k p_t[g,k] log p_s[l,k], float64 loops."""
    out = []
    for i in range(student.shape[0]):
        total = 0.0
        for g in range(teacher.shape[1]):
            z = [(float(teacher[i, g, k]) - float(center[k])) / tau_t for k in range(teacher.shape[2])]
            zmax = max(z)
            e = [math.exp(v - zmax) for v in z]
            p = [v / sum(e) for v in e]
            for c in range(student.shape[1]):
                s = [float(student[i, c, k]) / tau_s for k in range(student.shape[2])]
                smax = max(s)
                log_norm = smax + math.log(sum(math.exp(v - smax) for v in s))
                total -= sum(p[k] * (s[k] - log_norm) for k in range(len(s)))
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def test_each_sample_sums_the_cross_entropy_of_its_crops_against_its_centred_sharpened_views():
    student, teacher, center = _scores()
    targets = teacher_targets(teacher.double(), center.double(), 0.04)
    values = self_distill_losses(student.double(), targets, student_temp=0.1)
    ref = _reference(student.double(), teacher.double(), center.double(), 0.1, 0.04)
    torch.testing.assert_close(values.sums.double(), ref, rtol=1e-5, atol=1e-4)  # float32 math inside
    assert values.counts.tolist() == [6.0] * 5  # 2 views x 3 crops
    assert abs(float(losses.sample_mean(values)) - float(ref.sum() / 30)) < 1e-4


def test_the_targets_are_a_centred_sharpened_softmax_without_gradient():
    _, teacher, center = _scores(seed=1)
    teacher = teacher.requires_grad_(True)
    p = teacher_targets(teacher, center, 0.07)
    assert not p.requires_grad and p.dtype == torch.float32
    ref = torch.softmax((teacher.detach().double() - center.double()) / 0.07, dim=-1)
    torch.testing.assert_close(p.double(), ref, rtol=1e-5, atol=1e-6)


def test_the_gradient_is_the_student_softmax_minus_the_targets_over_its_temperature():
    student, teacher, center = _scores(n=3, crops=2, views=1, seed=2)
    student = student.double().requires_grad_(True)
    targets = teacher_targets(teacher, center, 0.04).double()
    self_distill_losses(student, targets, 0.1).sums.sum().backward()
    # d/ds of -sum_k p_k log softmax(s/tau)_k = (softmax(s/tau) - p) / tau, summed over the views
    ref = (torch.softmax(student.detach() / 0.1, dim=-1) * targets.sum(1, keepdim=True).sum(-1, keepdim=True)
           - targets.sum(1, keepdim=True)) / 0.1
    torch.testing.assert_close(student.grad, ref, rtol=1e-4, atol=1e-4)


def test_micro_batches_joined_equal_the_whole_batch_and_its_gradient():
    student, teacher, center = _scores(n=8, seed=3)
    targets = teacher_targets(teacher, center, 0.04)
    whole = student.clone().requires_grad_(True)
    losses.sample_mean(self_distill_losses(whole, targets)).backward()
    parts = [student[:3].clone().requires_grad_(True), student[3:].clone().requires_grad_(True)]
    joined = losses.joined([self_distill_losses(parts[0], targets[:3]), self_distill_losses(parts[1], targets[3:])])
    losses.sample_mean(joined).backward()
    torch.testing.assert_close(torch.cat([p.grad for p in parts]), whole.grad)


def test_bf16_autocast_scores_give_the_float32_loss():
    student, teacher, center = _scores(n=6, k=32, seed=4)
    targets = teacher_targets(teacher, center, 0.04)
    ref = losses.sample_mean(self_distill_losses(student, targets))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = losses.sample_mean(self_distill_losses(student.bfloat16(), targets))
    assert got.dtype == torch.float32
    # the scores rounded to bf16 (8 bits of mantissa), over tau_s = 0.1: about 1 % of a loss of this size
    assert abs(float(got) - float(ref)) < 0.02 * float(ref)


def test_the_centre_moves_by_the_batch_mean_and_a_skipped_step_leaves_it():
    center = torch.tensor([1.0, -1.0, 0.5])
    scores = torch.tensor([[2.0, 0.0, 1.0], [0.0, 2.0, 3.0]])
    got = next_center(center, scores.sum(0), torch.tensor(2.0), momentum=0.9)
    torch.testing.assert_close(got, 0.9 * center + 0.1 * scores.mean(0))
    kept = next_center(center, scores.sum(0), torch.tensor(2.0), 0.9, weight=torch.tensor(0.0))
    assert torch.equal(kept, center)


def test_bad_shapes_are_a_loss_input_error():
    with pytest.raises(losses.LossInputError):
        self_distill_losses(torch.randn(2, 3, 4), torch.randn(2, 1, 5))


WORLD = 2


def _center_worker(rank, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    scores = torch.arange(24, dtype=torch.float32).reshape(6, 4).sin()
    center = torch.linspace(-1, 1, 4)
    mine = scores[rank * 3:(rank + 1) * 3]
    torch.save(next_center(center, mine.sum(0), torch.tensor(3.0), 0.9, world_size=WORLD), f"{path}/c{rank}.pt")
    end_worker()


def test_two_processes_move_the_centre_as_one_with_the_whole_batch(tmp_path):
    spawn(_center_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    scores = torch.arange(24, dtype=torch.float32).reshape(6, 4).sin()
    center = torch.linspace(-1, 1, 4)
    one = next_center(center, scores.sum(0), torch.tensor(6.0), 0.9)
    for rank in range(WORLD):
        torch.testing.assert_close(torch.load(tmp_path / f"c{rank}.pt"), one, rtol=0, atol=1e-7)
