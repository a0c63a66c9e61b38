"""KV memory under a budget (docs/design.md §3.9, AdaptiveLLM): sizes, the host swap space, and what a
preemption costs.

When the pool cannot hold the next step, the engine preempts a request by one of two means:
- swap: copy the request's blocks (target and draft caches) to host memory and free them, then
  copy them back into fresh blocks when it resumes;
- recompute: free the blocks, and prefill the request's tokens again when it resumes.
It picks the cheaper by predicted cost. Both predictions are lines fitted to measurements taken
on this server at start-up (`calibrate_costs`): swap = a + b * bytes for the round trip, and
recompute = the sum over the server's prefill chunks of a + b * rows + c * context. Each
preemption's actual cost is measured too, so /metrics reports how far off the predictions are.
The measuring itself is in calibrate.py.
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from yggdrasil.errors import InvalidRequestError
from yggdrasil.models.model import KVCache, Transformer
from yggdrasil.models.tensor_parallel import unsharded_config
from .pool import SlotPool

PREEMPTION_MODES = ("auto", "swap", "recompute")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
          "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str, option: str) -> int | None:
    """'auto' -> None; '512MiB', '2G' (binary), '1.5GB' (decimal) or a plain count -> bytes."""
    if text.strip().lower() == "auto":
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise InvalidRequestError(f"{option} must be 'auto' or a size such as 512MiB, 2GiB or 1500000000, "
                                  f"got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def kv_bytes_per_token(model: Transformer) -> int:
    """K and V of every layer for one position (a tensor-parallel target's on all its ranks)."""
    cfg = unsharded_config(model)
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * torch.finfo(model.dtype).bits // 8


def available_memory(device: torch.device) -> int:
    """Bytes free for KV now: the GPU's free memory, or on CPU the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_memory()


def host_available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30  # no /proc (not Linux): assume a small machine


@dataclass
class SwappedKV:
    """A preempted request's blocks, copied to host memory: each cache keeps its copy under `key`
    (KVCache.swap_out; a tensor-parallel target's on every rank)."""

    key: int
    blocks: int
    n_bytes: int
    out_seconds: float


class KVStore:
    """The pool's blocks in every model's cache, and the host memory swapped blocks go to.
    block_bytes: what one block holds over every model (default: these caches' own; a
    tensor-parallel target's cache holds only rank 0's K/V heads, so its whole size is given)."""

    def __init__(self, pool: SlotPool, caches: list[KVCache], swap_budget: int, block_bytes: int | None = None) -> None:
        self.pool, self.caches, self.swap_budget = pool, caches, swap_budget
        self.block_bytes = block_bytes or pool.block_size * sum(c.nbytes() // c.capacity for c in caches)  # batch-1
        self.swapped_bytes = 0
        self._device = caches[0].k0.device
        self._keys = itertools.count()

    def request_bytes(self, owner: int) -> int:
        return self.pool.held_blocks(owner) * self.block_bytes

    def swap_fits(self, n_bytes: int) -> bool:
        return self.swapped_bytes + n_bytes <= self.swap_budget

    def _slot_index(self, owner: int) -> torch.Tensor:
        n = self.pool.held_blocks(owner) * self.pool.block_size
        return self.pool.slots(owner, n).to(self._device)

    def swap_out(self, owner: int) -> SwappedKV:
        """Copy owner's blocks to the host and free them."""
        started = time.perf_counter()
        index, blocks, key = self._slot_index(owner), self.pool.held_blocks(owner), next(self._keys)
        for cache in self.caches:
            cache.swap_out(key, index)
        self._sync()
        self.pool.release(owner)
        swapped = SwappedKV(key, blocks, blocks * self.block_bytes, time.perf_counter() - started)
        self.swapped_bytes += swapped.n_bytes
        return swapped

    def swap_in(self, owner: int, swapped: SwappedKV) -> float:
        """Copy the blocks back into fresh blocks of owner's; the seconds it took."""
        started = time.perf_counter()
        self.pool.reserve(owner, swapped.blocks * self.pool.block_size)
        index = self._slot_index(owner)
        for cache in self.caches:
            cache.swap_in(swapped.key, index)
        self._sync()
        self.swapped_bytes -= swapped.n_bytes
        return time.perf_counter() - started

    def discard(self, swapped: SwappedKV) -> None:
        """Forget a swapped request's copies (it will not resume)."""
        for cache in self.caches:
            cache.drop(swapped.key)
        self.swapped_bytes -= swapped.n_bytes

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
