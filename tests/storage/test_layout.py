"""The run folder's names (mmcl/storage/layout.py): each spelled once, and `RunLayout`'s paths built from them."""

from pathlib import Path

from mmcl.data.skips import SKIP_LOG
from mmcl.storage import layout
from mmcl.storage.checkpoints import CHECKPOINTS_DIR


def test_run_layout_gives_every_path_of_a_run_folder(tmp_path):
    run = layout.RunLayout(str(tmp_path / "run"))
    assert run.root == tmp_path / "run" and isinstance(run.root, Path)
    assert repr(run) == f"RunLayout({str(tmp_path / 'run')!r})"
    want = {"model": "model", "checkpoints": "checkpoints", "config": "config.yaml", "metrics": "metrics.jsonl",
            "out_log": "out.log", "eval_results": "eval_results.json", "param_groups": "param_groups.json",
            "wise_ft": "wise_ft", "skipped": SKIP_LOG}
    assert {k: getattr(run, k) for k in want} == {k: tmp_path / "run" / v for k, v in want.items()}
    assert run.checkpoints.name == CHECKPOINTS_DIR


def test_the_names_are_distinct_and_plain():
    names = [layout.MODEL, layout.CONFIG, layout.METRICS, layout.OUT_LOG, layout.EVAL_RESULTS, layout.PARAM_GROUPS,
             layout.WISE_FT, CHECKPOINTS_DIR, SKIP_LOG]
    assert len(set(names)) == len(names)
    assert all("/" not in n and not n.startswith(".") for n in names)
