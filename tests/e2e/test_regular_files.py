"""Files that mmcl reads are regular files: a FIFO, device or folder where a shard, an evaluation image, a class
names or templates file, an input of `mmcl shards`, a model folder's config or an index file is expected is a
skipped, named sample or shard (or one error line for a single required file), never a wait; a symbolic link in an
input folder of `mmcl shards` that leads out of it is a skipped sample, never read; and a stop signal ends a run
within its grace period whatever a data read does. Every command runs in a subprocess with a timeout, so a
regression fails rather than hangs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from helpers import short_run

ROOT = Path(__file__).resolve().parents[2]
SECRET = "NETRCSECRETm3n4"


def mmcl(*args, timeout=240):
    """`mmcl ARGS` in a subprocess: (rc, stdout, stderr); a command that blocks fails the test at `timeout`."""
    done = subprocess.run([sys.executable, "-m", "mmcl", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.returncode, done.stdout, done.stderr


def one_error(err: str, *names: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmcl: error: ") and all(n in lines[0] for n in names), lines
    return lines[0]


@pytest.fixture(scope="module")
def trained(small_demo, tmp_path_factory):
    from mmcl.cli import main

    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(short_run(small_demo, out)) == 0
    return out


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_fifo_beside_the_shards_is_a_skipped_shard_not_a_wait(small_demo, tmp_path, workers):
    shards = tmp_path / "shards"
    shards.mkdir()
    first = sorted(Path(small_demo["train"].split("{")[0]).parent.glob("shard-*.tar"))[0]
    shutil.copy(first, shards / "shard-000000.tar")
    os.mkfifo(shards / "shard-000001.tar")
    run = tmp_path / "run"
    rc, out, err = mmcl(*short_run(small_demo, run, f"data.train={shards}", f"data.workers={workers}",
                                   "train.steps=8", "train.save_every=0"))
    assert rc == 0, err[-2000:]
    assert "skipped: 0 samples, 1 shards" in out
    skipped = [json.loads(line) for line in (run / "skipped.jsonl").read_text().splitlines()]
    assert [(s["reason"], Path(s["source"]).name) for s in skipped] == [("shard_open", "shard-000001.tar")]
    assert "FIFO" in err  # the warning line names what it is


def _first_line_then_signal(proc, says: str, timeout: float = 120) -> float:
    start = time.monotonic()
    seen = ""
    while says not in seen:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, seen
        seen += line
        assert time.monotonic() - start < timeout, seen
    time.sleep(2)  # into the read that never returns
    proc.send_signal(signal.SIGTERM)
    return time.monotonic()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_sigterm_ends_a_run_whose_data_read_never_returns(small_demo, tmp_path, workers):
    """A shard whose read never returns (a command that stalls, as a hung network mount does): SIGTERM still ends
    the run within its grace period, with the requeue code and one line saying why no checkpoint was saved."""
    from mmcl.run.signals import DATA_GRACE_S, REQUEUE_EXIT_CODE

    run = tmp_path / "run"
    args = short_run(small_demo, run, "data.train=pipe:sleep 3600", f"data.workers={workers}", "data.retries=0")
    proc = subprocess.Popen([sys.executable, "-m", "mmcl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        sent = _first_line_then_signal(proc, "data.train:")
        proc.wait(timeout=DATA_GRACE_S + 20)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            os.killpg(proc.pid, signal.SIGKILL) if _group_alive(proc.pid) else None
    out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.returncode == REQUEUE_EXIT_CODE, err[-2000:]
    assert DATA_GRACE_S - 1 <= took <= DATA_GRACE_S + 15
    assert "mmcl: stopped (SIGTERM) while waiting for data" in out and "Traceback" not in err
    assert "stopped (SIGTERM) while waiting for data" in (run / "out.log").read_text()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


# ---------------------------------------------------------------------------------------------- evaluation
@pytest.mark.slow
def test_zeroshot_skips_a_fifo_image_and_names_a_fifo_classnames_or_templates_file(small_demo, trained, tmp_path):
    data = tmp_path / "colour"
    shutil.copytree(small_demo["zeroshot_colour"], data)
    os.mkfifo(data / "red" / "9999.png")
    rc, out, err = mmcl("zeroshot", "--model", trained, "--data", data, "--workers", 0)
    assert rc == 0, err
    result = json.loads(out[out.index("{"):])
    images = [p for p in data.glob("*/*") if p.is_file() and p.suffix in (".png", ".jpg")]
    assert result["skipped"] == {"decode": 1} and result["n_samples"] == len(images)
    os.mkfifo(tmp_path / "names.txt")
    rc, _, err = mmcl("zeroshot", "--model", trained, "--data", data, "--classnames", tmp_path / "names.txt")
    assert rc == 2 and one_error(err, "names.txt")
    rc, _, err = mmcl("zeroshot", "--model", trained, "--data", data, "--templates", tmp_path / "names.txt")
    assert rc == 2 and one_error(err, "names.txt")


# ------------------------------------------------------------------------------------------- mmcl shards
def _caption_folder(root: Path, outside: Path) -> Path:
    """An img2dataset-style folder: 000001 .. 000006 (image + caption), where 000001.txt links to a secret
    outside the folder, 000002.txt and 000003.jpg are FIFOs, 000004.jpg links to an image outside, 000005.txt
    links to a caption inside (kept), and 000006 is plain."""
    folder = root / "captions"
    folder.mkdir()
    for i in range(1, 7):
        Image.new("RGB", (16, 16), (i * 40, 10, 10)).save(folder / f"{i:06d}.jpg")
        (folder / f"{i:06d}.txt").write_text(f"caption {i}")
    (outside / "netrc").write_text(f"machine host login me password {SECRET}\n")
    Image.new("RGB", (16, 16), (1, 2, 3)).save(outside / "elsewhere.jpg")
    (folder / "000001.txt").unlink()
    (folder / "000001.txt").symlink_to(outside / "netrc")
    (folder / "000002.txt").unlink()
    os.mkfifo(folder / "000002.txt")
    (folder / "000003.jpg").unlink()
    os.mkfifo(folder / "000003.jpg")
    (folder / "000004.jpg").unlink()
    (folder / "000004.jpg").symlink_to(outside / "elsewhere.jpg")
    (folder / "shared.txt").write_text("caption 5")
    (folder / "000005.txt").unlink()
    (folder / "000005.txt").symlink_to("shared.txt")
    return folder


@pytest.mark.slow
def test_shards_reads_no_fifo_and_no_link_out_of_its_input_folder(tmp_path):
    outside = tmp_path / "home"
    outside.mkdir()
    folder = _caption_folder(tmp_path, outside)
    out = tmp_path / "out"
    rc, stdout, err = mmcl("shards", "--input", folder, "--out", out)
    assert rc == 0, err
    skipped = {(s["member"], s["reason"]) for s in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
    assert {("000001.txt", "outside_link"), ("000002.txt", "missing_file"), ("000003.jpg", "missing_file"),
            ("000004.jpg", "outside_link")} <= skipped, skipped
    import tarfile

    members = {}
    for shard in out.glob("*.tar"):
        with tarfile.open(shard) as tar:
            members.update({m.name: tar.extractfile(m).read() for m in tar.getmembers()})
    assert sorted(n for n in members if n.endswith(".txt")) == ["000005.txt", "000006.txt"]
    assert not [n for n, body in members.items() if SECRET.encode() in body]
    assert "outside_link" in stdout


@pytest.mark.slow
def test_shards_of_an_image_folder_skip_fifos_and_outside_links(tmp_path):
    root = tmp_path / "classes"
    (root / "cat").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (16, 16), (i * 60, 0, 0)).save(root / "cat" / f"{i}.png")
    os.mkfifo(root / "cat" / "fifo.png")
    Image.new("RGB", (16, 16), (0, 0, 9)).save(tmp_path / "mine.png")
    (root / "cat" / "link.png").symlink_to(tmp_path / "mine.png")
    out = tmp_path / "out"
    rc, _, err = mmcl("shards", "--input", root, "--out", out)
    assert rc == 0, err
    skipped = {(s["member"], s["reason"]) for s in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
    assert skipped == {("cat/fifo.png", "missing_file"), ("cat/link.png", "outside_link")}, skipped
    assert json.loads((out / "sizes.json").read_text()) and sum(json.loads((out / "sizes.json").read_text())
                                                                .values()) == 3


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_shards_names_a_fifo_table_in_one_line(tmp_path, suffix):
    os.mkfifo(tmp_path / f"table{suffix}")
    rc, _, err = mmcl("shards", "--input", tmp_path / f"table{suffix}", "--out", tmp_path / "out", timeout=60)
    assert rc == 2 and one_error(err, f"table{suffix}")


# ------------------------------------------------------------------------------------- models and indexes
@pytest.mark.slow
@pytest.mark.parametrize("name", ["open_clip_config.json", "open_clip_model.safetensors"])
def test_a_fifo_in_a_model_folder_is_one_line(trained, tmp_path, name):
    model = tmp_path / "model"
    shutil.copytree(trained / "model", model)
    (model / name).unlink()
    os.mkfifo(model / name)
    rc, _, err = mmcl("export", "--model", model, "--format", "open_clip", "--out", tmp_path / "export", timeout=60)
    assert rc == 2 and one_error(err, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["index.faiss", "items.jsonl"])
def test_a_fifo_in_an_index_folder_is_one_line(small_demo, trained, tmp_path, name):
    from mmcl.evaluation import index as index_mod

    index = tmp_path / "index"
    rc, _, err = mmcl("index", "--model", trained, "--data", small_demo["val"], "--out", index)
    assert rc == 0, err
    target = index / {"items.jsonl": index_mod.ITEMS_FILE, "index.faiss": index_mod.INDEX_FILE}[name]
    target.unlink()
    os.mkfifo(target)
    rc, _, err = mmcl("search", "--index", index, "a red square", timeout=60)
    assert rc == 2 and one_error(err, target.name)


# ------------------------------------------------------- in-process: what a path is, links out of a dataset folder
def error_line(capsys) -> str:
    """The one ``mmcl: error:`` line a command printed (and nothing else on stderr, no traceback)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmcl: error: "), err
    return err[0]


