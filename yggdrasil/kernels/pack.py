"""Weight blocks for the q4/q8 ops: packing into the kernels' interleaved layout, GGUF blocks,
quantizing float weights, and unpacking back.

A weight [N, K] is cut into blocks of 32 along K. 4-bit: w = d * q + m per block with q in 0..15
(GGUF Q4_0 exactly: m = -8d; Q4_1 exactly: m as stored). 8-bit: w = d * q with q in -127..127
(GGUF Q8_0). d and m are stored in fp16, as GGUF stores them: a quarter less weight traffic than
fp32 at one row, where the op is bound by memory, and exact for GGUF blocks.

Packed layout, for the micro-kernels (csrc/): output columns in groups of 16, each group's blocks
contiguous (one sequential stream per thread):

    q4 packed  uint8   [N/16, K/32, 256]  byte 64*i + 4*c + t of a (group, block): low nibble is
                                           k = 4i + t of column c, high nibble k = 16 + 4i + t
    q8 packed  int8    [N/16, K/32, 512]  byte 64*j + 4*c + t: k = 4j + t of column c
    scales/mins float16 [N/16, K/32, 16]

So one 64-byte load is 16 column lanes x 4 consecutive k: after a mask (low nibbles) or a shift
and mask (high ones) it is exactly the operand vpdpbusd takes against 4 broadcast activation bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from yggdrasil.errors import YggdrasilError

BLOCK = 32
COLS = 16
Q4_BYTES = COLS * BLOCK // 2
Q8_BYTES = COLS * BLOCK


class KernelShapeError(YggdrasilError, ValueError):
    """A weight the kernels cannot take (shape, values): callers fall back to ATen's kernels."""


# a packed weight's features, from its codes' [N/16, K/32, ...] shape (a NamedTuple takes no mixin)
OUT_FEATURES = property(lambda self: self.packed.shape[0] * COLS)
IN_FEATURES = property(lambda self: self.packed.shape[1] * BLOCK)


class Q4Weight(NamedTuple):
    packed: torch.Tensor  # uint8 [N/16, K/32, 256]
    scales: torch.Tensor  # float16 [N/16, K/32, 16]: d
    mins: torch.Tensor  # float16 [N/16, K/32, 16]: m
    out_features = OUT_FEATURES
    in_features = IN_FEATURES


class Q8Weight(NamedTuple):
    packed: torch.Tensor  # int8 [N/16, K/32, 512]
    scales: torch.Tensor  # float16 [N/16, K/32, 16]: d
    out_features = OUT_FEATURES
    in_features = IN_FEATURES


def check_shape(out_features: int, in_features: int) -> None:
    if out_features % COLS or in_features % BLOCK or out_features <= 0 or in_features <= 0:
        raise KernelShapeError(
            f"the q4/q8 kernels take a weight [out_features, in_features] with out_features a multiple of {COLS} "
            f"(the column interleave) and in_features a multiple of {BLOCK} (the block); got "
            f"[{out_features}, {in_features}]")


