"""The q4 format's linear modules, one per block kind the kernels take (yggdrasil/kernels/pack.py,
pack_k.py), and the mixed one for a fused linear whose GGUF parts are stored in different kinds.

    kind   module       buffers (pack layout)                          from
    q4     Q4Linear     weight, scales, mins                           GGUF Q4_1; requantized 4-5-bit types
    q4_0   Q40Linear    weight, scales                                 GGUF Q4_0 (no offset stored: 4.5 bits)
    q4_k   Q4KLinear    weight, scales, mins, sub_scales, sub_mins     GGUF Q4_K as stored (4.625 bits)
    q6_k   Q6KLinear    weight, high, scales, sub_scales               GGUF Q6_K as stored (6.5625 bits); a
                                                                       float LM head, requantized
    q8     Q8Linear     weight, scales                                 GGUF Q8_0; other 6+-bit tensors

A fused linear (wqkv, w13) whose parts the file stores in different kinds (Qwen's Q4_K_M keeps
half the layers' attn_v in Q6_K) runs one op per run of equal parts and concatenates their outputs
(`MixedLinear`): each part's weights stay as the file has them.
"""

from __future__ import annotations

import torch

from yggdrasil import kernels
from yggdrasil.models.quant_base import PackedLinear

# kind -> (the op, its weight buffers in argument order, the packed NamedTuple, its dequantizer)
KINDS = {
    "q4": ("q4_linear", ("weight", "scales", "mins"), kernels.Q4Weight, kernels.dequantize_q4),
    "q4_0": ("q4_0_linear", ("weight", "scales"), kernels.Q40Weight, kernels.dequantize_q4_0),
    "q4_k": ("q4_k_linear", ("weight", "scales", "mins", "sub_scales", "sub_mins"), kernels.Q4KWeight,
             kernels.dequantize_q4_k),
    "q6_k": ("q6_k_linear", ("weight", "high", "scales", "sub_scales"), kernels.Q6KWeight, kernels.dequantize_q6_k),
    "q8": ("q8_linear", ("weight", "scales"), kernels.Q8Weight, kernels.dequantize_q8),
}
MIXED = "q4_mixed"
Q4_FAMILY = (*KINDS, MIXED)  # module formats that make a model's format q4


def run_kind(kind: str, x: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    return getattr(torch.ops.yggdrasil, KINDS[kind][0])(x, *tensors)


def out_features_of(weight) -> int:
    return weight.packed.shape[0] * kernels.COLS


class BlockLinear(PackedLinear):
    """One block kind's linear (the subclasses name it, `fmt`): the op over its packed buffers."""

    def __init__(self, weight, bias: torch.Tensor | None) -> None:
        groups, blocks, _ = weight.packed.shape
        super().__init__(blocks * kernels.BLOCK, groups * kernels.COLS, bias)
        for name, tensor in zip(KINDS[self.fmt][1], weight):
            self.register_buffer(name, tensor)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in KINDS[self.fmt][1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(run_kind(self.fmt, x, self.tensors()))

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: the weights the kernel multiplies by, in GGUF's own order."""
        _, _, packed_type, dequantize = KINDS[self.fmt]
        return dequantize(packed_type(*self.tensors()))


class Q4Linear(BlockLinear):
    fmt = "q4"


class Q40Linear(BlockLinear):
    fmt = "q4_0"


class Q4KLinear(BlockLinear):
    fmt = "q4_k"


class Q6KLinear(BlockLinear):
    fmt = "q6_k"


class Q8Linear(BlockLinear):
    fmt = "q8"


BLOCK_CLASSES = {cls.fmt: cls for cls in (Q4Linear, Q40Linear, Q4KLinear, Q6KLinear, Q8Linear)}


class MixedLinear(PackedLinear):
    """Parts of one fused linear in different kinds: part i's buffers are `p{i}_{name}`, its rows
    the next out_features of the output; the outputs are concatenated in order."""

    fmt = MIXED

    def __init__(self, parts: list[tuple[str, object]], bias: torch.Tensor | None) -> None:
        """parts: (kind, packed weight) in row order."""
        in_features = parts[0][1].packed.shape[1] * kernels.BLOCK
        super().__init__(in_features, sum(out_features_of(w) for _, w in parts), bias)
        self.kinds = tuple(kind for kind, _ in parts)
        for i, (kind, weight) in enumerate(parts):
            for name, tensor in zip(KINDS[kind][1], weight):
                self.register_buffer(f"p{i}_{name}", tensor)

    @classmethod
    def from_buffers(cls, in_features: int, out_features: int, buffers: dict[str, torch.Tensor],
                     parts: list[str] | None = None) -> "MixedLinear":
        module = super().from_buffers(in_features, out_features, buffers)
        module.kinds = tuple(parts)
        return module

    def part_tensors(self, i: int) -> list[torch.Tensor]:
        return [getattr(self, f"p{i}_{name}") for name in KINDS[self.kinds[i]][1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [run_kind(kind, x, self.part_tensors(i)) for i, kind in enumerate(self.kinds)]
        return self._add_bias(torch.cat(outs, dim=-1))

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([KINDS[kind][3](KINDS[kind][2](*self.part_tensors(i))) for i, kind in enumerate(self.kinds)])


def block_module(parts: list[tuple[str, object]], bias: torch.Tensor | None) -> PackedLinear:
    """One linear over its parts' packed weights (kind, weight) in row order: runs of one kind are
    merged (their blocks concatenated along the rows), and a single run is a plain kind's module."""
    runs: list[tuple[str, list]] = []
    for kind, weight in parts:
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(weight)
        else:
            runs.append((kind, [weight]))
    merged = [(kind, type(ws[0])(*(torch.cat(fields) for fields in zip(*ws)))) for kind, ws in runs]
    if len(merged) == 1:
        kind, weight = merged[0]
        return BLOCK_CLASSES[kind](weight, bias)
    return MixedLinear(merged, bias)