@pytest.fixture
def fifo(tmp_path):
    """A FIFO; a command that opens it to read would wait forever: the test fails after 120 s instead."""
    def fail(*_):
        raise TimeoutError("blocked on a FIFO")
    path = tmp_path / "pipe.txt"
    os.mkfifo(path)
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(120)
    yield path
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("option", ["--config", "--model", "--classnames", "--templates", "--image", "--input",
                                    "--from", "model.init_from", "eval.classnames", "eval.templates"])
def test_a_fifo_given_as_a_file_is_named_as_a_fifo_never_not_found(small_demo, trained, tmp_path, capsys, fifo,
                                                                     option):
    """Every file-valued option says what the path is (`mmcl.errors.file_problem`), and never opens a FIFO."""
    from mmcl.cli import main

    from helpers import run_args

    zs = ["zeroshot", "--model", str(trained), "--data", small_demo["zeroshot_colour"]]
    args = {
        "--config": ["train", "--config", str(fifo)],
        "--model": ["zeroshot", "--model", str(fifo), "--data", small_demo["zeroshot_colour"]],
        "--classnames": [*zs, "--classnames", str(fifo)],
        "--templates": [*zs, "--templates", str(fifo)],
        "--image": None,
        "--input": ["shards", "--input", str(fifo), "--out", str(tmp_path / "out")],
        "--from": ["interpolate", "--from", str(fifo), "--to", str(trained), "--alpha", "0.5", "--out",
                   str(tmp_path / "w")],
        "model.init_from": ["train", *run_args(small_demo, tmp_path / "run", f"model.init_from={fifo}")],
        "eval.classnames": ["train", *run_args(small_demo, tmp_path / "run", f"eval.classnames={fifo}",
                                               zeroshot=small_demo["zeroshot_colour"])],
        "eval.templates": ["train", *run_args(small_demo, tmp_path / "run", f"eval.templates={fifo}",
                                              zeroshot=small_demo["zeroshot_colour"])],
    }[option]
    if option == "--image":
        index = tmp_path / "index"
        assert main(["index", "--model", str(trained), "--data", small_demo["val"], "--out", str(index)]) == 0
        capsys.readouterr()
        args = ["search", "--index", str(index), "--image", str(fifo)]
    assert main(args) == 2
    line = error_line(capsys)
    assert "is not a regular file (a FIFO)" in line and str(fifo) in line and "not found" not in line, line


