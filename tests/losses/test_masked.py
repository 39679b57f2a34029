"""TIPS' masked prediction term (iBOT's form) against a float64 formula written out here, its gradient, micro-batches,
bf16 autocast and the empty outputs of a term before its start."""

import math

import pytest
import torch

from mmcl import losses
from mmcl.losses.masked import masked_losses
from mmcl.losses.self_distill import teacher_targets


def _scores(n=4, m=5, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, m, k, generator=g) * 3, torch.randn(n, m, k, generator=g) * 3, torch.randn(k, generator=g)


def test_each_sample_sums_the_cross_entropy_over_its_masked_patches_in_float64():
    student, teacher, center = _scores()
    targets = teacher_targets(teacher, center, 0.04)
    values = masked_losses(student, targets, student_temp=0.1)
    for i in range(4):
        total = 0.0
        for j in range(5):
            s = [float(v) / 0.1 for v in student[i, j]]
            log_norm = max(s) + math.log(sum(math.exp(v - max(s)) for v in s))
            total -= sum(float(targets[i, j, k]) * (s[k] - log_norm) for k in range(6))
        assert abs(float(values.sums[i]) - total) < 1e-4 * max(1.0, abs(total))
    assert values.counts.tolist() == [5.0] * 4


def test_the_gradient_is_the_student_softmax_minus_the_targets_over_its_temperature():
    student, teacher, center = _scores(seed=1)
    student = student.double().requires_grad_(True)
    targets = teacher_targets(teacher, center, 0.04).double()
    masked_losses(student, targets, 0.1).sums.sum().backward()
    ref = (torch.softmax(student.detach() / 0.1, -1) - targets) / 0.1
    torch.testing.assert_close(student.grad, ref, rtol=1e-4, atol=1e-5)  # the loss's float32 math


def test_micro_batches_joined_equal_the_whole_batch():
    student, teacher, center = _scores(n=6, seed=2)
    targets = teacher_targets(teacher, center, 0.04)
    whole = losses.sample_mean(masked_losses(student, targets))
    joined = losses.joined([masked_losses(student[:2], targets[:2]), masked_losses(student[2:], targets[2:])])
    torch.testing.assert_close(losses.sample_mean(joined), whole)


def test_bf16_autocast_scores_give_the_float32_loss():
    student, teacher, center = _scores(n=4, m=8, k=32, seed=3)
    targets = teacher_targets(teacher, center, 0.04)
    ref = losses.sample_mean(masked_losses(student, targets))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = losses.sample_mean(masked_losses(student.bfloat16(), targets))
    assert got.dtype == torch.float32 and abs(float(got) - float(ref)) < 0.02 * float(ref)  # bf16's 8-bit mantissa


def test_a_term_before_its_start_holds_no_item_and_is_zero():
    empty = torch.zeros(3, 0, 0)
    values = masked_losses(empty, empty)
    assert values.sums.tolist() == [0.0] * 3 and float(losses.sample_mean(values)) == 0.0


def test_the_objective_adds_the_weighted_terms_from_the_model_outputs():
    student, teacher, center = _scores(seed=4)
    targets = teacher_targets(teacher, center, 0.04)
    out = {"masked_student": student, "masked_teacher": targets,
           "self_distill_student": student[:, :2], "self_distill_teacher": targets[:, :1]}
    objective = losses.ContrastiveObjective({"siglip": 0.0, "clip": 1.0, "masked": 0.5, "self_distill": 2.0},
                                            masked_student_temp=0.2, self_distill_student_temp=0.1)
    f = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    total, terms = objective(f, f, torch.tensor(10.0), samples=objective.sample_losses(out))
    masked = losses.sample_mean(masked_losses(student, targets, 0.2))
    sd = losses.sample_mean(losses.self_distill_losses(student[:, :2], targets[:, :1], 0.1))
    torch.testing.assert_close(total, losses.clip_loss(f, f, torch.tensor(10.0)) + 0.5 * masked + 2.0 * sd)
    with pytest.raises(losses.LossInputError, match="masked term needs the model's masked_student"):
        objective.sample_losses({"self_distill_student": student, "self_distill_teacher": targets})


def test_shapes_that_differ_are_a_loss_input_error():
    with pytest.raises(losses.LossInputError):
        masked_losses(torch.randn(2, 3, 4), torch.randn(2, 2, 4))
