"""User errors end in one line on stderr and exit code 2, with no traceback; every subcommand is reachable."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mmcl.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def run_main(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines()


@pytest.mark.parametrize("argv, expected", [
    (["train", "--config", "nope.yaml"], "config file not found: nope.yaml"),
    (["train", "--config", TINY, "data.batchsize=3"], "did you mean data.batch_size"),
    (["train", "--config", TINY, "data.batch_size=abc"], "data.batch_size"),
    (["train", "--config", TINY, "data.train=/does/not/exist/shard-{000000..000003}.tar", "train.output_dir=OUT"],
     "/does/not/exist"),
    (["zeroshot", "--model", "/no/such/model", "--data", "x"], "model path not found"),
])
def test_user_errors_are_one_line_with_exit_code_2(capsys, tmp_path, argv, expected):
    argv = [a.replace("OUT", str(tmp_path / "run")) for a in argv]
    code, err = run_main(capsys, *argv)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("mmcl: error: ") and expected in err[0], err


def test_empty_shards_are_a_clear_error(capsys, tmp_path):
    empty = tmp_path / "shards"
    empty.mkdir()
    (empty / "shard-000000.tar").write_bytes(b"")
    code, err = run_main(capsys, "train", "--config", TINY, f"data.train={empty}/shard-000000.tar",
                         f"train.output_dir={tmp_path / 'run'}", "data.workers=0", "train.steps=1")
    # The shard is reported and counted, then the run stops, each in one line.
    assert code == 2 and err == [
        f"mmcl: warning: cannot open shard {empty}/shard-000000.tar: TarFormatError: empty file; skipping it",
        "mmcl: error: no valid sample in any of the 1 shards (skipped so far: shard_open=1)"], err


def test_python_dash_m_prints_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mmcl", "train", TINY, "trian.steps=3"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip() == ("mmcl: error: override trian.steps: unknown config key 'trian'; "
                                "did you mean train or track or train.ddp?")


DOCUMENTED = ["train", "demo-data", "shards", "zeroshot", "retrieval", "export", "linear-probe", "index", "search",
              "plot"]


def test_every_documented_subcommand_exists(capsys):
    listing = build_parser().format_help()
    for command in DOCUMENTED:
        # Listed in `mmcl --help`, and answers its own --help with its own usage line.
        assert re.search(rf"^    {re.escape(command)}\s", listing, re.MULTILINE), command
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0, command
        assert capsys.readouterr().out.startswith(f"usage: mmcl {command} "), command
    with pytest.raises(SystemExit) as done:
        main(["no-such-command"])
    assert done.value.code == 2 and "invalid choice: 'no-such-command'" in capsys.readouterr().err


def test_mmcl_warnings_are_one_line_once_and_others_keep_their_format(capsys):
    import warnings

    from mmcl import cli

    mmcl_file = str(Path(cli.__file__).parent / "data" / "reading.py")
    others = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda *args, **kw: others.append(args[:4])
        with cli.warning_lines():
            for _ in range(3):  # e.g. a bad shard met on every pass over the data
                warnings.warn_explicit("shard x.tar is bad;\n  skipping it", UserWarning, mmcl_file, 10)
            warnings.warn_explicit("another cause", RuntimeWarning, mmcl_file, 20)
            warnings.warn_explicit("a library's own warning", DeprecationWarning, "/site-packages/lib/mod.py", 7)
        assert not isinstance(warnings.showwarning, cli._WarningLines)  # put back as it was
    assert capsys.readouterr().err.splitlines() == [
        "mmcl: warning: shard x.tar is bad; skipping it", "mmcl: warning: another cause"]
    assert [(str(m), c, f, n) for m, c, f, n in others] == [
        ("a library's own warning", DeprecationWarning, "/site-packages/lib/mod.py", 7)]


def test_init_copies_the_shipped_configs_and_launch_folders(tmp_path, capsys):
    code, err = run_main(capsys, "init", str(tmp_path / "project"))
    assert code == 0, err
    shipped = ROOT / "mmcl" / "training" / "starter"
    for name in ("configs", "launch"):
        want = sorted(p.relative_to(shipped / name).as_posix() for p in (shipped / name).rglob("*") if p.is_file())
        got = sorted(p.relative_to(tmp_path / "project" / name).as_posix()
                     for p in (tmp_path / "project" / name).rglob("*") if p.is_file())
        assert got == want and want


def test_a_warning_raised_anywhere_in_mmcl_is_one_mmcl_warning_line(capsys):
    """`mmcl.cli.warning_lines` shows the warnings of every mmcl module (the data package's here) in its one-line
    format, once per message, and hands other warnings to the handler before it."""
    import warnings

    from mmcl.cli import warning_lines
    from mmcl.data import sources

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with warning_lines():
            for _ in range(2):
                warnings.warn_explicit("a data warning", UserWarning, sources.__file__, 1)
            warnings.warn_explicit("a library's warning", UserWarning, "/elsewhere/lib.py", 1)
    err = capsys.readouterr().err
    assert err.count("mmcl: warning: a data warning") == 1, err
    assert "library" not in err  # handed to the previous handler (pytest's record here), not an mmcl line
