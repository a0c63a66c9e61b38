"""The dispatcher: one lookup from a step request to the compiled graph that runs it (DESIGN §3.6).

Every compiled graph is named by a hashable BucketKey (stage, rows, batch). A padding table,
computed once from the bucket grid, maps each request size to the smallest compiled size that
holds it (vLLM's padded-size table); requests beyond the largest bucket get a "not compiled"
error naming the recipe key to raise. The table is the single source of truth for shapes: the
runtime never builds a shape the dispatcher did not return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import YggdrasilError

STAGES = ("draft_head", "draft_step", "verify", "prefill")


class NotCompiledError(YggdrasilError):
    """A request no compiled bucket can hold."""


def graph_name(stage: str, rows: int, hidden: bool = False) -> str:
    """The one name a step graph goes by (runner, registry and bundle alike); rows 0: any number
    of rows (the server's pool graph)."""
    return f"{stage}{'_hidden' if hidden else ''}" + (f"_w{rows}" if rows else "")


@dataclass(frozen=True, order=True)
class BucketKey:
    stage: str
    rows: int  # tokens per sequence in the graph (padded)
    batch: int = 1

    def __str__(self) -> str:
        return f"{self.stage}_w{self.rows}" + (f"_b{self.batch}" if self.batch != 1 else "")


@dataclass(frozen=True)
class StepRequest:
    depth: int  # draft steps (0 = no speculation)
    width: int  # nodes per draft step
    verify: int  # tree nodes to verify (1 = plain decode)
    batch: int = 1


@dataclass(frozen=True)
class StepPlan:
    """The graphs one iteration runs: the draft's head and steps (none at depth 0), one verify."""

    depth: int
    draft_head: BucketKey | None
    draft_step: BucketKey | None
    verify: BucketKey


def _padding_table(sizes: Sequence[int], cost: Callable[[int], float] | None = None) -> tuple[int, ...]:
    """table[n] = the size a request of n rows runs at, for n = 0..max(sizes): the smallest size
    >= n, or with `cost` the cheapest size >= n (measured step times need not grow with rows:
    on CPU a 32-row GEMM can beat an 8-row one)."""
    ordered = sorted(sizes)
    if cost is None:
        return tuple(next(s for s in ordered if s >= n) for n in range(ordered[-1] + 1))
    return tuple(min((s for s in ordered if s >= n), key=lambda s: (cost(s), s)) for n in range(ordered[-1] + 1))


class Dispatcher:
    def __init__(self, depths: Sequence[int], draft_widths: Sequence[int], verify_widths: Sequence[int],
                 prefill_chunks: Sequence[int], batch_sizes: Sequence[int] = (1,),
                 recipe_hint: str = "the recipe", verify_cost: Callable[[int], float] | None = None) -> None:
        """verify_cost: measured seconds of a verify of n rows; the verify table then pads to the
        cheapest compiled width that holds a request instead of the smallest."""
        if not (depths and draft_widths and verify_widths and prefill_chunks and batch_sizes):
            raise ValueError("every bucket list needs at least one size")
        self.max_depth = max(depths)
        self.head_rows = max(max(draft_widths), 2)  # pending committed token + root, at least
        self.hint = recipe_hint
        self._tables = {"draft_step": _padding_table(draft_widths), "verify": _padding_table(verify_widths, verify_cost),
                        "prefill": _padding_table(prefill_chunks), "batch": _padding_table(batch_sizes)}
        self._recipe_key = {"draft_step": "draft_widths", "verify": "verify_widths",
                            "prefill": "prefill_chunks", "batch": "batch_sizes"}

    def _pad(self, table: str, n: int) -> int:
        sizes = self._tables[table]
        if n < 1:
            raise NotCompiledError(f"a {table} of {n} rows is not a valid request (sizes start at 1)")
        if n >= len(sizes):
            raise NotCompiledError(f"not compiled: {table} {n} is larger than the largest compiled "
                                   f"{len(sizes) - 1}; add it to buckets.{self._recipe_key[table]} in "
                                   f"{self.hint} and recompile")
        return sizes[n]

    def plan(self, request: StepRequest) -> StepPlan:
        batch = self._pad("batch", request.batch)
        verify = BucketKey("verify", self._pad("verify", request.verify), batch)
        if request.depth == 0:
            return StepPlan(0, None, None, verify)
        if request.depth > self.max_depth:
            raise NotCompiledError(f"not compiled: depth {request.depth} is deeper than the deepest compiled "
                                   f"{self.max_depth}; add it to buckets.depths in {self.hint} and recompile")
        step = BucketKey("draft_step", self._pad("draft_step", request.width), batch)
        return StepPlan(request.depth, BucketKey("draft_head", self.head_rows, batch), step, verify)

    def prefill(self, chunk: int, batch: int = 1) -> BucketKey:
        return BucketKey("prefill", self._pad("prefill", chunk), self._pad("batch", batch))

    def all_keys(self) -> list[BucketKey]:
        """Every graph the grid compiles, largest first (the capture order on CUDA)."""
        batches = sorted(set(self._tables["batch"][1:]))
        keys = {BucketKey("draft_head", self.head_rows, b) for b in batches}
        for stage in ("draft_step", "verify", "prefill"):
            keys |= {BucketKey(stage, n, b) for n in set(self._tables[stage][1:]) for b in batches}
        return sorted(keys, key=lambda k: (-k.rows * k.batch, k.stage))
