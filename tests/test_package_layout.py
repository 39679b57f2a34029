"""The package's layout, held by reading its source (AST): rules that the next feature cannot break quietly.

1. Packages import in one declared order (`ORDER`, top to bottom), counting imports inside functions; there is no
   cycle among packages nor among modules. An import inside a function is allowed only for a dependency listed in
   `LAZY` with its reason (a heavy or optional one), and for the entry points' own commands.
2. No module imports another module's private name (``_name``), nor reads one through a module it imported.
3. Only `training/loop.py` and `training/setup.py` (and the config's own package) receive the whole training
   config; every other function takes its section or plain values.
4. The run's parts are frozen (`training.setup.Parts`); `training.state.RunState` is the one state that changes
   during a run (`training/state.py`).
5. Each run-folder name is spelled once (`storage/layout.py`); one is-main; one way to print a line.
The rules' own checker is tested on small made-up modules at the end.
"""

import ast
import os
import re
from collections import defaultdict
from pathlib import Path

import mmcl

PACKAGE = Path(mmcl.__file__).parent
# Top to bottom: a package imports only those below it (and its own modules).
ORDER = ["cli", "training", "curation", "run", "evaluation", "shards", "storage", "models", "data", "config",
         "losses", "errors"]
ENTRY_POINTS = {"__init__", "__main__", "cli.__init__"}  # above everything; may load commands lazily
# The only dependencies imported inside functions, each for its reason. An import of anything else inside a
# function (torch, open_clip, another mmcl module...) belongs at the top of its module.
LAZY = {
    "mmcl": "the entry points (mmcl/__init__.py's `load`, the CLI's commands) import a command's modules when it "
            "runs: `import mmcl`, `mmcl --help` and a mistyped argument answer without importing torch",
    "matplotlib": "plots only (`mmcl plot`, train.plot); about 0.5 s and a font cache on first import",
    "faiss": "the embedding index only (`mmcl index`, `mmcl search`)",
    "onnx": "the ONNX export only (an optional extra)",
    "onnxruntime": "checking the ONNX export only (an optional extra)",
    "sklearn": "the linear probe only",
    "peft": "LoRA only (model.lora)",
    "pyarrow": "parquet tables only (`mmcl shards` on .parquet)",
    "py3langid": "curation's language rule only",
    "mlflow": "the mlflow tracker only (train.log_with)",
}
assert len(LAZY) <= 10


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        yield ".".join(rel.parts), path


def _package_parts(name):
    return name.split(".")[:-1]


def _type_checking_ids(tree):
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            ids.update(id(n) for n in ast.walk(node))
    return ids


def _function_ids(tree):
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            ids.update(id(n) for n in ast.walk(node) if n is not node)
    return ids


def _exists(dotted):
    p = PACKAGE.joinpath(*dotted.split(".")) if dotted else PACKAGE
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports(name, path, text=None):
    """Every import of module `name`: (target, names, lineno, inside_a_function). An mmcl target is dotted without
    the ``mmcl.`` prefix ("" is the package itself); another is its top-level name prefixed with ``!``."""
    tree = ast.parse(text if text is not None else path.read_text())
    skip, inner = _type_checking_ids(tree), _function_ids(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        lazy = id(node) in inner
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = _package_parts(name)
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + (node.module.split(".") if node.module else []))
        elif isinstance(node, ast.ImportFrom):
            target = node.module[5:] if node.module.startswith("mmcl.") else (
                "" if node.module == "mmcl" else "!" + node.module.split(".")[0])
        else:
            for alias in node.names:
                top = alias.name.split(".")[0]
                target = alias.name[5:] if alias.name.startswith("mmcl.") else (
                    "" if alias.name == "mmcl" else "!" + top)
                out.append((target, [], node.lineno, lazy))
            continue
        names = [a.name for a in node.names]
        if not target.startswith("!"):
            # from package import module: each such name is a module import
            subs = [f"{target}.{n}" if target else n for n in names]
            mods = [s for s in subs if _exists(s)]
            if mods:
                for s in mods:
                    out.append((s, [], node.lineno, lazy))
                rest = [n for n, s in zip(names, subs) if s not in mods]
                if rest:
                    out.append((target, rest, node.lineno, lazy))
                continue
        out.append((target, names, node.lineno, lazy))
    return out


def room(target):
    """The package a dotted module belongs to ('' for the package itself)."""
    return target.split(".")[0] if target else "__init__"


def rank(module):
    if module in ENTRY_POINTS or module.split(".")[0] in ("__init__", "__main__"):
        return len(ORDER) + 1
    top = module.split(".")[0]
    return len(ORDER) - ORDER.index(top)


def order_problems(mods):
    problems = []
    for name, path in mods:
        for target, _, line, _ in imports(name, path):
            if target.startswith("!") or target == "":
                continue
            same = room(target) == name.split(".")[0]
            if not same and rank(target) >= rank(name):
                problems.append(f"mmcl/{name.replace('.', '/')}.py:{line} imports {target} (above or beside it)")
    return problems


