"""The documentation: a short README that points into docs/, and a docs/ site that MkDocs builds in strict mode
(every link and anchor resolves), with every page in the navigation."""

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"


def nav_pages(entries):
    """Every page path in mkdocs.yml's nav (nested sections included)."""
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from nav_pages(value)
        else:
            yield value


def slug(heading: str) -> str:
    """A heading's anchor as MkDocs makes it (Python-Markdown's toc slugify)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, re.M)}


def test_the_readme_is_short():
    size = len(README.read_bytes())
    assert size < 15_000, f"README.md is {size} bytes; move detail into docs/"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load(MKDOCS.read_text())
    assert config["site_name"] == "mmcl" and config["theme"]["name"] == "material"
    nav = list(nav_pages(config["nav"]))
    assert len(nav) == len(set(nav)), nav
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == on_disk, (sorted(set(nav) - set(on_disk)), sorted(set(on_disk) - set(nav)))


def test_the_readme_links_into_docs_resolve():
    links = re.findall(r"\]\((docs/[^)\s]+)\)", README.read_text())
    assert len(links) >= 10, links
    for link in links:
        path, _, anchor = link.partition("#")
        page = ROOT / path
        assert page.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(page), f"README links to {link}: {path} has no heading with that anchor"


def test_mkdocs_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    had_site = (ROOT / "site").exists()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(MKDOCS), "-d", str(site)],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "index.html").is_file() and (site / "getting-started" / "index.html").is_file()
    assert had_site or not (ROOT / "site").exists()  # nothing written into the checkout


def _shell_commands():
    """(page, command line) for every command of the ```bash blocks of README.md and docs/*.md, continuation lines
    joined and comments dropped."""
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        for block in re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", page.read_text(), re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    yield page.relative_to(ROOT).as_posix(), line


def _mmcl_argv(line):
    """The arguments mmcl gets from a shell line (`mmcl ...`, `python -m mmcl ...`, a launcher's `-m mmcl ...`), or
    None for a line that does not run mmcl."""
    import shlex

    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    for i, word in enumerate(words):
        if word in ("|", "&&", ";"):
            return None
        if word == "mmcl" and i == 0:
            argv = words[1:]
        elif word == "mmcl" and i > 0 and words[i - 1] == "-m":
            argv = words[i + 1:]
        else:
            continue
        ends = [j for j, w in enumerate(argv) if w in ("|", "&&", ";", ">", "2>&1")]
        return None if argv[:1] == ["launch"] else argv[:ends[0]] if ends else argv
    return None


def _placeholder(word: str) -> bool:
    """A word of a synopsis rather than a command: [--optional], (A | B), CONFIG, DIR, $VAR, <yours>, ..."""
    value = word.split("=")[-1]
    return (word[:1] in "[(" or word in ("|",) or "$" in word or "<" in word or "..." in word
            or (len(value) >= 3 and re.fullmatch(r"[A-Z][A-Z0-9_]*", value) is not None))


def test_every_mmcl_command_in_the_docs_parses_and_names_real_config_keys(monkeypatch):
    """No page goes stale: each `mmcl ...` line of a shell block is a command mmcl's parser takes, and for `mmcl
    train` its config file exists and its overrides name real keys with values of the right type."""
    from mmcl.cli import build_parser
    from mmcl.config import load_config

    monkeypatch.chdir(ROOT)
    parser = build_parser()
    seen, problems = 0, []
    for page, line in _shell_commands():
        argv = _mmcl_argv(line)
        if not argv or any(_placeholder(a) for a in argv):
            continue  # a synopsis, or a placeholder the reader fills in
        seen += 1
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            problems.append(f"{page}: {line.strip()}")
            continue
        if args.command == "train":
            config = args.config if args.config and Path(args.config).is_file() else None  # one the page writes
            try:
                load_config(config, args.overrides)
            except Exception as err:  # noqa: BLE001 - every problem is listed
                problems.append(f"{page}: {line.strip()}: {str(err).splitlines()[0]}")
    assert seen >= 20, seen
    assert problems == [], "\n".join(problems)


def _two_commands(page: Path) -> str:
    return re.search(r"^## Two commands\n\n```bash\n(.*?)^```", page.read_text(), re.M | re.S).group(1)


def test_facts_that_drift_have_one_home_or_none():
    """The README's and Getting started's copies of `make demo` / `make test` are the same text, and no page keeps a
    count of the tests (it is stale after the next test)."""
    assert _two_commands(README) == _two_commands(DOCS / "getting-started.md")
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        counted = re.findall(r"\b\d{1,3}(?:,\d{3})+ tests\b|\b\d{3,} tests\b", page.read_text())
        assert counted == [], (page.name, counted)


# The pages whose commands a reader runs one after another, in the order the site gives them.
PAGES_IN_ORDER = ["docs/getting-started.md", "docs/training.md", "docs/evaluation.md", "docs/migration.md"]
# Appended where a page says settings may be appended: a short run of a small model on the small demo.
TINY = {"demo-data": ["--n-train", "256"],
        "train": ["train.steps=2", "data.batch_size=16", "data.workers=0", "train.plot=false",
                  "train.progress=false", "model.vision_cfg={layers: 1, width: 32, head_width: 16}",
                  "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]}
# Commands that need what the page says to make or fetch first, beyond this walk: the prefix, and what they need.
NEEDS = {"train --config configs/distill.yaml": "a teacher (runs/lit-minilm: LiT on a downloaded MiniLM)",
         "train --config configs/lora.yaml": "published weights (laion2b_s34b_b79k) and your shards",
         "export --model runs/lora-b32": "the LoRA run above"}
# The shards a page names as yours (its example's own data): the demo's stand in, as a reader's own would, and an
# epoch of them is made small (the run's length is its epochs there).
YOURS = {"shards/{00000..00099}.tar": ["data.train=runs/demo-data/train/shard-*.tar", "train.epochs=1",
                                      "data.train_num_samples=32"]}


def _walk(pages):
    """(page, argv) of every runnable mmcl command of `pages`, in order (synopses and placeholders left out)."""
    for name in pages:
        blocks, block, lang = [], None, None
        for line in (ROOT / name).read_text().splitlines(keepends=True):  # fences opened and closed in turn
            if line.startswith("```"):
                if block is None:
                    block, lang = [], line[3:].strip()
                else:
                    blocks += ["".join(block)] if lang in ("", "bash", "sh", "console") else []
                    block = None
            elif block is not None:
                block.append(line)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                argv = _mmcl_argv(line)
                if argv and not any(_placeholder(a) for a in argv):
                    yield name, argv


