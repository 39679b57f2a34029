"""A preemption at a chosen training step, for the resume tests: ``mmcl.training.step.forward_loss`` is wrapped so
that the process sends itself SIGTERM during its `step`-th call, as a scheduler would during that step."""

import os
import signal


def sigterm_during_step(step: int, monkeypatch=None, rank=None):
    """Wrap ``mmcl.training.step.forward_loss`` (through `monkeypatch` when given, else for the life of the process);
    with `rank`, only the process whose RANK is `rank` is signalled. Returns the real ``forward_loss``."""
    import mmcl.training.step as step_mod

    real, calls = step_mod.forward_loss, [0]

    def signalled(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step and (rank is None or os.environ.get("RANK") == str(rank)):
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    if monkeypatch is not None:
        monkeypatch.setattr(step_mod, "forward_loss", signalled)
    else:
        step_mod.forward_loss = signalled
    return real
