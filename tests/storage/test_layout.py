"""The run folder's names (mmcl/storage/layout.py): each spelled once, and `RunLayout`'s paths built from them."""

from pathlib import Path

from mmcl.storage import layout


def test_run_layout_gives_every_path_of_a_run_folder(tmp_path):
    run = layout.RunLayout(str(tmp_path / "run"))
    assert run.root == tmp_path / "run" and isinstance(run.root, Path)
    assert repr(run) == f"RunLayout({str(tmp_path / 'run')!r})"
    want = {"model": "model", "checkpoints": "checkpoints", "config": "config.yaml", "metrics": "metrics.jsonl",
            "out_log": "out.log", "eval_results": "eval_results.json", "param_groups": "param_groups.json",
            "wise_ft": "wise_ft", "skipped": "skipped.jsonl", "lock": ".lock"}
    assert {k: getattr(run, k) for k in want} == {k: tmp_path / "run" / v for k, v in want.items()}


def test_the_names_are_distinct_and_plain():
    names = [layout.MODEL, layout.CONFIG, layout.METRICS, layout.OUT_LOG, layout.EVAL_RESULTS, layout.PARAM_GROUPS,
             layout.WISE_FT, layout.SKIP_LOG, layout.LOCK, layout.MANIFEST, layout.CHECKPOINTS_DIR, layout.LATEST]
    assert len(set(names)) == len(names)
    assert all(n and "/" not in n and n == n.strip() for n in names)
    assert [n for n in names if n.startswith(".")] == [layout.LOCK]  # only the lock is hidden
    # a checkpoint's name, its set-aside name and its marker
    assert (layout.CKPT_PREFIX, layout.DAMAGED_PREFIX, layout.COMPLETE) == ("step-", "damaged-", "COMPLETE")
