"""Which vector ISA the graphs are compiled for (`compile --isa`, recipe key `isa:`).

Inductor compiles a CPU graph's C++ with gcc's -march=native by default, and picks its own
vector ISA (the widest this CPU has) for the kernels it writes. Such graphs run only on CPUs with
every extension the compiling one has. A portable target instead compiles for an x86-64 level
(-march=x86-64-v3 with Inductor's AVX2 vectors, or x86-64-v4 with plain AVX-512: no VNNI, no
BF16), so one build serves a fleet whose CPUs have at least that level. The settings are
patched in only around packaging (never globally), and each cached graph records what it was
compiled for beside it (NAME.isa), so a bundle's manifest describes the graphs it holds.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from unittest import mock

import torch
import yaml
from torch._inductor import config, cpu_vec_isa

from yggdrasil.cpu import NATIVE, PORTABLE, X86, CpuFingerprint, GraphIsa, ordered
from yggdrasil.errors import YggdrasilError


class IsaError(YggdrasilError):
    """An --isa this machine cannot compile (and check) graphs for."""


def _portable_vec_isa(target: str):
    """Inductor's VecISA for a portable target: its arch flags only (Inductor's own AVX-512 adds
    -mavx512bf16 where the compiling CPU has it, which an x86-64-v4 CPU need not have)."""
    if target == "avx2":
        return cpu_vec_isa.VecAVX2()

    class PortableAVX512(cpu_vec_isa.VecAVX512):
        def build_arch_flags(self) -> str:
            return self._arch_flags

        def is_avx512_bf16_supported(self) -> bool:
            return False

    return PortableAVX512()


@contextlib.contextmanager
def inductor_isa(target: str):
    """Inductor compiles for `target` inside the block: gcc's -march (config.cpp.march), the
    vector width (config.cpp.simdlen) and the one vector ISA it may pick. native: as it is."""
    if target == NATIVE:
        yield
        return
    if not hasattr(config.cpp, "march"):
        raise IsaError(f"--isa {target} needs a torch whose Inductor can set gcc's -march (torch.__version__ "
                       f"{torch.__version__} cannot); use --isa native, or torch >= 2.13")
    march, simdlen, _ = PORTABLE[target]
    vec = _portable_vec_isa(target)
    with config.patch({"cpp.march": march, "cpp.simdlen": simdlen}), \
            mock.patch.object(cpu_vec_isa, "valid_vec_isa_list", lambda: [vec]):
        yield


def configured_march() -> str:
    """gcc's -march Inductor compiles with: native unless patched. Torch releases before
    cpp.march existed (2.11, the GPU image's) always compiled with -march=native."""
    march = getattr(config.cpp, "march", None)
    return NATIVE if march is None else (march or "gcc's default")


def graph_isa(target: str, cpu: CpuFingerprint) -> GraphIsa:
    """What graphs compiled here for `target` are compiled for, and what they need of a CPU:
    a portable target its x86-64 level; native every feature this CPU has (gcc may emit any)."""
    if target != NATIVE:
        if cpu.machine not in X86:
            raise IsaError(f"--isa {target} is for x86-64 CPUs; this machine is {cpu.machine}: use --isa native")
        missing = cpu.lacks(PORTABLE[target][2])
        if missing:  # compile checks the graphs by running them here
            raise IsaError(f"--isa {target} needs a CPU with {', '.join(missing)} to compile and check its graphs "
                           f"on, which this one ({cpu.summary()}) lacks; compile on such a machine, or use "
                           f"--isa {cpu.portable_isa() or NATIVE}")
    with inductor_isa(target):
        vec = str(cpu_vec_isa.pick_vec_isa())
        march = configured_march()
    if target == NATIVE:
        requires = cpu.features or ()
    else:
        requires = ordered({*PORTABLE[target][2], *_flag_features(_portable_vec_isa(target).build_arch_flags())})
    return GraphIsa(target, march, vec, tuple(requires), cpu.summary())


def _flag_features(flags: str) -> set[str]:
    """The cpuinfo names of gcc -m flags ('-mavx512f -mfma' -> {'avx512f', 'fma'})."""
    names = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "amx-tile": "amx_tile",
             "amx-bf16": "amx_bf16", "amx-int8": "amx_int8"}
    return {names.get(f[2:], f[2:]) for f in flags.split() if f.startswith("-m")}


def isa_key(isa: GraphIsa) -> tuple:
    """What a cached graph's key adds for its target: nothing for native (graphs cached before
    --isa existed stay valid), else the target and this module's code."""
    if isa.target == NATIVE:
        return ()
    return (f"isa {isa.target}", hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16])


def _record(graph: Path) -> Path:
    return graph.with_suffix(".isa")


def record_isa(graph: Path, isa: GraphIsa) -> None:
    """Write down beside a cached graph what it was compiled for."""
    _record(graph).write_text(yaml.safe_dump(isa.as_dict(), sort_keys=False))


def recorded_isa(graph: Path) -> GraphIsa | None:
    """What a cached graph was compiled for (None: cached before graphs recorded it)."""
    try:
        return GraphIsa.from_dict(yaml.safe_load(_record(graph).read_text()))
    except (OSError, KeyError, TypeError, AttributeError, yaml.YAMLError):
        return None
