"""The documentation: a short README that points into docs/, and a docs/ site that MkDocs builds in strict mode
(every link and anchor resolves), with every page in the navigation."""

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

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
