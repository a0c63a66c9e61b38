"""Weight formats: how the model's big linear weights are stored and multiplied.

`apply_weight_format(model, fmt)` swaps every big linear (attention wqkv and wo, feed-forward w13 and
w2, the LM head) for a packed-weight linear, in place. Activations keep the model's dtype; only the
weights change:

    fp32  the checkpoint's weights as loaded (no-op)
    bf16  bfloat16 weights, the matmul in bf16 (fast where the CPU has AVX512-BF16 or AMX)
    int8  symmetric int8 per output channel, ATen's `_weight_int8pack_mm` (Inductor lowers it to its
          weight-only-int8 GEMM)
    int4  asymmetric int4 in groups of 32 along the input dimension, w = (q - 8) * scale + zero,
          ATen's `_weight_int4pack_mm_for_cpu` (Inductor's WoQ-int4 GEMM template); the LM head,
          and any linear a GGUF file stores with 6 or more bits (Q6_K, Q8_0, floats), stay int8,
          as llama.cpp's Q4 mixes keep them wide: 4-bit heads cost most of int4's agreement
    q4    block weights times int8 activations on our own kernel (yggdrasil/models/quant_q4.py):
          a GGUF's Q4_0/Q4_1/Q4_K/Q6_K/Q8_0 tensors as stored, the rest requantized to 4-bit (or
          8-bit) blocks, the head at least 6-bit; nearly flat in rows, batch-invariant;
          the token embedding as the GGUF's own block codes where they give the same rows
          bitwise (yggdrasil/models/quant_embed.py)

The token embeddings stay in the model's dtype: a step reads only the rows of its own tokens, so they
cost memory, not bandwidth. A tied LM head gets its own packed copy.

Packed weights are registered buffers with stable names (`layers.0.attention.wqkv.weight`,
`... .scales`), so an exported graph binds them from the live model at load like any parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from yggdrasil.models.quant_base import PackedLinear, WeightFormatError
from yggdrasil.models.quant_embed import compact_embedding
from yggdrasil.models.quant_gguf import gguf_int4_groups, gguf_wide_linears
from yggdrasil.models.quant_blocks import Q4_FAMILY
from yggdrasil.models.quant_q4 import fits, invariant_ops_fit, kernels_available, q4_modules

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "q4")
GROUP_SIZE = 32  # int4 quantization group along the input dimension (GGUF's Q4_0/Q4_1 block)
# Inductor's int4 lowering makes the group size a graph constant of its own; compile names it after
# the first Int4Linear's buffer of this name (every Int4Linear has one), so that it binds from the
# model at load like any weight, in the full model and in a truncated self-draft
INT4_GROUP_SIZE_SUFFIX = "group_size"
LOW_BIT_ORDER = ("q4", "int4", "int8", "bf16")  # a model's format: the narrowest its linears use


class BF16Linear(PackedLinear):
    fmt = "bf16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype))

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float()


class Int8Linear(PackedLinear):
    """weight int8 [out, in], scales [out]: w = weight * scales[:, None]. The matmul runs in
    compute_dtype (the activations are cast to it, the scales stored in it): bf16 where the CPU has
    it, since ATen's and Inductor's fast int8 weight-only kernels take bf16 activations only."""

    fmt = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("weight", qweight.contiguous())
        self.register_buffer("scales", scales.to(compute_dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.scales.dtype)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales).to(x.dtype)
        return self._add_bias(y.reshape(*x.shape[:-1], self.out_features))

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


class Int4Linear(PackedLinear):
    """weight: the CPU kernel's packed uint8 [out, in/2]; scales_and_zeros [in/32, out, 2]:
    w = (q - 8) * scale + zero per group of 32 inputs."""

    fmt = "int4"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None, compute_dtype: torch.dtype) -> None:
        """q: int values 0..15 [out, in]; scales, zeros: [out, in/32]. The matmul runs in
        compute_dtype, which scales and zeros are stored in (see Int8Linear)."""
        super().__init__(q.shape[1], q.shape[0], bias)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("weight", packed)
        pairs = torch.stack([scales.t(), zeros.t()], dim=-1).to(compute_dtype).contiguous()
        self.register_buffer("scales_and_zeros", pairs)
        self.register_buffer(INT4_GROUP_SIZE_SUFFIX, int4_group_size_tensor())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, GROUP_SIZE,
                                                       self.scales_and_zeros).to(x.dtype)
        return self._add_bias(y.reshape(*x.shape[:-1], self.out_features))

    def int4_values(self) -> torch.Tensor:
        """The unpacked int4 values [out, in] (0..15)."""
        return unpack_int4(self.weight, self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        pairs = self.scales_and_zeros.float()
        scales = pairs[..., 0].t().repeat_interleave(GROUP_SIZE, dim=1)
        zeros = pairs[..., 1].t().repeat_interleave(GROUP_SIZE, dim=1)
        return (self.int4_values().float() - 8) * scales + zeros


def int4_group_size_tensor() -> torch.Tensor:
    return torch.tensor(GROUP_SIZE, dtype=torch.int64)


def int4_row_block() -> int:
    """Rows per block of the int4 CPU kernel's packed layout on this CPU (64 on AVX-512, 32 on
    AVX2): found by packing a probe, since ATen picks it by the CPU's instruction set."""
    probe = torch.arange(128 * 32, dtype=torch.int32).reshape(128, 32) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for block in (64, 32, 16):
        if torch.equal(_unpack_blocks(packed, 128, 32, block), probe):
            return block
    raise WeightFormatError("this PyTorch build packs int4 weights in a layout yggdrasil does not "
                            "know; use --weights int8 or bf16")


