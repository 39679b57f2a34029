"""The package's layout: the top level reads as a table of contents, and imports run one way,
cli -> training -> evaluation -> storage -> models, with data, losses, config and errors below; curation sits
between the command line and evaluation, beside training (neither imports the other)."""

import ast
from pathlib import Path

import mmcl

PACKAGE = Path(mmcl.__file__).parent
# Higher imports lower, never the other way round; a package may import its own modules.
RANK = {"cli": 6, "__main__": 6, "__init__": 6, "training": 5, "curation": 4.5, "evaluation": 4, "storage": 3,
        "models": 2, "data": 1, "losses": 0, "config": 0, "errors": 0}
# data's shard and demo writers claim their output folder through storage's two file-system leaves, which import
# nothing of mmcl but errors (and each other): they sit below data although they live with storage.
BELOW_DATA = {"storage.fsutil", "storage.manifest"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        yield ".".join(rel.parts), path


def _imports(name, path):
    """The mmcl modules (dotted, without the ``mmcl.`` prefix) that module `name` imports at run time."""
    tree = ast.parse(path.read_text())
    package = name.split(".")[:-1] if not name.endswith("__init__") else name.split(".")[:-1]
    type_checking = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            type_checking.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[:len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            if node.module is None or (PACKAGE.joinpath(*target).is_dir()):
                for alias in node.names:  # from . import a, b: a and b may be modules
                    sub = target + [alias.name]
                    yield ".".join(sub) if (PACKAGE.joinpath(*sub).with_suffix(".py").is_file()
                                            or PACKAGE.joinpath(*sub).is_dir()) else ".".join(target)
            else:
                yield ".".join(target)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for m in mods:
                if m and m.split(".")[0] == "mmcl":
                    yield ".".join(m.split(".")[1:]) or "__init__"


def test_the_top_level_is_a_table_of_contents():
    top = sorted(p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "__pycache__")))
    assert top == ["__init__.py", "__main__.py", "cli.py", "config", "curation", "data", "errors.py",
                   "evaluation", "losses", "models", "storage", "training"]


def test_the_readme_layout_names_every_module():
    """docs/design.md's Layout section draws the tree: each package there names each of its modules, so the tree a
    newcomer reads is the one on disk."""
    import re

    page = (PACKAGE.parent / "docs" / "design.md").read_text()
    block = page[page.index("\nmmcl/ cli.py") + 1:]
    block = block[:block.index("```")]
    rooms = {}
    for m in re.finditer(r"^  (\w+)/ +(.*?)(?=^  \w+/ |\Z)", block, re.M | re.S):
        rooms[m.group(1)] = m.group(2)
    packages = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert sorted(rooms) == packages
    for package in packages:
        for module in sorted((PACKAGE / package).glob("*.py")):
            if module.stem != "__init__":
                assert re.search(rf"(?<![\w.]){module.stem}(?!\w)", rooms[package]), \
                    f"docs/design.md's layout does not name {package}/{module.name}"


def test_imports_run_one_way():
    problems = []
    for name, path in _modules():
        room = name.split(".")[0]
        for target in _imports(name, path):
            other = target.split(".")[0]
            if not target or other == room:
                continue
            if target in BELOW_DATA and RANK[room] >= RANK["data"]:
                continue
            if room == "losses" or RANK[other] > RANK[room] or {room, other} == {"training", "curation"}:
                problems.append(f"{name} imports {target}")
    assert problems == []


def test_storage_leaves_below_data_import_only_errors():
    for leaf in BELOW_DATA:
        path = PACKAGE.joinpath(*leaf.split(".")).with_suffix(".py")
        assert set(_imports(leaf, path)) <= {"errors"} | BELOW_DATA, leaf


def test_the_losses_import_nothing_of_mmcl_and_resume_not_the_run():
    for name, path in _modules():
        if name.startswith("losses."):
            assert all(t.startswith("losses") for t in _imports(name, path)), name
    resume = PACKAGE / "training" / "resume.py"
    assert "training.loop" not in set(_imports("training.resume", resume))


def test_the_check_sees_a_violation(tmp_path):
    """The checker itself: an upward import is found."""
    fake = tmp_path / "m.py"
    fake.write_text("from ..training import loop\nfrom ..errors import ConfigError\n")
    assert list(_imports("storage.m", fake)) == ["training.loop", "errors"]
