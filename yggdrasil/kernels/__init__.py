"""The project's own CPU kernels: 4-bit (and 8-bit) block weights x int8 activations, and the
batch-invariant float32 RMSNorm and attention that go with them.

    from yggdrasil import kernels
    w = kernels.quantize_q4(weight)              # or pack_q4 / pack_gguf_q4 / pack_gguf_q8_0
    y = kernels.q4_linear(x, w)                  # torch.ops.yggdrasil.q4_linear underneath
    h = kernels.rms_norm(x, norm_weight, eps)    # torch.ops.yggdrasil.rms_norm
    o = kernels.attention(q, k, v, mask, scale)  # torch.ops.yggdrasil.attention

The C++ library builds on first use (build.py); importing this package needs no compiler. With no
compiler, load() raises KernelBuildError: callers fall back to ATen's int4/int8 kernels.
Layout: pack.py; exact arithmetic: reference.py; ISA paths, threading: csrc/q4_linear.cpp and
csrc/invariant_ops.cpp.
"""

from .build import KernelBuildError, is_loaded, library_path, load
from .ops import (ATTENTION_SHIM, ISA_ENV, ISAS, Q4_SHIM, Q8_SHIM, RMS_NORM_SHIM, aoti_configs, aoti_link_env,
                  attention, forced_isa, kernel_isa, kernel_isas, q4_0_linear, q4_k_linear, q4_linear, q6_k_linear,
                  q8_linear, rms_norm, silu_mul)
from .pack import (BLOCK, COLS, KernelShapeError, Q4Weight, Q8Weight, dequantize_q4, dequantize_q8, pack_gguf_q4,
                   pack_gguf_q8_0, pack_q4, pack_q8, quantize_q4, quantize_q8, unpack_q4, unpack_q8)
from .pack_k import (Q40Weight, Q4KWeight, Q6KWeight, dequantize_q4_0, dequantize_q4_k, dequantize_q6_k,
                     pack_gguf_q4_0, pack_gguf_q4_k, pack_gguf_q6_k, pack_q4_0, pack_q4_k, pack_q6_k, quantize_q6_k)
from .reference import (attention_reference, q4_0_linear_reference, q4_k_linear_reference, q4_linear_reference,
                        q6_k_linear_reference, q8_linear_reference, quantize_activations, rms_norm_reference,
                        silu_mul_reference)

__all__ = [
    "ATTENTION_SHIM", "BLOCK", "COLS", "ISAS", "ISA_ENV", "KernelBuildError", "KernelShapeError", "Q4Weight", "Q4_SHIM",
    "Q8Weight", "Q8_SHIM", "RMS_NORM_SHIM", "aoti_configs", "aoti_link_env", "attention", "attention_reference",
    "dequantize_q4", "dequantize_q8", "forced_isa", "is_loaded", "kernel_isa", "kernel_isas", "library_path", "load",
    "pack_gguf_q4", "pack_gguf_q8_0", "pack_q4", "pack_q8", "q4_linear", "q4_linear_reference", "q8_linear",
    "q8_linear_reference", "quantize_activations", "quantize_q4", "quantize_q8", "rms_norm", "rms_norm_reference",
    "unpack_q4", "unpack_q8", "Q40Weight", "Q4KWeight", "Q6KWeight", "dequantize_q4_0", "dequantize_q4_k",
    "dequantize_q6_k", "pack_gguf_q4_0", "pack_gguf_q4_k", "pack_gguf_q6_k", "pack_q4_0", "pack_q4_k", "pack_q6_k",
    "q4_0_linear", "q4_k_linear", "q6_k_linear", "q4_0_linear_reference", "q4_k_linear_reference",
    "q6_k_linear_reference", "quantize_q6_k", "silu_mul", "silu_mul_reference",
]
