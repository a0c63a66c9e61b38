"""KV memory under a budget (DESIGN §3.9, AdaptiveLLM): sizes, the host swap space, and what a
preemption costs.

When the pool cannot hold the next step, the engine preempts a request by one of two means:
- swap: copy the request's blocks (target and draft caches) to host memory and free them, then
  copy them back into fresh blocks when it resumes;
- recompute: free the blocks, and prefill the request's tokens again when it resumes.
It picks the cheaper by predicted cost. Both predictions are lines fitted to measurements taken
on this server at start-up (`calibrate_costs`): swap = a + b * bytes for the round trip, and
recompute = the sum over the server's prefill chunks of a + b * rows + c * context. Each
preemption's actual cost is measured too, so /metrics reports how far off the predictions are.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import InvalidRequestError
from ..model import KVCache, Transformer
from .goodput import LinearCost
from .pool import Segment, SlotPool, run_segments

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
    """K and V of every layer for one position."""
    cfg = model.config
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


@dataclass(frozen=True)
class PreemptionCosts:
    """Predicted seconds of preempting and resuming a request."""

    swap: LinearCost  # rows = bytes of one request's blocks; seconds of copying them out and back
    # one chunk, target and draft: gamma * rows + alpha * span + delta, where the span is the
    # slots the attention reads (up to the request's highest slot in the pool)
    prefill: LinearCost

    def swap_seconds(self, n_bytes: int) -> float:
        return self.swap.seconds(n_bytes)

    def recompute_seconds(self, tokens: int, chunk_size: int, span_floor: int = 0) -> float:
        """Prefilling tokens again in chunks; each chunk's span is at least span_floor (the
        slots other requests' blocks reach, since a resumed request's blocks land among them)."""
        return sum(self.prefill.seconds(min(chunk_size, tokens - start),
                                        max(start + min(chunk_size, tokens - start), span_floor))
                   for start in range(0, tokens, chunk_size))


@dataclass
class SwappedKV:
    """A preempted request's blocks, copied to host memory."""

    tensors: list[torch.Tensor]  # per cache, per layer: K then V [1, heads, blocks * block_size, dim]
    blocks: int
    n_bytes: int
    predicted_seconds: float  # the round trip, predicted when it was swapped out
    out_seconds: float


class KVStore:
    """The pool's blocks in every model's cache, and the host memory swapped blocks go to."""

    def __init__(self, pool: SlotPool, caches: list[KVCache], swap_budget: int) -> None:
        self.pool, self.caches, self.swap_budget = pool, caches, swap_budget
        self.block_bytes = pool.block_size * sum(
            2 * c.n_layers * c.k0.shape[1] * c.k0.shape[3] * c.k0.element_size() for c in caches)
        self.swapped_bytes = 0
        self._device = caches[0].k0.device

    def request_bytes(self, owner: int) -> int:
        return self.pool.held_blocks(owner) * self.block_bytes

    def swap_fits(self, n_bytes: int) -> bool:
        return self.swapped_bytes + n_bytes <= self.swap_budget

    def _slot_index(self, owner: int) -> torch.Tensor:
        n = self.pool.held_blocks(owner) * self.pool.block_size
        return self.pool.slots(owner, n).to(self._device)

    def swap_out(self, owner: int, predicted_seconds: float) -> SwappedKV:
        """Copy owner's blocks to the host and free them."""
        started = time.perf_counter()
        index, blocks = self._slot_index(owner), self.pool.held_blocks(owner)
        pin = self._device.type == "cuda"
        tensors = [t.index_select(2, index).to("cpu", non_blocking=pin)
                   for cache in self.caches for i in range(cache.n_layers) for t in cache.layer(i)]
        self._sync()
        self.pool.release(owner)
        swapped = SwappedKV(tensors, blocks, blocks * self.block_bytes, predicted_seconds,
                            time.perf_counter() - started)
        self.swapped_bytes += swapped.n_bytes
        return swapped

    def swap_in(self, owner: int, swapped: SwappedKV) -> float:
        """Copy the blocks back into fresh blocks of owner's; the seconds it took."""
        started = time.perf_counter()
        self.pool.reserve(owner, swapped.blocks * self.pool.block_size)
        index = self._slot_index(owner)
        host = iter(swapped.tensors)
        for cache in self.caches:
            for i in range(cache.n_layers):
                for t in cache.layer(i):
                    t.index_copy_(2, index, next(host).to(self._device, non_blocking=True))
        self._sync()
        self.discard(swapped)
        return time.perf_counter() - started

    def discard(self, swapped: SwappedKV) -> None:
        self.swapped_bytes -= swapped.n_bytes
        swapped.tensors = []

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


