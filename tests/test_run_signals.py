"""What a run tells while it trains and how it ends: one text line per logged step (console and out.log), the exit
code of a stopped run on 1 and 2 processes under the launchers (no traceback), and the trackers' run names."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MICRO, ROOT, metrics

from mmcl.cli import main


@pytest.fixture(scope="module")
def demo(small_demo):
    return small_demo


def run_args(demo, out, *extra):
    return ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={demo['train']}",
            f"train.output_dir={out}", "eval.zeroshot=null", "train.progress=false", "train.plot=false",
            "data.shuffle_buffer=8", "data.batch_size=8", "data.workers=0", "train.save_every=0",
            "train.log_with=[]", *MICRO, *extra]


# ------------------------------------------------------------------------------------------ step lines
STEP_LINE = re.compile(r"mmcl: step (\d+)/(\d+) \((\d+)%\) \| samples (\d+) \| loss (\S+) \(clip (\S+)\) \| "
                       r"lr (\S+) \| logit scale (\S+) \| (\S+) samples/s \| data wait (\d+)%")


def _parsed(lines):
    out = []
    for ln in lines:
        m = STEP_LINE.fullmatch(ln)
        assert m, ln
        step, total, pct, samples = map(int, m.groups()[:4])
        loss, clip, lr, scale, sps = map(float, m.groups()[4:9])
        out.append({"step": step, "total": total, "pct": pct, "samples": samples, "loss": loss, "loss/clip": clip,
                    "lr": lr, "logit_scale": scale, "samples_per_s": sps, "data_time_frac": int(m.group(10)) / 100})
    return out


def _matches_metrics(parsed, rows):
    assert [p["step"] for p in parsed] == [r["step"] for r in rows]
    for p, r in zip(parsed, rows):
        assert p["samples"] == r["samples"] and p["total"] == 5 and p["pct"] == round(100 * r["step"] / 5)
        for key, tol in (("loss", 1e-4), ("loss/clip", 1e-4), ("logit_scale", 1e-3), ("samples_per_s", 0.1)):
            assert p[key] == pytest.approx(r[key], abs=tol), key
        assert p["lr"] == pytest.approx(r["lr"], rel=1e-3)
        assert p["data_time_frac"] == pytest.approx(r["data_time_frac"], abs=0.006)


def test_without_the_bar_each_logged_step_is_one_line_on_the_console_and_in_out_log(demo, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(run_args(demo, out, "train.steps=5", "train.log_every=2")) == 0
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("mmcl: step ")]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [2, 4, 5]  # every train.log_every steps, and the last
    _matches_metrics(_parsed(printed), rows)
    logged = [ln for ln in (out / "out.log").read_text().splitlines() if ln.startswith("mmcl: step ")]
    assert logged == printed


def test_with_the_bar_the_step_lines_go_to_out_log_only(demo, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(run_args(demo, out, "train.steps=5", "train.log_every=2", "train.progress=true")) == 0
    console = capsys.readouterr()
    assert "mmcl: step " not in console.out + console.err and "5/5" in console.err  # the bar
    logged = [ln for ln in (out / "out.log").read_text().splitlines() if ln.startswith("mmcl: step ")]
    _matches_metrics(_parsed(logged), metrics(out))
