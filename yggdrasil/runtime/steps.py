"""Fixed-shape model steps: chunked prefill and single-token decode, eager or compiled.

Host logic (which positions, which slots, which mask) lives here in plain Python/tensor code; the
only thing handed to the compiler is the model forward at a fixed shape (gpt-fast style). The
compiled forward always attends over the whole cache so that each step kind has exactly one
shape; the eager forward attends over just the used prefix (rounded up), which is cheaper.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import numpy as np
import torch

from yggdrasil.buckets import GraphKey
from yggdrasil.runtime.dispatcher import Dispatcher, GraphCall
from yggdrasil.runtime.prefill_plan import Piece, chunk_pieces, piece_options, plan_pieces
from yggdrasil.errors import InvalidRequestError
from yggdrasil.storage.inductor_steps import isa_keyed_cache  # the cache key carries the CPU ISA
from yggdrasil.host_reads import HostReads, staged
from yggdrasil.models.model import Transformer
from yggdrasil.runtime.threads import HostThreads
from yggdrasil.trace import NO_TRACE

# eager attention spans are rounded up to this many slots so shapes repeat
SPAN_ROUNDING = 64


@dataclass(frozen=True)
class StepInputs:
    """The fixed-shape tensors of one forward (see model.py for their meaning)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    logit_index: torch.Tensor | None = None


def _forward(model: Transformer, tokens, positions, slots, mask, logit_index, return_hidden=False):
    return model(tokens, positions, slots, mask, logit_index=logit_index, return_hidden=return_hidden)


def _as_inference_tensors(inputs: StepInputs) -> StepInputs:
    """inputs as inference tensors (call inside inference mode). Dynamo guards on a tensor's
    dispatch keys, and an inference tensor's differ from a normal one's: a compiled forward first
    called with inputs built outside inference mode (a warm-up) would recompile when the decode
    loop, which builds its inputs inside it, calls it next."""
    values = [inputs.tokens, inputs.positions, inputs.slots, inputs.mask, inputs.logit_index]
    if all(v is None or v.is_inference() for v in values):
        return inputs
    return StepInputs(*(v if v is None or v.is_inference() else v.clone() for v in values))


def compiled_forward(name: str):
    """A torch.compile'd forward with its own code object.

    Dynamo keeps compiled graphs (and its recompile limit) per code object, so every fixed shape
    gets its own copy of _forward: one compiled callable per bucket, never a shared cache of them.
    """
    code = _forward.__code__.replace(co_name=f"_forward_{name}")
    fn = types.FunctionType(code, _forward.__globals__, f"_forward_{name}")
    return torch.compile(fn, fullgraph=True, dynamic=False)


def context_bucket(needed: int, limit: int, smallest: int = 128) -> int:
    """Cache size for a generation that needs `needed` positions: the next power of two.

    Compiled steps attend over the whole cache, so a tight cache is faster; powers of two keep the
    number of distinct shapes (and so Inductor cache misses) small.
    """
    size = smallest
    while size < needed:
        size *= 2
    return min(size, limit)


