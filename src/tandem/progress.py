"""Progress bars that suit where they are written: a live tqdm bar on a terminal; in a redirected
log (stderr not a terminal), whole lines, at most one every LOG_INTERVAL_S across all bars of
the process plus the last state of each kept bar, never a carriage return or cursor move."""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable

from tqdm import tqdm

LOG_INTERVAL_S = 30.0


class LogLineBar(tqdm):
    """tqdm that writes plain lines: its refreshes are throttled to one line every `interval_s`
    (shared by every bar, so nested bars stay within it), and a bar kept after closing
    (leave=True) writes its final state once. A leave=False bar simply stops."""

    _last_line_at = float("-inf")  # class-wide: one budget for the whole process

    def __init__(self, *args: Any, interval_s: float | None = None, **kwargs: Any) -> None:
        self.interval_s = LOG_INTERVAL_S if interval_s is None else interval_s
        kwargs.setdefault("ascii", True)  # a log viewer may not be UTF-8
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        # msg is tqdm clearing its line (leave=False): a log keeps what it has
        if msg is not None or time.monotonic() - LogLineBar._last_line_at < self.interval_s:
            return False
        self._write_line()
        return True

    def close(self) -> None:
        if not self.disable and self.leave:
            self._write_line()
        self.leave = False  # the final line is written: tqdm must not redraw or end it
        super().close()

    def _write_line(self) -> None:
        LogLineBar._last_line_at = time.monotonic()
        self.fp.write(self.__str__() + "\n")
        self.fp.flush()


def is_terminal(stream: Any) -> bool:
    """Whether `stream` is an interactive terminal (a closed or odd stream is not)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def progress_bar(iterable: Iterable | None = None, **kwargs: Any) -> tqdm:
    """tqdm's signature (desc, total, initial, leave, disable, file, ...): a tqdm bar when its
    file (default stderr) is a terminal, else a LogLineBar (`interval_s` applies to it only)."""
    stream = kwargs["file"] = kwargs.get("file") or sys.stderr
    if is_terminal(stream):
        kwargs.pop("interval_s", None)
        return tqdm(iterable, **kwargs)
    return LogLineBar(iterable, **kwargs)
