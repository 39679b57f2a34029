"""Test-only entry point: `mmcl` under accelerate's FSDP plugin on CPU processes (gloo).

accelerate (1.15) turns a launch with ``distributed_type: FSDP`` into FSDP only for GPU-like devices; on a machine
without one, `AcceleratorState` keeps ``MULTI_CPU`` and the model is silently replicated (DDP). This shim, used by
`tests/e2e/test_distributed_fsdp.py` only, lets `AcceleratorState` finish as usual and then, when the launcher asked
for FSDP, sets the state's distributed type to FSDP with the plugin accelerate built from the launch config. From
there everything is accelerate's own FSDP2 path (`fully_shard`, its state-dict and checkpoint handling). A GPU
user gets the same path from `launch/fsdp.yaml` without any shim.

    accelerate launch --config_file <fsdp cpu config> tests/fsdp_cpu_shim.py train --config ... key=value ...

With ``MMCL_TEST_SLOW_EVAL_S`` set, every evaluation on the main process first sleeps that long (an evaluation
slower than the process group's timeout); with ``MMCL_TEST_REPORT_PRECISION`` set, the main process prints, at
the first forward of training, each FSDP group's mixed-precision policy and the dtype of the logit scale the
model computes (`tests/e2e/test_gpu_path_launch.py`).
"""

import os
import sys


def _patch_accelerate() -> None:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    real_init = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        real_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        wanted = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if wanted and fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":  # what accelerate's FSDP branch does on a GPU
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            # a later AcceleratorState() copies the partial state's type back over its own
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init


def _slow_evaluation(seconds: float) -> None:
    import time

    import mmcl.training.end

    real_run_eval = mmcl.training.end.run_eval

    def run_eval(cfg, model, tokenizer, pp_cfg, accelerator, *rest):
        if accelerator.is_main_process:
            time.sleep(seconds)
        return real_run_eval(cfg, model, tokenizer, pp_cfg, accelerator, *rest)

    mmcl.training.end.run_eval = run_eval


def _report_precision() -> None:
    from torch.distributed.fsdp import FSDPModule

    import mmcl.training.end

    real_forward = mmcl.training.step._forward
    reported = []

    def forward(model, images, texts, *batch):
        out = real_forward(model, images, texts, *batch)
        if not reported and os.environ.get("RANK", "0") == "0":
            reported.append(True)
            for name, module in model.named_modules():
                group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
                if group is not None:
                    policy = group.mp_policy
                    print(f"shim: fsdp group {name or '<root>'}: param_dtype={policy.param_dtype} "
                          f"reduce_dtype={policy.reduce_dtype}", flush=True)
            print(f"shim: logit_scale dtype {out[2].dtype}", flush=True)
        return out

    mmcl.training.step._forward = forward


if __name__ == "__main__":
    _patch_accelerate()
    if os.environ.get("MMCL_TEST_SLOW_EVAL_S"):
        _slow_evaluation(float(os.environ["MMCL_TEST_SLOW_EVAL_S"]))
    if os.environ.get("MMCL_TEST_REPORT_PRECISION"):
        _report_precision()
    if os.environ.get("MMCL_TEST_STOP_AT_STEP"):
        from preempt import sigterm_during_step  # this file's folder is on sys.path when run as a script

        sigterm_during_step(int(os.environ["MMCL_TEST_STOP_AT_STEP"]))
    from mmcl.cli import main

    sys.exit(main(sys.argv[1:]))
