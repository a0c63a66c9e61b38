"""What this device is and how to time work on it: shared by profiling, the planner, the
bundle manifest and the runtime's own start-up measurements; and what else was running on the
machine while something was timed (for telling a quiet measurement from a disturbed one)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from yggdrasil.errors import InvalidRequestError


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def check_device(device: str) -> None:
    """A CUDA device asked for on a machine without one is refused before anything loads."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"--device {device} was asked for but CUDA is not available here")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def device_sync(device: torch.device) -> Callable[[], None]:
    """What to call before reading the clock so that queued GPU work is counted."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1,
                sync: Callable[[], None] = lambda: None) -> tuple[float, float, float]:
    """(median, min, max) seconds of fn over `repeats` runs after `warmup` untimed ones."""
    times = timed_runs(fn, repeats, warmup, sync)
    return statistics.median(times), min(times), max(times)


def timed_runs(fn: Callable[[], Any], repeats: int, warmup: int = 1,
               sync: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of each of `repeats` runs of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def relative_spread(times: list[float], floor: float = 1e-3) -> float:
    """How far repeated timings of the same work disagree: (max - min) / median, with the
    slowest fifth of the runs left out once there are 5 or more (one stray pause in five is not
    a busy machine, nor three in a profile's 15 rounds). The median is floored at `floor`
    seconds, where timer jitter dominates."""
    ordered = sorted(times)
    top = ordered[-1 - len(ordered) // 5] if len(ordered) >= 5 else ordered[-1]
    return (top - ordered[0]) / max(statistics.median(ordered), floor)


# ---- what else is running: counters read before and after a measurement -----------------------

@dataclass(frozen=True)
class CpuSnapshot:
    """Counters at one moment: the wall clock, this process's CPU time (all its threads) and,
    where /proc/stat exists, the busy, stolen and total time of the CPUs this process may run
    on (seconds since boot, everyone's)."""

    wall: float
    process: float
    cpus: int
    busy: float | None = None
    steal: float | None = None
    total: float | None = None


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None


def _proc_stat_times(allowed: set[int] | None) -> tuple[float, float, float] | None:
    """(busy, steal, total) seconds over the allowed CPUs' lines of /proc/stat (the machine-wide
    line where the per-CPU ones are not there); None without /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    rows = []
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and (allowed is None or int(name[3:]) in allowed):
            rows.append([int(x) for x in fields[:8]])
    if not rows:
        rows = [[int(x) for x in line.split()[1:9]] for line in lines if line.startswith("cpu ")]
    if not rows:
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user)
    user, nice, system, idle, iowait, irq, softirq, steal = (sum(col) for col in zip(*rows))
    busy = user + nice + system + irq + softirq
    return busy / tick, steal / tick, (busy + idle + iowait + steal) / tick


def cpu_snapshot() -> CpuSnapshot:
    allowed = _allowed_cpus()
    cpus = len(allowed) if allowed else (os.cpu_count() or 1)
    times = _proc_stat_times(allowed)
    snap = CpuSnapshot(time.perf_counter(), time.process_time(), cpus)
    return snap if times is None else replace(snap, busy=times[0], steal=times[1], total=times[2])


@dataclass(frozen=True)
class CpuWindow:
    """What else ran between two snapshots: cores' worth of CPU time other processes used,
    the share of CPU time the hypervisor stole (None where unknown), the 1-minute load average
    at the end, and the CPUs this process may use."""

    others_cores: float | None
    steal: float | None
    load: float | None
    cpus: int


def cpu_window(before: CpuSnapshot, after: CpuSnapshot) -> CpuWindow:
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    elapsed = after.wall - before.wall
    if before.busy is None or after.busy is None or elapsed < 0.05:  # /proc/stat counts in 10 ms ticks
        return CpuWindow(None, None, load, after.cpus)
    ours = after.process - before.process
    others = max(0.0, (after.busy - before.busy) - ours) / elapsed
    total = after.total - before.total
    steal = (after.steal - before.steal) / total if total > 0 else 0.0
    return CpuWindow(others, steal, load, after.cpus)


def reference_seconds(device: torch.device, repeats: int = 5) -> float:
    """Median time of a fixed matmul: run before and after a measurement, a change between the
    two says the machine's load changed while it was being measured."""
    if device.type == "cuda":  # the device's own clock: a wall-clocked small matmul is launch latency
        a = torch.full((2048, 2048), 0.5, dtype=torch.bfloat16, device=device)
        torch.mm(a, a)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, a)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    a = torch.full((256, 256), 0.5, device=device)
    return statistics.median(timed_runs(lambda: torch.mm(a, a), repeats, sync=device_sync(device)))


BANDWIDTH_BYTES = 256 * 2**20  # well past any CPU's last-level cache: the copy streams from memory


def memory_bandwidth(seconds: float = 1.0) -> float:
    """Bytes per second this machine moves between memory and its cores with torch's threads:
    repeated copies of a 256 MiB buffer for about `seconds`, counting what is read and written,
    the fastest copy's rate (interference only slows a copy down). A decode step on a CPU reads
    every weight once, so weight bytes over this is its floor (compile's formats phase, and what
    compile expects of a machine it has not been measured on)."""
    src = torch.ones(BANDWIDTH_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of both buffers' pages: not a rate
    fastest, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        dst.copy_(src)
        fastest = min(fastest, time.perf_counter() - started)
    return 2 * BANDWIDTH_BYTES / fastest


def last_level_cache_bytes(default: int = 64 * 2**20) -> int:
    """The largest data cache one core reaches (sysfs; `default` where it cannot be read):
    weights beyond a few times this are read from memory on every step."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() in ("Unified", "Data"):
                text = (index / "size").read_text().strip().upper()
                sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]] if text[-1] in "KMG"
                             else int(text))
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes, default=default)
