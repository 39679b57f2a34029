"""The tests mirror the package: the tests of mmcl/<package>/<module>.py are in tests/<package>/test_<module>.py
(mmcl/cli.py's in tests/cli/, mmcl/errors.py's in tests/), or the module is listed in `TESTED_ELSEWHERE` with the
file(s) that exercise it and why it has none of its own. Scenario suites that cross packages are in tests/e2e/;
checks of the repository as a whole (layout, docs, README, benchmarks, dependency pins) are at tests/ itself."""

from pathlib import Path

import mmcl

PACKAGE = Path(mmcl.__file__).parent
TESTS = Path(__file__).resolve().parent

# module (relative to mmcl/) -> (test files that exercise it, why it has no test file of its own)
TESTED_ELSEWHERE = {
    "config/checks.py": (["tests/config/test_config.py", "tests/config/test_config_facts.py"],
                         "the checks run inside load_config; each is tested through the key it refuses"),
    "config/keys.py": (["tests/config/test_config.py", "tests/cli/test_discoverable.py"],
                       "the key names and their help text, read through the config and `mmcl train --help`"),
    "config/load.py": (["tests/config/test_config.py", "tests/config/test_configs.py"],
                       "load_config is the config package's entry point: test_config.py is its test file"),
    "config/process.py": (["tests/e2e/test_distributed_elastic.py", "tests/e2e/test_gpu_path_launch.py"],
                          "the launcher's process variables, only meaningful under a real launch"),
    "config/schema.py": (["tests/config/test_config.py", "tests/config/test_config_facts.py"],
                         "the dataclasses of the config tree, tested through loading and the facts they share"),
    "models/naflex.py": (["tests/models/test_naflex_tower.py", "tests/e2e/test_naflex_journey.py"],
                         "test file names are unique across packages: tests/data/test_naflex.py has the data side's"),
    "curation/report.py": (["tests/curation/test_curate.py"], "curate's report.json, written by `mmcl curate`"),
    "curation/rules.py": (["tests/curation/test_curate.py"], "each rule against hand-computed decisions"),
    "data/batching.py": (["tests/data/test_pipeline.py", "tests/data/test_stream.py", "tests/training/test_phases.py"],
                         "a worker's batches, seen through the stream that builds them"),
    "data/eval_data.py": (["tests/data/test_data.py", "tests/data/test_shard_inputs.py",
                           "tests/evaluation/test_eval_names.py"], "evaluation datasets, by what evaluation reads"),
    "data/sizes.py": (["tests/e2e/test_first_contact.py", "tests/e2e/test_bounded_inputs.py"],
                      "sizes.json and the start lines describing each source, as a new user meets them"),
    "data/sources.py": (["tests/data/test_data.py", "tests/e2e/test_untrusted_shards.py"],
                        "URL and source expansion (test_data.py), pipe: and credentials (test_untrusted_shards.py)"),
    "data/writer.py": (["tests/data/test_data.py"], "shard writing, with the conversions to shards"),
    "evaluation/embed.py": (["tests/evaluation/test_evaluate.py", "tests/evaluation/test_index.py"],
                            "the embedding loops, through the zero-shot, retrieval and index results they give"),
    "evaluation/in_run.py": (["tests/evaluation/test_eval_sets.py"], "the evaluation sets a run scores on its steps"),
    "losses/inputs.py": (["tests/losses/test_objective.py", "tests/losses/test_supcon.py"],
                          "the Gathered batch and the input checks every loss runs, tested through the losses"),
    "losses/precision.py": (["tests/losses/test_losses_properties.py", "tests/e2e/test_gpu_path_losses.py"],
                             "half inputs computed in float32, checked through every loss it wraps"),
    "losses/errors.py": (["tests/losses/test_objective.py", "tests/losses/test_mochi.py"],
                         "LossInputError, raised by the input checks (test_errors.py is mmcl/errors.py's name)"),
    "models/clip_classes.py": (["tests/models/test_models.py"], "the model classes, against open_clip's"),
    "models/flip.py": (["tests/training/test_recipes.py", "tests/training/test_no_stalls.py"],
                       "FLIP patch dropout, a training recipe"),
    "models/resize.py": (["tests/training/test_phases.py"], "the position-embedding resize of token-reduction phases"),
    "models/towers.py": (["tests/models/test_models.py", "tests/models/test_tokenizers.py"],
                         "the towers and tokenizers that models.build assembles"),
    "storage/checkpoints.py": (["tests/training/test_loop.py", "tests/e2e/test_faults_train.py",
                                "tests/e2e/test_untrusted_files.py"], "checkpoints written and read by runs"),
    "storage/clip_tokenizer_file.py": (["tests/storage/test_export.py", "tests/storage/test_export_tokenizers.py"],
                                       "the exported tokenizer.json, against open_clip's tokenizer"),
    "storage/fsutil.py": (["tests/e2e/test_no_way_out.py", "tests/e2e/test_faults_train.py"],
                          "atomic writes and refused links, under faults and links"),
    "storage/layout.py": (["tests/training/test_runfolder.py", "tests/test_one_home.py"],
                          "the run folder's names; tests/test_layout.py is the package layout's test"),
    "storage/weights.py": (["tests/storage/test_locate.py", "tests/storage/test_export.py"],
                           "loading and saving model folders, through every model path"),
    "training/agree.py": (["tests/e2e/test_gpu_path_launch.py", "tests/e2e/test_faults_train.py"],
                          "the processes' agreement, only meaningful with several processes"),
    "training/build.py": (["tests/training/test_loop.py", "tests/config/test_configs.py"],
                          "what a run builds from its config, by training"),
    "training/console.py": (["tests/training/test_run_signals.py", "tests/e2e/test_first_contact.py"],
                            "the step lines and the progress bar a run prints"),
    "training/finish.py": (["tests/evaluation/test_eval_sets.py", "tests/training/test_runfolder.py"],
                           "the end of a run: evaluation and the summary"),
    "training/fsdp.py": (["tests/e2e/test_distributed_fsdp.py", "tests/e2e/test_gpu_path_launch.py"],
                         "FSDP2, on 2 CPU processes"),
    "training/preempt.py": (["tests/training/test_run_signals.py", "tests/e2e/test_faults_train.py"],
                            "stop signals and the exit codes they give"),
    "training/reinforce.py": (["tests/losses/test_distill.py", "tests/curation/test_curate.py"],
                              "`mmcl reinforce`'s stored teacher targets, used by distillation"),
    "training/teacher.py": (["tests/losses/test_distill.py", "tests/training/test_small_costs.py"],
                            "the distillation teacher, with the KL term it feeds"),
    "training/wise_ft.py": (["tests/storage/test_interpolate.py"],
                            "`mmcl interpolate`, with the interpolation it evaluates (storage/interpolate.py)"),
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


def test_test_file_names_are_unique_and_folders_mirror_the_package():
    files = sorted(TESTS.rglob("test_*.py"))
    names = [f.name for f in files]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    folders = {f.parent.name for f in files if f.parent != TESTS}
    assert folders <= packages | {"cli", "e2e"}, sorted(folders - packages)
    assert not list(TESTS.rglob("__init__.py"))  # rootdir-relative imports: helpers, spawned, ... from tests/
