"""Yggdrasil: a static-graph runtime for latency-optimal tree-based speculative decoding."""

import time

__version__ = "0.1.0"

# when the package was first imported: the CLI reports start-up latency against it
IMPORTED_AT = time.perf_counter()