def module_graph(mods):
    graph = defaultdict(set)
    for name, path in mods:
        for target, _, _, _ in imports(name, path):
            if target.startswith("!") or target in ("", name):
                continue
            t = target if _exists(target) else target.rsplit(".", 1)[0]
            if t.endswith("__init__"):
                t = t[:-9]
            graph[name.removesuffix(".__init__")].add(t)
    return graph


def cycles(graph):
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def lazy_problems(mods):
    problems = []
    for name, path in mods:
        for target, _, line, lazy in imports(name, path):
            if not lazy:
                continue
            dep = target[1:] if target.startswith("!") else "mmcl"
            if dep == "mmcl" and name in ENTRY_POINTS:
                continue
            if dep not in LAZY or dep == "mmcl":
                problems.append(f"mmcl/{name.replace('.', '/')}.py:{line} imports {target.lstrip('!') or 'mmcl'} "
                                f"inside a function")
    return problems


def private_problems(mods):
    problems = []
    for name, path in mods:
        text = path.read_text()
        tree = ast.parse(text)
        own = name.removesuffix(".__init__")
        module_aliases = {}
        for target, names, line, _ in imports(name, path):
            if target.startswith("!"):
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != own:
                    problems.append(f"mmcl/{name.replace('.', '/')}.py:{line} imports {target}.{n}")
            last = target.split(".")[-1] if target else "mmcl"
            if last.startswith("_") and not last.startswith("__"):
                problems.append(f"mmcl/{name.replace('.', '/')}.py:{line} imports the private module {target}")
            if not names and target != own:
                module_aliases[last] = target
        for node in ast.walk(tree):  # module._name
            if isinstance(node, ast.Import) or isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.asname and a.name.split(".")[-1] in module_aliases:
                        module_aliases[a.asname] = module_aliases[a.name.split(".")[-1]]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                problems.append(f"mmcl/{name.replace('.', '/')}.py:{node.lineno} reads "
                                f"{module_aliases[node.value.id]}.{node.attr}")
    return problems


MODS = list(modules())


def test_the_top_level_is_a_table_of_contents():
    top = sorted(p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "__pycache__")))
    assert top == sorted(["__init__.py", "__main__.py", "errors.py"] + [p for p in ORDER if p != "errors"])


def test_packages_import_in_the_declared_order_counting_imports_inside_functions():
    assert order_problems(MODS) == []


def test_no_cycle_among_modules():
    assert cycles(module_graph(MODS)) == []


def test_imports_inside_functions_only_for_the_listed_dependencies():
    assert lazy_problems(MODS) == []


def test_no_module_imports_another_modules_private_name():
    assert private_problems(MODS) == []


def test_the_readme_layout_names_every_module():
    """docs/design.md's Layout section draws the tree: each package there names each of its modules, so the tree a
    newcomer reads is the one on disk."""
    page = (PACKAGE.parent / "docs" / "design.md").read_text()
    block = page[page.index("\nmmcl/ ") + 1:]
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


def test_the_design_page_states_the_order():
    page = (PACKAGE.parent / "docs" / "design.md").read_text()
    assert " → ".join(f"`{p}`" for p in ORDER) in page


# The checker itself, on made-up modules: each rule sees a violation.

def _fake(tmp_path, name, text):
    path = tmp_path / (name.replace(".", "_") + ".py")
    path.write_text(text)
    return name, path


def test_the_checker_sees_an_upward_import_inside_a_function(tmp_path):
    mods = [_fake(tmp_path, "storage.m", "def f():\n    from ..training import loop\n")]
    assert order_problems(mods) == ["mmcl/storage/m.py:2 imports training.loop (above or beside it)"]
    assert lazy_problems(mods) == ["mmcl/storage/m.py:2 imports training.loop inside a function"]


def test_the_checker_sees_a_cycle_and_a_private_name(tmp_path):
    a = _fake(tmp_path, "data.sources", "from .reading import _x\n")
    b = _fake(tmp_path, "data.reading", "from . import sources\nsources._y\n")
    assert cycles(module_graph([a, b])) == [["data.reading", "data.sources"]]
    assert private_problems([a, b]) == ["mmcl/data/sources.py:1 imports data.reading._x",
                                        "mmcl/data/reading.py:2 reads data.sources._y"]


def test_the_checker_allows_a_listed_dependency_inside_a_function(tmp_path):
    mods = [_fake(tmp_path, "evaluation.m", "def f():\n    import faiss\n    import torch\n")]
    assert lazy_problems(mods) == ["mmcl/evaluation/m.py:3 imports torch inside a function"]