@pytest.mark.slow
def test_the_docs_commands_run_in_page_order_from_a_fresh_folder(tmp_path, monkeypatch, capsys):
    """Getting started, then Training, Evaluation and the migration page, command after command in one fresh
    folder: each example writes its own run folder, so none is refused for holding another's run."""
    from mmcl.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["init", "."]) == 0
    ran, folders, seen = [], {}, set()
    for page, argv in _walk(PAGES_IN_ORDER):
        shown = " ".join(argv)
        if any(shown.startswith(prefix) for prefix in NEEDS) or shown in seen:
            continue  # a page repeating an earlier page's command runs it as that one did
        seen.add(shown)
        if argv[0] == "train" and argv[argv.index("--config") + 1] == "config.yaml":
            argv = [*argv, *(o for k in YOURS if k in Path("config.yaml").read_text() for o in YOURS[k])]
        code = main([*argv, *TINY.get(argv[0], [])])
        said = capsys.readouterr()
        assert code == 0, (page, shown, said.err[-2000:])
        assert "holds another run" not in said.err
        ran.append(argv[0])
        if argv[0] == "train":
            out = re.search(r"^mmcl: (\S+): a new run$", said.out, re.M)
            assert out, (page, shown, said.out[:2000])  # a new folder each time, never another example's
            assert out.group(1) not in folders, (shown, folders)
            folders[out.group(1)] = page
    assert ran.count("train") == 6 and {"zeroshot", "retrieval", "linear-probe", "export", "plot",
                                        "from-open-clip"} <= set(ran), ran
    assert sorted(folders) == ["runs/clipa", "runs/from-open-clip", "runs/global-contrastive", "runs/tiny",
                               "runs/tiny-2proc", "runs/tiny-evals"]
