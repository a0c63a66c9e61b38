"""Step timelines as Chrome/Perfetto traces (`--trace FILE` on generate and chat).

Two kinds of spans: the stages of each speculative iteration (draft, prune, verify, accept,
compact) on the "iteration" lane, and every model forward (its graph name, e.g. verify_w4 or
draft_step_w2) on the "target" or "draft" lane. The file is the Chrome trace event format
(complete events, ph "X", microseconds): open it in https://ui.perfetto.dev or chrome://tracing.
On CUDA a span synchronises the device when it ends, so device stages are timed whole (this
slows the run a little; a trace is for looking, not for benchmarking).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch

LANES = ("iteration", "target", "draft", "host")


class Tracer:
    def __init__(self, sync_cuda: bool = False) -> None:
        self._spans: list[tuple[str, str, float, float, int]] = []  # made into events when read
        self.iteration = -1  # -1 until the first speculative iteration (prefill, first token)
        self._sync = sync_cuda
        self._origin = time.perf_counter()
        self._pid = os.getpid()

    def next_iteration(self) -> int:
        self.iteration += 1
        return self.iteration

    def span(self, name: str, lane: str = "iteration") -> "_Span":
        return _Span(self, name, lane)

    def _record(self, name: str, lane: str, start: float, end: float) -> None:
        """One span, kept as it came (a trace of a benchmark times every forward: the event
        dicts are built when read, not in the loop)."""
        if self._sync:
            torch.cuda.synchronize()
            end = time.perf_counter()
        self._spans.append((name, lane, start, end, self.iteration))

    @property
    def events(self) -> list[dict]:
        """Every span so far as a Chrome trace event (complete event, microseconds)."""
        return [{"name": name, "cat": lane, "ph": "X", "pid": self._pid,
                 "tid": LANES.index(lane) if lane in LANES else len(LANES),
                 "ts": round((start - self._origin) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                 "args": {"iteration": iteration}} for name, lane, start, end, iteration in self._spans]

    def stage_counts(self, lane: str = "iteration") -> Counter:
        return Counter(name for name, span_lane, *_ in self._spans if span_lane == lane)

    def to_json(self) -> dict:
        names = [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": k, "args": {"name": lane}}
                 for k, lane in enumerate(LANES)]
        return {"traceEvents": names + self.events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        """Write the trace (atomically: a crash never leaves half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.to_json()))
        os.replace(partial, path)
        return path


class _Span:
    """One span being timed (a plain context object: spans wrap every forward, so a generator
    based context manager's overhead would land in the host time the trace splits)."""

    __slots__ = ("_tracer", "_name", "_lane", "_start")

    def __init__(self, tracer: Tracer, name: str, lane: str) -> None:
        self._tracer, self._name, self._lane = tracer, name, lane

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self._tracer._record(self._name, self._lane, self._start, time.perf_counter())


_NO_SPAN = contextlib.nullcontext()  # reusable: it holds nothing


class _NoTrace:
    """Stands in when tracing is off: spans cost one call."""

    iteration = -1

    def span(self, name: str, lane: str = "iteration"):
        return _NO_SPAN

    def next_iteration(self) -> int:
        return -1


NO_TRACE = _NoTrace()


@contextlib.contextmanager
def tracing(tracer: Tracer | None, runner, speculator=None):
    """Route a generation's spans to `tracer` (nothing changes when it is None): the target
    runner, the draft runner if the drafter has one, and the speculator's stages."""
    if tracer is None:
        yield
        return
    parts = [(runner, "target")]
    draft_runner = getattr(getattr(speculator, "drafter", None), "runner", None)
    if draft_runner is not None:
        parts.append((draft_runner, "draft"))
    for part, lane in parts:
        part.tracer, part.trace_lane = tracer, lane
    if speculator is not None:
        speculator.tracer = tracer
    try:
        yield
    finally:
        for part, _ in parts:
            part.tracer = NO_TRACE
        if speculator is not None:
            speculator.tracer = NO_TRACE
