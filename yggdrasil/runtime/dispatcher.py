"""The dispatcher: one lookup from a bucket to the compiled graphs that run it (docs/design.md §3.6).

Every compiled graph is named by a hashable GraphKey (buckets.py). Padding tables, computed once
from the bundle's Grid, map each request size to the compiled size that holds it (vLLM's padded
size table); requests beyond the largest bucket get a "not compiled" error naming the recipe key
to raise. The dispatcher is the single source of truth for shapes: compile iterates its keys
(bundle_keys, draft_ahead_keys) to know which graphs to build, capture iterates the same list as
the bundle stored it, and at run time each StepRunner holds one dispatcher, built once over its
graph set (for_runner), whose dispatch() hands it a GraphCall: the compiled graph a step runs and
the substitution rules the runner applies (a decode graph standing in for a one-row verify,
hidden states dropped from a superset graph). A speculator's verify padding table comes from
the same dispatcher (verify_table).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Collection, Iterable, Sequence

from yggdrasil.buckets import SERVE_STAGE, Bucket, GraphKey, Grid, NotCompiledError

STAGES = ("draft_head", "draft_step", "verify", "prefill")

__all__ = ["Dispatcher", "GraphCall", "StepGraphs", "NotCompiledError", "STAGES"]


@dataclass(frozen=True)
class GraphCall:
    """One step's graph: the one asked for and the compiled one that runs it (the same, or a
    stand-in); the runner applies the rules below and decides nothing itself."""

    asked: GraphKey
    runs: GraphKey

    @property
    def first_row_logits(self) -> bool:
        """The decode graph stands in for a one-row verify: its one row is the logits' row
        (logit index 0), whatever index the verify's inputs carry."""
        return self.runs.stage == "decode" and self.asked.stage != "decode"

    def output(self, out):
        """The asked graph's output: a superset graph's hidden states dropped."""
        return out[0] if self.runs.hidden and not self.asked.hidden else out


@dataclass(frozen=True)
class StepGraphs:
    """The graphs one iteration runs: the draft's head and steps (none at depth 0), one verify."""

    depth: int
    draft_head: GraphKey | None
    draft_step: GraphKey | None
    verify: GraphKey


def padding_table(sizes: Sequence[int], cost: Callable[[int], float] | None = None) -> tuple[int, ...]:
    """table[n] = the size a request of n rows runs at, for n = 0..max(sizes): the smallest size
    >= n, or with `cost` the cheapest size >= n (measured step times need not grow with rows:
    on CPU a 32-row GEMM can beat an 8-row one)."""
    ordered = sorted(sizes)
    if cost is None:
        return tuple(next(s for s in ordered if s >= n) for n in range(ordered[-1] + 1))
    return tuple(min((s for s in ordered if s >= n), key=lambda s: (cost(s), s)) for n in range(ordered[-1] + 1))


def padded(table: Sequence[int], n: int, what: str, recipe_key: str, hint: str = "the recipe") -> int:
    """table[n] (a padding_table), or a "not compiled" error naming the recipe key to raise."""
    if n < 1:
        raise NotCompiledError(f"a {what} of {n} rows is not a valid request (sizes start at 1)")
    if n >= len(table):
        raise NotCompiledError(f"not compiled: {what} {n} is larger than the largest compiled "
                               f"{len(table) - 1}; add it to buckets.{recipe_key} in {hint} and recompile")
    return table[n]


def prefill_pieces(chunks: Sequence[int], n: int) -> list[tuple[int, int]]:
    """(offset, chunk size) pieces for n prompt tokens over these compiled chunk sizes: the
    largest chunk while it is full, then the smallest chunk that holds the rest."""
    if n < 1:
        raise NotCompiledError(f"a prefill of {n} tokens is not a valid request (sizes start at 1)")
    table, out, offset = padding_table(chunks), [], 0
    largest = len(table) - 1
    while n - offset > largest:
        out.append((offset, largest))
        offset += largest
    out.append((offset, table[n - offset]))
    return out


def head_sizes(widths: Sequence[int]) -> tuple[int, ...]:
    """Draft head graphs' rows: one per draft width, at least 2 (the pending committed token
    plus the root); a head step uses the smallest that holds its pending tokens."""
    return tuple(sorted({max(w, 2) for w in widths}))


@dataclass(frozen=True)
class KeySet:
    """A fixed set of compiled graphs, with a GraphSet's has/keys (what a Dispatcher asks)."""

    keys: frozenset[GraphKey]

    def has(self, key: GraphKey) -> bool:
        return key in self.keys


