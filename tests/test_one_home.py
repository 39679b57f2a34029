"""Facts spelled in one place: the run folder's names (`mmcl.storage.layout`), the launcher's process variables
(`mmcl.config.world`), and every repository path a message or comment names exists."""

import ast
import io
import re
import tokenize
from pathlib import Path

import mmcl

PACKAGE = Path(mmcl.__file__).parent
REPO = PACKAGE.parent

# A file name -> the one module that spells it.
FILE_HOMES = {"config.yaml": "storage/layout.py", "metrics.jsonl": "storage/layout.py", "out.log": "storage/layout.py",
              "eval_results.json": "storage/layout.py", "param_groups.json": "storage/layout.py",
              "skipped.jsonl": "storage/layout.py", ".lock": "storage/layout.py",
              "mmcl-manifest.json": "storage/layout.py"}
# Folder names that are also common words (a dict key "model"): caught where a path is built with them.
DIR_HOMES = {"model": "storage/layout.py", "wise_ft": "storage/layout.py", "checkpoints": "storage/layout.py"}
# open_clip_train's own run folder has a checkpoints/ too: its name is open_clip's, not mmcl's.
DIR_ELSEWHERE = {("storage/weights.py", "checkpoints")}
LAUNCH_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text(encoding="utf-8")


def _in_path(node, parents):
    """Whether string constant `node` names a path part: an operand of ``/``, or an entry of a tuple of names and
    constants (folder names, not a list of keys) that a loop walks."""
    parent = parents.get(node)
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return True
    return (isinstance(parent, (ast.Tuple, ast.List)) and isinstance(parents.get(parent), ast.For)
            and parents[parent].iter is parent and not all(isinstance(e, ast.Constant) for e in parent.elts))


def _misplaced(rel, text):
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if FILE_HOMES.get(node.value, rel) != rel:
            yield f"{rel}:{node.lineno}: {node.value!r} (its home is {FILE_HOMES[node.value]})"
        elif (DIR_HOMES.get(node.value, rel) != rel and (rel, node.value) not in DIR_ELSEWHERE
              and _in_path(node, parents)):
            yield f"{rel}:{node.lineno}: {node.value!r} (its home is {DIR_HOMES[node.value]})"
        elif node.value in LAUNCH_VARS and rel != "config/process.py":
            yield f"{rel}:{node.lineno}: {node.value!r} read outside mmcl.config.world"


def test_each_run_folder_name_and_launch_variable_has_one_home():
    problems = [p for rel, text in _sources() for p in _misplaced(rel, text)]
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_misplaced_name():
    found = list(_misplaced("training/x.py", 'import os\np = out / "model" / "config.yaml"\n'
                                             'for sub in ("wise_ft", DIR): pass\nr = os.environ.get("RANK")\n'))
    assert len(found) == 4, found
    assert not list(_misplaced("training/x.py", 'd = {"model": 1, "task": "wise_ft"}\nfor k in ("model", "m"): pass\n'))


_PATH = re.compile(r"(?<![\w/.-])((?:mmcl|docs|configs|launch)/[\w/*.-]*\.\w+)")


def _named_paths(text):
    """Paths in the repository named by the string constants and comments of a module."""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for m in _PATH.finditer(tok.string):
                yield tok.start[0], m.group(1).rstrip(".")


def test_every_repository_path_named_in_the_package_exists():
    missing = [f"{rel}:{line}: {path}" for rel, text in _sources() for line, path in _named_paths(text)
               if not any(REPO.glob(path))]
    assert not missing, "\n".join(missing)


def test_the_path_check_finds_a_stale_path():
    assert [p for _, p in _named_paths('x = 1  # see mmcl/optim.py and docs/design.md\n')] == [
        "mmcl/optim.py", "docs/design.md"]