def _linked_out(folder: Path, name: str, target: Path) -> None:
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(target)


def test_an_image_linked_out_of_an_evaluation_folder_is_a_skipped_sample(small_demo, trained, tmp_path, capsys):
    """Zero-shot (and linear-probe, retrieval, index: the same ImageFolder reader): a link that leaves the folder is
    an ``outside_link`` skip, never read; a link to an image inside the folder is read."""
    from mmcl.cli import main

    data = tmp_path / "colour"
    shutil.copytree(small_demo["zeroshot_colour"], data)
    Image.new("RGB", (16, 16), (200, 0, 0)).save(tmp_path / "private.png")
    (data / "red" / "9998.png").symlink_to(tmp_path / "private.png")
    inside = sorted((data / "green").glob("*.png"))[0]
    (data / "red" / "9999.png").symlink_to(os.path.relpath(inside, data / "red"))
    assert main(["zeroshot", "--model", str(trained), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])
    images = [p for p in data.glob("*/*.png")]
    assert result["skipped"] == {"outside_link": 1} and result["n_samples"] == len(images) - 1
    capsys.readouterr()
    assert main(["linear-probe", "--model", str(trained), "--train", str(data), "--test", str(data)]) == 0
    assert '"outside_link": 1' in capsys.readouterr().out


