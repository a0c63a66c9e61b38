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

import torch

from .buckets import Grid, graph_name
from .dispatcher import Dispatcher
from .errors import InvalidRequestError
from .model import Transformer
from .trace import NO_TRACE

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
                 compile: bool = False, graphs=None, chunk_sizes: tuple[int, ...] = ()) -> None:
        """graphs: a bundle's GraphSet (graphs/registry.py); every step then runs one of its
        ahead-of-time compiled graphs and nothing is ever compiled here.
        chunk_sizes: the compiled prefill chunks; a prompt is prefilled in chunks of the largest
        and its last piece in the smallest that holds it (default: chunk_size only)."""
        sizes = tuple(sorted(set(chunk_sizes or (chunk_size,))))
        if sizes[0] < 1:
            raise InvalidRequestError(f"prefill chunk size must be >= 1, got {sizes[0]}")
        self.model = model
        self.chunk_sizes = sizes
        self.chunk_size = sizes[-1]
        # prefill pieces come from the dispatcher's padding table over the compiled chunks
        self.dispatcher = Dispatcher(Grid((1,), (1,), (1,), chunks=sizes))
        self.cache = model.setup_cache(1, max_context)
        self.device = model.device
        self.graphs = graphs
        self.compiled = compile and graphs is None
        # one compiled callable per step shape (prefill chunk, decode, tree widths), made lazily
        self._forwards: dict[str, object] = {}
        self._ran: set[str] = set()  # callables that have run (and so compiled) once
        self.tracer = NO_TRACE  # trace.tracing() swaps in a Tracer for a traced generation
        self.trace_lane = "target"

    @property
    def max_context(self) -> int:
        return self.cache.max_context

    def span(self, end: int) -> int:
        if self.compiled:
            return self.cache.capacity
        if self.graphs is not None and self.graphs.fixed_span is not None:
            return self.graphs.fixed_span  # CUDA graphs replay one shape: the whole context
        rounded = -(-end // SPAN_ROUNDING) * SPAN_ROUNDING
        return min(rounded, self.cache.capacity)

    def prefill_inputs(self, ids: list[int], start: int, size: int | None = None) -> StepInputs:
        """One chunk: len(ids) <= size real tokens at positions start.., padded to size rows
        (default: the largest chunk)."""
        n, size = len(ids), size or self.chunk_size
        dev = self.device
        real = torch.arange(size, device=dev) < n
        positions = torch.where(real, torch.arange(start, start + size, device=dev), 0)
        slots = torch.where(real, positions, self.cache.scratch_slot)
        tokens = torch.zeros(size, dtype=torch.long, device=dev)
        tokens[:n] = torch.tensor(ids, dtype=torch.long, device=dev)
        span = self.span(start + size)
        slot_ids = torch.arange(span, device=dev)
        causal = slot_ids[None, :] <= positions[:, None]
        # padding rows attend only the chunk's first (real) slot, so their outputs stay finite
        pad_rows = (slot_ids == start)[None, :].expand(size, span)
        mask = torch.where(real[:, None], causal, pad_rows)
        return StepInputs(tokens[None], positions[None], slots[None], mask[None],
                          torch.tensor([[n - 1]], device=dev))

    def decode_inputs(self, token: int, position: int) -> StepInputs:
        dev = self.device
        span = self.span(position + 1)
        mask = (torch.arange(span, device=dev) <= position)[None, None, :]
        pos = torch.tensor([[position]], device=dev)
        return StepInputs(torch.tensor([[token]], device=dev), pos, pos, mask,
                          torch.zeros((1, 1), dtype=torch.long, device=dev))

    def _forward_for(self, key: str):
        if key not in self._forwards:
            self._forwards[key] = compiled_forward(key) if self.compiled else _forward
        return self._forwards[key]

    def run(self, inputs: StepInputs, key: str | None = None, hidden: bool = False):
        """Logits of the rows inputs.logit_index selects (all rows when it is None); with hidden,
        (logits, final hidden states) of those rows, from a callable of its own."""
        width = inputs.tokens.shape[1]
        key = key or ("decode" if width == 1 else "prefill")
        name = graph_name(key, width, hidden)
        with self.tracer.span(name, self.trace_lane):
            return self._run(inputs, key, width, name, hidden)

    def _run(self, inputs: StepInputs, key: str, width: int, name: str, hidden: bool):
        if self.graphs is not None:
            # a graph that also returns hidden states serves a plain call too (a superset)
            superset = not hidden and name not in self.graphs and graph_name(key, width, True) in self.graphs
            logit_index = inputs.logit_index
            if _decode_serves(self.graphs, name, key, width, hidden):
                # a one-row verify is a decode step: bundles compile no graph of its own for it
                name, logit_index = graph_name("decode", 1), torch.zeros((1, 1), dtype=torch.long, device=self.device)
            forward = self.graphs.get(graph_name(key, width, True) if superset else name)
            with torch.inference_mode():
                out = forward(inputs.tokens, inputs.positions, inputs.slots, inputs.mask, logit_index)
            return out[0] if superset else out
        forward = self._forward_for(name)
        # each callable compiles on its first call; any later recompile is an error
        stance = (torch.compiler.set_stance("fail_on_recompile") if self.compiled and name in self._ran
                  else contextlib.nullcontext())
        with torch.inference_mode(), stance:
            out = forward(self.model, inputs.tokens, inputs.positions, inputs.slots,
                          inputs.mask, inputs.logit_index, hidden)
        self._ran.add(name)
        return out

    def warm_up(self) -> None:
        """Compile every step shape now, so generation itself never compiles."""
        for size in self.chunk_sizes:
            self.run(self.prefill_inputs([0], 0, size))
        self.run(self.decode_inputs(0, 0))

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """(offset, chunk size) pieces for n prompt tokens: the largest chunk while it is full,
        then the smallest chunk that holds the rest."""
        return self.dispatcher.prefill_pieces(n)

    def check_fits(self, n_tokens: int) -> None:
        if n_tokens >= self.max_context:
            raise InvalidRequestError(
                f"the prompt has {n_tokens} tokens but the context holds {self.max_context}; "
                "shorten the prompt or raise --max-context (up to the model's limit)"
            )

    def prefill(self, ids: list[int], start: int = 0, hidden: bool = False):
        """Prefill ids at positions start..; returns the logits after the last one, [vocab], and
        with hidden also the last one's final hidden state [dim]."""
        self.check_fits(start + len(ids))
        assert ids, "prefill needs at least one token"
        pieces = self.chunks(len(ids))
        for i, (offset, size) in enumerate(pieces):
            last = i == len(pieces) - 1
            out = self.run(self.prefill_inputs(ids[offset:offset + size], start + offset, size),
                           hidden=hidden and last)
        return (out[0][0, -1], out[1][0, -1]) if hidden else out[0, -1]

    def decode(self, token: int, position: int) -> torch.Tensor:
        return self.run(self.decode_inputs(token, position))[0, -1]


def _decode_serves(graphs, name: str, key: str, width: int, hidden: bool) -> bool:
    """A one-row verify with no hidden states computes exactly the decode step's row."""
    return (key == "verify" and width == 1 and not hidden and name not in graphs
            and graph_name(key, width, True) not in graphs and graph_name("decode", 1) in graphs)


def verify_inputs(runner: StepRunner, tree, kept: torch.Tensor, base: int, width: int) -> StepInputs:
    """One verify forward over the kept tree nodes, padded to `width` rows.

    kept[j] sits at slot base + j; padding rows write to the scratch slot and attend only the
    root's slot, so they stay finite and touch nothing real.
    """
    v, dev = kept.numel(), runner.device
    span = runner.span(base + width)
    tokens = torch.zeros(width, dtype=torch.long, device=dev)
    positions = torch.zeros(width, dtype=torch.long, device=dev)
    slots = torch.full((width,), runner.cache.scratch_slot, device=dev)
    mask = torch.zeros(width, span, dtype=torch.bool, device=dev)
    tokens[:v] = tree.tokens[kept]
    positions[:v] = tree.positions(kept, base)
    slots[:v] = base + torch.arange(v, device=dev)
    mask[:v] = tree.mask_for(kept, kept, base, span)
    mask[v:, base] = True
    return StepInputs(tokens[None], positions[None], slots[None], mask[None])
