"""Ahead-of-time compilation of one step graph into an AOTInductor package (docs/design.md §3.6, §4).

The model forward is exported at a fixed number of rows per bucket; only the attention span (the
mask's last dimension, a multiple of 64) is left symbolic on CPU, so one graph serves every
context length with no recompile, and attends over the used prefix rather than the whole cache.
On CUDA the span is the whole context: CUDA graphs replay one shape.

The server's graph (`export_pool_step`) is the same forward over the server's shared KV pool:
the pool's cache tensors are inputs (written in place), not constants, so one graph serves any
pool size, and rows, logit rows and span are all symbolic: a CPU step runs exactly the rows its
requests need, with no padding (serve/pool.py).

Weights and the KV cache are left out of the package (package_constants_in_so=False) and bound
to the live model's tensors at load, so a bundle holds no copy of the weights at all.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
from torch._inductor.graph import GraphLowering
from torch.export import Dim

from yggdrasil import kernels
from yggdrasil.buckets import SPAN_UNIT, GraphKey
from yggdrasil.models.quant import int4_group_size_buffer, int4_group_size_tensor


class StepModule(torch.nn.Module):
    """The model's step forward as an exportable module (the names of its constants are the
    model's own, prefixed with `model.`)."""

    def __init__(self, model, hidden: bool) -> None:
        super().__init__()
        self.model, self.hidden = model, hidden

    def forward(self, tokens, positions, slots, mask, logit_index=None):
        return self.model(tokens, positions, slots, mask, logit_index=logit_index,
                          return_hidden=self.hidden)


def example_inputs(spec: GraphKey, span: int, device) -> tuple:
    """Inputs of the right shapes and dtypes for the bucket (values do not matter for export)."""
    rows = spec.rows
    tokens = torch.zeros(1, rows, dtype=torch.long, device=device)
    positions = torch.arange(rows, device=device)[None]
    mask = torch.zeros(1, rows, span, dtype=torch.bool, device=device)
    mask[..., 0] = True
    logit_index = (torch.full((1, 1), rows - 1, dtype=torch.long, device=device)
                   if spec.logit_rows == "one" else None)
    return tokens, positions, positions.clone(), mask, logit_index


@contextlib.contextmanager
def _quiet_export():
    """torch 2.13's export and AOTInductor warn once per graph about their own pytree internals
    (LeafSpec); the user can do nothing about it, and it interrupts compile's progress lines."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        yield


@contextlib.contextmanager
def _model_owned_group_size(buffer: str | None):
    """Inductor's int4 lowering makes a constant of its own for the group size (named constantN),
    which a package built without its constants (package_constants_in_so=False) could not bind at
    load. Give it the name of the group-size buffer an int4 model carries (yggdrasil.models.quant), so it
    binds like any weight. buffer: that buffer's name in the exported program (None: no int4)."""
    original = GraphLowering.allocate_non_dup_const_name
    internal = "int4_group_size"

    def allocate(self, name, data):
        if (buffer is not None and name is None and data.dtype == torch.int64
                and torch.equal(data, int4_group_size_tensor())):
            if internal not in self.constants:
                self.constants[internal] = data
                self.constant_reprs[internal] = f"{data.device!r} {data.dtype!r} () ()"
                self.allocated_constant_name[internal] = buffer
            return internal
        return original(self, name, data)

    with mock.patch.object(GraphLowering, "allocate_non_dup_const_name", allocate):
        yield


def calls_our_kernels(exported) -> bool:
    """Whether the exported graph calls yggdrasil's own ops (the q4 format's linears)."""
    return any(node.op == "call_function" and str(node.target).startswith("yggdrasil.")
               for node in exported.graph.nodes)


def package_graph(exported, path: Path) -> None:
    """AOTInductor-compile an exported step into a package at path that carries no constants. A
    graph that calls our kernels calls them through their C shims (no Python, no ProxyExecutor)
    and links the kernel library, which a bundle carries and loads first."""
    configs = {"aot_inductor.package_constants_in_so": False}
    ours = calls_our_kernels(exported)
    with _quiet_export(), _model_owned_group_size(int4_group_size_buffer(exported.state_dict)), \
            (kernels.aoti_link_env() if ours else contextlib.nullcontext()):
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(path), inductor_configs={**configs, **(kernels.aoti_configs() if ours else {})})


