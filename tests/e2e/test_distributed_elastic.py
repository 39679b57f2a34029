"""Resuming on another number of processes: every sample of the epoch under way is read exactly once through the
resize (1 -> 2, 2 -> 1, 2 -> 3, and a second resize before the first one's leftover is done)."""

import warnings

import pytest

from mmcl import data

from helpers import PREPROCESS, cfg_for, tokenizer


def streams(spec, world, states=None):
    out = []
    for rank in range(world):
        s = data.build_train_stream(cfg_for(spec, workers=0), PREPROCESS, tokenizer, seed=3, rank=rank,
                                    world_size=world)
        if states is not None:
            assert s.load_resized(states) is None
        out.append(s)
    return out


def take(stream, n):
    """Keys of the next `n` batches (of one sample each)."""
    keys = []
    it = iter(stream)
    for _ in range(n):
        keys += next(it)["key"]
    it.close()
    return keys


def epoch_keys_after_resizes(spec, worlds, consumed):
    """Run len(worlds) - 1 resizes: world worlds[i] reads consumed[i] batches per process, then saves."""
    seen = []
    current = streams(spec, worlds[0])
    for i, world in enumerate(worlds[1:]):
        for s in current:
            seen += take(s, consumed[i])
        states = [s.state_dict() for s in current]
        current = streams(spec, world, states)
    for s in current:  # the rest of the epoch: the leftover batches of every new process
        it = iter(s)
        while s._positions[0].get("leftover"):
            batch = next(it)
            if s._positions[0].get("leftover"):  # this batch's sample came from the saved run's epoch
                seen += batch["key"]
        it.close()
    return seen


@pytest.mark.parametrize("worlds,consumed", [((1, 2), (7,)), ((2, 1), (5,)), ((2, 3), (4,)), ((1, 2, 1), (7, 3)),
                                             ((3, 2), (2,))])
def test_every_sample_of_the_epoch_once_through_a_resize(corpus, worlds, consumed):
    spec, good, _ = corpus
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the corpus's bad shards
        seen = epoch_keys_after_resizes(spec, worlds, consumed)
    assert len(seen) == len(set(seen)), sorted(k for k in set(seen) if seen.count(k) > 1)
    assert sorted(seen) == sorted(good)


def global_steps(spec, world, batch, steps, states=None):
    """The set of sample keys of each of `steps` global steps of `world` processes with `batch` each, and the
    processes' states after them."""
    procs = []
    for rank in range(world):
        s = data.build_train_stream(cfg_for(spec, workers=0, batch_size=batch), PREPROCESS, tokenizer, seed=3,
                                    rank=rank, world_size=world)
        if states is not None:
            assert s.load_resized(states) is None
        procs.append(s)
    per_step = [set() for _ in range(steps)]
    for s in procs:
        it = iter(s)
        for t in range(steps):
            per_step[t].update(next(it)["key"])
        it.close()
    return per_step, [s.state_dict() for s in procs]


