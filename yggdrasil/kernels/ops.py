"""Python entry points of the ops: lazy loading, fake kernels for torch.export, ISA choice, and
the AOTInductor settings that make a compiled graph call the C shims directly."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .build import load
from .pack import BLOCK, COLS, Q4Weight, Q8Weight
from .pack_k import Q40Weight, Q4KWeight, Q6KWeight

# The kernels' one ISA vocabulary: their run-time paths, best first (q4_linear.cpp's kPaths; the
# float ops take the avx512 file on avx512vnni, the avx2 one on avxvnni and avx2: the one mapping,
# invariant_ops.cpp's float_kernels). The graphs' compile targets (yggdrasil/cpu.py: native,
# avx512, avx2) are x86-64 levels Inductor compiles for, not kernel paths: one kernel library
# picks its path at run time on whatever CPU runs the bundle.
ISAS = ("avx512vnni", "avxvnni", "avx2", "scalar")
# read once per process, at the first op call: avx512vnni | avxvnni | avx2 | scalar | auto
ISA_ENV = "YGGDRASIL_KERNEL_ISA"

# declarations the AOTInductor wrapper puts in front of its calls (aoti_torch_<device>_<op name>)
Q4_SHIM = ("AOTITorchError aoti_torch_cpu_q4_linear(AtenTensorHandle x, AtenTensorHandle packed, "
           "AtenTensorHandle scales, AtenTensorHandle mins, AtenTensorHandle* ret0)")
Q8_SHIM = ("AOTITorchError aoti_torch_cpu_q8_linear(AtenTensorHandle x, AtenTensorHandle packed, "
           "AtenTensorHandle scales, AtenTensorHandle* ret0)")
Q4_0_SHIM = ("AOTITorchError aoti_torch_cpu_q4_0_linear(AtenTensorHandle x, AtenTensorHandle packed, "
             "AtenTensorHandle scales, AtenTensorHandle* ret0)")
Q4_K_SHIM = ("AOTITorchError aoti_torch_cpu_q4_k_linear(AtenTensorHandle x, AtenTensorHandle packed, "
             "AtenTensorHandle scales, AtenTensorHandle mins, AtenTensorHandle sub_scales, "
             "AtenTensorHandle sub_mins, AtenTensorHandle* ret0)")
Q6_K_SHIM = ("AOTITorchError aoti_torch_cpu_q6_k_linear(AtenTensorHandle x, AtenTensorHandle packed, "
             "AtenTensorHandle high, AtenTensorHandle scales, AtenTensorHandle sub_scales, AtenTensorHandle* ret0)")
# a schema `float` is a C double in Inductor's shim calls (as torchgen declares ATen's)
RMS_NORM_SHIM = ("AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle weight, double eps, "
                 "AtenTensorHandle* ret0)")
SILU_MUL_SHIM = "AOTITorchError aoti_torch_cpu_silu_mul(AtenTensorHandle x, AtenTensorHandle* ret0)"
ATTENTION_SHIM = ("AOTITorchError aoti_torch_cpu_attention(AtenTensorHandle q, AtenTensorHandle k, "
                  "AtenTensorHandle v, AtenTensorHandle mask, double scale, AtenTensorHandle* ret0)")

def register_fakes() -> None:
    """Shape-only kernels, so torch.export / torch.compile trace the ops. build.load calls it once
    per process, when it first loads the library (a second registration would raise)."""

    def out_like(x, packed):
        torch._check(x.shape[-1] == packed.shape[1] * BLOCK, lambda: "x's last dim must be the weight's in_features")
        return x.new_empty((*x.shape[:-1], packed.shape[0] * COLS))

    torch.library.register_fake("yggdrasil::q4_linear")(lambda x, packed, scales, mins: out_like(x, packed))
    torch.library.register_fake("yggdrasil::q4_0_linear")(lambda x, packed, scales: out_like(x, packed))
    torch.library.register_fake("yggdrasil::q4_k_linear")(lambda x, packed, *scales: out_like(x, packed))
    torch.library.register_fake("yggdrasil::q6_k_linear")(lambda x, packed, *rest: out_like(x, packed))
    torch.library.register_fake("yggdrasil::q8_linear")(lambda x, packed, scales: out_like(x, packed))
    torch.library.register_fake("yggdrasil::rms_norm")(_rms_norm_fake)
    torch.library.register_fake("yggdrasil::attention")(_attention_fake)
    torch.library.register_fake("yggdrasil::silu_mul")(lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)))


def _rms_norm_fake(x, weight, eps):
    torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1], lambda: "weight must be [x.shape[-1]]")
    return x.new_empty(x.shape)


def _attention_fake(q, k, v, mask, scale):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "q, k, v must be 4-d")
    torch._check(k.shape[2] == v.shape[2] and k.shape[2] == mask.shape[-1], lambda: "k, v, mask must agree on S")
    return q.new_empty(q.shape)  # contiguous [B, H, T, D]


def q4_linear(x: torch.Tensor, weight: Q4Weight) -> torch.Tensor:
    """x [..., K] float32/bfloat16 -> [..., N] in x's dtype: x @ dequantize(weight).T with int8
    activations (see reference.py for the exact arithmetic)."""
    load()
    return torch.ops.yggdrasil.q4_linear(x, weight.packed, weight.scales, weight.mins)


def q8_linear(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    load()
    return torch.ops.yggdrasil.q8_linear(x, weight.packed, weight.scales)


def q4_0_linear(x: torch.Tensor, weight: Q40Weight) -> torch.Tensor:
    load()
    return torch.ops.yggdrasil.q4_0_linear(x, *weight)


def q4_k_linear(x: torch.Tensor, weight: Q4KWeight) -> torch.Tensor:
    load()
    return torch.ops.yggdrasil.q4_k_linear(x, *weight)


def q6_k_linear(x: torch.Tensor, weight: Q6KWeight) -> torch.Tensor:
    load()
    return torch.ops.yggdrasil.q6_k_linear(x, *weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x float32 [..., D], weight [D] -> weight * (x * rsqrt(mean(x*x, -1) + eps)), each row reduced
    in one fixed order by one thread (batch-invariant; reference.rms_norm_reference is exact)."""
    load()
    return torch.ops.yggdrasil.rms_norm(x, weight, eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, over keys where mask is True) v, q [B, H, T, D], k/v [B, Hkv, S, D]
    (H a multiple of Hkv; views of a cache are read in place), mask bool [B, 1, T, S] -> contiguous
    float32 [B, H, T, D]; a row that may attend no key is 0. scale defaults to D ** -0.5. Each row is
    computed in one fixed order over keys (batch-invariant; reference.attention_reference is exact)."""
    load()
    return torch.ops.yggdrasil.attention(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x float32 [..., 2F] (gate, then up) -> silu(gate) * up [..., F], every element computed by
    the same fixed operations on every path (reference.silu_mul_reference is exact): the SwiGLU's
    nonlinearity, made part of an invariant op so no vector/scalar choice can change its bits."""
    load()
    return torch.ops.yggdrasil.silu_mul(x)


