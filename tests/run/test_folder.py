"""A run folder means one run: a new or empty folder starts it, the same run resumes, a finished run re-run changes
nothing, another run or files mmcl did not write are refused; config.yaml keeps the config the weights were trained
with; the end-of-run summary and out.log; the docs' and the demo's folders."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from mmcl.cli import main
from mmcl.config import load_config, to_dict
from mmcl.errors import ConfigError

from helpers import short_run

ROOT = Path(__file__).resolve().parents[2]


def snapshot(folder: Path):
    """Every entry under `folder` with its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def metric_steps(out: Path):
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def finished(small_demo, tmp_path_factory):
    """A finished 2-step run, and what its first invocation printed."""
    import io
    from contextlib import redirect_stdout

    out = tmp_path_factory.mktemp("finished") / "run"
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(short_run(small_demo, out, zeroshot=small_demo["zeroshot_colour"])) == 0
    return out, buf.getvalue()


@pytest.mark.slow
def test_a_finished_run_rerun_says_so_and_touches_nothing(small_demo, finished, capsys):
    out, _ = finished
    before = snapshot(out)
    assert main(short_run(small_demo, out, zeroshot=small_demo["zeroshot_colour"])) == 0
    said = capsys.readouterr().out
    assert "finished at step 2 of 2" in said and "nothing was changed" in said, said
    assert snapshot(out) == before  # bytes and mtimes of metrics.jsonl, config.yaml, out.log, ... and no new entry
    assert metric_steps(out) == [1, 2]


@pytest.mark.slow
def test_another_run_in_the_folder_is_refused_naming_the_differences(small_demo, finished, capsys):
    out, _ = finished
    before = snapshot(out)
    code = main(short_run(small_demo, out, "train.steps=3", "optim.lr=5e-4", "data.batch_size=4",
                          zeroshot=small_demo["zeroshot_colour"]))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds another run (step 2)" in err and "optim.lr 0.001 -> 0.0005" in err, err
    assert "data.batch_size 8 -> 4" in err and "train.steps" not in err, err  # train.steps may change on resume
    assert "another train.output_dir" in err and "train.resume=force" in err, err
    assert snapshot(out) == before


