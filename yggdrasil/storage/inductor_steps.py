"""Bundles whose buckets run Inductor-compiled steps (recipe `steps: inductor`; docs/design.md §3.6).

Where a torch build cannot load the AOTInductor packages it compiles (the lent GPU image: torch
2.11.0+cu130, bench/results/gpu-session-*-2026-11-26), a bundle carries Inductor's own compiled
code instead: at compile each bucket's step is `torch.compile`d (fullgraph, fixed shapes, no
Inductor-managed CUDA graphs) and run once, and what Inductor produced is saved with
`torch.compiler.save_cache_artifacts()` (the FX-graph and AOTAutograd cache entries, Triton
kernels bundled in them) into one file per graph, with the C++ kernels Inductor built for a CPU
step (those the artifacts do not carry). At open the artifacts are restored with
`torch.compiler.load_cache_artifacts()` into a cache directory of our own, and each step is built
again by the same code and run once on harmless inputs: Dynamo traces it (a second or two) and
every compiled piece comes from the restored cache, so nothing is generated, compiled or
autotuned (`load_steps` counts the cache misses and new C++ kernels; tests require zero). On
CUDA the steps are then captured as CUDA graphs like any bucket (cuda_graphs.capture).

Every step attends over the whole context (fixed shapes, as CUDA graphs replay one shape). Once
warm, a call that compiled anything raises (a bundle never compiles at run time). Graph files
are zip archives:

    artifacts.bin      torch.compiler.save_cache_artifacts() bytes
    kernels/AB/c....so the C++ kernels of a CPU step, at their path inside an Inductor cache dir
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from yggdrasil.errors import YggdrasilError

ARTIFACTS = "artifacts.bin"
KERNELS = "kernels/"
# Inductor options every step compiles with, at compile and at open alike. An AOTInductor compile
# writes its device metadata into Inductor's global config (torch 2.13), which is part of every
# later FX-graph cache key: a process that had compiled a package (compile's formats phase, a
# test session) saved steps no fresh process could find. Each step pins it to the default.
STEP_OPTIONS = {"aot_inductor.metadata": {}}


def _step(model, tokens, positions, slots, mask, logit_index, hidden):
    return model(tokens, positions, slots, mask, logit_index=logit_index, return_hidden=hidden)


def step_function(name: str):
    """The function a bucket's step compiles from, with a code object of its own: Dynamo keeps
    compiled code (and its recompile limit) per code object, so buckets never share one."""
    code = _step.__code__.replace(co_name=f"step_{name}")
    return types.FunctionType(code, _step.__globals__, f"step_{name}")


@contextlib.contextmanager
def isa_keyed_cache() -> Iterator[None]:
    """Inductor's cache key (torch 2.13) lacks the CPU vector ISA it generates for: code compiled
    for AVX-512 would be found, and crash, on a machine (or an ATen forced) without it. The ISA
    goes into the key, at compile and at open alike, so another CPU misses instead."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # Inductor's Python side: only here

    tag = f"cpu-isa={pick_vec_isa() or 'scalar'}"
    current = torch.compiler.config.cache_key_tag
    with torch.compiler.config.patch(cache_key_tag=f"{current}|{tag}" if current else tag):
        yield


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """A copy made inside inference mode: the same strides and tensor kind whatever view the
    caller passes (a capture's slice of a larger buffer, a runner's fresh tensor), so Dynamo's
    guards see one input kind and never ask for a second compile."""
    return tensor.clone(memory_format=torch.contiguous_format)


class InductorStep:
    """One bucket's step, torch.compile'd: same call as a registry.CompiledStep. `warm()` runs it
    once (compiling, or loading what a bundle restored); after that a recompile is an error."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self._model, self.name = model, name
        self._hidden = "_hidden" in name  # buckets.graph_name's mark of a step returning hidden states
        self._compiled = torch.compile(step_function(name), fullgraph=True, dynamic=False, options=STEP_OPTIONS)
        self._warm = False
        self.seconds = 0.0

    def __call__(self, tokens, positions, slots, mask, logit_index=None, kv=()):
        if kv:
            raise ValueError(f"inductor step {self.name} runs over the model's own cache, not a passed KV pool")
        started = time.perf_counter()
        # counted, not forbidden by torch.compiler.set_stance: a stance is process-global, and
        # steps run on two threads at once (compile's contention measurement) would leave it set
        compiled_before = _compiled_frames()
        with torch.inference_mode():
            inputs = [_dense(t) for t in (tokens, positions, slots, mask)]
            index = _dense(logit_index) if logit_index is not None else None
            out = self._compiled(self._model, *inputs, index, self._hidden)
        if self._warm and _compiled_frames() != compiled_before:
            raise StepRecompiledError(f"inductor step {self.name} compiled again at run time (its inputs' "
                                      "shapes, strides or dtypes changed); this is a bug in yggdrasil, please report it")
        self.seconds += time.perf_counter() - started
        return out

    def warm(self, span: int, scratch_slot: int) -> None:
        """One run on harmless inputs (every row writes the scratch slot, attends slot 0)."""
        self(*warm_inputs(self.name, span, scratch_slot, self._model.device))
        self._warm = True


class StepRecompiledError(YggdrasilError):
    """A warm step compiled again: a bundle never compiles at run time."""


def _compiled_frames() -> int:
    from torch._dynamo.utils import counters  # imported by torch.compile itself by now

    return counters["stats"]["unique_graphs"]


def warm_inputs(name: str, span: int, scratch_slot: int, device) -> tuple:
    """Inputs of the bucket's shapes and dtypes whose run changes nothing that matters."""
    rows = int(name.rsplit("_w", 1)[1].split("_")[0])
    tokens = torch.zeros(1, rows, dtype=torch.long, device=device)
    positions = torch.zeros(1, rows, dtype=torch.long, device=device)
    slots = torch.full((1, rows), scratch_slot, dtype=torch.long, device=device)
    mask = torch.zeros(1, rows, span, dtype=torch.bool, device=device)
    mask[..., 0] = True
    one_row = name.startswith(("prefill", "decode"))  # buckets.GraphKey.logit_rows "one"
    logit_index = torch.zeros(1, 1, dtype=torch.long, device=device) if one_row else None
    return tokens, positions, slots, mask, logit_index


