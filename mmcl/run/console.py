"""The progress bar, the console lines printed while it is shown, and the line of each logged step.

A tqdm bar redraws its line in place (a carriage return, no newline). A line printed meanwhile by anything else (a
warning from the data workers, a log line of the loop) would start where the bar's text ends and share its line.
While the bar is shown, `progress_bar` routes stdout and stderr through the bar: each complete line is written
after the bar is cleared, and the bar is drawn again below it, as ``tqdm.write`` does.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, Optional

from tqdm import tqdm


class _ThroughBar:
    """A text stream that writes whole lines to `stream` with `bar` cleared around them."""

    def __init__(self, stream, bar):
        self.stream, self.bar, self.pending = stream, bar, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\n", 1)
            with self.bar.get_lock():
                self.bar.clear(nolock=True)
                self.bar.fp.flush()  # the cleared line reaches the console before the text that takes it
                self.stream.write(lines + "\n")
                self.stream.flush()
                self.bar.refresh(nolock=True)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding... of the console stream
        return getattr(self.stream, name)


def progress_bar(total: int, initial: int, held: Optional[contextlib.ExitStack] = None, **kwargs: Any):
    """A tqdm bar on stderr with stdout and stderr written through it until it is closed (or `held` unwinds, as
    when the run ends with an error)."""

    saved = (sys.stdout, sys.stderr)
    bar = tqdm(total=total, initial=initial, file=sys.stderr, **kwargs)
    sys.stdout, sys.stderr = _ThroughBar(saved[0], bar), _ThroughBar(saved[1], bar)

    def restore() -> None:
        if isinstance(sys.stdout, _ThroughBar) and sys.stdout.bar is bar:
            for through, stream in zip((sys.stdout, sys.stderr), saved):
                if through.pending:  # a partial line: after the bar, on its own line
                    stream.write(through.pending)
            sys.stdout, sys.stderr = saved

    close = bar.close

    def close_and_restore() -> None:
        close()
        restore()

    bar.close = close_and_restore
    if held is not None:
        held.callback(restore)
    return bar


def step_line(record: Dict[str, Any], total: int) -> str:
    """One logged step in words, from its metrics record, as open_clip's "Train Epoch ... Loss ... LR ..." lines:
    progress, samples, the loss and each of its terms, the learning rate, the logit scale, the throughput and the
    share of the time spent waiting for data, the model FLOPs utilisation (n/a where the device's peak is not
    known), and the samples and shards skipped so far (all processes)."""
    terms = ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in record.items() if k.startswith("loss/"))
    return (f"step {record['step']}/{total} ({record['step'] / total:.0%}) | samples {record['samples']} | "
            f"loss {record['loss']:.4f}" + (f" ({terms})" if terms else "") + f" | lr {record['lr']:.3e} | "
            f"logit scale {record['logit_scale']:.3f} | {record['samples_per_s']:.1f} samples/s | "
            f"data wait {record['data_time_frac']:.0%} | MFU {mfu_text(record.get('mfu'))} | "
            f"skipped {int(record.get('data/skipped_samples', 0))} samples, "
            f"{int(record.get('data/skipped_shards', 0))} shards")


def mfu_text(share: Optional[float]) -> str:
    return "n/a" if share is None else f"{share:.1%}"
