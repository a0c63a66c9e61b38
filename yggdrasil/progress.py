"""Progress lines on stderr for long work (model loading, joining, compiling, calibrating).

Every line says the time spent so far and, once one unit of work is done, an estimate of the
time left from the rate so far. On a terminal the line redraws in place; elsewhere (logs, CI)
the start, every further tenth of the work and the end print, so captured output stays readable.

While a terminal bar is open, Python warnings (torch's included) would land in the middle of the
bar's line. So a bar routes them: it finishes its line, lets the warning print as it would have,
and redraws itself below it.
"""

from __future__ import annotations

import shutil
import sys
import time
import warnings
from typing import TextIO

BAR_WIDTH = 30  # at most; narrower when the terminal is (a wrapped line cannot redraw in place)
MIN_BAR_WIDTH = 10
REDRAW_SECONDS = 0.1  # terminal redraws at most this often
QUIET_SECONDS = 2.0  # non-terminal output: work quicker than this prints only start and end


def format_duration(seconds: float) -> str:
    """4.2s, 59s, 1m05s, 2h03m: short and fixed-form, for progress lines."""
    seconds = max(seconds, 0.0)
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def estimate_left(done: int, total: int, elapsed: float) -> float | None:
    """Seconds left at the rate so far; None until something is done."""
    if done <= 0:
        return None
    return max(total - done, 0) * elapsed / done


def timing(done: int, total: int, elapsed: float) -> str:
    """'12s elapsed, ~1m05s left' (no estimate before the first unit is done)."""
    left = estimate_left(done, total, elapsed)
    text = f"{format_duration(elapsed)} elapsed"
    return text if left is None or done >= total else f"{text}, ~{format_duration(left)} left"


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interactive = enabled and self.stream.isatty()
        self.started = time.perf_counter()
        self._last_draw = 0.0
        self._last_tenth = 0
        self._line_open = False  # a terminal bar is drawn and its line not yet ended
        self._closed = False
        self._drawn = 0  # characters of the bar's line drawn last
        self._previous_showwarning = warnings.showwarning
        self._routing = self.interactive  # warnings go through this bar while it is open
        if self.interactive:
            warnings.showwarning = self._show_warning
            self._draw(self.started)
        elif enabled:
            print(f"{label} ...", file=self.stream, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.close()
            return
        self._stop_routing_warnings()  # failed: end the bar's line so the error starts on its own
        if self._line_open:
            print(file=self.stream, flush=True)
        self._line_open, self._closed = False, True

    def update(self, done: int | None = None, step: int = 1) -> None:
        self.done = done if done is not None else self.done + step
        now = time.perf_counter()
        if self.interactive and (now - self._last_draw > REDRAW_SECONDS or self.done >= self.total):
            self._draw(now)
        tenth = 10 * min(self.done, self.total) // self.total
        if (self.enabled and not self.interactive and tenth > self._last_tenth
                and now - self.started >= QUIET_SECONDS):
            self._last_tenth = tenth
            print(f"{self.label}: {self.done}/{self.total} ({timing(self.done, self.total, now - self.started)})",
                  file=self.stream, flush=True)

    def close(self, note: str = "") -> float:
        elapsed = time.perf_counter() - self.started
        self._stop_routing_warnings()
        if self.enabled:
            text = f"{self.label}: done in {format_duration(elapsed)}" + (f" ({note})" if note else "")
            if self.interactive:  # over the bar, wiping what is longer
                text = "\r" + text + " " * max(self._drawn - len(text), 0)
            print(text, file=self.stream, flush=True)
        self._line_open, self._closed = False, True
        return elapsed

    def line(self, now: float, columns: int = 80) -> str:
        """The terminal bar as it reads at time `now`, kept shorter than `columns`."""
        room = columns - 4  # a margin: a line that wraps cannot redraw in place
        count = f"{self.done}/{self.total} {timing(self.done, self.total, now - self.started)}"
        if len(self.label) + len(count) + 4 + MIN_BAR_WIDTH > room:  # narrow: drop the word
            count = count.replace(" elapsed", "")
        # room for the longest count the bar will show, so the bar keeps its width as counts grow
        widest_count = len(f"{self.total}/{self.total} 59m59s elapsed, ~59m59s left")
        width = max(MIN_BAR_WIDTH, min(BAR_WIDTH, room - len(self.label) - max(len(count), widest_count) - 4))
        filled = int(width * min(self.done, self.total) / self.total)
        return f"{self.label} [{'#' * filled}{'-' * (width - filled)}] {count}"[:room]

    def _draw(self, now: float) -> None:
        self._last_draw = now
        # trailing spaces wipe what a longer previous draw left behind
        text = self.line(now, shutil.get_terminal_size().columns)
        print(f"\r{text}" + " " * max(self._drawn - len(text), 0), end="", file=self.stream, flush=True)
        self._drawn = len(text)
        self._line_open = True

    def _show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self._line_open:  # end the bar's line so the warning starts on its own
            print(file=self.stream, flush=True)
            self._line_open, self._drawn = False, 0
        self._previous_showwarning(message, category, filename, lineno, file, line)
        if self._routing:  # still open: the bar again, below the warning
            self._draw(time.perf_counter())

    def _stop_routing_warnings(self) -> None:
        if not self._routing:
            return
        self._routing = False
        if warnings.showwarning == self._show_warning:
            warnings.showwarning = self._previous_showwarning
        # else a later bar (or anyone) replaced it and will put ours back: ours then passes through
