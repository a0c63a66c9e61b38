"""Yggdrasil: a static-graph runtime for latency-optimal tree-based speculative decoding."""

import os
import time

__version__ = "0.1.0"

# when the package was first imported: the CLI reports start-up latency against it
IMPORTED_AT = time.perf_counter()


def _process_started_at() -> float | None:
    """When this process started, on IMPORTED_AT's clock (Linux: /proc/self/stat's start time
    against CLOCK_BOOTTIME, 10 ms ticks), so start-up figures include Python's own start; None
    where the system does not say."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return IMPORTED_AT - age if 0 <= age < 3600 else None


PROCESS_STARTED_AT = _process_started_at()