@pytest.mark.slow
def test_resume_keeps_config_yaml_and_writes_no_metrics_line_twice(small_demo, finished, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    config = (out / "config.yaml").read_bytes()
    assert main(short_run(small_demo, out, "train.steps=3", "eval.zeroshot=null",
                          zeroshot=small_demo["zeroshot_colour"])) == 0  # resume keys only
    said = capsys.readouterr().out
    assert "holds this run (step 2 of 3): resuming it; changed on resume: " in said, said
    assert "train.steps 2 -> 3" in said and "eval.zeroshot" in said
    assert (out / "config.yaml").read_bytes() == config  # the config the weights were trained with
    assert metric_steps(out) == [1, 2, 3]
    log = (out / "out.log").read_text()
    assert log.count("--- mmcl train") == 2 and "resuming it" in log  # appended on resume
    # Forced on with another learning rate: config.yaml records the config the weights are trained with from there.
    assert main(short_run(small_demo, out, "train.steps=4", "optim.lr=5e-4", "train.resume=force",
                          zeroshot=small_demo["zeroshot_colour"])) == 0
    said = capsys.readouterr().out
    assert "train.resume=force, resuming despite: optim.lr 0.001 -> 0.0005" in said, said
    assert load_config(str(out / "config.yaml")).optim.lr == 5e-4
    assert metric_steps(out) == [1, 2, 3, 4]


def test_a_folder_with_files_mmcl_did_not_write_is_refused(small_demo, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    for name, text in (("config.yaml", "mine: 1\n"), ("param_groups.json", "[]\n"), ("metrics.jsonl", "{}\n")):
        (out / name).write_text(text)
    before = snapshot(out)
    for extra in ((), ("train.resume=force",)):
        assert main(short_run(small_demo, out, *extra, zeroshot=small_demo["zeroshot_colour"])) == 2
        err = capsys.readouterr().err
        assert "holds files mmcl train did not write (config.yaml, metrics.jsonl, param_groups.json)" in err, err
        assert "nothing was changed" in err and "another train.output_dir" in err
        assert snapshot(out) == before


def test_a_folder_of_another_mmcl_command_is_refused(tmp_path):
    from mmcl.run.folder import decide

    (tmp_path / "mmcl-manifest.json").write_text(json.dumps({"command": "demo-data", "files": []}))
    cfg = load_config(None, [f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="holds the output of mmcl demo-data"):
        decide(to_dict(cfg), 1, 10)


def test_an_empty_folder_or_one_with_a_lock_alone_starts_a_run(tmp_path):
    from mmcl.run.folder import decide

    cfg = load_config(None, [f"train.output_dir={tmp_path}"])
    assert decide(to_dict(cfg), 1, 10).action == "start"
    (tmp_path / ".lock").write_text("")
    assert decide(to_dict(cfg), 1, 10).action == "start"


@pytest.mark.slow
def test_the_readme_second_example_on_two_processes_is_refused_and_the_same_command_is_not(small_demo, finished):
    """The second example of docs/getting-started.md's command list (data.batch_size=32 on two processes) on the
    first's folder is another run; the first's own command on two processes is the same run (its global batch is
    kept)."""
    from mmcl.run.folder import decide
    from mmcl.training.plan import batch_plan

    out, _ = finished
    tiny, colour = str(ROOT / "configs" / "tiny.yaml"), small_demo["zeroshot_colour"]
    other = load_config(tiny, short_run(small_demo, out, "data.batch_size=32", zeroshot=colour)[3:])
    with pytest.raises(ConfigError, match=r"data.batch_size 8 -> 32 \(a global batch of 64, the run's is 8\)"):
        decide(to_dict(other), 2, 2)
    same = load_config(tiny, short_run(small_demo, out, zeroshot=colour)[3:])
    plan = batch_plan(same.data, same.train, 2)
    assert plan.batch_size == 4 and "keeping the global batch of 8" in plan.line
    assert decide(to_dict(same), 2, 2).action == "finished"
    # The same global batch split otherwise is the same run too.
    split = load_config(tiny, short_run(small_demo, out, "data.batch_size=4", zeroshot=colour)[3:])
    assert decide(to_dict(split), 2, 2).action == "finished"


@pytest.mark.slow
def test_the_summary_and_out_log(finished):
    out, said = finished
    lines = [ln for ln in said.splitlines() if ln.startswith("mmcl: ")]
    summary = next(i for i, ln in enumerate(lines) if ln.startswith("mmcl: run finished: "))
    assert re.fullmatch(r"mmcl: run finished: 2 steps, 16 samples \(16 in [\d.]+ s, [\d.]+ samples/s\); "
                        r"skipped: 0 samples, 0 shards, 0 steps", lines[summary]), lines[summary]
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    acc1 = record["eval/zeroshot_classification/colour/acc1"]
    assert lines[summary + 1].startswith(
        f"mmcl: final evaluation, zeroshot_classification colour: acc1 {acc1:.4f}, acc5 ")
    assert lines[summary + 2] == f"mmcl: model: {out / 'model'} (mmcl.load, mmcl zeroshot/export --model {out})"
    log = (out / "out.log").read_text().splitlines()
    assert log[0].startswith("--- mmcl train")
    assert lines == [ln for ln in log if ln.startswith("mmcl: ")]  # every line the console had, in order
    assert lines[0] == f"mmcl: {out}: a new run"


def test_the_readme_examples_train_into_different_folders():
    """Consecutive `mmcl train` commands in a shell block of the README or the docs (the command list of
    docs/getting-started.md among them) name different output folders."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    default = load_config(str(ROOT / "configs" / "tiny.yaml")).train.output_dir
    checked = 0
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        dirs = []
        for line in block.replace("\\\n", " ").splitlines():
            if re.search(r"(^|\s)(-m )?mmcl train\b", line) and "configs/tiny.yaml" in line:
                found = re.search(r"train\.output_dir=(\S+)", line)
                dirs.append(found.group(1) if found else default)
        assert len(set(dirs)) == len(dirs), dirs
        checked += len(dirs) >= 2
    assert checked, "the command list of docs/getting-started.md has two mmcl train examples"


def test_make_demo_writes_its_own_folder_and_deletes_nothing():
    dry = subprocess.run(["make", "-n", "-B", "demo", "VIRTUAL_ENV=/nonexistent"], cwd=ROOT, capture_output=True,
                         text=True)
    assert dry.returncode == 0, dry.stderr
    assert "rm " not in dry.stdout, dry.stdout
    default = load_config(str(ROOT / "configs" / "tiny.yaml")).train.output_dir
    outs = set(re.findall(r"train\.output_dir=(\S+)", dry.stdout))
    assert len(outs) == 1 and default not in outs and outs.pop().startswith("runs/demo"), dry.stdout


def test_out_log_holds_the_console_lines_not_the_bar_redraws(tmp_path):
    import sys

    from mmcl.run.folder import ConsoleLog

    log = ConsoleLog().start()
    try:
        print("mmcl: before the folder is taken")
        log.attach(tmp_path / "out.log")
        sys.stderr.write("\rtrain:  33%| 1/3\rtrain:  67%| 2/3\rtrain: 100%| 3/3\n")
        print("mmcl: after")
    finally:
        log.stop(ConfigError, ConfigError("bad value"), None)
    lines = (tmp_path / "out.log").read_text().splitlines()
    assert lines[0].startswith("--- mmcl train, ")
    assert lines[1:] == ["mmcl: before the folder is taken", "train: 100%| 3/3", "mmcl: after",
                         "mmcl: error: bad value"]
    assert not isinstance(sys.stdout, type(log)) and "Tee" not in type(sys.stderr).__name__  # streams restored


def test_a_run_folder_written_before_the_record_is_still_its_run(tmp_path):
    """config.yaml beside an mmcl checkpoint (no mmcl-manifest.json): the same config resumes, another is refused."""
    from mmcl.config import to_yaml
    from mmcl.run.folder import decide

    cfg = load_config(None, [f"train.output_dir={tmp_path}", "data.batch_size=8"])
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 4, "samples": 32, "world_size": 1, "files": {}}))
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    decision = decide(to_dict(cfg), 1, 10)
    assert (decision.action, decision.write_config) == ("resume", True)  # the record is written then
    assert decision.line == f"{tmp_path} holds this run (step 4 of 10): resuming it"
    with pytest.raises(ConfigError, match=r"holds another run \(step 4\): optim.lr 0.0005 -> 0.01;"):
        other = load_config(None, [f"train.output_dir={tmp_path}", "data.batch_size=8", "optim.lr=0.01"])
        decide(to_dict(other), 1, 10)


@pytest.mark.slow
def test_a_run_folder_saved_before_a_key_moved_is_still_its_run(small_demo, finished, capsys):
    """A config.yaml written while ``max_logit_scale`` was under ``loss.`` is the same run: the moved key is carried
    to ``model.`` when mmcl reads what it wrote (a user's own override of the old key is an error line instead)."""
    import yaml

    from mmcl.config import from_dict

    out, _ = finished
    path = out / "config.yaml"
    original = path.read_bytes()
    saved = yaml.safe_load(original)
    saved["model"].pop("max_logit_scale")
    saved["loss"]["max_logit_scale"] = 50.0  # as a run with a non-default limit wrote it
    try:
        path.write_text(yaml.safe_dump(saved))
        assert from_dict(saved).model.max_logit_scale == 50.0
        assert main(short_run(small_demo, out, "model.max_logit_scale=50", zeroshot=small_demo["zeroshot_colour"])) == 0
        said = capsys.readouterr().out
        assert "finished at step 2 of 2" in said and "nothing was changed" in said, said
    finally:
        path.write_bytes(original)
    assert main(short_run(small_demo, out, "loss.max_logit_scale=50", zeroshot=small_demo["zeroshot_colour"])) == 2
    assert "'loss.max_logit_scale' is now 'model.max_logit_scale'" in capsys.readouterr().err
