"""BENCHMARKS.md stays a short summary: under 20,000 bytes, every table row with the command that reproduces its
figure and the commit it was measured on, every commit it names present in git history; the runs' diary lives in
bench/HISTORY.md."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "bench" / "HISTORY.md"
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
CELL_SPLIT = re.compile(r"(?<!\\)\|")


def _cells(line: str):
    return [c.strip() for c in CELL_SPLIT.split(line.strip().strip("|"))]


def tables(text: str):
    """Each Markdown table as (header cells, [row cells, ...])."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]):
            header, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            found.append((header, rows))
        else:
            i += 1
    return found


def named_commits(text: str):
    """The commits the file names: every commit cell's hashes and every code span that is a hash alone."""
    commits = set()
    for header, rows in tables(text):
        if "commit" in header:
            col = header.index("commit")
            for row in rows:
                commits.update(HEX.findall(row[col]))
    commits.update(re.findall(r"`([0-9a-f]{7,40})`", text))
    return commits


def test_benchmarks_md_is_under_20000_bytes():
    assert BENCHMARKS.stat().st_size < 20_000, BENCHMARKS.stat().st_size


def test_the_runs_history_is_kept():
    assert HISTORY.is_file() and HISTORY.stat().st_size > 0


def test_every_table_row_names_a_command_and_a_commit():
    found = tables(BENCHMARKS.read_text())
    assert len(found) >= 6, "one table per area"
    for header, rows in found:
        assert "command" in header and "commit" in header, header
        assert rows, header
        cmd, commit = header.index("command"), header.index("commit")
        for row in rows:
            assert len(row) == len(header), row
            assert "`" in row[cmd] and len(row[cmd].strip("`")) > 1, f"no command: {row}"
            assert HEX.search(row[commit]), f"no commit: {row}"


def test_every_commit_named_exists_in_git_history():
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run([git, "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True)
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone lacks the older commits")
    commits = named_commits(BENCHMARKS.read_text())
    assert commits
    missing = [c for c in sorted(commits)
               if subprocess.run([git, "-C", str(ROOT), "cat-file", "-e", f"{c}^{{commit}}"],
                                 capture_output=True).returncode != 0]
    assert not missing, missing
