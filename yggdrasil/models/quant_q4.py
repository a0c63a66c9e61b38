"""Weight format q4: 4-bit weights x int8 activations on our own CPU kernel (yggdrasil.kernels).

    q4  the big linears in blocks of 32 inputs, w = d * q + m (q 0..15; d, m fp16), multiplied by
        `yggdrasil::q4_linear`, which quantizes each activation row to int8 per block and
        accumulates in int32: its T(n) stays nearly flat to 8-16 rows, where ATen's int4 kernel
        (which multiplies in floats) costs n times its one-row time. GGUF Q4_0/Q4_1 tensors are
        packed exactly as stored; other 4-5-bit types are requantized from the loaded weights
        (min/max per block, like Q4_1). The LM head, and every tensor the file keeps at 6+ bits,
        are 8-bit blocks (w = d * q, GGUF Q8_0 as stored, others requantized) on
        `yggdrasil::q8_linear`, the same arithmetic.

Both ops are batch-invariant: a row's output is bitwise the same alone or among any other rows.
With float32 activations the format also runs RMSNorm and attention on the kernels' fixed-order
ops (Transformer.use_batch_invariant_ops), so a whole step computes a token the same in a
decode, verify or prefill step (measured by compile/invariance.py and recorded in the bundle).

The kernels build on first use (a C++ compiler); without one the format is unavailable and says
so (`kernels_available`), and compile falls back to ATen's int4.
"""

from __future__ import annotations

import torch

from yggdrasil import kernels
from yggdrasil.models.quant_base import PackedLinear
from yggdrasil.models.quant_gguf import gguf_q4_parts, gguf_q8_parts

Q4_FORMAT, Q8_FORMAT = "q4", "q8"


class Q4Linear(PackedLinear):
    fmt = Q4_FORMAT

    def __init__(self, weight: kernels.Q4Weight, bias: torch.Tensor | None) -> None:
        groups, blocks, _ = weight.packed.shape
        super().__init__(blocks * kernels.BLOCK, groups * kernels.COLS, bias)
        self.register_buffer("weight", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(torch.ops.yggdrasil.q4_linear(x, self.weight, self.scales, self.mins))

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: d * q + m per block (the kernel's own weights)."""
        return kernels.dequantize_q4(kernels.Q4Weight(self.weight, self.scales, self.mins))


class Q8Linear(PackedLinear):
    fmt = Q8_FORMAT

    def __init__(self, weight: kernels.Q8Weight, bias: torch.Tensor | None) -> None:
        groups, blocks, _ = weight.packed.shape
        super().__init__(blocks * kernels.BLOCK, groups * kernels.COLS, bias)
        self.register_buffer("weight", weight.packed)
        self.register_buffer("scales", weight.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(torch.ops.yggdrasil.q8_linear(x, self.weight, self.scales))

    def dequantized_weight(self) -> torch.Tensor:
        return kernels.dequantize_q8(kernels.Q8Weight(self.weight, self.scales))


def kernels_available() -> str | None:
    """None when our kernels load here (building them once if needed), else why not (one line)."""
    try:
        kernels.load()
    except kernels.KernelBuildError as exc:
        return str(exc).splitlines()[0]
    return None


def invariant_ops_fit(model) -> bool:
    """Whether the model can run RMSNorm and attention on the kernels' batch-invariant ops:
    float32 activations and a head size they take (a multiple of 16, 16..256)."""
    head = model.config.head_dim
    return model.dtype == torch.float32 and head % 16 == 0 and 16 <= head <= 256


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernels take this [out, in] weight (whole blocks of 32 inputs, 16 outputs)."""
    out_features, in_features = weight.shape
    return in_features % kernels.BLOCK == 0 and out_features % kernels.COLS == 0


def q4_modules(model, linears: dict[str, torch.nn.Linear], wide: set[str], gguf=None) -> dict[str, PackedLinear]:
    """Our linear name → its q4-format module: 8-bit blocks for `wide` names, 4-bit for the rest;
    a GGUF's Q4_0/Q4_1 (and, for wide ones, Q8_0) blocks are packed as stored."""
    direct4 = gguf_q4_parts(gguf, model, skip=wide) if gguf is not None else {}
    direct8 = {n: v for n, v in gguf_q8_parts(gguf, model).items() if n in wide} if gguf is not None else {}
    modules = {}
    for name, linear in linears.items():
        bias = linear.bias
        if name in direct4:
            modules[name] = Q4Linear(kernels.pack_q4(*direct4[name]), bias)
        elif name in direct8:
            modules[name] = Q8Linear(kernels.pack_q8(*direct8[name]), bias)
        elif name in wide:
            modules[name] = Q8Linear(kernels.quantize_q8(linear.weight), bias)
        else:
            modules[name] = Q4Linear(kernels.quantize_q4(linear.weight), bias)
    return modules
