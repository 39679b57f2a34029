"""Small per-step costs: the EMA as a few multi-tensor kernels, the teacher in the student's mixed precision."""

import collections

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mmcl.training.ema import WeightEMA

from helpers import fake_batch, micro_model
from syncwatch import SyncWatch


def test_ema_update_with_a_device_flag_is_a_few_kernels_for_all_tensors():
    """The update after a device-checked step (flag 0: applied, 1: skipped) equals ``lerp`` towards the weights,
    leaves the average untouched on a skipped step, and dispatches a number of ops that does not grow with the
    number of tensors (a per-tensor loop would launch a kernel or two per tensor)."""
    model = micro_model(0)
    ema = WeightEMA(model, 0.75)
    start = {n: t.clone() for n, t in ema.shadow.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    with SyncWatch() as watch:
        ema.update(model, skipped=torch.tensor(0.0))
    assert watch.count == 0, watch.summary()
    assert len(ema.shadow) > 50 and watch.op_count <= 8, watch.op_counts
    params = dict(model.named_parameters())
    for n, avg in ema.shadow.items():
        torch.testing.assert_close(avg, start[n].lerp(params[n].detach(), 0.25), rtol=1e-6, atol=1e-7, msg=n)
    applied = {n: t.clone() for n, t in ema.shadow.items()}
    ema.update(model, skipped=torch.tensor(1.0))  # a skipped step: the average stays exactly as it is
    assert all(torch.equal(ema.shadow[n], applied[n]) for n in applied)
    assert ema.updates == 2


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                                   torch.ops.aten.baddbmm, torch.ops.aten.linear):
            self.dtypes[args[0].dtype if func.overloadpacket is not torch.ops.aten.addmm else args[1].dtype] += 1
        return func(*args, **(kwargs or {}))


def test_the_teacher_runs_in_the_students_mixed_precision_and_returns_float32():
    from accelerate import Accelerator

    from mmcl.evaluation.teacher import Teacher
    from mmcl.training.step import teacher_targets

    model = micro_model(3).eval().requires_grad_(False)
    teacher = Teacher(model, view=None, finish=lambda x: x.float() / 255.0, name="micro")
    b = fake_batch(4, seed=1)
    batch = {"teacher_image": (b["image"].clamp(-2, 2) * 60 + 128).to(torch.uint8), "teacher_text": b["text"]}
    reference = teacher.embed(batch["teacher_image"], batch["teacher_text"])  # float32 throughout
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    with _MatmulDtypes() as seen:
        features = teacher_targets(teacher, [batch], torch.device("cpu"), acc.autocast)
    assert seen.dtypes[torch.bfloat16] > 0 and seen.dtypes[torch.float32] == 0, seen.dtypes
    assert features.image.dtype == features.text.dtype == torch.float32
    # bf16 towers: the same directions to bf16 precision (cosine ~1 - 1e-4), unit norm in float32.
    for got, want in ((features.image, reference.image), (features.text, reference.text)):
        assert F.cosine_similarity(got, want).min() > 0.995
        torch.testing.assert_close(got.norm(dim=1), torch.ones(4), rtol=1e-5, atol=1e-5)