def kernel_isa() -> str:
    """The path the ops take: the CPU's best, or the lower one $YGGDRASIL_KERNEL_ISA names (read at
    the first op call of the process), or forced_isa's."""
    load()
    return torch.ops.yggdrasil.kernel_isa()


def kernel_isas() -> list[str]:
    """Every path this CPU can run, best first."""
    load()
    return list(torch.ops.yggdrasil.kernel_isas())


@contextlib.contextmanager
def forced_isa(name: str) -> Iterator[None]:
    """For tests and the per-path benchmarks: the ops take path `name` inside the block (in every
    thread; a path this CPU or build lacks raises here), the one they took before after it."""
    before = kernel_isa()
    torch.ops.yggdrasil.set_kernel_isa(name)
    try:
        yield
    finally:
        torch.ops.yggdrasil.set_kernel_isa(before)


def aoti_configs() -> dict:
    """inductor_configs for torch._inductor.aoti_compile_and_package: the compiled wrapper calls
    aoti_torch_cpu_q4_linear / _q8_linear / _rms_norm / _attention from our library instead of the
    ProxyExecutor. Compile
    inside aoti_link_env(); load the package in a process that loaded the library first."""
    path = load()
    return {
        "aot_inductor.custom_ops_to_c_shims": {
            torch.ops.yggdrasil.q4_linear.default: [Q4_SHIM],
            torch.ops.yggdrasil.q8_linear.default: [Q8_SHIM],
            torch.ops.yggdrasil.q4_0_linear.default: [Q4_0_SHIM],
            torch.ops.yggdrasil.q4_k_linear.default: [Q4_K_SHIM],
            torch.ops.yggdrasil.q6_k_linear.default: [Q6_K_SHIM],
            torch.ops.yggdrasil.rms_norm.default: [RMS_NORM_SHIM],
            torch.ops.yggdrasil.attention.default: [ATTENTION_SHIM],
            torch.ops.yggdrasil.silu_mul.default: [SILU_MUL_SHIM],
        },
        # -l:<file>: the file has no lib prefix; its directory comes from aoti_link_env
        "aot_inductor.custom_op_libs": [":" + path.name],
    }


@contextlib.contextmanager
def aoti_link_env() -> Iterator[None]:
    """Put the library's directory on LIBRARY_PATH (the compiler driver's -L) while AOTInductor
    links a model against it. The one environment edit the kernels make, and only inside the
    block: Inductor's config names libraries (custom_op_libs, -l) but no directory to find them in
    (its aoti_shim_library_path is for Windows cross builds only), and the linker reads no other
    search path we could set."""
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
