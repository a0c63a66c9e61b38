"""Start-up measurements of what the serve engine's choices cost on this device, taken on scratch
owners of the empty pool with the engine's own forwards (compiled or eager, as it serves):

- measure_step_costs: the goodput rule's step-time curves (docs/design.md §3.8). The bundle's profile
  times its single-request graphs, while serve runs its pool graph (or eager forwards) over the
  pool, so the engine measures its own forwards: the target over 1 to max-batch x (deepest
  draft + 1) verify rows, the draft over 1 and max-batch rows.
- calibrate_costs: swap round trips and prefill chunks, for choosing how to preempt (§3.9).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from yggdrasil.policy.costs import LinearStepModel, PreemptionCosts, StepCurve
from .goodput import StepCostModel
from .memory import KVStore
from .pool import PoolForward, Segment, SlotPool

Models = list[PoolForward]  # target first, then the draft model if there is one


def measure_step_costs(models: Models, pool: SlotPool, max_rows: int, draft_rows: int,
                       report: Callable[[str], None] = lambda message: None,
                       prefill_rows: int = 0) -> StepCostModel:
    """Curves over rows for a verify forward of the target and a draft step of the draft model
    (None when there is no draft model: lookup costs nothing on the device). With prefill_rows,
    the target's curve reaches max_rows + prefill_rows too: steps that carry a prompt chunk are
    then interpolated, not extrapolated from the decode sizes."""
    capacity = pool.free_blocks * pool.block_size  # no step has more rows than the pool has slots
    max_rows = min(max_rows, capacity)
    widest = min(max_rows + prefill_rows, capacity)
    context = max(0, min(128, capacity - widest))
    sizes = {r for r in (1, 2, 4, 8, 16, 32) if r < max_rows} | {max_rows, widest}
    target = _rows_curve(models[:1], pool, sorted(sizes), context)
    draft = _rows_curve(models[1:2], pool, sorted({1, draft_rows}), context) if len(models) > 1 else None
    report(f"step: {max_rows} verify rows in {target(max_rows) * 1e3:.1f} ms, 1 in {target(1) * 1e3:.1f} ms"
           + (f"; draft step {draft(draft_rows) * 1e3:.1f} ms" if draft else ""))
    return StepCostModel(target, draft)


def _rows_curve(models: Models, pool: SlotPool, sizes: list[int], context: int) -> StepCurve:
    """Measured times over rows, interpolated between them: on a CPU a forward costs about the
    same for 1 to 8 rows and then grows, which no single line fits."""
    measures = [lambda rows=rows: time_forward(models, pool, rows, context, logits="all") for rows in sizes]
    for measure in measures * 2:  # a fresh process's first forwards run up to 2x slow (allocations, threads)
        measure()
    times = [_repeated(measure) for measure in measures]
    return StepCurve(tuple(sizes), tuple(times))


def _repeated(measure: Callable[[], float]) -> float:
    """A warm-up run, then the median of 3 timed runs, or 1 when a run takes over 0.3 s (big
    models on a CPU: their times are steadier, and start-up should stay short)."""
    warm = measure()
    runs = [measure() for _ in range(1 if warm > 0.3 else 3)]
    return statistics.median(runs)


def calibrate_costs(store: KVStore, models: Models, chunk_size: int,
                    report: Callable[[str], None] = lambda message: None) -> PreemptionCosts:
    """Measure swap round trips and prefill chunks on a scratch owner of the empty pool."""
    pool = store.pool
    free = pool.free_blocks
    swap_points = []
    # between out and in a forward runs, as in serving, so the copies back do not find the
    # blocks still in the CPU's caches
    forward = lambda: time_forward(models[-1:], pool, 1, 0, owner=-2)  # noqa: E731 (the smallest model)
    for blocks in sorted({min(free - 1, n) for n in (1, 4, 16, 64)}):
        swap_points.append((blocks * store.block_bytes, _repeated(lambda: _time_swap(store, blocks, forward))))
    report(f"swap: {swap_points[-1][0] / 2**20:.1f} MiB out and back in {swap_points[-1][1] * 1e3:.1f} ms")
    prefill_points = []
    far = max(0, min(free * pool.block_size - chunk_size, 4 * chunk_size))
    for rows in (min(chunk_size, free * pool.block_size), max(1, chunk_size // 4)):
        for context in (0, far):
            seconds = _repeated(lambda: time_forward(models, pool, rows, context))
            prefill_points.append((rows, context + rows, seconds))
    report(f"prefill: {chunk_size} tokens in {prefill_points[0][2] * 1e3:.1f} ms")
    return PreemptionCosts(LinearStepModel.fit_rows(swap_points), LinearStepModel.fit_nonnegative(prefill_points))


def _time_swap(store: KVStore, blocks: int, between: Callable[[], object]) -> float:
    """Seconds to swap a scratch owner's blocks out and back in (not counting between())."""
    scratch = -1
    store.pool.reserve(scratch, blocks * store.pool.block_size)
    swapped = store.swap_out(scratch)
    between()
    seconds = swapped.out_seconds + store.swap_in(scratch, swapped)
    store.pool.release(scratch)
    return seconds


def time_forward(models: Models, pool: SlotPool, rows: int, context: int,
                 owner: int = -1, logits: str = "none") -> float:
    """Seconds of one forward (per model) of rows after context tokens, on a scratch owner of
    the empty pool."""
    scratch = owner
    pool.reserve(scratch, context + rows)
    started = time.perf_counter()
    for forward in models:
        forward.run(pool, [Segment(scratch, (0,) * rows, context, logits)])
    if _device(models).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    pool.release(scratch)
    return seconds


def _device(models: Models) -> torch.device:
    return models[0].cache.k0.device
