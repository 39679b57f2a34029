"""The tests mirror the package: the tests of mmcl/<package>/<module>.py are in tests/<package>/test_<module>.py
(mmcl/errors.py's in tests/, the CLI package's own in tests/cli/test_cli.py), or, for at most a tenth of the
modules, the module is listed in `TESTED_ELSEWHERE` with the file(s) that exercise it and why it has none of its own.
Scenario suites that cross packages are in tests/e2e/; checks of the repository as a whole (layout, docs, README,
benchmarks, dependency pins) are at tests/ itself."""

from pathlib import Path

import mmcl

PACKAGE = Path(mmcl.__file__).parent
TESTS = Path(__file__).resolve().parent

# module (relative to mmcl/) -> (test files that exercise them, why the module has no test file of its own). At most
# a tenth of the modules (test_the_exceptions_are_at_most_a_tenth_of_the_modules).
TESTED_ELSEWHERE = {
    "config/process.py": (["tests/e2e/test_distributed_elastic.py", "tests/e2e/test_gpu_path_launch.py"],
                          "the launcher's process variables, only meaningful under a real launch"),
    "curation/reinforce.py": (["tests/losses/test_distill.py", "tests/curation/test_curate.py",
                               "tests/e2e/test_captioning_journey.py"],
                              "`mmcl reinforce`'s stored teacher targets, used by distillation, and its generated "
                              "captions, trained on"),
    "evaluation/embed.py": (["tests/evaluation/test_evaluate.py", "tests/evaluation/test_index.py"],
                            "the embedding loops, through the zero-shot, retrieval and index results they give"),
    "losses/errors.py": (["tests/losses/test_inputs.py", "tests/losses/test_objective.py"],
                         "LossInputError, raised by the input checks (test_errors.py is mmcl/errors.py's name)"),
    "models/naflex.py": (["tests/models/test_naflex_tower.py", "tests/e2e/test_naflex_journey.py"],
                         "test file names are unique across packages: tests/data/test_naflex.py has the data side's"),
    "training/end.py": (["tests/evaluation/test_eval_sets.py", "tests/run/test_folder.py"],
                        "the end of a run (final evaluation, model/, the summary): only a run reaches it"),
    "training/fsdp.py": (["tests/e2e/test_distributed_fsdp.py", "tests/e2e/test_gpu_path_launch.py"],
                         "FSDP2, on 2 CPU processes"),
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py") or rel.parts[0] in ("starter", "model_configs"):
            continue
        yield rel.as_posix()


def _own_test(rel: str) -> Path:
    parts = rel.split("/")
    name = f"test_{parts[-1]}"
    if len(parts) == 1:  # a top-level module: tests/test_errors.py, or its folder (tests/cli/test_cli.py)
        top = TESTS / name
        return top if top.is_file() else TESTS / parts[0][:-3] / name
    return TESTS.joinpath(*parts[:-1], name)


def test_every_module_has_its_test_file_or_says_where_it_is_tested():
    missing = [rel for rel in _modules() if not _own_test(rel).is_file() and rel not in TESTED_ELSEWHERE]
    assert not missing, "modules with no tests/<package>/test_<module>.py nor an entry in TESTED_ELSEWHERE: " + \
        ", ".join(missing)


def test_the_exceptions_name_real_modules_and_test_files_and_have_no_test_file_of_their_own():
    modules = set(_modules())
    for rel, (files, why) in TESTED_ELSEWHERE.items():
        assert rel in modules, f"{rel} is not a module of mmcl"
        assert not _own_test(rel).is_file(), f"{rel} has {_own_test(rel).relative_to(TESTS.parent)}: drop its entry"
        assert files and why, rel
        for f in files:
            assert (TESTS.parent / f).is_file(), f"{rel}: {f} does not exist"


def test_the_exceptions_are_at_most_a_tenth_of_the_modules():
    modules = list(_modules())
    assert len(TESTED_ELSEWHERE) <= len(modules) // 10, \
        f"{len(TESTED_ELSEWHERE)} modules have no test file of their own, at most {len(modules) // 10} of the " \
        f"{len(modules)} may: give some tests/<package>/test_<module>.py"


def test_test_file_names_are_unique_and_folders_mirror_the_package():
    files = sorted(TESTS.rglob("test_*.py"))
    names = [f.name for f in files]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    folders = {f.parent.name for f in files if f.parent != TESTS}
    assert folders <= packages | {"cli", "e2e"}, sorted(folders - packages)
    assert not list(TESTS.rglob("__init__.py"))  # rootdir-relative imports: helpers, spawned, ... from tests/
