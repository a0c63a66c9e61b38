"""The dispatcher: one lookup from a bucket to the compiled graphs that run it (docs/design.md §3.6).

Every compiled graph is named by a hashable GraphKey (buckets.py). Padding tables, computed once
from the bundle's Grid, map each request size to the compiled size that holds it (vLLM's padded
size table); requests beyond the largest bucket get a "not compiled" error naming the recipe key
to raise. The dispatcher is the single source of truth for shapes: compile iterates its keys to
know which graphs to build, and the runtime asks it for verify and prefill-chunk padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from yggdrasil.buckets import SERVE_STAGE, Bucket, GraphKey, Grid, NotCompiledError

STAGES = ("draft_head", "draft_step", "verify", "prefill")

__all__ = ["Dispatcher", "StepGraphs", "NotCompiledError", "STAGES"]


@dataclass(frozen=True)
class StepGraphs:
    """The graphs one iteration runs: the draft's head and steps (none at depth 0), one verify."""

    depth: int
    draft_head: GraphKey | None
    draft_step: GraphKey | None
    verify: GraphKey


def _padding_table(sizes: Sequence[int], cost: Callable[[int], float] | None = None) -> tuple[int, ...]:
    """table[n] = the size a request of n rows runs at, for n = 0..max(sizes): the smallest size
    >= n, or with `cost` the cheapest size >= n (measured step times need not grow with rows:
    on CPU a 32-row GEMM can beat an 8-row one)."""
    ordered = sorted(sizes)
    if cost is None:
        return tuple(next(s for s in ordered if s >= n) for n in range(ordered[-1] + 1))
    return tuple(min((s for s in ordered if s >= n), key=lambda s: (cost(s), s)) for n in range(ordered[-1] + 1))


def head_sizes(widths: Sequence[int]) -> tuple[int, ...]:
    """Draft head graphs' rows: one per draft width, at least 2 (the pending committed token
    plus the root); a head step uses the smallest that holds its pending tokens."""
    return tuple(sorted({max(w, 2) for w in widths}))


class Dispatcher:
    def __init__(self, grid: Grid, recipe_hint: str = "the recipe",
                 verify_cost: Callable[[int], float] | None = None) -> None:
        """verify_cost: measured seconds of a verify of n rows; the verify table then pads to the
        cheapest compiled width that holds a request instead of the smallest."""
        if not (grid.chunks and grid.batches):
            raise ValueError("every bucket list needs at least one size")
        self.grid = grid
        self.max_depth = grid.max_depth
        self.head_rows = max(grid.max_width, 2)  # pending committed token + root, at least
        self.hint = recipe_hint
        self._tables = {"draft_step": _padding_table(grid.widths), "verify": _padding_table(grid.verifies, verify_cost),
                        "draft_head": _padding_table(head_sizes(grid.widths)),
                        "prefill": _padding_table(grid.chunks), "batch": _padding_table(grid.batches)}
        self._recipe_key = {"draft_step": "draft_widths", "draft_head": "draft_widths", "verify": "verify_widths",
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

    def graphs(self, bucket: Bucket, batch: int = 1) -> StepGraphs:
        batch = self._pad("batch", batch)
        verify = GraphKey("verify", self._pad("verify", bucket.verify), batch)
        if bucket.depth == 0:
            return StepGraphs(0, None, None, verify)
        if bucket.depth > self.max_depth:
            raise NotCompiledError(f"not compiled: depth {bucket.depth} is deeper than the deepest compiled "
                                   f"{self.max_depth}; add it to buckets.depths in {self.hint} and recompile")
        step = GraphKey("draft_step", self._pad("draft_step", bucket.width), batch)
        return StepGraphs(bucket.depth, GraphKey("draft_head", self.head_rows, batch), step, verify)

    def draft_head(self, pending: int, batch: int = 1) -> GraphKey:
        """The head step's graph for `pending` tokens (committed ones the draft has not fed, and
        the root)."""
        return GraphKey("draft_head", self._pad("draft_head", pending), batch)

    def prefill(self, chunk: int, batch: int = 1) -> GraphKey:
        return GraphKey("prefill", self._pad("prefill", chunk), self._pad("batch", batch))

    def prefill_pieces(self, n: int) -> list[tuple[int, int]]:
        """(offset, chunk size) pieces for n prompt tokens: the largest chunk while it is full,
        then the compiled chunk that holds the rest."""
        out, offset, largest = [], 0, self.grid.chunks[-1]
        while n - offset > largest:
            out.append((offset, largest))
            offset += largest
        out.append((offset, self._pad("prefill", n - offset)))
        return out

    def all_keys(self) -> list[GraphKey]:
        """Every graph the grid compiles, largest first (the capture order on CUDA)."""
        batches = sorted(set(self._tables["batch"][1:]))
        keys = {GraphKey("draft_head", n, b) for n in head_sizes(self.grid.widths) for b in batches}
        for stage in ("draft_step", "verify", "prefill"):
            keys |= {GraphKey(stage, n, b) for n in set(self._tables[stage][1:]) for b in batches}
        return sorted(keys, key=lambda k: (-k.rows * k.batch, k.stage))

    def bundle_keys(self, draft_model: bool, speculates: bool, hidden: bool) -> list[GraphKey]:
        """Every graph a bundle over this grid compiles for its models, largest first: the
        target's prefill chunks and decode step (and the serve graph); when it speculates, its
        verify widths, and with a draft model the draft's prefill, head and steps per width.
        hidden: the graphs the depth predictor reads also return the final hidden states."""
        chunks = self.grid.chunks
        keys = {GraphKey("prefill", c) for c in chunks} | {GraphKey("decode", 1)}
        if hidden:  # a prompt's last chunk also returns the hidden state the predictor reads
            keys |= {GraphKey("prefill", c, hidden=True) for c in chunks}
        if speculates:
            # a one-row verify runs on the decode graph unless it must return hidden states
            keys |= {GraphKey("verify", v, hidden=hidden) for v in self.grid.verifies if v > 1 or hidden}
            if draft_model:
                keys |= {GraphKey("prefill", c, role="draft") for c in chunks}
                keys |= {GraphKey("draft_head", n, role="draft") for n in head_sizes(self.grid.widths)}
                keys |= {GraphKey("draft_step", w, role="draft") for w in self.grid.widths}
        keys |= set(serve_keys(draft_model and speculates))
        return sorted(keys, key=lambda k: (-k.rows, k.role, k.stage, k.hidden))


def serve_keys(draft_model: bool) -> list[GraphKey]:
    """`yggdrasil serve`'s graphs: one per model that serving runs (the draft only when the
    bundle speculates with it), each taking any number of rows over the server's KV pool."""
    keys = [GraphKey(SERVE_STAGE, 0)]
    if draft_model:
        keys.append(GraphKey(SERVE_STAGE, 0, role="draft"))
    return keys