def full_span(max_context: int) -> int:
    """The widest attention span a graph may see: the context, in whole span units."""
    return max_context // SPAN_UNIT * SPAN_UNIT


def export_step(model, spec: GraphKey, max_context: int, path: Path, dynamic_span: bool) -> float:
    """Compile spec's graph for `model` (whose cache must be set up for max_context) into an
    AOTInductor package at path; returns the seconds it took."""

    started = time.perf_counter()
    widest = full_span(max_context)
    span = min(2 * SPAN_UNIT, widest) if dynamic_span else widest
    args = example_inputs(spec, span, model.device)
    dynamic = None
    if dynamic_span and widest > SPAN_UNIT:
        blocks = Dim(f"span_blocks_{spec.rows}", min=1, max=widest // SPAN_UNIT)
        dynamic = (None, None, None, {2: SPAN_UNIT * blocks}, None)
    with torch.no_grad(), _quiet_export():
        exported = torch.export.export(StepModule(model, spec.hidden), args, dynamic_shapes=dynamic,
                                       strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    package_graph(exported, path)
    return time.perf_counter() - started


class PoolStepModule(torch.nn.Module):
    """The forward over a KV cache passed in as tensors (k0, v0, k1, v1, ...): the server's pool."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, slots, mask, logit_index, kv):
        return self.model(tokens, positions, slots, mask, logit_index=logit_index, cache=PassedCache(kv))


class PassedCache:
    """What model.forward reads of a cache, over a flat list of K/V tensors."""

    def __init__(self, kv) -> None:
        self.kv = kv

    def layer(self, i: int):
        return self.kv[2 * i], self.kv[2 * i + 1]


MAX_POOL_SLOTS = 2**22  # the symbolic pool size's bound (4M positions)


def export_pool_step(model, path: Path) -> float:
    """Compile the server's step for `model` into an AOTInductor package at path (weights not in
    it, as for every graph); returns the seconds it took."""

    started = time.perf_counter()
    # earlier exports in this process leave dynamo cache entries whose guards, checked against
    # these symbolic inputs, would pin rows away from the model's own sizes (rows != n_heads ...)
    torch._dynamo.reset()
    cfg, device = model.config, model.device
    rows, capacity = 8, 4 * SPAN_UNIT  # pools are whole span units (serve/pool.py)
    tokens = torch.zeros(1, rows, dtype=torch.long, device=device)
    positions = torch.arange(rows, device=device)[None]
    mask = torch.zeros(1, rows, 2 * SPAN_UNIT, dtype=torch.bool, device=device)
    mask[..., 0] = True
    logit_index = torch.arange(3, device=device)[None]
    kv = [torch.zeros(1, cfg.n_kv_heads, capacity, cfg.head_dim, dtype=model.dtype, device=device)
          for _ in range(2 * cfg.n_layers)]
    row_dim, logit_dim = Dim("rows", min=1, max=MAX_POOL_SLOTS), Dim("logit_rows", min=1, max=MAX_POOL_SLOTS)
    span = SPAN_UNIT * Dim("span_blocks", min=1, max=MAX_POOL_SLOTS // SPAN_UNIT)
    slots_dim = Dim("pool_slots", min=SPAN_UNIT, max=MAX_POOL_SLOTS)
    dynamic = ({1: row_dim}, {1: row_dim}, {1: row_dim}, {1: row_dim, 2: span}, {1: logit_dim},
               [{2: slots_dim} for _ in kv])
    with torch.no_grad(), _quiet_export():
        exported = torch.export.export(PoolStepModule(model), (tokens, positions, positions.clone(), mask,
                                                               logit_index, kv),
                                       dynamic_shapes=dynamic, strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    package_graph(exported, path)
    return time.perf_counter() - started
