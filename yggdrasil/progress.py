"""Progress lines on stderr for long work (model loading, joining, compiling).

On a terminal the line redraws in place; elsewhere (logs, CI) the start, every further tenth of
the work and the end print, so captured output stays readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


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
        if enabled and not self.interactive:
            print(f"{label} ...", file=self.stream, flush=True)

    def update(self, done: int | None = None, step: int = 1) -> None:
        self.done = done if done is not None else self.done + step
        now = time.perf_counter()
        if self.interactive and (now - self._last_draw > 0.1 or self.done >= self.total):
            self._last_draw = now
            width = 30
            filled = int(width * min(self.done, self.total) / self.total)
            bar = "#" * filled + "-" * (width - filled)
            print(f"\r{self.label} [{bar}] {self.done}/{self.total} {now - self.started:5.1f}s",
                  end="", file=self.stream, flush=True)
        tenth = 10 * min(self.done, self.total) // self.total
        if (self.enabled and not self.interactive and tenth > self._last_tenth
                and now - self.started >= 2.0):  # quick work prints only start and end
            self._last_tenth = tenth
            print(f"{self.label}: {self.done}/{self.total} ({now - self.started:.0f}s)",
                  file=self.stream, flush=True)

    def close(self, note: str = "") -> float:
        elapsed = time.perf_counter() - self.started
        if self.enabled:
            prefix = "\r" if self.interactive else ""
            suffix = f" ({note})" if note else ""
            print(f"{prefix}{self.label}: done in {elapsed:.1f}s{suffix}" + " " * 20,
                  file=self.stream, flush=True)
        return elapsed
