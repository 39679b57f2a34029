"""A resume continues the random generators the checkpoint holds, or says in one line which it did not."""

import accelerate.checkpointing
import torch
from accelerate.utils import load

from mmcl.config import load_config
from mmcl.run import resume as resume_mod
from mmcl.training.loop import train

from helpers import ROOT, run_args

SHORT = ["train.save_every=2", "train.log_with=[]", "data.workers=0", "data.batch_size=8"]


def _run(demo, out, steps):
    args = run_args(demo, out, f"train.steps={steps}", *SHORT)
    return train(load_config(str(ROOT / "configs" / "tiny.yaml"), args[2:]))


def test_a_resume_restores_the_cpu_generator_exactly(demo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _run(demo, out, 2)
    seen, real = [], resume_mod.generators_not_restored

    def spy(ckpt, index):
        seen.append((torch.get_rng_state().clone(), load(ckpt / f"random_states_{index}.pkl")["torch_manual_seed"]))
        return real(ckpt, index)

    monkeypatch.setattr(resume_mod, "generators_not_restored", spy)
    capsys.readouterr()
    _run(demo, out, 3)
    assert len(seen) == 1 and seen[0][0].equal(seen[0][1])
    assert "not restored" not in capsys.readouterr().out


def test_a_failed_restore_of_the_generators_is_one_warning_line(demo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _run(demo, out, 2)

    real = accelerate.checkpointing.load

    def fail(path, *args, **kwargs):
        if "random_states" in str(path):
            torch.rand(1)  # the generator is not where the checkpoint's is (as after a dropout tower's steps)
            raise RuntimeError("cannot read the random states")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(accelerate.checkpointing, "load", fail)  # accelerate logs the failure at INFO only
    capsys.readouterr()
    _run(demo, out, 3)
    printed = capsys.readouterr().out
    lines = [ln for ln in printed.splitlines() if "not restored" in ln]
    assert len(lines) == 1 and "warning" in lines[0] and "the CPU generator" in lines[0], printed