def _block_params(t: torch.Tensor, n: int, nb: int, name: str) -> torch.Tensor:
    """[N, K/32] per-block values -> float16 [N/16, K/32, 16], finite."""
    if tuple(t.shape) != (n, nb):
        raise KernelShapeError(f"{name} must have shape [{n}, {nb}] (one per block of {BLOCK}), got {list(t.shape)}")
    half = t.to(torch.float16)
    if not torch.isfinite(half).all():
        raise KernelShapeError(f"{name} has values that are not finite in float16")
    return half.reshape(n // COLS, COLS, nb).permute(0, 2, 1).contiguous()


def _unblock(t: torch.Tensor) -> torch.Tensor:
    """float16 [N/16, K/32, 16] -> float32 [N, K/32]."""
    groups, nb, _ = t.shape
    return t.permute(0, 2, 1).reshape(groups * COLS, nb).float()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (checked by the caller) -> the interleaved bytes [N/16, K/32, 256]."""
    n, k = q.shape
    nb = k // BLOCK
    codes = q.to(torch.uint8).reshape(n // COLS, COLS, nb, 2, 4, 4)  # [g, c, b, half, i, t]
    bytes_ = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)  # [g, c, b, i, t]
    return bytes_.permute(0, 2, 3, 1, 4).reshape(n // COLS, nb, Q4_BYTES).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The interleaved bytes [N/16, K/32, 256] -> 4-bit codes uint8 [N, K]."""
    groups, nb, _ = packed.shape
    p = packed.reshape(groups, nb, 4, COLS, 4)  # [g, b, i, c, t]
    codes = torch.stack([p & 0x0F, p >> 4], dim=2)  # [g, b, half, i, c, t]
    return codes.permute(0, 4, 1, 2, 3, 5).reshape(groups * COLS, nb * BLOCK)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4Weight:
    """q uint8 0..15 [N, K], d and m [N, K/32] (w = d * q + m; rounded to float16) -> Q4Weight."""
    n, k = q.shape
    check_shape(n, k)
    if q.is_floating_point():
        raise KernelShapeError(f"q must hold integer codes 0..15, got {q.dtype}")
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise KernelShapeError("q must hold 4-bit codes 0..15")
    nb = k // BLOCK
    return Q4Weight(pack_nibbles(q), _block_params(d, n, nb, "d"), _block_params(m, n, nb, "m"))


def unpack_q4(w: Q4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4Weight -> (q uint8 [N, K], d float32 [N, K/32], m float32 [N, K/32])."""
    return unpack_nibbles(w.packed), _unblock(w.scales), _unblock(w.mins)


def dequantize_q4(w: Q4Weight) -> torch.Tensor:
    """float32 [N, K]: d * q + m per block."""
    q, d, m = unpack_q4(w)
    return d.repeat_interleave(BLOCK, 1) * q.float() + m.repeat_interleave(BLOCK, 1)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> Q8Weight:
    """q int8 -127..127 [N, K], d [N, K/32] (w = d * q; rounded to float16) -> Q8Weight. -128 is
    refused: the AVX2 path's sign trick needs |q| <= 127."""
    n, k = q.shape
    check_shape(n, k)
    if q.numel() and (q.min() < -127 or q.max() > 127):
        raise KernelShapeError("q must hold 8-bit codes in -127..127 (no -128)")
    nb = k // BLOCK
    packed = q.to(torch.int8).reshape(n // COLS, COLS, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [g, b, j, c, t]
    return Q8Weight(packed.reshape(n // COLS, nb, Q8_BYTES).contiguous(), _block_params(d, n, nb, "d"))


def unpack_q8(w: Q8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8Weight -> (q int8 [N, K], d float32 [N, K/32])."""
    groups, nb, _ = w.packed.shape
    q = w.packed.reshape(groups, nb, 8, COLS, 4).permute(0, 3, 1, 2, 4).reshape(groups * COLS, nb * BLOCK)
    return q, _unblock(w.scales)


def dequantize_q8(w: Q8Weight) -> torch.Tensor:
    q, d = unpack_q8(w)
    return d.repeat_interleave(BLOCK, 1) * q.float()


def quantize_q4(weight: torch.Tensor, symmetric: bool = False) -> Q4Weight:
    """Float weight [N, K] -> 4-bit blocks. Default: min/max per block like GGUF Q4_1 (d = (max -
    min) / 15, m = min); symmetric: like GGUF Q4_0 (d = (value of largest magnitude) / -8, m = -8d).
    The codes are rounded against the float16 d and m the kernel will use."""
    n, k = weight.shape
    check_shape(n, k)
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if symmetric:
        extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)
        d = (extreme / -8).half().float()
        m = (-8 * d).half().float()
    else:
        low, high = w.amin(-1), w.amax(-1)
        d = ((high - low) / 15).half().float()
        m = low.half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = ((w - m[..., None]) / safe[..., None]).round().clamp(0, 15)
    q = torch.where(d[..., None] == 0, torch.zeros_like(q), q)
    return pack_q4(q.to(torch.uint8).reshape(n, k), d, m)


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """Float weight [N, K] -> 8-bit blocks like GGUF Q8_0 (d = amax / 127)."""
    n, k = weight.shape
    check_shape(n, k)
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (w.abs().amax(-1) / 127).half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = (w / safe[..., None]).round().clamp(-127, 127)
    return pack_q8(q.to(torch.int8).reshape(n, k), d)


def _raw_blocks(raw, shape: tuple[int, int], block_bytes: int, block: int = BLOCK, check=check_shape,
                what: str = "block") -> np.ndarray:
    """A GGUF tensor's bytes as [N, K/block, block_bytes] (block: 32, or a K kind's super-block)."""
    n, k = shape
    check(n, k)
    data = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8))
    if data.size != n * (k // block) * block_bytes:
        raise KernelShapeError(f"{data.size} bytes of {what}s for a [{n}, {k}] weight; expected "
                               f"{n * (k // block) * block_bytes} ({block_bytes} a {what} of {block})")
    return data.reshape(n, k // block, block_bytes)


def _fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def pack_gguf_q4(raw, qtype, shape: tuple[int, int]) -> Q4Weight:
    """GGUF Q4_0 / Q4_1 block bytes of a [N, K] tensor (rows of K/32 blocks) -> Q4Weight, exact:
    Q4_0 (fp16 d, 16 nibble bytes): w = d*q - 8d; Q4_1 (fp16 d, fp16 m, 16 bytes): w = d*q + m.
    Byte j of a block holds value j in its low nibble and value j + 16 in its high one. (Q4_0
    without the stored offset, 4.5 bits a weight: pack_k.pack_gguf_q4_0.)"""
    import gguf  # optional: only GGUF-sourced weights reach here

    kind = gguf.GGMLQuantizationType(qtype)
    if kind not in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        raise KernelShapeError(f"pack_gguf_q4 takes Q4_0 or Q4_1 blocks, got {kind.name}")
    head = 2 if kind == gguf.GGMLQuantizationType.Q4_0 else 4
    blocks = _raw_blocks(raw, shape, head + BLOCK // 2)
    d = _fp16_field(blocks, 0)
    m = -8 * d if head == 2 else _fp16_field(blocks, 2)  # -8d is exact in fp16 (a power-of-two scaling)
    nibbles = blocks[..., head:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(shape)
    return pack_q4(torch.from_numpy(q), torch.from_numpy(d.astype(np.float32)), torch.from_numpy(m.astype(np.float32)))


def pack_gguf_q8_0(raw, shape: tuple[int, int]) -> Q8Weight:
    """GGUF Q8_0 block bytes (fp16 d, 32 int8) of a [N, K] tensor -> Q8Weight, exact."""
    blocks = _raw_blocks(raw, shape, 2 + BLOCK)
    d = _fp16_field(blocks, 0).astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
    return pack_q8(torch.from_numpy(q.copy()), torch.from_numpy(d))
