"""The graph registry: load a bundle's compiled step graphs and hand them to the step runners.

What runs the buckets is the manifest's `steps`: "aoti" (below), "inductor" (Inductor's saved
compiled code, torch.compile'd again from a restored cache at open: inductor_steps.py) or
"eager" (the model's own forward, EagerStep). An AOTInductor graph is a package compiled ahead
of time for one (stage, rows) bucket of one model; the weights and the KV cache are not in it. At load the package's constants are bound to
the live model's own tensors (user-managed: nothing is copied, cache writes land in our cache),
so every bucket of a model shares one copy of its weights.

The packages are opened with the C++ loader directly: importing torch._inductor's Python side
costs seconds, which a fresh process should not pay before its first token.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from yggdrasil.buckets import SPAN_UNIT, GraphKey, NotCompiledError
from yggdrasil.user_dirs import cache_dir

from .inductor_steps import load_steps  # imports Inductor itself only when called
from .layout import BundleLayout
from .manifest import BundleError

class CompiledStep:
    """One loaded graph, called like the model's step forward."""

    def __init__(self, loader, name: str) -> None:
        self._loader, self.name = loader, name
        self.seconds = 0.0  # host time inside this graph (all of it on CPU, where calls block)

    def __call__(self, tokens, positions, slots, mask, logit_index=None, kv=()):
        """kv: the K/V tensors of the cache a pool graph reads and writes in place."""
        flat = [tokens, positions, slots, mask]
        if logit_index is not None:
            flat.append(logit_index)
        flat = [t if t.is_contiguous() else t.contiguous() for t in flat] + list(kv)
        started = time.perf_counter()
        out = self._loader.run(flat)
        self.seconds += time.perf_counter() - started
        return out[0] if len(out) == 1 else tuple(out)


