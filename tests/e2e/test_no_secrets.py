"""No credential a data source carries is written or printed: sources holding a password in a URL, a token in a
URL's query, a bearer token in a ``pipe:`` command's header and a secret environment variable of a ``pipe:``
command are read for real (a local HTTP server, `cat`) by a training run's evaluation, `mmcl retrieval`, `mmcl
index`, `mmcl curate`, `mmcl reinforce` and `mmcl train --print-config`, and no byte of any file they wrote (the
TensorBoard event files included) nor of their console output holds a secret."""

import functools
import http.server
import shutil
import threading
from pathlib import Path

import pytest

from helpers import ROOT, TRAINING_TOWERS

SECRETS = ["PASSWORDa1b2", "SIGNATUREc3d4", "QUERYTOKENe5f6", "BEARERg7h8", "ENVSECRETi9j0"]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def sources(small_demo, tmp_path_factory):
    """Three sources of the demo's validation shard, each carrying secrets: a URL with a password and query tokens,
    a curl command with a bearer token, a command with a secret environment variable."""
    served = tmp_path_factory.mktemp("served")
    val = Path(small_demo["val"].replace("{000000..000000}", "000000"))
    for name in ("coco.tar", "flickr.tar", "laion.tar"):
        shutil.copy(val, served / name)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(served)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{httpd.server_address[1]}"
    yield {"url": f"http://user:{SECRETS[0]}@{host}/coco.tar?X-Amz-Signature={SECRETS[1]}&token={SECRETS[2]}",
           "curl": f"pipe:curl -s -f -H 'Authorization: Bearer {SECRETS[3]}' http://{host}/flickr.tar",
           "env": f"pipe:SECRET_TOKEN={SECRETS[4]} cat {served / 'laion.tar'} # Authorization: Bearer {SECRETS[3]}"}
    httpd.shutdown()


def assert_no_secret(capsys, *folders):
    """Neither the console output so far nor any file under `folders` (its name, its bytes) holds a secret."""
    seen = capsys.readouterr()
    texts = {"stdout": seen.out.encode(), "stderr": seen.err.encode()}
    for folder in folders:
        paths = list(Path(folder).rglob("*"))
        texts.update({str(p): p.read_bytes() for p in paths if p.is_file()}, names=str(paths).encode())
    assert texts
    leaks = [(where, s) for where, data in texts.items() for s in SECRETS if s.encode() in data]
    assert not leaks, sorted({where for where, _ in leaks})


def _train_args(demo, out, sources):
    return ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={demo['train']}",
            f"train.output_dir={out}", "eval.zeroshot=null", "train.progress=false", "train.plot=false",
            "data.shuffle_buffer=8", "data.batch_size=8", "data.workers=0", "train.log_every=1", "train.steps=2",
            "train.save_every=0", "train.log_with=[tensorboard]", *TRAINING_TOWERS,
            "eval.retrieval=[" + ", ".join(f'"{sources[k]}"' for k in ("url", "curl", "env")) + "]",
            f"eval.val_loss={sources['curl']}"]


@pytest.fixture(scope="module")
def run(small_demo, sources, tmp_path_factory):
    from mmcl.cli import main

    out = tmp_path_factory.mktemp("run") / "run"
    assert main([*_train_args(small_demo, out, sources)[:-2], "train.log_with=[]"]) == 0
    return out


def test_a_training_run_writes_and_prints_no_secret_of_its_evaluation_sets(small_demo, sources, tmp_path, capsys):
    from mmcl.cli import main

    out = tmp_path / "run"
    assert main(_train_args(small_demo, out, sources)) == 0
    text = (out / "metrics.jsonl").read_text()
    assert all(f"retrieval/{name}/" in text for name in ("coco", "flickr", "laion")) and "val/loss" in text
    assert list(out.rglob("events.out.tfevents*"))
    assert_no_secret(capsys, out)


