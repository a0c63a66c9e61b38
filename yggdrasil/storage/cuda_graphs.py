"""CUDA graph capture of a bundle's compiled steps at load (docs/design.md §3.6; SGLang's graph runner).

Compiled kernels can be stored in a bundle, CUDA graphs cannot, so they are captured when the
bundle loads: one static input buffer set sized for the largest bucket (smaller buckets use its
leading rows), filled with harmless values (every row writes the scratch KV slot and attends
slot 0), every bucket captured largest first into one shared memory pool. A call copies its
inputs into the buffers and replays the bucket's graph.
"""

from __future__ import annotations

import torch

from .registry import CompiledStep, GraphSet


class StaticInputs:
    def __init__(self, rows: int, span: int, scratch_slot: int, device) -> None:
        self.tokens = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.slots = torch.full((1, rows), scratch_slot, dtype=torch.long, device=device)
        self.mask = torch.zeros(1, rows, span, dtype=torch.bool, device=device)
        self.mask[..., 0] = True
        self.logit_index = torch.zeros(1, 1, dtype=torch.long, device=device)

    def views(self, rows: int, with_logit_index: bool) -> tuple:
        return (self.tokens[:, :rows], self.positions[:, :rows], self.slots[:, :rows], self.mask[:, :rows],
                self.logit_index if with_logit_index else None)


class CapturedStep:
    """A compiled step replayed from its CUDA graph; `replays` counts the replays (tests check
    that decoding really runs on the captured graphs)."""

    def __init__(self, step: CompiledStep, graph: torch.cuda.CUDAGraph, inputs: tuple, outputs) -> None:
        self.name, self._step, self._graph = step.name, step, graph
        self._inputs, self._outputs = inputs, outputs
        self.seconds = 0.0
        self.replays = 0
        self.timing: list | None = None  # when a list: (start, end) CUDA events of each replay (bench)

    def __call__(self, tokens, positions, slots, mask, logit_index=None):
        for static, given in zip(self._inputs, (tokens, positions, slots, mask, logit_index)):
            if static is not None:
                static.copy_(given, non_blocking=True)
        if self.timing is None:
            self._graph.replay()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._graph.replay()
            end.record()
            self.timing.append((start, end))
        self.replays += 1
        # the outputs live in the graph's pool and the next replay overwrites them
        if isinstance(self._outputs, tuple):
            return tuple(t.clone() for t in self._outputs)
        return self._outputs.clone()


WARMUP_RUNS = 2  # uncaptured runs before each capture: lazy initialisation (kernel loads, workspaces)


def capture(graph_set: GraphSet, span: int, scratch_slot: int, device) -> int:
    """Replace every graph of the set by its captured CUDA graph; returns the bytes the captures
    took (the rise of the allocator's reserved memory: the shared graph pool, which
    memory_allocated under-counts, plus what warm-up left cached).

    SGLang's graph-runner pattern: warm-up and capture run on one side stream (a capture cannot
    run on the legacy default stream, and lazily created per-stream state, such as cuBLAS's
    workspace, must exist for the capture stream before capture begins), and every bucket is
    captured into one shared memory pool, largest first, so that the smaller graphs reuse the
    largest one's blocks (one graph of a set runs at a time, in stream order). Each model's
    set has a pool of its own: with stage plans the draft's and the target's graphs replay at
    once on two streams."""
    device = torch.device(device)
    steps = sorted(graph_set.graphs.values(), key=lambda s: -_rows(s.name))
    static = StaticInputs(_rows(steps[0].name), span, scratch_slot, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the capture empties the cache itself; measure from the same start
    before = torch.cuda.memory_reserved(device)
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    captured = {}
    with torch.cuda.stream(stream):
        for step in steps:
            inputs = static.views(_rows(step.name), step.name.startswith(("prefill", "decode")))
            for _ in range(WARMUP_RUNS):
                step(*inputs)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs = step(*inputs)
            captured[step.name] = CapturedStep(step, graph, inputs, outputs)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph_set.graphs.update(captured)
    graph_set.fixed_span = span
    return torch.cuda.memory_reserved(device) - before


def replay_counts(graph_sets) -> dict[str, int]:
    """Replays so far of every captured graph, by role/name (empty where nothing was captured)."""
    return {f"{role}/{name}": step.replays for role, graphs in graph_sets.items()
            for name, step in graphs.graphs.items() if isinstance(step, CapturedStep)}


def _rows(name: str) -> int:
    return int(name.rsplit("_w", 1)[1])


# ---- the server's pool graph at fixed row buckets (issue 36) --------------------------------------

def row_buckets(widest: int) -> tuple[int, ...]:
    """Row counts the server's step graph is captured at: powers of two up to the first that
    holds the widest step (a step pads its rows to the smallest bucket that holds them)."""
    buckets, rows = [], 1
    while True:
        buckets.append(rows)
        if rows >= widest:
            return tuple(buckets)
        rows *= 2


class PoolGraphBuckets:
    """The server's step graph (any rows over the KV pool, graphs/aoti.py) captured as one CUDA
    graph per row bucket over one pool's K/V tensors, with the whole pool as the attention span.
    serve/pool.py pads a step to a bucket (padded_inputs) and calls it; a step wider than the
    largest bucket runs the uncaptured graph. `replays` counts replays per bucket (tests)."""

    def __init__(self, step, kv: list[torch.Tensor], span: int, scratch_slot: int, buckets: tuple[int, ...],
                 device) -> None:
        self.step, self.kv, self.span, self.scratch_slot = step, list(kv), span, scratch_slot
        self.buckets = tuple(sorted(buckets))
        self.replays = {rows: 0 for rows in self.buckets}
        self.capture_bytes = 0
        self._graphs: dict[int, tuple] = {}
        self._capture(torch.device(device))

    def rows_for(self, rows: int) -> int | None:
        """The bucket a step of `rows` rows pads to (None: wider than every bucket)."""
        return next((b for b in self.buckets if b >= rows), None)

    def _capture(self, device: torch.device) -> None:
        """Largest first into one pool on one side stream, after warm-up runs (see capture())."""
        widest = self.buckets[-1]
        static = StaticInputs(widest, self.span, self.scratch_slot, device)
        static.logit_index = torch.zeros(1, widest, dtype=torch.long, device=device)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for rows in reversed(self.buckets):
                inputs = (*static.views(rows, False)[:4], static.logit_index[:, :rows])
                for _ in range(WARMUP_RUNS):
                    self.step(*inputs, kv=self.kv)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    outputs = self.step(*inputs, kv=self.kv)
                self._graphs[rows] = (graph, inputs, outputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.capture_bytes = torch.cuda.memory_reserved(device) - before

    def __call__(self, tokens, positions, slots, mask, logit_index, kv=()):
        rows = tokens.shape[1]
        if rows not in self._graphs or mask.shape[2] != self.span or logit_index.shape[1] != rows:
            return self.step(tokens, positions, slots, mask, logit_index, kv=kv)
        graph, inputs, outputs = self._graphs[rows]
        for static, given in zip(inputs, (tokens, positions, slots, mask, logit_index)):
            static.copy_(given, non_blocking=True)
        graph.replay()
        self.replays[rows] += 1
        # the outputs live in the graph pool and the next replay overwrites them
        return tuple(t.clone() for t in outputs) if isinstance(outputs, tuple) else outputs.clone()
