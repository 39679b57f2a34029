"""A run with negative captions from the data, start to end: demo shards copied with rule negatives
(`mmcl negatives`), then `mmcl train` with configs/negatives.yaml's setting (data.negatives) reading them."""

import json
import math

import pytest

from mmcl.cli import main

from helpers import metrics, short_run


@pytest.mark.slow
def test_a_run_trains_on_the_negatives_mmcl_negatives_wrote(small_demo, tmp_path, capsys):
    out = tmp_path / "neg-shards"
    assert main(["negatives", "--input", small_demo["train"], "--out", str(tmp_path / "all"), "--no-progress",
                 "--rules", "attributes,objects,order"]) == 0
    assert json.loads(capsys.readouterr().out)["with_negatives"] == 64  # every demo caption can be shuffled
    assert main(["negatives", "--input", small_demo["train"], "--out", str(out), "--no-progress"]) == 0
    swapped = json.loads(capsys.readouterr().out)["with_negatives"]
    assert 0 < swapped < 64  # by default swaps only: the captions with two things to exchange
    run = tmp_path / "run"
    assert main(short_run(str(out / "*.tar"), run, "data.negatives=2", "loss.chunk_size=4")) == 0
    lines = [m for m in metrics(run) if "loss" in m]
    assert len(lines) == 2 and all(math.isfinite(m["loss"]) for m in lines)
    assert (run / "model" / "open_clip_model.safetensors").is_file()
