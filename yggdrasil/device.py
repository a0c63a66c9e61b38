"""What this device is and how to time work on it: shared by profiling, the planner, the
bundle manifest and the runtime's own start-up measurements."""

from __future__ import annotations

import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import InvalidRequestError


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
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)