@pytest.mark.parametrize("name", ["classnames.txt", "templates.txt"])
@pytest.mark.parametrize("layout", ["folder", "shards"])
def test_a_metadata_file_linked_out_of_a_dataset_folder_is_one_line(small_demo, trained, tmp_path, capsys, name,
                                                                     layout):
    """classnames.txt / templates.txt of an ImageFolder or beside evaluation shards, linked to a file outside the
    folder (``~/.netrc``): one line naming it, the file never read (its text is not shown)."""
    from mmcl.cli import main

    secret = tmp_path / "netrc"
    secret.write_text(f"machine host login me password {SECRET}\n")
    if layout == "folder":
        data = tmp_path / "colour"
        shutil.copytree(small_demo["zeroshot_colour"], data)
        spec = data
    else:
        data = tmp_path / "val"
        shutil.copytree(Path(small_demo["val"].split("{")[0]).parent, data)
        spec = sorted(data.glob("shard-*.tar"))[0]
    _linked_out(data, name, secret)
    assert main(["zeroshot", "--model", str(trained), "--data", str(spec)]) == 2
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and "leads out of" in lines[0], lines


def test_a_fifo_templates_file_in_a_dataset_folder_is_one_line(small_demo, trained, tmp_path, capsys):
    from mmcl.cli import main

    data = tmp_path / "colour"
    shutil.copytree(small_demo["zeroshot_colour"], data)
    (data / "templates.txt").unlink()
    os.mkfifo(data / "templates.txt")
    assert main(["zeroshot", "--model", str(trained), "--data", str(data)]) == 2
    assert "templates.txt" in (line := error_line(capsys)) and "a FIFO" in line, line