class StepRunner:
    """Runs prefill chunks and decode steps for batch 1 against the model's static cache."""

    def __init__(self, model: Transformer, max_context: int, chunk_size: int = 64,
                 compile: bool = False, graphs=None, chunk_sizes: tuple[int, ...] = (),
                 piece_seconds: dict[str, float] | None = None) -> None:
        """graphs: a bundle's GraphSet (yggdrasil/storage/registry.py); every step then runs one of its
        ahead-of-time compiled graphs and nothing is ever compiled here.
        chunk_sizes: the compiled prefill chunks; a prompt is prefilled in chunks of the largest
        and its last piece in the smallest that holds it (default: chunk_size only).
        piece_seconds: the measured seconds of the graphs' forwards (the bundle's profile); a
        prompt is then prefilled on whichever graphs cost least (prefill_plan.py)."""
        sizes = tuple(sorted(set(chunk_sizes or (chunk_size,))))
        if sizes[0] < 1:
            raise InvalidRequestError(f"prefill chunk size must be >= 1, got {sizes[0]}")
        self.model = model
        self.chunk_sizes = sizes
        self.chunk_size = sizes[-1]
        # eager runners stack the cache (one-op compaction) unless graphs are bound to the model's
        # cache (an eager step runs over either layout); torch.compile cannot take aliased
        # buffers, and a bundle's graphs are bound to the cache the bundle made (kept as it is)
        bound = model.cache is not None and bool(model.cache.bound_by)
        stacked = None if graphs is not None or (bound and not compile) else not compile
        self.device = model.device
        self.cache = model.setup_cache(1, max_context, stacked=stacked)
        # every device→host read of the decode loop goes through it (none needed on the host)
        self.reads = HostReads(on_host=self.device.type == "cpu")
        self.threads = HostThreads()  # a speculator's serial host work gives forwards their threads back
        self._move_index: dict[int, torch.Tensor] = {}  # static K/V move indices per width (CUDA)
        self.graphs = graphs
        self.role = graphs.role if graphs is not None else "target"
        # the one dispatcher of this runner: which graph each step runs, and how (built once)
        self.dispatcher = Dispatcher.for_runner(graphs, sizes)
        self.piece_options = piece_options(graphs.keys, piece_seconds) if graphs is not None else ()
        self.compiled = compile and graphs is None
        # one compiled callable per step shape (prefill chunk, decode, tree widths), made lazily
        self._forwards: dict[str, object] = {}
        self._ran: set[str] = set()  # callables that have run (and so compiled) once
        self.tracer = NO_TRACE  # trace.tracing() swaps in a Tracer for a traced generation
        self.trace_lane = "target"

    @property
    def cache(self):
        return self._cache

    @cache.setter
    def cache(self, cache) -> None:
        """The runner's KV cache, with what every step asks of it read once: its size and its
        scratch slot."""
        self._cache = cache
        self._slots, self.scratch_slot = cache.capacity, cache.scratch_slot

    @property
    def max_context(self) -> int:
        return self.cache.max_context

    def span(self, end: int) -> int:
        if self.compiled:
            return self._slots
        if self.graphs is not None and self.graphs.fixed_span is not None:
            return self.graphs.fixed_span  # CUDA graphs replay one shape: the whole context
        rounded = -(-end // SPAN_ROUNDING) * SPAN_ROUNDING
        return min(rounded, self._slots)

    def prefill_inputs(self, ids: list[int], start: int, size: int | None = None,
                       logit_index: bool = True) -> StepInputs:
        """One chunk: len(ids) <= size real tokens at positions start.., padded to size rows
        (default: the largest chunk). logit_index: the last real row's index, for graphs that
        compute one row's logits (prefill, decode); without it a graph returns every row's."""
        n, size = len(ids), size or self.chunk_size
        real = torch.arange(size) < n  # built on the host, staged in one copy
        positions = torch.where(real, torch.arange(start, start + size), 0)
        slots = torch.where(real, positions, self.scratch_slot)
        tokens = torch.zeros(size, dtype=torch.long)
        tokens[:n] = torch.tensor(ids, dtype=torch.long)
        span = self.span(start + size)
        slot_ids = torch.arange(span)
        causal = slot_ids[None, :] <= positions[:, None]
        # padding rows attend only the chunk's first (real) slot, so their outputs stay finite
        pad_rows = (slot_ids == start)[None, :].expand(size, span)
        mask = torch.where(real[:, None], causal, pad_rows)
        return self.stage(tokens[None], positions[None], slots[None], mask[None],
                          torch.tensor([[n - 1]]) if logit_index else None)

    def piece_inputs(self, ids: list[int], start: int, key: GraphKey) -> StepInputs:
        """A prompt piece's inputs for graph `key` (its rows; a logit index where it takes one)."""
        return self.prefill_inputs(ids, start, key.rows, logit_index=key.logit_rows == "one")

    def decode_inputs(self, token: int, position: int, hidden: bool = False) -> StepInputs:
        """One token's step at `position`. hidden: for the one-row verify graph that also returns
        the hidden state, which takes no logit index (its one row is the logits' row)."""
        span = self.span(position + 1)
        mask = (torch.arange(span) <= position)[None, None, :]
        pos = torch.tensor([[position]])
        logit_index = None if hidden else torch.zeros((1, 1), dtype=torch.long)
        return self.stage(torch.tensor([[token]]), pos, pos.clone(), mask, logit_index)

    def stage(self, tokens, positions, slots, mask, logit_index=None) -> StepInputs:
        """One forward's inputs, built on the host, on the model's device in one copy."""
        values = (tokens, positions, slots, mask) + (() if logit_index is None else (logit_index,))
        return StepInputs(*staged(values, self.device))

    def stage_rows(self, tokens: list[int], positions: list[int], slots: list[int], mask: np.ndarray) -> StepInputs:
        """stage() of one sequence's inputs built as lists and a numpy mask [1, rows, span]: the
        three index rows become one array and its views (few calls: each costs microseconds
        right after a forward, when the caches are cold)."""
        rows = torch.from_numpy(np.array([[tokens], [positions], [slots]], dtype=np.int64)).unbind(0)
        return self.stage(*rows, torch.from_numpy(mask))

    def _forward_for(self, key: str):
        if key not in self._forwards:
            self._forwards[key] = compiled_forward(key) if self.compiled else _forward
        return self._forwards[key]

    def run(self, inputs: StepInputs, key: str | None = None, hidden: bool = False):
        """Logits of the rows inputs.logit_index selects (all rows when it is None); with hidden,
        (logits, final hidden states) of those rows. key: the stage (default: decode for one row,
        prefill for more); the dispatcher says which graph runs it."""
        width = inputs.tokens.shape[1]
        call = self.dispatcher.dispatch(key or ("decode" if width == 1 else "prefill"), width, hidden, self.role)
        with self.tracer.span(call.asked.name, self.trace_lane):
            return self._run(inputs, call) if self.graphs is not None else self._run_own(inputs, call.asked)

    def _run(self, inputs: StepInputs, call: GraphCall):
        """The bundle graph the dispatcher picked, under its substitution rules (in inference
        mode: a speculative iteration enters it once for all its forwards)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self._run(inputs, call)
        logit_index = inputs.logit_index
        if call.first_row_logits:
            logit_index = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        forward = self.graphs.get(call.runs.name)
        with self.threads.model():
            out = forward(inputs.tokens, inputs.positions, inputs.slots, inputs.mask, logit_index)
        return call.output(out)

    def _run_own(self, inputs: StepInputs, key: GraphKey):
        """This step's own forward, eager or torch.compile'd (one callable per shape)."""
        name = key.name
        forward = self._forward_for(name)
        # each callable compiles on its first call; any later recompile is an error
        if not self.compiled:
            stance = contextlib.nullcontext()
        elif name in self._ran:
            stance = torch.compiler.set_stance("fail_on_recompile")
        else:
            stance = isa_keyed_cache()
        with torch.inference_mode(), stance, self.threads.model():
            if self.compiled:
                inputs = _as_inference_tensors(inputs)
            out = forward(self.model, inputs.tokens, inputs.positions, inputs.slots,
                          inputs.mask, inputs.logit_index, key.hidden)
        self._ran.add(name)
        return out

    def move_slots(self, src: list[int], dst: list[int], width: int) -> None:
        """Copy K/V from src slots to dst slots (the compaction after acceptance): one
        fixed-shape gather/scatter of `width` moves for all layers (unused moves copy the scratch
        slot onto itself). On CUDA the indices go through a static device buffer per width, so
        the move is capturable: a graph captured over `cache.move(*self.move_index(width))`
        replays it after this method's copy (yggdrasil/storage/cuda_graphs.py may do so)."""
        moves = [(s, d) for s, d in zip(src, dst) if s != d]  # a chain's accepted nodes are in place
        if not moves:
            return
        if len(moves) <= 2 and moves[0][1] != moves[-1][0] and self.device.type == "cpu" and self.cache.is_stacked:
            # on the host, one or two moves (the usual compaction) as slot copies: fewer ops than
            # the index build, gather and scatter; in order, as no move reads a slot written before it
            for s, d in moves:
                self.cache.storage.select(3, d).copy_(self.cache.storage.select(3, s))
            return
        pad = [self.scratch_slot] * (width - len(moves))
        index = torch.tensor([[s for s, _ in moves] + pad, [d for _, d in moves] + pad])
        if self.device.type != "cpu":
            static = self.move_index(width)
            static.copy_(staged((index,), self.device)[0])
            index = static
        self.cache.move(index[0], index[1])

    def move_index(self, width: int) -> torch.Tensor:
        """The static [2, width] source/destination slot buffer of moves of this width."""
        if width not in self._move_index:
            self._move_index[width] = torch.full((2, width), self.scratch_slot, device=self.device)
        return self._move_index[width]

    def warm_up(self) -> None:
        """Compile every step shape now, so generation itself never compiles."""
        for size in self.chunk_sizes:
            self.run(self.prefill_inputs([0], 0, size))
        self.run(self.decode_inputs(0, 0))

    def check_fits(self, n_tokens: int) -> None:
        check_fits(n_tokens, self.max_context)

    def prefill(self, ids: list[int], start: int = 0, hidden: bool = False, pieces: list[Piece] | None = None):
        """Prefill ids at positions start..; returns the logits after the last one, [vocab], and
        with hidden also the last one's final hidden state [dim]. pieces: the graphs to run it
        on (default: self.pieces)."""
        self.check_fits(start + len(ids))
        assert ids, "prefill needs at least one token"
        pieces = pieces or self.pieces(len(ids), hidden)
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            inputs = self.piece_inputs(ids[piece.offset:piece.offset + piece.real], start + piece.offset, piece.key)
            out = self.run(inputs, key=piece.key.stage, hidden=hidden and last)
        # graphs that return every row's logits: the last real row's; the others return just it
        row = piece.real - 1 if piece.key.logit_rows == "all" else -1
        return (out[0][0, row], out[1][0, row]) if hidden else out[0, row]

    def pieces(self, n: int, hidden: bool = False) -> list[Piece]:
        """The graphs a prompt of n tokens is prefilled on: the cheapest by the measured forward
        times where the runner has them (prefill_plan.py), else the prefill chunks."""
        if self.piece_options:
            return plan_pieces(n, self.piece_options, hidden)
        return chunk_pieces(self.chunk_sizes, n)

    def decode(self, token: int, position: int) -> torch.Tensor:
        return self.run(self.decode_inputs(token, position))[0, -1]


def check_fits(n_tokens: int, max_context: int) -> None:
    """A prompt of n_tokens must leave room in a context of max_context for the reply."""
    if n_tokens >= max_context:
        raise InvalidRequestError(
            f"the prompt has {n_tokens} tokens but the context holds {max_context}; "
            "shorten the prompt or raise --max-context (up to the model's limit)"
        )


def verify_inputs(runner: StepRunner, tree, kept: torch.Tensor | list[int], base: int, width: int) -> StepInputs:
    """One verify forward over the kept nodes of a host tree, padded to `width` rows.

    kept[j] sits at slot base + j; padding rows write to the scratch slot and attend only the
    root's slot, so they stay finite and touch nothing real. Built in numpy from the tree's
    lists (a handful of array writes), staged in one copy.
    """
    kept = kept.tolist() if isinstance(kept, torch.Tensor) else list(kept)
    tree.check_slot_order(kept)  # kept[j] at slot base + j must keep each path in order
    nodes, v = tree.nodes(), len(kept)
    pad = [0] * (width - v)
    mask = np.zeros((1, width, runner.span(base + width)), dtype=np.bool_)
    mask[0, :v, :base] = True
    mask[0, :v, base:base + v] = [[row[k] for k in kept] for row in (nodes.ancestors[j] for j in kept)]
    if v < width:
        mask[0, v:, base] = True
    return runner.stage_rows([nodes.tokens[k] for k in kept] + pad, [base + nodes.depth[k] for k in kept] + pad,
                             list(range(base, base + v)) + [runner.scratch_slot] * (width - v), mask)
