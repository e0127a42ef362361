"""A progress bar with an ETA on stderr, without a dependency.

On a terminal the bar is redrawn in place; anywhere else (CI logs, a pipe) it
prints one line each time another ~5% is done, and at the end, so a log shows
progress without thousands of lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

_WIDTH = 24
_LOG_STEPS = 20  # one line per 1/20 = 5% when not on a terminal


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``2h07m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def render(done: int, total: int, failed: int, elapsed: float, label: str = "prewarm") -> str:
    """One progress line: bar, counts, rate and ETA (the rate counts variants finished in this run)."""
    fraction = done / total if total else 1.0
    filled = int(fraction * _WIDTH)
    bar = "#" * filled + "." * (_WIDTH - filled)
    rate = done / elapsed if elapsed > 0 else 0.0
    if done >= total:
        eta = f"took {format_duration(elapsed)}"
    elif done:
        eta = f"ETA {format_duration((total - done) / rate)}"
    else:
        eta = "ETA --"
    fail = f" {failed} failed" if failed else ""
    return f"{label} [{bar}] {done}/{total} {fraction:4.0%}{fail} {rate:.2f}/s {eta}"


class Progress:
    """Counts finished variants and shows them on ``stream``."""

    def __init__(self, total: int, stream: TextIO, label: str = "prewarm",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.stream = stream
        self.label = label
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.failed = 0
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._logged_step = -1

    def begin(self) -> None:
        """Show the empty bar (0 done)."""
        self._show()

    def step(self, failed: bool = False) -> None:
        """One more variant finished (built or failed)."""
        self.done += 1
        self.failed += int(failed)
        self._show()

    def _show(self) -> None:
        line = render(self.done, self.total, self.failed, self.clock() - self.start, self.label)
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if self.done >= self.total else ""))
            self.stream.flush()
            return
        step = self.done * _LOG_STEPS // self.total if self.total else _LOG_STEPS
        if step > self._logged_step:
            self._logged_step = step
            self.stream.write(line + "\n")
            self.stream.flush()

    def note(self, message: str) -> None:
        """Print a message (a failure) without breaking the bar."""
        self.stream.write(("\r\033[K" if self.tty else "") + message + "\n")
        if self.tty and self.done < self.total:
            self._show()
        self.stream.flush()