# Rule 3: the whole training config reaches loop.py, setup.py and the config package only.
SECTIONS = {"model", "data", "loss", "optim", "train", "eval", "distill", "track"}
WHOLE_CONFIG_HOMES = {"training.loop", "training.setup"}


def _sections_read(fn, param):
    """The config sections read through `param` in function `fn` (``param.<section>``, ``param.cfg.<section>``)."""
    seen = set()
    called = {id(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}  # model.train(), model.eval(): methods
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and node.attr in SECTIONS and id(node) not in called:
            base = node.value
            if isinstance(base, ast.Attribute) and base.attr == "cfg":
                base = base.value
            if isinstance(base, ast.Name) and base.id == param:
                seen.add(node.attr)
    return seen


def whole_config_problems(mods):
    problems = []
    for name, path in mods:
        if name in WHOLE_CONFIG_HOMES or name.startswith(("config.", "cli.")):  # the CLI loads it for `train`
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in fn.args.args + fn.args.kwonlyargs:
                note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                read = _sections_read(fn, arg.arg)
                named = arg.arg in ("cfg", "config", "run") and (not note or "TrainConfig" in note)
                if "TrainConfig" in note or len(read) >= 2 or (read and named):
                    problems.append(f"mmcl/{name.replace('.', '/')}.py:{fn.lineno} {fn.name}({arg.arg}) takes the "
                                    f"whole config" + (f" (reads {', '.join(sorted(read))})" if read else ""))
    return problems


def test_only_the_loop_and_setup_receive_the_whole_training_config():
    assert whole_config_problems(MODS) == []


def test_the_checker_sees_a_function_that_takes_the_whole_config(tmp_path):
    mods = [_fake(tmp_path, "training.end", "def f(run):\n    return run.cfg.eval, run.cfg.train.plot\n"
                                            "def g(ev):\n    return ev.every\n")]
    assert whole_config_problems(mods) == ["mmcl/training/end.py:1 f(run) takes the whole config (reads eval, train)"]


# Rule 5: one home for each run-folder name, one is-main, one way to say a line.
SAYS = {"config.process"}  # `say`; the CLI prints a command's results and its one error line


def layout_names():
    from mmcl.storage import layout

    return {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)}


def one_home_problems(mods):
    names, problems = layout_names(), []
    # Names that are also plain words elsewhere (a results key "model", a stage "latest") are matched only as a path
    # joined to a folder: the file names below are matched wherever they stand.
    spelled = {n for n in names if "." in n or "-" in n or n in ("COMPLETE",)}
    for name, path in mods:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if name != "storage.layout" and isinstance(node, ast.Constant) and node.value in spelled:
                problems.append(f"mmcl/{name.replace('.', '/')}.py:{node.lineno} spells {node.value!r}")
            if (isinstance(node, ast.Attribute) and node.attr == "is_main_process"
                    and not name.startswith("config.")):
                problems.append(f"mmcl/{name.replace('.', '/')}.py:{node.lineno} asks .is_main_process")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
                    and name not in SAYS and not name.startswith("cli")):
                problems.append(f"mmcl/{name.replace('.', '/')}.py:{node.lineno} prints")
    return problems


def test_each_run_folder_name_is_spelled_once_with_one_is_main_and_one_way_to_say_a_line():
    assert {".lock", "skipped.jsonl", "metrics.jsonl", "out.log", "config.yaml", "step-"} <= layout_names()
    assert one_home_problems(MODS) == []


def test_the_checker_sees_a_second_spelling_another_is_main_and_a_print(tmp_path):
    mods = [_fake(tmp_path, "run.lock", "LOCK = '.lock'\nif accelerator.is_main_process:\n    print('x')\n")]
    assert one_home_problems(mods) == ["mmcl/run/lock.py:1 spells '.lock'",
                                       "mmcl/run/lock.py:2 asks .is_main_process", "mmcl/run/lock.py:3 prints"]


# The mmcl modules the data package may use: plain values and errors, and storage's two file-system leaves (atomic
# writes, and the manifest that tells a command's files from the user's), which import only errors
# (BELOW_DATA).
DATA_MAY_IMPORT = ("config", "errors", "storage.fsutil", "storage.manifest")


def test_data_modules_import_only_the_modules_before_them():
    order = ["limits", "sources", "sizes", "reading", "decode", "skips", "transforms", "device_decode", "naflex",
             "pipeline", "batching", "stream", "eval_data", "shard_inputs"]
    folder = str(PACKAGE / "data")
    assert sorted(order + ["__init__"]) == sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py"))
    for i, name in enumerate(order):
        tree = ast.parse(open(os.path.join(folder, name + ".py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert node.module in order[:i], f"{name}.py imports .{node.module}"
            elif isinstance(node, ast.ImportFrom) and node.level == 2:
                assert node.module in DATA_MAY_IMPORT, f"{name}.py imports ..{node.module}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(m.split(".")[0] == "mmcl" for m in modules), f"{name}.py imports {modules}"
