"""Python entry points of the ops: lazy loading, fake kernels for torch.export, ISA choice, and
the AOTInductor settings that make a compiled graph call the C shims directly."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .build import load
from .pack import BLOCK, COLS, Q4Weight, Q8Weight

ISA_ENV = "YGGDRASIL_KERNEL_ISA"  # avx512vnni | avxvnni | avx2 | scalar | auto: force a lower path
ISAS = ("avx512vnni", "avxvnni", "avx2", "scalar")

# declarations the AOTInductor wrapper puts in front of its calls (aoti_torch_<device>_<op name>)
Q4_SHIM = ("AOTITorchError aoti_torch_cpu_q4_linear(AtenTensorHandle x, AtenTensorHandle packed, "
           "AtenTensorHandle scales, AtenTensorHandle mins, AtenTensorHandle* ret0)")
Q8_SHIM = ("AOTITorchError aoti_torch_cpu_q8_linear(AtenTensorHandle x, AtenTensorHandle packed, "
           "AtenTensorHandle scales, AtenTensorHandle* ret0)")

_fakes_registered = False


def register_fakes() -> None:
    """Shape-only kernels, so torch.export / torch.compile trace the ops (called by build.load)."""
    global _fakes_registered
    if _fakes_registered:
        return

    def out_like(x, packed):
        torch._check(x.shape[-1] == packed.shape[1] * BLOCK, lambda: "x's last dim must be the weight's in_features")
        return x.new_empty((*x.shape[:-1], packed.shape[0] * COLS))

    torch.library.register_fake("yggdrasil::q4_linear")(lambda x, packed, scales, mins: out_like(x, packed))
    torch.library.register_fake("yggdrasil::q8_linear")(lambda x, packed, scales: out_like(x, packed))
    _fakes_registered = True


def q4_linear(x: torch.Tensor, weight: Q4Weight) -> torch.Tensor:
    """x [..., K] float32/bfloat16 -> [..., N] in x's dtype: x @ dequantize(weight).T with int8
    activations (see reference.py for the exact arithmetic)."""
    load()
    return torch.ops.yggdrasil.q4_linear(x, weight.packed, weight.scales, weight.mins)


def q8_linear(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    load()
    return torch.ops.yggdrasil.q8_linear(x, weight.packed, weight.scales)


def kernel_isa() -> str:
    """The path the ops take now: the CPU's best, or the lower one $YGGDRASIL_KERNEL_ISA names."""
    load()
    return torch.ops.yggdrasil.kernel_isa()


def kernel_isas() -> list[str]:
    """Every path this CPU can run, best first."""
    load()
    return list(torch.ops.yggdrasil.kernel_isas())


@contextlib.contextmanager
def forced_isa(name: str) -> Iterator[None]:
    """Run the ops on path `name` inside the block (the op reads the variable on every call)."""
    old = os.environ.get(ISA_ENV)
    os.environ[ISA_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ISA_ENV, None)
        else:
            os.environ[ISA_ENV] = old


def aoti_configs() -> dict:
    """inductor_configs for torch._inductor.aoti_compile_and_package: the compiled wrapper calls
    aoti_torch_cpu_q4_linear / _q8_linear from our library instead of the ProxyExecutor. Compile
    inside aoti_link_env(); load the package in a process that loaded the library first."""
    path = load()
    return {
        "aot_inductor.custom_ops_to_c_shims": {
            torch.ops.yggdrasil.q4_linear.default: [Q4_SHIM],
            torch.ops.yggdrasil.q8_linear.default: [Q8_SHIM],
        },
        # -l:<file>: the file has no lib prefix; its directory comes from aoti_link_env
        "aot_inductor.custom_op_libs": [":" + path.name],
    }


@contextlib.contextmanager
def aoti_link_env() -> Iterator[None]:
    """Put the library's directory on LIBRARY_PATH (the compiler driver's -L) while AOTInductor
    links a model against it: Inductor's config takes library names but no directory."""
    directory = str(load().parent)
    old = os.environ.get("LIBRARY_PATH")
    os.environ["LIBRARY_PATH"] = os.pathsep.join(filter(None, [directory, old]))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LIBRARY_PATH", None)
        else:
            os.environ["LIBRARY_PATH"] = old