def calibrate_costs(store: KVStore, models: list[tuple[Transformer, KVCache]], chunk_size: int,
                    report: Callable[[str], None] = lambda message: None) -> PreemptionCosts:
    """Measure swap round trips and prefill chunks on a scratch owner of the empty pool."""
    pool = store.pool
    free = pool.free_blocks
    swap_points = []
    # between out and in a forward runs, as in serving, so the copies back do not find the
    # blocks still in the CPU's caches
    forward = lambda: _time_prefill(models, pool, 1, 0, owner=-2)  # noqa: E731
    for blocks in sorted({min(free - 1, n) for n in (1, 4, 16, 64)}):
        times = [_time_swap(store, blocks, forward) for _ in range(4)]  # the first warms up
        swap_points.append((blocks * store.block_bytes, statistics.median(times[1:])))
    report(f"swap: {swap_points[-1][0] / 2**20:.1f} MiB out and back in {swap_points[-1][1] * 1e3:.1f} ms")
    prefill_points = []
    far = max(0, min(free * pool.block_size - chunk_size, 4 * chunk_size))
    for rows in (chunk_size, max(1, chunk_size // 4)):
        for context in (0, far):
            times = [_time_prefill(models, pool, rows, context) for _ in range(3)]  # the first warms up
            prefill_points.append((rows, context + rows, statistics.mean(times[1:])))
    report(f"prefill: {chunk_size} tokens in {prefill_points[0][2] * 1e3:.1f} ms")
    return PreemptionCosts(LinearCost.fit(swap_points), fit_prefill(prefill_points))


def _time_swap(store: KVStore, blocks: int, between: Callable[[], object]) -> float:
    """Seconds to swap a scratch owner's blocks out and back in (not counting between())."""
    scratch = -1
    store.pool.reserve(scratch, blocks * store.pool.block_size)
    swapped = store.swap_out(scratch, 0.0)
    between()
    seconds = swapped.out_seconds + store.swap_in(scratch, swapped)
    store.pool.release(scratch)
    return seconds


def _time_prefill(models: list[tuple[Transformer, KVCache]], pool: SlotPool, rows: int, context: int,
                  owner: int = -1) -> float:
    """Seconds of one chunk of rows after context tokens, on a scratch owner of the empty pool."""
    scratch = owner
    pool.reserve(scratch, context + rows)
    started = time.perf_counter()
    for model, cache in models:
        run_segments(model, cache, pool, [Segment(scratch, (0,) * rows, context, "none")])
    if pool_device(models).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    pool.release(scratch)
    return seconds


def pool_device(models: list[tuple[Transformer, KVCache]]) -> torch.device:
    return models[0][1].k0.device


def fit_prefill(points: list[tuple[int, int, float]]) -> LinearCost:
    """Least squares of seconds over (rows, span), coefficients kept non-negative."""
    a = torch.tensor([[rows, span, 1.0] for rows, span, _ in points], dtype=torch.float64)
    b = torch.tensor([[seconds] for _, _, seconds in points], dtype=torch.float64)
    gamma, alpha, delta = torch.linalg.lstsq(a, b, driver="gelsd").solution.flatten().tolist()
    return LinearCost(max(alpha, 0.0), max(gamma, 0.0), max(delta, 0.0))