class EagerStep:
    """One bucket run by the model's own step forward (a bundle whose manifest says steps: eager,
    for a torch whose AOTInductor packages cannot be loaded): same call as a CompiledStep, and on
    CUDA captured into a CUDA graph at load like one (cuda_graphs.capture)."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self._model, self.name = model, name
        self._hidden = "_hidden" in name  # graph_name's mark of a step that also returns hidden states
        self.seconds = 0.0

    def __call__(self, tokens, positions, slots, mask, logit_index=None, kv=()):
        if kv:
            raise ValueError(f"eager step {self.name} runs over the model's own cache, not a passed KV pool")
        started = time.perf_counter()
        with torch.inference_mode():
            out = self._model(tokens, positions, slots, mask, logit_index=logit_index, return_hidden=self._hidden)
        self.seconds += time.perf_counter() - started
        return out


def model_constants(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied ones under each of their names."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def open_loader(path: Path, device: torch.device):
    """The C++ loader of one package (torch's binding takes them positionally: path, model
    name, run_single_threaded, num_runners, device index).

    On CUDA the runner is single-threaded: the default (multi-runner) container queries a CUDA
    event to find a free runner before each run, which is illegal inside a CUDA graph capture;
    the single-threaded path runs on the caller's current stream with no such query. One
    runner is all we use anyway: each graph is called from one thread."""
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else 0) if cuda else -1
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", cuda, 1, index)


def open_graph(path: Path, model: torch.nn.Module, name: str, rebuild: str) -> CompiledStep:
    try:
        loader = open_loader(path, model.device)
    except Exception as exc:  # the C++ loader raises RuntimeError with its own text
        raise BundleError(f"compiled graph {path} cannot be loaded ({str(exc).splitlines()[0]}); "
                          f"rebuild with {rebuild}") from None
    constants = model_constants(model)
    wanted = {}
    for fqn in loader.get_constant_fqns():
        tensor = constants.get(fqn.removeprefix("model."))
        if tensor is None:
            raise BundleError(f"compiled graph {path} expects a tensor {fqn} the model does not have "
                              f"(another model or cache size?); rebuild with {rebuild}")
        wanted[fqn] = tensor
    try:
        loader.load_constants(wanted, False, True, True)  # active set, check all, user-managed
    except Exception as exc:
        raise BundleError(f"compiled graph {path} does not fit this model's tensors "
                          f"({str(exc).splitlines()[0]}); rebuild with {rebuild}") from None
    return CompiledStep(loader, name)


class GraphSet:
    """The compiled graphs of one model, by name. Asking for one that was not compiled is an
    error, never a compile: the runtime has no other way to run a step."""

    def __init__(self, role: str, graphs: dict[str, CompiledStep], fixed_span: int | None,
                 load_seconds: float, hint: str, codegen=None) -> None:
        self.role, self.graphs, self.fixed_span = role, graphs, fixed_span
        self.load_seconds, self.hint = load_seconds, hint
        self.codegen = codegen  # inductor steps: what opening generated (inductor_steps.Codegen)
        self.calls = 0

    def get(self, name: str) -> CompiledStep:
        graph = self.graphs.get(name)
        if graph is None:
            raise NotCompiledError(f"not compiled: the {self.role} has no graph {name} in this bundle "
                                   f"(it has {', '.join(sorted(self.graphs))}); add its bucket to "
                                   f"{self.hint} and recompile")
        self.calls += 1
        return graph

    @property
    def seconds(self) -> float:
        return sum(g.seconds for g in self.graphs.values())

    def __contains__(self, name: str) -> bool:
        return name in self.graphs

    def has(self, key: GraphKey) -> bool:
        """Whether it holds the graph a dispatcher key names (read live: compile's stage check
        adds graphs after the runner is built)."""
        return key.role == self.role and key.name in self.graphs

    @property
    def keys(self) -> frozenset[GraphKey]:
        """The graphs it holds, as the dispatcher names them."""
        return frozenset(GraphKey.parse(name, self.role) for name in self.graphs)


def load_graph_set(bundle: Path, role: str, model: torch.nn.Module, names: list[str],
                   rebuild: str, hint: str, steps: str = "aoti", rank: int | None = None) -> GraphSet:
    """The role's graphs: its packages bound to the model (steps aoti), its Inductor steps
    restored and warmed over the model's cache (inductor), or its eager steps. rank: a
    tensor-parallel target's, whose packages are that rank's set (bound to its shard)."""
    started = time.perf_counter()
    layout = BundleLayout(bundle)
    fixed_span, codegen = None, None
    if steps == "eager":
        graphs = {name: EagerStep(model, name) for name in names}
    elif steps == "inductor":
        if rank is not None:
            raise BundleError(f"a tensor-parallel target's graphs are AOTInductor packages per rank, not inductor "
                              f"steps; rebuild with {rebuild}")
        graphs, codegen, fixed_span = _inductor_steps(layout, role, model, names, rebuild)
    else:
        graphs = {name: open_graph(_existing(layout.graph_named(role, name, rank=rank), rank, rebuild), model,
                                   name, rebuild) for name in names}
    if getattr(model, "cache", None) is not None:  # the graphs now write into this very cache
        model.cache.bound_by = f"the {role} graphs of {bundle}"
    return GraphSet(role, graphs, fixed_span, time.perf_counter() - started, hint, codegen)


def _existing(path: Path, rank: int | None, rebuild: str) -> Path:
    """A package that is there (a rank's set missing a graph says which rank)."""
    if rank is not None and not path.is_file():
        raise BundleError(f"rank {rank}'s compiled graph {path} is missing; rebuild with {rebuild}")
    return path


def _inductor_steps(layout: BundleLayout, role: str, model, names: list[str], rebuild: str):
    """(steps, Codegen, their span): every step attends over the whole context, a fixed shape."""
    cache = model.cache
    if cache is None or cache.is_stacked:
        raise ValueError("inductor steps run over a cache of separate K/V buffers: setup_cache(stacked=False)")
    span = cache.max_context // SPAN_UNIT * SPAN_UNIT
    files = {name: layout.graph_named(role, name, "inductor") for name in names}
    for path in files.values():
        if not path.is_file():
            raise BundleError(f"compiled graph {path} is missing; rebuild with {rebuild}")
    try:
        steps, codegen = load_steps(files, model, span, cache.scratch_slot, cache_dir() / "inductor")
    except Exception as exc:  # a damaged archive, a torch that cannot read these artifacts
        raise BundleError(f"the {role}'s compiled steps cannot be restored ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); rebuild with {rebuild}") from None
    return steps, codegen, span
