"""Which compiled graphs prefill a prompt, priced by their measured times (issue 50's start-up).

A bundle compiles prefill chunks (64 rows in the shipped recipes) for long prompts, but its step
graphs (decode, verify, the draft's head and steps) take the same inputs: rows of tokens at
positions and slots under a mask. On a CPU a 64-row forward costs what its rows cost, so a
6-token prompt padded into one 64-row chunk costs about ten times what three 2-row verify steps
do; on a GPU the chunk costs about one small step. Compile times each of these graphs once warm
(`measure_piece_seconds`, recorded in the bundle's profile.yaml as `piece_seconds`) and a runner
covers a prompt with the pieces whose summed time is least (`plan_pieces`). Without recorded
times (older bundles, eager or torch.compile'd runners) the prompt goes in chunks as before.

Every piece writes its real rows' K/V at their own slots and pads with rows that write the scratch
slot, exactly as a chunk does, so which graphs ran changes nothing but the time where the steps
are batch-invariant (the bundle's `batch_invariance` says whether they are).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from yggdrasil.buckets import GraphKey
from yggdrasil.device import device_sync, timed_runs
from yggdrasil.runtime.dispatcher import prefill_pieces

# the stages whose graphs take a prompt piece's inputs (tokens, positions, slots, mask[, logit index])
PIECE_STAGES = ("prefill", "decode", "verify", "draft_head", "draft_step")


@dataclass(frozen=True)
class Piece:
    """One forward of a prefill: `real` prompt tokens from `offset`, on graph `key` (key.rows
    rows, the rest padding)."""

    offset: int
    real: int
    key: GraphKey


@dataclass(frozen=True)
class PieceOption:
    key: GraphKey
    seconds: float


def piece_keys(keys: Iterable[GraphKey]) -> list[GraphKey]:
    """The graphs of a set that can run a prompt piece: one sequence, a fixed number of rows."""
    return sorted(k for k in keys if k.stage in PIECE_STAGES and k.rows > 0 and k.batch == 1)


def piece_options(keys: Iterable[GraphKey], seconds: Mapping[str, float] | None) -> tuple[PieceOption, ...]:
    """Each usable graph with its recorded time; () unless every prefill chunk has one (a plan
    that cannot price the chunks cannot say when they are cheaper)."""
    usable = piece_keys(keys)
    if not seconds or not usable:
        return ()
    chunks = [k for k in usable if k.stage == "prefill"]
    if not chunks or any(k.name not in seconds for k in chunks):
        return ()
    return tuple(PieceOption(k, float(seconds[k.name])) for k in usable if k.name in seconds)


def _cheapest_per_rows(options: Sequence[PieceOption]) -> list[PieceOption]:
    best: dict[int, PieceOption] = {}
    for option in options:
        held = best.get(option.key.rows)
        if held is None or (option.seconds, option.key) < (held.seconds, held.key):
            best[option.key.rows] = option
    return [best[rows] for rows in sorted(best)]


def plan_pieces(n: int, options: Sequence[PieceOption], hidden: bool = False) -> list[Piece]:
    """Pieces covering n prompt tokens whose measured times sum least; the last one on a graph
    that returns hidden states when `hidden` (what the depth predictor reads). Exact up to four
    of the widest graph's rows; a longer prompt's head goes in full pieces of the graph cheapest
    per row and only the rest is searched, so planning stays cheap for any prompt."""
    if n < 1:
        raise ValueError(f"a prefill of {n} tokens is not a valid request")
    anywhere = _cheapest_per_rows(options)
    last = _cheapest_per_rows([o for o in options if o.key.hidden or not hidden])
    if not last:
        raise ValueError("no graph here returns hidden states for a prompt's last piece")
    bulk = min(anywhere, key=lambda o: (o.seconds / o.key.rows, -o.key.rows))
    searched = 4 * max(o.key.rows for o in anywhere)
    head_pieces = 0 if n <= searched else -(-(n - searched) // bulk.key.rows)
    tail = n - head_pieces * bulk.key.rows
    # cost[k]: least seconds to cover the tail's first k tokens (every piece but the last); a
    # piece takes as many tokens as it holds (taking fewer never makes the rest cheaper)
    cost, choice = [0.0] + [float("inf")] * tail, [None] * (tail + 1)
    for k in range(1, tail + 1):
        for option in anywhere:
            seconds = cost[max(0, k - option.key.rows)] + option.seconds
            if seconds < cost[k]:
                cost[k], choice[k] = seconds, option
    final = min(last, key=lambda o: (cost[max(0, tail - o.key.rows)] + o.seconds, o.key.rows))
    k = max(0, tail - final.key.rows)
    spans = [(k, tail, final)]
    while k > 0:
        option = choice[k]
        start = max(0, k - option.key.rows)
        spans.append((start, k, option))
        k = start
    head = [Piece(i * bulk.key.rows, bulk.key.rows, bulk.key) for i in range(head_pieces)]
    offset = head_pieces * bulk.key.rows
    return head + [Piece(offset + a, b - a, o.key) for a, b, o in reversed(spans)]


def chunk_pieces(chunks: Sequence[int], n: int) -> list[Piece]:
    """The prefill chunks' pieces (dispatcher.prefill_pieces) as Pieces: what a runner without
    recorded times prefills on (a one-row chunk is a decode step, as a runner has always run it)."""
    return [Piece(offset, min(size, n - offset), GraphKey("prefill" if size > 1 else "decode", size))
            for offset, size in prefill_pieces(chunks, n)]


def plan_seconds(pieces: Sequence[Piece], options: Sequence[PieceOption]) -> float:
    """What a plan costs by the recorded times."""
    seconds = {o.key: o.seconds for o in options}
    return sum(seconds[p.key] for p in pieces)


def measure_piece_seconds(runner, repeats: int = 3, warmup: int = 1) -> dict[str, float]:
    """The median seconds of one forward of each graph of a runner's set that can run a prompt
    piece (compile's warm-load check records them). Each forward writes one real row at slot 0
    and pads into the scratch slot: the cache holds nothing a generation keeps."""
    times = {}
    for key in piece_keys(runner.graphs.keys):
        inputs = runner.piece_inputs([0], 0, key)

        def forward(key=key, inputs=inputs):
            return runner.run(inputs, key=key.stage, hidden=key.hidden)

        times[key.name] = statistics.median(timed_runs(forward, repeats, warmup, device_sync(runner.device)))
    return times