# ---- the graph file --------------------------------------------------------------------------------

def write_artifact(path: Path, artifacts: bytes, inductor_dir: Path) -> None:
    """One graph's file: the saved cache artifacts and every C++ kernel in the (private) Inductor
    cache directory it was compiled in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(ARTIFACTS, artifacts)
        for kernel in sorted(inductor_dir.rglob("*.so")):
            archive.write(kernel, KERNELS + kernel.relative_to(inductor_dir).as_posix())
    tmp.replace(path)


def _restore(path: Path, inductor_dir: Path) -> None:
    """Unpack a graph file's kernels into inductor_dir (content-addressed names: an existing
    file of the same size is the same kernel) and load its artifacts into the caches there."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.startswith(KERNELS) or info.is_dir():
                continue
            target = inductor_dir / info.filename.removeprefix(KERNELS)
            if not (target.is_file() and target.stat().st_size == info.file_size):
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(target.with_name(target.name + ".tmp"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                target.with_name(target.name + ".tmp").replace(target)
        torch.compiler.load_cache_artifacts(archive.read(ARTIFACTS))


# ---- compile and open ------------------------------------------------------------------------------

@contextlib.contextmanager
def private_inductor_cache(directory: Path | None = None) -> Iterator[Path]:
    """Inductor's caches pointed at `directory` (a fresh temporary one when None), and artifact
    recording fresh: what is compiled or loaded inside is exactly one graph's."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch.compiler._cache import CacheArtifactManager

    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="yggdrasil-inductor-")))
        directory.mkdir(parents=True, exist_ok=True)
        stack.enter_context(temporary_cache_dir(str(directory)))
        stack.enter_context(CacheArtifactManager.with_fresh_cache())
        stack.enter_context(isa_keyed_cache())
        yield directory


def compile_step(model, name: str, span: int, scratch_slot: int, path: Path) -> float:
    """Compile one bucket's step for `model` (its cache set up, separate buffers) and save it to
    path; returns the seconds it took."""
    started = time.perf_counter()
    with private_inductor_cache() as inductor_dir:
        InductorStep(model, name).warm(span, scratch_slot)
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise RuntimeError(f"torch.compile of {name} left no cache artifacts to save (is Inductor's FX graph "
                               "cache off? TORCHINDUCTOR_FX_GRAPH_CACHE=0 disables what this needs)")
        write_artifact(path, saved[0], inductor_dir)
    return time.perf_counter() - started


@dataclass(frozen=True)
class Codegen:
    """What opening generated instead of loading: cache misses (FX graph, AOTAutograd) and C++
    kernels built; all zero when the bundle's compiled code fits this machine and torch."""

    fx_graph_misses: int = 0
    aot_autograd_misses: int = 0
    kernels_built: int = 0

    @property
    def none(self) -> bool:
        return not (self.fx_graph_misses or self.aot_autograd_misses or self.kernels_built)

    def __str__(self) -> str:
        return (f"{self.fx_graph_misses} FX-graph and {self.aot_autograd_misses} AOTAutograd cache misses, "
                f"{self.kernels_built} C++ kernels built")


def _misses() -> tuple[int, int]:
    from torch._dynamo.utils import counters  # Dynamo's Python side: only where steps compile

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return (inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"],
            aot["autograd_cache_miss"] + aot["autograd_cache_bypass"])


def load_steps(files: dict[str, Path], model, span: int, scratch_slot: int,
               inductor_dir: Path) -> tuple[dict[str, InductorStep], Codegen]:
    """The steps of `files` (name -> graph file) for `model`, restored into inductor_dir and
    warmed once each, and what that generated (Codegen)."""
    steps = {}
    fx_before, aot_before = _misses()
    with private_inductor_cache(inductor_dir):
        kernels_before = set(inductor_dir.rglob("*.so"))
        for name, path in files.items():
            _restore(path, inductor_dir)
        for name in files:
            steps[name] = InductorStep(model, name)
            steps[name].warm(span, scratch_slot)
        built = len(set(inductor_dir.rglob("*.so")) - kernels_before - _shipped(files.values(), inductor_dir))
    fx_after, aot_after = _misses()
    return steps, Codegen(fx_after - fx_before, aot_after - aot_before, built)


def _shipped(files, inductor_dir: Path) -> set[Path]:
    """The kernel files the graph files carry, at their restored paths."""
    shipped = set()
    for path in files:
        with zipfile.ZipFile(path) as archive:
            shipped |= {inductor_dir / n.removeprefix(KERNELS) for n in archive.namelist() if n.startswith(KERNELS)}
    return shipped
