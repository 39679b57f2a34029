"""Test-only entry point: `mmcl` under accelerate's FSDP plugin on CPU processes (gloo).

accelerate (1.15) turns a launch with ``distributed_type: FSDP`` into FSDP only for GPU-like devices; on a machine
without one, `AcceleratorState` keeps ``MULTI_CPU`` and the model is silently replicated (DDP). This shim, used by
`tests/test_distributed_fsdp.py` only, lets `AcceleratorState` finish as usual and then, when the launcher asked
for FSDP, sets the state's distributed type to FSDP with the plugin accelerate built from the launch config. From
there everything is accelerate's own FSDP2 path (`fully_shard`, its state-dict and checkpoint handling). A GPU
user gets the same path from `launch/fsdp.yaml` without any shim.

    accelerate launch --config_file <fsdp cpu config> tests/fsdp_cpu_shim.py train --config ... key=value ...
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
            self.fsdp_plugin = fsdp_plugin
            # a later AcceleratorState() copies the partial state's type back over its own
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init


if __name__ == "__main__":
    _patch_accelerate()
    if os.environ.get("MMCL_TEST_STOP_AT_STEP"):
        from preempt import sigterm_during_step  # this file's folder is on sys.path when run as a script

        sigterm_during_step(int(os.environ["MMCL_TEST_STOP_AT_STEP"]))
    from mmcl.cli import main

    sys.exit(main(sys.argv[1:]))
