"""The trackers of `train.log_with` through accelerate: TensorBoard, wandb (offline) and MLflow (a local file
store) hold the logged scalars, an unknown or missing tracker is one clear error, and a run stopped by a signal
closes its trackers."""

import pytest

from mmcl.config import load_config

from helpers import metrics, run_args
from preempt import sigterm_during_step


def _run_with(demo, out, trackers, *extra):
    from mmcl.cli import main

    args = run_args(demo, out, "train.steps=4", "data.batch_size=8", "train.log_every=2", "train.save_every=0",
                    "data.workers=0", f"train.log_with=[{', '.join(trackers)}]", *extra)
    assert main(["train", *args]) == 0
    return metrics(out)


def test_tensorboard_tracker_through_accelerate_holds_the_scalars(demo, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    rows = _run_with(demo, out, ["tensorboard"])
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for key in ("loss", "lr", "logit_scale"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows], key
    # the resolved config as hyperparameters
    hparams = list((out / "tensorboard").glob("*/hparams.yml"))
    assert len(hparams) == 1 and "optim.lr: 0.001" in hparams[0].read_text()


def test_unknown_or_missing_tracker_is_one_clear_error():
    from mmcl.errors import ConfigError
    from mmcl.run.records import accelerator_kwargs

    with pytest.raises(ConfigError, match="train.log_with: unknown tracker"):
        load_config(None, ["train.log_with=[tensorbored]"])
    import importlib.util

    for name in ("wandb", "mlflow", "aim"):
        if importlib.util.find_spec(name) is None:
            with pytest.raises(ConfigError, match=f"{name} is not installed"):
                accelerator_kwargs([name], ".")


def _wandb_records(path):
    """The protobuf records of an offline run's ``run-*.wandb`` file: a 7-byte header, then LevelDB-log blocks of
    32 KiB holding records with a 7-byte header each (CRC-32, length, type: full, first, middle, last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunks, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        chunks = payload if kind in (1, 2) else chunks + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            out.append(record)
    return out


def test_wandb_offline_run_directory_holds_the_scalars(demo, tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")  # track.project unset: the environment's
    monkeypatch.setenv("WANDB_TAGS", "env-tag")  # track.tags set: the key's
    out = tmp_path / "run"
    rows = _run_with(demo, out, ["wandb"], "track.run_name=tiny-b8", "track.tags=[tiny, demo]",
                     "track.notes='a first try'")
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, sorted(p.name for p in (out / "wandb").iterdir())
    records = _wandb_records(runs[0])
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history.setdefault(r.history.step.num, {}).update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    assert sorted(history) == [r["step"] for r in rows] == [2, 4]
    for r in rows:
        for key in ("loss", "lr", "logit_scale", "samples"):
            assert history[r["step"]].get(key) == pytest.approx(r[key], rel=1e-9), (r["step"], key, history)
    config = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for r in records
              if r.WhichOneof("record_type") == "config"
              for u in r.config.update}
    assert config["optim.lr"] == 0.001 and config["train.log_with"] == "['wandb']"  # the resolved config
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, list(run.tags), run.notes) == (
        "from-the-environment", "tiny-b8", ["tiny", "demo"], "a first try")


def test_mlflow_local_file_store_holds_the_scalars(demo, tmp_path, monkeypatch):
    import yaml

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TAGS"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    rows = _run_with(demo, out, ["mlflow"], "track.project=clip-sweep", "track.run_name=tiny-b8",
                     "track.tags=[tiny]", "track.notes='a first try'")
    files = list((out / "mlruns").glob("*/*/metrics/loss"))
    assert len(files) == 1, list((out / "mlruns").rglob("*"))[:20]
    logged = [(int(ln.split()[2]), float(ln.split()[1])) for ln in files[0].read_text().splitlines()]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    run = files[0].parent.parent
    assert (run / "params" / "optim.lr").read_text() == "0.001"
    assert yaml.safe_load((run.parent / "meta.yaml").read_text())["name"] == "clip-sweep"
    assert yaml.safe_load((run / "meta.yaml").read_text())["run_name"] == "tiny-b8"
    assert [(run / "tags" / t).read_text() for t in ("tiny", "mlflow.note.content")] == ["true", "a first try"]


def test_a_run_stopped_by_a_signal_closes_its_trackers(demo, tmp_path, monkeypatch, capsys):
    """SIGTERM at step 3 (a preemption): the trackers are closed before the run stops. TensorBoard's events hold
    every logged step, and the MLflow run is marked KILLED with an end time instead of staying RUNNING forever;
    the resumed run finishes and its own MLflow run is FINISHED."""
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import mmcl.training.step as step_mod
    from mmcl.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    real = sigterm_during_step(3, monkeypatch)
    out = tmp_path / "run"
    args = run_args(demo, out, "train.steps=5", "data.batch_size=8", "train.log_every=1", "train.save_every=0",
                    "data.workers=0", "train.log_with=[tensorboard, mlflow]")
    assert main(["train", *args]) == 75
    assert "preempted (SIGTERM) at step 3" in capsys.readouterr().err
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [r["step"] for r in metrics(out)] == [1, 2, 3]

    def statuses():
        metas = [yaml.safe_load(p.read_text()) for p in (out / "mlruns").glob("*/*/meta.yaml")]
        return sorted((m["status"], m["end_time"] is not None) for m in metas)

    from mlflow.entities import RunStatus

    assert statuses() == [(RunStatus.KILLED, True)]
    monkeypatch.setattr(step_mod, "forward_loss", real)
    assert main(["train", *args]) == 0
    assert statuses() == sorted([(RunStatus.KILLED, True), (RunStatus.FINISHED, True)])
