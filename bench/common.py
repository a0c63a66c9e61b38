"""Shared pieces for the benchmarks: environment, interleaved timing, statistics, output.

Conventions every benchmark follows:
  * progress goes to stderr, results to stdout;
  * the LAST stdout line is exactly one JSON object with every number and the environment,
    so scripts can take `tail -n 1` without parsing the table;
  * variants are timed interleaved (repeat → item → variant), so slow drift of the machine
    (thermal, background load) hits all variants alike instead of whichever ran last.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from yggdrasil.cpu import cpu_fingerprint

_STARTED = time.perf_counter()


# ---------------------------------------------------------------- environment

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def core_count() -> int:
    """Cores this process may run on (respects taskset/cgroup pinning, unlike os.cpu_count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_threads(n: int | None = None) -> int:
    n = n or core_count()
    torch.set_num_threads(n)
    return n


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def load_average() -> list[float] | None:
    """1/5/15-minute load: a busy machine (others' jobs) explains noisy numbers."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def git_head(root: Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD of the checkout this code runs from, whether tracked files differ from it); (None,
    None) when it does not run from a checkout (an install from a wheel)."""
    root = root or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())


def commit() -> str | None:
    """The checkout's commit, with "+dirty" when tracked files differ from it (None: not a checkout)."""
    head, dirty = git_head()
    return None if head is None else head + ("+dirty" if dirty else "")


def environment(**extra: Any) -> dict[str, Any]:
    """Where the numbers came from; extra keys (dtype, ...) are merged in."""

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{cpu_name()} ({core_count()} cores)",
        "cpu": cpu_name(),
        "cores": core_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "yggdrasil": _version("yggdrasil"),
        "load_average": load_average(),
        "isa_flags": list(cpu_fingerprint().features or ()),
        "commit": commit(),
        # the exact invocation, interpreter flags and -m included, and where it ran, so that
        # `yggdrasil bench reproduce` can run it again
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "cwd": str(Path.cwd()),
    }
    env.update(extra)
    return env


# ---------------------------------------------------------------- progress and timing

def log(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def best_mean_ms(fn: Callable[[int], Any], calls: int, repeats: int) -> float:
    """Best over repeats of the mean ms per call of fn(i), i = 0..calls-1 (one untimed pass first):
    a call may cycle through copies of its operands by i, so weights come from memory."""
    def all_calls() -> None:
        for i in range(calls):
            fn(i)

    all_calls()
    return 1e3 * min(timed(all_calls)[1] for _ in range(repeats)) / calls


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """(fn's result, wall seconds): bench's one clock; every suite times through it."""
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - started


@dataclass
class Sample:
    """One timed run: which repeat, which item (prompt, ...), which variant, and its numbers."""

    repeat: int
    item: int
    variant: str
    values: dict[str, Any] = field(default_factory=dict)


def interleaved(repeats: int, n_items: int, variants: dict[str, Callable[[int], dict]],
                rotate: bool = True, label: str = "") -> list[Sample]:
    """Run every variant on every item, repeat times, as repeat → item → variant.

    variants maps name → fn(item index) → dict of numbers. With rotate, the variant order shifts
    by one each repeat so no variant always runs first (right after a different item's work).
    """
    names = list(variants)
    samples = []
    for r in range(repeats):
        shift = r % len(names) if rotate else 0
        order = names[shift:] + names[:shift]
        for i in range(n_items):
            for name in order:
                log(f"{label}repeat {r + 1}/{repeats} item {i + 1}/{n_items} {name}")
                samples.append(Sample(r, i, name, variants[name](i)))
    return samples


def paired_ratios(samples: Sequence[Sample], num: str, den: str, key: str) -> list[float]:
    """num/den of `key` for each (repeat, item) both variants ran on: pairs share machine state."""
    den_at = {(s.repeat, s.item): s.values[key] for s in samples if s.variant == den}
    return [s.values[key] / den_at[(s.repeat, s.item)] for s in samples
            if s.variant == num and (s.repeat, s.item) in den_at and den_at[(s.repeat, s.item)]]


# ---------------------------------------------------------------- statistics

def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median plus spread: min–max always, quartiles once there are enough points to mean much."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    q1 = q3 = None
    if len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"n": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values), "q1": q1, "q3": q3}


def scaled(summary: dict, factor: float, digits: int = 3) -> dict:
    """The same summary with every value multiplied (e.g. seconds → ms), counts untouched."""
    return {k: (v if k == "n" or v is None else round(v * factor, digits))
            for k, v in summary.items()}


# ---------------------------------------------------------------- output

def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table's lines; cells as given (None as '-')."""
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain aligned columns: text left, everything else right (numbers line up)."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(not isinstance(row[i], str) or _looks_numeric(row[i]) for row in rows)
               for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(row, widths, numeric)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return text == "-"


def emit_json(result: dict, out: str | Path | None = None) -> None:
    """Pretty JSON to `out` (if given), then the compact one-line JSON as stdout's last line."""
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        log(f"wrote {path}")
    sys.stdout.flush()
    print(json.dumps(result, separators=(",", ":"), default=str), flush=True)


# ---------------------------------------------------------------- machine load

def timed_cpu(fn, *args, **kwargs):
    """(result, wall seconds, process CPU seconds): CPU / wall well below the thread count means
    the process was starved (other load on the machine), so that sample's time is suspect."""
    cpu = time.process_time()
    result, wall = timed(fn, *args, **kwargs)
    return result, wall, time.process_time() - cpu


def cpu_snapshot() -> tuple[float, float, float, float] | None:
    """(machine busy s, machine total s, machine steal s, this process's CPU s), or None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq
    return busy / hz, (busy + idle + iowait + steal) / hz, steal / hz, time.process_time()