@pytest.mark.parametrize("before,after", [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_without_data_workers_a_resize_keeps_the_samples_of_every_step(demo, before, after):
    """Same global batch (12), no bad samples: after the resize every global step holds the samples the
    uninterrupted run's step holds, up to the end of the epoch (768 samples: 64 steps)."""
    spec = demo["train"]
    reference, _ = global_steps(spec, before, 12 // before, 40)
    head, states = global_steps(spec, before, 12 // before, 15)
    tail, _ = global_steps(spec, after, 12 // after, 25, states)
    assert head + tail == reference
    assert all(len(keys) == 12 for keys in tail)


# ------------------------------------------------------------------------------------------ end to end
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from helpers import ACCELERATE_LAUNCH, ROOT, final_weights, metrics, run_args  # noqa: E402
from spawned import free_port as _free_port  # noqa: E402

# Each process appends the keys of the samples of every step it trains on to keys-<rank>.jsonl.
LOG_KEYS = """\
import json, os, signal, sys
import mmcl.training.loop as train_mod
from mmcl.cli import main

real = train_mod.next_batches


def logged(parts, state, data_iter):
    step = state.progress.step + 1
    if os.environ.get("STOP_AT") == str(step):  # as a scheduler's SIGTERM during this step
        os.kill(os.getpid(), signal.SIGTERM)
    batches = real(parts, state, data_iter)
    with open(os.path.join(os.environ["KEYS_DIR"], f"keys-{parts.accelerator.process_index}.jsonl"), "a") as f:
        f.write(json.dumps([step, [k for b in batches for k in b["key"]]]) + "\\n")
    return batches


train_mod.next_batches = logged
sys.exit(main(sys.argv[1:]))
"""


def launch(script, processes, args, keys_dir, stop_at=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", KEYS_DIR=str(keys_dir))
    if stop_at is not None:
        env["STOP_AT"] = str(stop_at)
    if processes == 1:
        cmd = [sys.executable, str(script), "train", *args]
    else:
        cmd = [*ACCELERATE_LAUNCH, "--config_file",
               str(ROOT / "launch" / "cpu-2proc.yaml"), "--num_processes", str(processes), "--main_process_port",
               str(_free_port()), str(script), "train", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(p, codes=(0,)):
    out, err = p.communicate(timeout=300)
    assert p.returncode in codes, out + err
    return out + err


def steps_and_keys(keys_dir):
    by_step = {}
    for f in sorted(Path(keys_dir).glob("keys-*.jsonl")):
        for line in f.read_text().splitlines():
            step, keys = json.loads(line)
            by_step.setdefault(step, []).extend(keys)
    return by_step


def _common(before):
    return ["train.steps=30", "train.log_every=5", "train.save_every=10", "data.workers=0",
            f"data.batch_size={12 // before}"]


@pytest.fixture(scope="module")
def stopped_runs(demo, tmp_path_factory):
    """For a number of processes `before`: the uninterrupted run's folder and keys, and a run stopped by SIGTERM at
    step 20 (its folder and keys, with a pristine copy of each), made once and shared by the resizes from `before`."""
    made = {}

    def get(before):
        if before not in made:
            root = tmp_path_factory.mktemp(f"before-{before}")
            script = root / "log_keys.py"
            script.write_text(LOG_KEYS)
            ref, out = root / "ref", root / "run"
            for d in ("ref-keys", "keys"):
                (root / d).mkdir()
            reference = launch(script, before, run_args(demo, ref, *_common(before)), root / "ref-keys")
            stopped = launch(script, before, run_args(demo, out, *_common(before)), root / "keys", stop_at=20)
            said = finished(stopped, (75 if before == 1 else 1,))
            assert "preempted (SIGTERM) at step 20" in said, said
            finished(reference)
            for d in ("run", "keys"):
                shutil.copytree(root / d, root / f"{d}.stopped")
            made[before] = root
        root = made[before]
        for d in ("run", "keys"):  # each resize starts from the stopped run as it was left
            shutil.rmtree(root / d)
            shutil.copytree(root / f"{d}.stopped", root / d)
        return root

    return get


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(1, 2), (2, 1), (2, 3)])
def test_a_run_resumed_on_another_number_of_processes_ends_with_the_uninterrupted_weights(stopped_runs, demo,
                                                                                          before, after):
    """Stopped by SIGTERM at step 20 of 30 on `before` processes, resumed on `after`: the per-process batch keeps
    the global batch of 12, steps and samples go on, no sample of the epoch (360 of its 768) is trained on twice,
    and the weights are those of the uninterrupted run on `before` processes (float32 reduction noise: 4e-7 to
    7e-7 measured)."""
    root = stopped_runs(before)
    script, out, ref, keys_dir, ref_keys = (root / "log_keys.py", root / "run", root / "ref", root / "keys",
                                            root / "ref-keys")
    common = _common(before)
    said = finished(launch(script, after, run_args(demo, out, *common), keys_dir))
    assert (f"mmcl: resuming on {after} process(es) a checkpoint written by {before}: data.batch_size "
            f"{12 // before} -> {12 // after} per process, keeping the global batch of 12") in said, said
    assert "resuming from" in said and "at step 20" in said
    rows = metrics(out)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert [r["samples"] for r in rows] == [60, 120, 180, 240, 300, 360]
    by_step = steps_and_keys(keys_dir)
    assert sorted(by_step) == list(range(1, 31))
    assert all(len(keys) == 12 for keys in by_step.values())
    seen = [k for step in sorted(by_step) for k in by_step[step]]
    assert len(seen) == len(set(seen)) == 360  # each sample once: the resize neither repeats nor drops any
    expected = steps_and_keys(ref_keys)
    assert all(sorted(by_step[t]) == sorted(expected[t]) for t in range(1, 31))  # the same samples per step
    a, b = final_weights(ref), final_weights(out)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, worst