def test_print_config_and_a_bad_override_print_no_secret(small_demo, sources, tmp_path, capsys):
    from mmcl.cli import main

    args = _train_args(small_demo, tmp_path / "run", sources)
    assert main([*args, "--print-config"]) == 0
    shown = capsys.readouterr().out
    assert "Authorization: ***" in shown and "SECRET_TOKEN=***" in shown and "user:***@" in shown
    assert main([*args, f"eval.val_loss={sources['env']}", "--print-config"]) == 0  # a pipe: value is a string
    assert "eval.val_loss" not in capsys.readouterr().err
    bad_values = [f"data.batch_size={sources['curl']}", f"data.batch_size=[{sources['curl']}",
                  f"eval.every={sources['url']}"]
    for bad in bad_values:
        assert main([*args, bad, "--print-config"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mmcl: error:") and "***" in err, err
    assert_no_secret(capsys, tmp_path)


@pytest.mark.parametrize("source", ["url", "curl", "env"])
def test_the_commands_that_read_data_write_and_print_no_secret(run, sources, source, tmp_path, capsys):
    from mmcl.cli import main

    data = sources[source]
    capsys.readouterr()
    assert main(["retrieval", "--model", str(run), "--data", data, "--out", str(tmp_path / "results.json")]) == 0
    assert main(["index", "--model", str(run), "--data", data, "--out", str(tmp_path / "index")]) == 0
    assert main(["search", "--index", str(tmp_path / "index"), "a red circle", "-k", "2"]) == 0
    assert main(["curate", "--model", str(run), "--data", data, "--out", str(tmp_path / "curated"),
                 "--no-progress", "--min-caption-len", "3"]) == 0
    assert main(["reinforce", "--teacher", str(run), "--data", data, "--out", str(tmp_path / "reinforced"),
                 "--no-progress"]) == 0
    assert len(list((tmp_path / "curated").glob("*.tar"))) == 1
    assert len(list((tmp_path / "reinforced").glob("*.tar"))) == 1
    assert_no_secret(capsys, tmp_path)


# ------------------------------------------------------------------------- no interpolation in a config
ENV_SECRET = "HFTOKENk1l2"


def _interpolating_config(tmp_path, section="track:\n  run_name: ${oc.env:HF_TOKEN}\n"):
    config = tmp_path / "colleague.yaml"
    config.write_text((ROOT / "configs" / "tiny.yaml").read_text() + section)
    return config


def _one_error_naming(capsys, key):
    seen = capsys.readouterr()
    err = seen.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmcl: error: ") and key in err[0], err
    assert ENV_SECRET not in seen.out + seen.err
    return err[0]


@pytest.mark.parametrize("section,key", [
    ("track:\n  run_name: ${oc.env:HF_TOKEN}\n", "track.run_name"),
    ("track:\n  run_name: run-${oc.env:HF_TOKEN,none}\n", "track.run_name"),
    ("eval:\n  retrieval: [data/a.tar, 'pipe:curl -H \"Authorization: ${oc.env:HF_TOKEN}\" x']\n", "eval.retrieval.1"),
    ("track:\n  run_name: ${train.output_dir}\n", "track.run_name"),
])
def test_a_config_file_never_interpolates(small_demo, tmp_path, capsys, monkeypatch, section, key):
    """A colleague's YAML asking OmegaConf for the environment (or any interpolation) is one line naming the key:
    --print-config prints no secret, and a run writes nothing (no config.yaml, no tracker)."""
    from mmcl.cli import main

    monkeypatch.setenv("HF_TOKEN", ENV_SECRET)
    config = _interpolating_config(tmp_path, section)
    out = tmp_path / "run"
    args = ["train", "--config", str(config), f"data.train={small_demo['train']}", f"train.output_dir={out}",
            "eval.zeroshot=null", "train.steps=2", "train.log_with=[tensorboard]", "train.progress=false"]
    assert main([*args, "--print-config"]) == 2
    _one_error_naming(capsys, key)
    assert main(args) == 2
    _one_error_naming(capsys, key)
    assert not out.exists()


@pytest.mark.parametrize("override", ["track.run_name=${oc.env:HF_TOKEN}", "eval.retrieval=[a, '${oc.env:HF_TOKEN}']",
                                      "data.train=pipe:curl -H 'Authorization: ${oc.env:HF_TOKEN}' x"])
def test_an_override_never_interpolates(small_demo, tmp_path, capsys, monkeypatch, override):
    from mmcl.cli import main

    monkeypatch.setenv("HF_TOKEN", ENV_SECRET)
    assert main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"train.output_dir={tmp_path / 'r'}",
                 f"data.train={small_demo['train']}", override, "--print-config"]) == 2
    _one_error_naming(capsys, override.split("=")[0])


def test_from_open_clip_writes_no_interpolation(tmp_path, capsys, monkeypatch):
    from mmcl.cli import main

    monkeypatch.setenv("HF_TOKEN", ENV_SECRET)
    out = tmp_path / "c.yaml"
    assert main(["from-open-clip", "--out", str(out), "--", "--train-data", "data/{000..009}.tar",
                 "--name", "${oc.env:HF_TOKEN}"]) == 2
    _one_error_naming(capsys, "train.output_dir")
    assert not out.exists()


def test_a_run_folders_config_yaml_is_never_interpolated(small_demo, tmp_path, capsys, monkeypatch):
    """A run's config.yaml read back as a --config is one line naming the key; an export of a step (its
    architecture recorded beside it) and a resume that compares it with the new config print and write no secret."""
    from mmcl.cli import main

    from helpers import short_run

    run = tmp_path / "run"
    assert main(short_run(small_demo, run)) == 0
    capsys.readouterr()
    monkeypatch.setenv("HF_TOKEN", ENV_SECRET)
    saved = run / "config.yaml"
    saved.write_text(saved.read_text().replace("run_name: null", "run_name: ${oc.env:HF_TOKEN}"))
    assert "${oc.env:HF_TOKEN}" in saved.read_text()
    assert main(["train", "--config", str(saved), "--print-config"]) == 2
    _one_error_naming(capsys, "track.run_name")
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert main(["export", "--model", str(step), "--format", "open_clip", "--out", str(tmp_path / "export")]) == 0
    assert main(short_run(small_demo, run, "train.steps=3")) == 0
    seen = capsys.readouterr()
    assert ENV_SECRET not in seen.out + seen.err
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and ENV_SECRET.encode() in p.read_bytes()]