def _unpack_blocks(packed: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    # each block of `block` rows is stored k-major: byte d of column k holds row d (low nibble) and
    # row d + block/2 (high nibble)
    v = packed.reshape(rows // block, cols, block // 2).to(torch.int32)
    both = torch.cat([v & 15, v >> 4], dim=2)
    return both.permute(0, 2, 1).reshape(rows, cols)


def unpack_int4(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return _unpack_blocks(packed, rows, cols, int4_row_block())


QUANTIZE_ROWS = 4096  # rows quantized at a time: a 150k-row head never needs several float copies


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [out, in], scales float32 [out])."""
    parts = [_quantize_int8_rows(rows) for rows in weight.split(QUANTIZE_ROWS)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def _quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of 32 (min/max, like GGUF's Q4_1): (q 0..15 [out, in],
    scales [out, in/32], zeros [out, in/32]) with w ~ (q - 8) * scale + zero."""
    parts = [_quantize_int4_rows(rows) for rows in weight.split(QUANTIZE_ROWS)]
    return tuple(torch.cat(column) for column in zip(*parts))


def _quantize_int4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    zeros = low + 8 * scales
    return q.reshape(out_features, in_features).to(torch.uint8), scales, zeros


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype int8/int4 matmuls run in: bf16 where the CPU supports it (their fast kernels need
    it), else float32."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def packed_linear(fmt: str, weight: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> nn.Module:
    """A packed linear holding `weight` ([out, in], any float dtype) in format fmt; dtype: the
    int8/int4 matmul's compute dtype."""
    if fmt == "bf16":
        return BF16Linear(weight, bias)
    if fmt == "int8":
        q, scales = quantize_int8(weight)
        return Int8Linear(q, scales, bias, dtype)
    if fmt == "int4":
        q, scales, zeros = quantize_int4(weight)
        return Int4Linear(q, scales, zeros, bias, dtype)
    raise WeightFormatError(f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)}")


def reference_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Plain PyTorch dequantize-then-matmul, in float32: what a packed linear should compute."""
    if isinstance(module, PackedLinear):
        weight, bias = module.dequantized_weight(), module.bias
    else:
        weight, bias = module.weight.float(), module.bias
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y.to(x.dtype)


def big_linears(model: nn.Module) -> list[str]:
    """Names of the linears a weight format applies to, in model order."""
    names = []
    for i in range(len(model.layers)):
        names += [f"layers.{i}.attention.wqkv", f"layers.{i}.attention.wo",
                  f"layers.{i}.feed_forward.w13", f"layers.{i}.feed_forward.w2"]
    return names + ["output"]


def check_weight_format(fmt: str, device: torch.device | str) -> None:
    """Refuse a format that is unknown or that this device has no kernel for."""
    if fmt not in WEIGHT_FORMATS:
        raise WeightFormatError(f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)}")
    if fmt in ("int8", "int4") and torch.device(device).type != "cpu":
        raise WeightFormatError(f"weight format {fmt} has a CPU kernel only; on {device} use bf16 or fp32")
    if fmt == "int4":
        int4_row_block()  # raises if this build's packed layout is unknown
    if fmt == "q4":
        if torch.device(device).type != "cpu":
            raise WeightFormatError(f"weight format q4 has a CPU kernel only; on {device} use bf16 or fp32")
        missing = kernels_available()
        if missing:
            raise WeightFormatError(f"weight format q4 needs yggdrasil's CPU kernels, which cannot be used here "
                                    f"({missing}); use int4 (ATen's kernel) instead")


def _check_shape(fmt: str, name: str, weight: torch.Tensor) -> None:
    out_features, in_features = weight.shape
    if fmt == "int4" and (in_features % GROUP_SIZE or out_features % int4_row_block()):
        raise WeightFormatError(
            f"{name} is {out_features}x{in_features}: int4 needs inputs in whole groups of {GROUP_SIZE} "
            f"and outputs in whole blocks of {int4_row_block()}; use int8 or bf16 for this model")


def apply_weight_format(model: nn.Module, fmt: str, gguf=None) -> None:
    """Store model's big linears in format fmt, in place ("fp32" leaves the model as it is).

    gguf: the GGUFFile the model was loaded from; int4 then takes Q4_0/Q4_1 tensors' own 4-bit values,
    scales and mins as they are (no round trip through float), and quantizes the rest from the
    loaded weights (k-quants are dequantized at load, then requantized here).
    """
    check_weight_format(fmt, model.device)
    if fmt == "fp32":
        return
    if fmt == "q4":
        _apply_q4(model, gguf)
        return
    dtype = compute_dtype(model.device)
    wide = int4_kept_int8(model, gguf) if fmt == "int4" else set()
    direct = gguf_int4_groups(gguf, model, skip=wide) if (gguf is not None and fmt == "int4") else {}
    for name in big_linears(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, attr)
        if not isinstance(linear, nn.Linear):
            continue  # already packed
        linear_fmt = "int8" if name in wide else fmt
        _check_shape(linear_fmt, name, linear.weight)
        if name in direct:
            q, scales, zeros = direct[name]
            packed = Int4Linear(q, scales, zeros, linear.bias, dtype)
        else:
            packed = packed_linear(linear_fmt, linear.weight, linear.bias, dtype)
        setattr(parent, attr, packed)


def _apply_q4(model: nn.Module, gguf=None) -> None:
    """The q4 format: each GGUF tensor in the block kind the kernels take for its type, as stored;
    the rest requantized; the head at least 6-bit (quant_q4.py)."""
    linears = {}
    for name in big_linears(model):
        linear = model.get_submodule(name)
        if isinstance(linear, nn.Linear):
            if not fits(linear.weight):
                out_features, in_features = linear.weight.shape
                raise WeightFormatError(f"{name} is {out_features}x{in_features}: q4 needs inputs in whole blocks "
                                        "of 32 and outputs in whole groups of 16; use int4 or int8 for this model")
            linears[name] = linear
    for name, module in q4_modules(model, linears, gguf).items():
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)
    compact_embedding(model, gguf)  # the GGUF's own blocks where they give the same rows bitwise
    if invariant_ops_fit(model):  # with invariant linears, the whole step is then invariant
        model.use_batch_invariant_ops()


def int4_kept_int8(model: nn.Module, gguf=None) -> set[str]:
    """The linears the int4 format stores as int8: the LM head (greedy choices hinge on its
    logits), and those a GGUF file keeps at 6 bits or more."""
    return {"output"} | (gguf_wide_linears(gguf, model) if gguf is not None else set())


def int4_group_size_buffer(names) -> str | None:
    """Of a model's buffer names (in module order), the first Int4Linear's group-size buffer."""
    return next((name for name in names if name.endswith("." + INT4_GROUP_SIZE_SUFFIX)), None)


def weight_format(model: nn.Module) -> str:
    """The format of model's big linears: the narrowest packed format among them (int4 keeps its
    head int8), "fp32" for plain ones."""
    kinds = {"q4" if module.fmt in Q4_FAMILY else module.fmt for module in model.modules()
             if isinstance(module, PackedLinear)}
    return next((fmt for fmt in LOW_BIT_ORDER if fmt in kinds), "fp32")


def matmul_dtype(model: nn.Module) -> torch.dtype:
    """The precision model's big matmuls round to: bf16 weights always multiply in bf16, int8/int4
    in bf16 where the CPU has it, q4 rounds its activations to int8 (bf16-like), plain linears in
    the model's dtype (what tolerances follow)."""
    fmt = weight_format(model)
    if fmt == "fp32":
        return model.dtype
    if fmt == "q4":  # activations rounded to int8 per block: about bf16's precision (8 bits)
        return torch.bfloat16
    return torch.bfloat16 if fmt == "bf16" else compute_dtype(model.device)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: parameters and persistent buffers, each tensor once
    (a tied head counts once while it is tied); the KV cache is not counted."""
    seen, total = set(), 0
    for tensor in model.state_dict(keep_vars=True).values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total
