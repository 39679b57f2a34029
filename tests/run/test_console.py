"""The console (mmcl/run/console.py): a logged step's line, and lines printed while the progress bar is shown
written whole above it, never on the bar's line."""

import contextlib
import io
import sys

from mmcl.run import console


def test_step_line_reads_the_record_in_open_clips_order():
    record = {"step": 25, "samples": 3200, "loss": 1.234567, "loss/clip": 1.0, "loss/distill": 0.234567,
              "lr": 0.000512, "logit_scale": 14.28571, "samples_per_s": 812.345, "data_time_frac": 0.125,
              "data/skipped_samples": 7, "data/skipped_shards": 1}
    assert console.step_line(record, 100) == (
        "step 25/100 (25%) | samples 3200 | loss 1.2346 (clip 1.0000, distill 0.2346) | lr 5.120e-04 | "
        "logit scale 14.286 | 812.3 samples/s | data wait 12% | MFU n/a | skipped 7 samples, 1 shards")
    del record["loss/clip"], record["loss/distill"]
    assert " | loss 1.2346 | lr" in console.step_line(record, 100)


class _Console(io.StringIO):
    def isatty(self):
        return False


def test_lines_printed_while_the_bar_is_shown_are_written_whole_and_the_streams_come_back(monkeypatch):
    out, err = _Console(), _Console()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    bar = console.progress_bar(10, 2, ascii=True, ncols=40)
    assert sys.stdout is not out and sys.stderr is not err and sys.stdout.isatty() is False
    print("first line")
    sys.stdout.write("part")
    assert "part" not in out.getvalue()  # a partial line waits for its end
    sys.stdout.write(" two\n")
    print("a warning", file=sys.stderr)
    bar.update(3)
    bar.close()
    assert sys.stdout is out and sys.stderr is err
    assert out.getvalue() == "first line\npart two\n"
    assert "a warning\n" in err.getvalue() and "5/10" in err.getvalue()
    for line in err.getvalue().replace("\r", "\n").splitlines():
        assert not (("a warning" in line) and ("/10" in line)), line  # never on the bar's line


def test_a_partial_line_is_kept_and_the_streams_come_back_when_the_run_unwinds(monkeypatch):
    out, err = _Console(), _Console()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with contextlib.ExitStack() as held:
        console.progress_bar(5, 0, held=held, ascii=True)
        sys.stdout.write("no newline")
    assert sys.stdout is out and sys.stderr is err
    assert out.getvalue() == "no newline"
