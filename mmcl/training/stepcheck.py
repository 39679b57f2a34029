"""The finite-loss decision of each optimiser step, kept on the device and read on logged and saved steps only.

Reading a per-step flag on the host (``.item()``) waits for the device on a GPU and, with several processes,
for the all-reduce that makes them agree: a stall on every step. Here each step's flag stays a tensor:

* every process's "this loss is not finite" flag (0 or 1) is reduced to its maximum over the processes on the
  device (one all-reduce of one number, not read), so every process holds the same decision, 0 or 1;
* the fused AdamW takes it as ``found_inf`` (the mechanism of `torch.amp.GradScaler`): where it is 1 the kernel
  leaves the parameters, both moments and the step count exactly as they were, as a skipped step did when it was
  decided on the host. It must be exactly 0 or 1: the kernel skips only on 1 and takes ``found_inf`` off the
  step count, so a count of the non-finite processes (2 where two are poisoned) would apply the step, NaN
  gradients and all, and move the step count back (to 0 and below: NaN from the bias correction next);
* the flags of the steps since the last read are read together on the next logged or saved step
  (`StepChecks.resolve`, one host read), where a non-finite step is counted and reported (``nan_policy=skip``)
  or ends the run (``stop``) before any checkpoint is written.

An optimiser without that mechanism (no fused kernel for the device or dtype, DeepSpeed's), or a loss scaler
(fp16), which sets ``found_inf`` itself, leaves the decision to the host every step (`mmcl.training.loop.agree_on_step`).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .optim import takes_found_inf


class StepChecks:
    """Per-run state: the device-side flags of the steps not yet read."""

    def __init__(self, accelerator, optimizer):
        self.accelerator = accelerator
        self.inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.on_device = takes_found_inf(self.inner) and getattr(accelerator, "scaler", None) is None
        self.pending: List[Tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, flag, loss)

    def not_finite_anywhere(self, loss: torch.Tensor) -> torch.Tensor:
        """A float32 0-d tensor, the same on every process: 1.0 where `loss` is not finite on some process, else
        0.0 (a flag, never a count: see the module's notes on ``found_inf``)."""
        bad = (~torch.isfinite(loss.detach())).reshape(()).to(torch.float32)
        if self.accelerator.num_processes > 1:
            import torch.distributed as dist

            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # in place; nothing is read on the host
        return bad

    def arm(self, loss: torch.Tensor, step: int) -> None:
        """Before this step's backward (device path): the coming optimiser step is skipped where the loss is not
        finite on some process. `step` is the 1-based number of the step."""
        bad = self.not_finite_anywhere(loss)
        self.inner.found_inf = bad
        self.pending.append((step, bad, loss.detach()))

    def resolve(self) -> List[Tuple[int, float]]:
        """The steps since the last call whose loss was not finite on some process, as (step, this process's loss);
        one host read of all their flags."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        flags = torch.stack([flag for _, flag, _ in pending]).tolist()
        return [(step, float(loss)) for (step, _, loss), f in zip(pending, flags) if f > 0]


def stop_requested_anywhere(accelerator, requested: bool) -> bool:
    """Whether a stop signal came to some process. One process reads its own flag (no device involved); several
    agree through one all-reduce (call it on logged and saved steps only)."""
    if accelerator.num_processes == 1:
        return requested
    from .agree import any_process

    return any_process(accelerator, requested)