class Dispatcher:
    def __init__(self, grid: Grid, recipe_hint: str = "the recipe",
                 verify_cost: Callable[[int], float] | None = None, graphs=None) -> None:
        """verify_cost: measured seconds of a verify of n rows; the verify table then pads to the
        cheapest compiled width that holds a request instead of the smallest.
        graphs: what dispatch() picks from, anything with has(key) and keys: a bundle's GraphSet
        (read live) or a KeySet; None: every shape runs (eager or torch.compile steps)."""
        if not (grid.chunks and grid.batches):
            raise ValueError("every bucket list needs at least one size")
        self.grid = grid
        self._graphs = graphs
        self.max_depth = grid.max_depth
        self.head_rows = max(grid.max_width, 2)  # pending committed token + root, at least
        self.hint = recipe_hint
        self._tables = {"draft_step": padding_table(grid.widths), "verify": padding_table(grid.verifies, verify_cost),
                        "batch": padding_table(grid.batches)}
        self._recipe_key = {"draft_step": "draft_widths", "verify": "verify_widths", "batch": "batch_sizes"}
        self._calls: dict[tuple[str, int, bool, str], GraphCall] = {}  # dispatch()'s answers, once each

    def _pad(self, table: str, n: int) -> int:
        return padded(self._tables[table], n, table, self._recipe_key[table], self.hint)

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

    def verify_table(self, widths: Sequence[int], cost: Callable[[int], float] | None = None) -> tuple[int, ...]:
        """The verify padding table over a bucket policy's verify widths (and its measured verify
        times): its speculator computes it once and pads each tree's kept nodes with it."""
        return padding_table(widths, cost)

    @classmethod
    def of_compiled(cls, keys: Collection[GraphKey], hint: str = "the recipe") -> Dispatcher:
        """The dispatcher over one model's compiled graphs (a bundle's graph set): its grid is
        the shapes those graphs have (a step has no draft depth of its own: depths (1,))."""
        return cls(compiled_grid(keys), hint, graphs=KeySet(frozenset(keys)))

    @classmethod
    def for_runner(cls, graph_set, chunks: Sequence[int]) -> Dispatcher:
        """A step runner's one dispatcher, built once: over its bundle graph set (read live), or
        without graphs (eager or torch.compile steps: every shape runs as asked; only the
        prefill chunks are real sizes then)."""
        if graph_set is None:
            return cls(Grid((1,), (1,), (1,), chunks=tuple(chunks)))
        return cls(compiled_grid(graph_set.keys), graph_set.hint, graphs=graph_set)

    def _has(self, key: GraphKey) -> bool:
        return self._graphs is None or self._graphs.has(key)

    def dispatch(self, stage: str, rows: int, hidden: bool = False, role: str = "target") -> GraphCall:
        """The compiled graph a step of `rows` (already padded) rows runs: its own; else one of
        the same shape that also returns hidden states (a superset: the call drops them); else,
        for a one-row verify without hidden states, the decode graph (the same row; bundles
        compile no one-row verify of their own). Without compiled graphs, the step's own key."""
        found = self._calls.get((stage, rows, hidden, role))
        if found is not None:  # graphs are only ever added to a set, so an answer stays right
            return found
        wanted = GraphKey(stage, rows, hidden=hidden, role=role)
        for runs in (wanted, replace(wanted, hidden=True) if not hidden else None,
                     GraphKey("decode", 1, role=role) if stage == "verify" and rows == 1 and not hidden else None):
            if runs is not None and self._has(runs):
                call = self._calls[(stage, rows, hidden, role)] = GraphCall(wanted, runs)
                return call
        have = ", ".join(sorted(k.name for k in self._graphs.keys if k.role == role))
        raise NotCompiledError(f"not compiled: the {role} has no graph {wanted.name} in this bundle (it has "
                               f"{have}); add its bucket to {self.hint} and recompile")

    @staticmethod
    def draft_ahead_keys(rows: Iterable[int]) -> tuple[GraphKey, ...]:
        """The draft's ahead-of-time graphs a bundle's stage plans need (stage_plan.ahead_rows),
        largest first."""
        return tuple(GraphKey("draft_ahead", r, role="draft") for r in sorted(set(rows), reverse=True))

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


def compiled_grid(keys: Collection[GraphKey]) -> Grid:
    """The shapes a set of compiled graphs has, as a Grid."""
    def rows(stage: str) -> tuple[int, ...]:
        return tuple(sorted({k.rows for k in keys if k.stage == stage and k.rows}))

    return Grid((1,), rows("draft_step") or (1,), rows("verify") or (1,), chunks=rows("prefill") or (1,),
                batches=tuple(sorted({k.batch for k in keys})) or (1,))


def serve_keys(draft_model: bool) -> list[GraphKey]:
    """`yggdrasil serve`'s graphs: one per model that serving runs (the draft only when the
    bundle speculates with it), each taking any number of rows over the server's KV pool."""
    keys = [GraphKey(SERVE_STAGE, 0)]
    if draft_model:
        keys.append(GraphKey(SERVE_STAGE, 0, role="draft"))
    return keys
