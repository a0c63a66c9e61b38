"""GGUF blocks to float32 in torch, bit for bit what the gguf package's numpy code gives.

The gguf package dequantizes in numpy, 16 rows at a time on one core, with a temporary array
per step: 26 s for Qwen2.5-Coder-1.5B's Q4_K/Q6_K tensors on a 2-core Zen 4, paid at every load
(compile loads each weight format it measures, each from the file). Here the block types our
models use are decoded over the whole tensor with torch's parallel element-wise kernels. Every
float operation is the one numpy does, in the same order and in float32 (fp16 scales widened
exactly, then one IEEE multiply or subtract per step, never fused; in place, since a fresh
tensor's pages cost more to fault in than the arithmetic), so the values are the same bits
(tests/test_gguf_dequant.py compares them over every block type here and the real files).
Other types fall back to the gguf package.

Block layouts (llama.cpp's ggml-common.h), one block of BLOCK values along a row:
    Q4_0  fp16 d, 16 B nibbles          w = d * (q - 8)
    Q4_1  fp16 d, fp16 m, 16 B nibbles  w = d * q + m
    Q5_0  fp16 d, u32 high bits, 16 B   w = d * (q - 16)
    Q8_0  fp16 d, 32 int8               w = q * d
    Q4_K  fp16 d, fp16 dmin, 12 B 6-bit scales and mins, 128 B nibbles (256 values)
          w = (d * sc) * q - (dmin * m)
    Q6_K  128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, fp16 d (256 values)
          w = (d * scale) * (q - 32)
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

# GGML type codes (the values of gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
QK_K = 256


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, widened to float32 (exact): [n, 1]."""
    return blocks[:, start:start + 2].clone().view(torch.float16).float()  # clone: offset 0, aligned


def _nibbles(packed: torch.Tensor, group: int) -> torch.Tensor:
    """[n, k*group] bytes -> [n, 2*k*group]: per run of `group` bytes, their low nibbles then
    their high ones (the order every block type here stores them in)."""
    n = packed.shape[0]
    runs = packed.reshape(n, -1, 1, group)
    return torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(n, -1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return q.float().mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _nibbles(blocks[:, 4:], 16).float().mul_(d).add_(m)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    # a little-endian u32 whose bit i is value i's fifth bit: bit i % 8 of byte i // 8
    high = ((blocks[:, 2:6, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1, 32)
    q = (_nibbles(blocks[:, 6:], 16) | (high << 4)).to(torch.int8) - 16
    return q.float().mul_(d)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)


def _q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins per block (get_scale_min)."""
    n = packed.shape[0]
    parts = packed.reshape(n, 3, 4)
    d, m, m_d = parts[:, 0], parts[:, 1], parts[:, 2]
    scales = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scales, mins


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _q4_k_scales(blocks[:, 4:16])
    scale = (d * scales.float()).reshape(n, -1, 1)
    offset = (dmin * mins.float()).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, -1, 32).float()
    return q.mul_(scale).sub_(offset).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :QK_K // 2], 64).reshape(n, -1, 32)
    pairs = blocks[:, QK_K // 2:QK_K // 2 + QK_K // 4].reshape(n, -1, 1, 32)
    high = torch.cat([(pairs >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2).reshape(n, -1, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    scales = blocks[:, 3 * QK_K // 4:3 * QK_K // 4 + QK_K // 16].contiguous().view(torch.int8).float()
    d = _f16(blocks, 3 * QK_K // 4 + QK_K // 16)
    scale = (d * scales).reshape(n, QK_K // 16, 1)
    return q.reshape(n, QK_K // 16, -1).float().mul_(scale).reshape(n, QK_K)


# type code -> (values per block, bytes per block, decoder)
DECODERS = {Q4_0: (32, 18, _q4_0), Q4_1: (32, 20, _q4_1), Q5_0: (32, 22, _q5_0), Q8_0: (32, 34, _q8_0),
            Q4_K: (QK_K, 144, _q4_k), Q6_K: (QK_K, 210, _q6_k)}


def supported(qtype: int) -> bool:
    return int(qtype) in DECODERS


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: a tensor's stored blocks (any shape, uint8) -> float32 [shape], a fresh tensor."""
    _, nbytes, decode = DECODERS[int(qtype)]
    with warnings.catch_warnings():  # a view of the read-only file map, which nothing here writes
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1, nbytes)
    return decode(blocks).reshape(shape)
