"""The server's KV memory: one static cache per model, shared by all requests in blocks of slots.

Requests own blocks, not cache rows: position p of a request lives at slot
blocks[p // block_size] * block_size + p % block_size, in the target's and the draft's cache alike.
A batched step is then one batch-1 forward over the rows of every request in it ("segments"),
and the attention mask alone keeps requests apart (model.py: the mask is the whole attention
pattern). Blocks are handed out lowest first, so the slots in use stay packed at the front and
eager attention reads only that prefix.

Full blocks of a prompt stay cached after their request leaves (prefix_cache.py): a later
request starting with the same tokens shares them (reference counted, read-only) and prefills
only the rest; idle cached blocks count as free and are evicted least recently used first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from yggdrasil.errors import YggdrasilError
from yggdrasil.models.model import KVCache, Transformer
from yggdrasil.host_reads import staged
from yggdrasil.runtime.steps import SPAN_ROUNDING, StepInputs
from .prefix_cache import PrefixCache


class PoolFullError(YggdrasilError):
    """The KV pool has no free block for a request that needs one."""


@dataclass(frozen=True)
class Segment:
    """Consecutive tokens of one request at positions start.., each attending every earlier
    position of that request (prefill chunks, draft catch-up and chain verification alike)."""

    owner: int  # request id
    tokens: tuple[int, ...]
    start: int
    logits: str  # which rows reach the head: "none", "last" or "all"

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def logit_rows(self) -> int:
        return {"none": 0, "last": 1, "all": len(self.tokens)}[self.logits]


class SlotPool:
    """Block allocator over n_blocks * block_size slots (the last slot of the cache is scratch)."""

    def __init__(self, n_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs >= 1 block of >= 1 slot, got {n_blocks} x {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free = list(range(n_blocks))  # a heap: lowest block first keeps slots packed
        self._blocks: dict[int, list[int]] = {}
        self._holders = [0] * n_blocks  # requests holding each block
        self.cache = PrefixCache(block_size) if prefix_cache else None

    @property
    def capacity(self) -> int:
        """Slots in the cache: the blocks and the scratch slot, rounded up to whole attention
        spans (so that every span a forward asks for fits, and the serve graph's span and cache
        dimensions stay multiples of SPAN_ROUNDING)."""
        return -(-(self.n_blocks * self.block_size + 1) // SPAN_ROUNDING) * SPAN_ROUNDING

    @property
    def scratch_slot(self) -> int:
        return self.capacity - 1

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - self.free_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks a reservation can take: never used, or cached but idle (evicted on demand)."""
        return len(self._free) + (self.cache.idle if self.cache is not None else 0)

    def reach(self, exclude: int | None = None) -> int:
        """Slots up to the highest block in use (by owners other than exclude): the least a
        forward's attention span covers."""
        highest = max((max(blocks) for owner, blocks in self._blocks.items() if blocks and owner != exclude),
                      default=-1)
        return (highest + 1) * self.block_size

    def held_blocks(self, owner: int) -> int:
        return len(self._blocks.get(owner, ()))

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def reserve(self, owner: int, positions: int) -> None:
        """Make sure owner's blocks cover positions 0..positions-1."""
        blocks = self._blocks.setdefault(owner, [])
        missing = self.blocks_for(positions) - len(blocks)
        if missing > self.free_blocks:
            raise PoolFullError(f"the KV pool has {self.free_blocks} free blocks of {self.block_size} slots, "
                                f"request {owner} needs {missing} more")
        for _ in range(max(missing, 0)):
            block = heapq.heappop(self._free) if self._free else self.cache.evict()
            self._holders[block] = 1
            blocks.append(block)

    def release(self, owner: int) -> None:
        for block in self._blocks.pop(owner, []):
            self._holders[block] -= 1
            if self._holders[block] > 0:
                continue
            if self.cache is not None and self.cache.holds(block):
                self.cache.release(block)  # stays cached, idle, until the pool needs it
            else:
                heapq.heappush(self._free, block)

    def share_prefix(self, owner: int, tokens: list[int]) -> int:
        """Give a request that holds no blocks yet the cached blocks of the longest prefix of
        `tokens`; the tokens they cover (whole blocks)."""
        if self.cache is None or self._blocks.get(owner):
            return 0
        blocks = self.cache.match(tokens)
        for block in blocks:
            if self._holders[block] == 0:
                self.cache.take(block)
            self._holders[block] += 1
        self._blocks[owner] = list(blocks)
        return len(blocks) * self.block_size

    def remember(self, owner: int, tokens: list[int]) -> None:
        """The owner's K/V is valid for tokens (its first len(tokens) positions): cache its whole
        blocks of them for later requests."""
        if self.cache is not None:
            self.cache.insert(tokens, self._blocks.get(owner, []))

    def slots(self, owner: int, positions: int) -> torch.Tensor:
        """[positions] the slot of each of owner's positions 0..positions-1."""
        blocks = torch.tensor(self._blocks.get(owner, []), dtype=torch.long)
        index = torch.arange(positions)
        if self.blocks_for(positions) > blocks.numel():
            raise ValueError(f"request {owner} holds {blocks.numel()} blocks, not enough for {positions} positions")
        return blocks[index // self.block_size] * self.block_size + index % self.block_size

    def new_cache(self, model: Transformer) -> KVCache:
        """A batch-1 static cache with one slot per pool slot, for this model (a tensor-parallel
        target makes it on every rank, each holding its own K/V heads)."""
        return model.new_cache(1, self.capacity)


def batch_inputs(pool: SlotPool, segments: list[Segment], device: torch.device) -> StepInputs:
    """One batch-1 forward over all segments' rows, in order; logit_index picks the rows each
    segment asks for, in the same order."""
    slot_tables = [pool.slots(s.owner, s.end) for s in segments]
    used = max(int(t.max()) + 1 for t in slot_tables)
    span = min(-(-used // SPAN_ROUNDING) * SPAN_ROUNDING, pool.capacity)
    rows = sum(len(s.tokens) for s in segments)
    mask = torch.zeros(rows, span, dtype=torch.bool)
    tokens, positions, slots, logit_rows = [], [], [], []
    row = 0
    for segment, table in zip(segments, slot_tables):
        n = len(segment.tokens)
        seg_positions = torch.arange(segment.start, segment.end)
        causal = torch.arange(segment.end)[None, :] <= seg_positions[:, None]  # [n, end]
        mask[row:row + n, table] = causal
        tokens.append(torch.tensor(segment.tokens, dtype=torch.long))
        positions.append(seg_positions)
        slots.append(table[segment.start:])
        first = row + n - segment.logit_rows
        logit_rows.extend(range(first, row + n))
        row += n
    logit_index = torch.tensor(logit_rows or [0], dtype=torch.long)
    host = (torch.cat(tokens)[None], torch.cat(positions)[None], torch.cat(slots)[None], mask[None], logit_index[None])
    return StepInputs(*host) if torch.device(device).type == "cpu" else StepInputs(*staged(host, torch.device(device)))


def padded_inputs(inputs: StepInputs, rows: int, span: int, scratch_slot: int) -> StepInputs:
    """A step's host inputs padded to `rows` rows and the whole pool's `span` (the shapes a captured
    serve graph replays, storage/cuda_graphs.PoolGraphBuckets): padding rows are token 0 at
    position 0, write the scratch slot and attend only it, so they stay finite and touch nothing
    real; the logit index is padded with row 0 (its extra logits are dropped)."""
    n, used_span = inputs.tokens.shape[1], inputs.mask.shape[2]
    tokens = torch.zeros(1, rows, dtype=torch.long)
    positions = torch.zeros(1, rows, dtype=torch.long)
    slots = torch.full((1, rows), scratch_slot, dtype=torch.long)
    mask = torch.zeros(1, rows, span, dtype=torch.bool)
    logit_index = torch.zeros(1, rows, dtype=torch.long)
    tokens[:, :n], positions[:, :n], slots[:, :n] = inputs.tokens, inputs.positions, inputs.slots
    mask[:, :n, :used_span] = inputs.mask
    mask[:, n:, scratch_slot] = True
    logit_index[:, :inputs.logit_index.shape[1]] = inputs.logit_index
    return StepInputs(tokens, positions, slots, mask, logit_index)


def run_segments(model: Transformer, cache: KVCache, pool: SlotPool,
                 segments: list[Segment], graph=None) -> list[torch.Tensor]:
    """Run the segments in one forward; each segment's logits [rows it asked for, vocab].
    graph: the bundle's compiled serve graph for this model (None: the eager forward)."""
    if not segments:
        return []
    inputs = batch_inputs(pool, segments, torch.device("cpu"))  # built on the host, staged once
    bucket = graph.rows_for(inputs.tokens.shape[1]) if hasattr(graph, "rows_for") else None
    logit_rows = inputs.logit_index.shape[1]
    if bucket is not None:  # a captured CUDA graph replays this bucket's shapes
        inputs = padded_inputs(inputs, bucket, graph.span, pool.scratch_slot)
    inputs = StepInputs(*staged((inputs.tokens, inputs.positions, inputs.slots, inputs.mask, inputs.logit_index),
                                model.device))
    with torch.inference_mode():
        if graph is not None:
            kv = [t for pair in zip(cache.keys, cache.values) for t in pair]
            logits = graph(inputs.tokens, inputs.positions, inputs.slots, inputs.mask, inputs.logit_index, kv=kv)[0]
            logits = logits[:logit_rows]
        else:
            logits = model(inputs.tokens, inputs.positions, inputs.slots, inputs.mask,
                           logit_index=inputs.logit_index, cache=cache)[0]
    out, row = [], 0
    for segment in segments:
        out.append(logits[row:row + segment.logit_rows])
        row += segment.logit_rows
    return out


@dataclass(frozen=True)
class PoolForward:
    """One model as the server runs it: its cache in the pool and, from a bundle, its compiled
    serve graph (None: eager)."""

    model: Transformer
    cache: KVCache
    graph: object = None

    def run(self, pool: SlotPool, segments: list[Segment]) -> list[torch.Tensor]:
        return run_segments(self.model, self.cache, pool, segments, self.graph)
