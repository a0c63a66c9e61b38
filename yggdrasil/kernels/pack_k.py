"""The GGUF block kinds the kernels take as the file stores them (issue 53): Q4_0 without its
offset (4.5 bits a weight), Q4_K with its super-block scales and 6-bit sub-block scales and mins
(4.625 bits: the 6-bit values a byte each), Q6_K with its 6-bit codes and int8 scales per 16
weights (6.5625 bits). pack.py has the shared layout (16 interleaved columns, blocks of 32 along K,
the 4-bit codes in q4's nibble order); this adds each kind's scales and, for q6_k, the plane of
high bits:

    q4_0  packed uint8 [N/16, K/32, 256], scales fp16 [N/16, K/32, 16]         w = d*(q - 8)
    q4_k  packed as q4's; scales, mins fp16 [N/16, K/256, 16] (d, dmin of each super-block);
          sub_scales, sub_mins uint8 [N/16, K/32, 16] (0..63)                  w = d*sc*q - dmin*mn
    q6_k  packed: the codes' low nibbles, as q4's; high uint8 [N/16, K/32, 128]: byte
          64*j + 4*c + t holds the top 2 bits of k = 8j+t, 16+8j+t, 8j+4+t, 16+8j+4+t of column c
          (bits 0-1, 2-3, 4-5, 6-7); scales fp16 [N/16, K/256, 16]; sub_scales int8
          [N/16, K/32, 32] (the block's first 16 weights' scale for each column, then its last 16's)
                                                                               w = d*sc*(q - 32)

Dequantizing in float32 in GGUF's order gives the file's own dequantized weights bit for bit
(tests/test_kernels_k.py checks this against the `gguf` package).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .pack import BLOCK, COLS, KernelShapeError, _block_params, _fp16_field, _raw_blocks, check_shape, pack_nibbles, \
    unpack_nibbles

SUPER = 256  # weights per K-quant super-block
SUPER_BLOCKS = SUPER // BLOCK
Q4_K_BYTES, Q6_K_BYTES = 144, 210  # GGUF bytes per super-block


class Q40Weight(NamedTuple):
    packed: torch.Tensor  # uint8 [N/16, K/32, 256]
    scales: torch.Tensor  # float16 [N/16, K/32, 16]


class Q4KWeight(NamedTuple):
    packed: torch.Tensor  # uint8 [N/16, K/32, 256]
    scales: torch.Tensor  # float16 [N/16, K/256, 16]: d
    mins: torch.Tensor  # float16 [N/16, K/256, 16]: dmin
    sub_scales: torch.Tensor  # uint8 [N/16, K/32, 16]
    sub_mins: torch.Tensor  # uint8 [N/16, K/32, 16]


class Q6KWeight(NamedTuple):
    packed: torch.Tensor  # uint8 [N/16, K/32, 256]: low nibbles
    high: torch.Tensor  # uint8 [N/16, K/32, 128]: the top 2 bits
    scales: torch.Tensor  # float16 [N/16, K/256, 16]: d
    sub_scales: torch.Tensor  # int8 [N/16, K/32, 32]


def _check_super(n: int, k: int) -> None:
    check_shape(n, k)
    if k % SUPER:
        raise KernelShapeError(f"a K-quant weight takes whole super-blocks of {SUPER} inputs; got in_features {k}")


def _per_column(t: torch.Tensor, n: int, per_row: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """[N, per_row] -> [N/16, per_row, 16] in dtype (values checked to fit by the caller)."""
    if tuple(t.shape) != (n, per_row):
        raise KernelShapeError(f"{name} must have shape [{n}, {per_row}], got {list(t.shape)}")
    return t.to(dtype).reshape(n // COLS, COLS, per_row).permute(0, 2, 1).contiguous()


def _unblock(t: torch.Tensor) -> torch.Tensor:
    """[N/16, per_row, 16] -> [N, per_row]."""
    groups, per_row, _ = t.shape
    return t.permute(0, 2, 1).reshape(groups * COLS, per_row)


def _codes(q: torch.Tensor, top: int) -> None:
    if q.is_floating_point() or (q.numel() and (q.min() < 0 or q.max() > top)):
        raise KernelShapeError(f"q must hold integer codes 0..{top}")


def pack_q4_0(q: torch.Tensor, d: torch.Tensor) -> Q40Weight:
    """q uint8 0..15 [N, K], d [N, K/32] (w = d * (q - 8), GGUF Q4_0) -> Q40Weight."""
    n, k = q.shape
    check_shape(n, k)
    _codes(q, 15)
    return Q40Weight(pack_nibbles(q), _block_params(d, n, k // BLOCK, "d"))


def pack_q4_k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> Q4KWeight:
    """q 0..15 [N, K]; d, dmin [N, K/256]; sc, mn 0..63 [N, K/32] (w = d*sc*q - dmin*mn, GGUF Q4_K)."""
    n, k = q.shape
    _check_super(n, k)
    _codes(q, 15)
    for name, t in (("sc", sc), ("mn", mn)):
        if t.numel() and (t.min() < 0 or t.max() > 63):
            raise KernelShapeError(f"{name} must hold 6-bit values 0..63")
    nb, ns = k // BLOCK, k // SUPER
    return Q4KWeight(pack_nibbles(q), _block_params(d, n, ns, "d"), _block_params(dmin, n, ns, "dmin"),
                     _per_column(sc, n, nb, torch.uint8, "sc"), _per_column(mn, n, nb, torch.uint8, "mn"))


def pack_q6_k(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> Q6KWeight:
    """q 0..63 [N, K]; d [N, K/256]; sc int8 [N, K/16] (w = d*sc*(q - 32), GGUF Q6_K)."""
    n, k = q.shape
    _check_super(n, k)
    _codes(q, 63)
    if tuple(sc.shape) != (n, k // 16):
        raise KernelShapeError(f"sc must have shape [{n}, {k // 16}] (one per 16 weights), got {list(sc.shape)}")
    q = q.to(torch.uint8)
    nb = k // BLOCK
    # [g, c, b, half, j, e, t]: k = 16*half + 8*j + 4*e + t; its 2 bits go to bit 2 * (2e + half)
    top = (q >> 4).reshape(n // COLS, COLS, nb, 2, 2, 2, 4)
    # the four 2-bit fields of a byte ORed in place (a sum over the two dims was 0.2 s a tensor)
    high = top[:, :, :, 0, :, 0].clone()  # [g, c, b, j, t]
    for half, e, shift in ((0, 1, 4), (1, 0, 2), (1, 1, 6)):
        high |= top[:, :, :, half, :, e] << shift
    high = high.permute(0, 2, 3, 1, 4).reshape(n // COLS, nb, 128).contiguous()
    sub = sc.to(torch.int8).reshape(n // COLS, COLS, nb, 2).permute(0, 2, 3, 1).reshape(n // COLS, nb, 2 * COLS)
    return Q6KWeight(pack_nibbles(q & 0x0F), high, _block_params(d, n, k // SUPER, "d"), sub.contiguous())


def unpack_q4_k(w: Q4KWeight) -> tuple[torch.Tensor, ...]:
    """-> (q [N, K], d, dmin float32 [N, K/256], sc, mn int32 [N, K/32])."""
    return (unpack_nibbles(w.packed), _unblock(w.scales).float(), _unblock(w.mins).float(),
            _unblock(w.sub_scales).int(), _unblock(w.sub_mins).int())


def unpack_q6_k(w: Q6KWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q 0..63 [N, K], d float32 [N, K/256], sc int32 [N, K/16])."""
    groups, nb, _ = w.high.shape
    low = unpack_nibbles(w.packed)
    high = w.high.reshape(groups, nb, 2, COLS, 4).to(torch.int32)  # [g, b, j, c, t]
    bits = torch.stack([torch.stack([(high >> s) & 3 for s in pair], 3) for pair in ((0, 4), (2, 6))], 3)
    # bits [g, b, j, half, e, c, t] -> [g, c, b, half, j, e, t]
    top = bits.permute(0, 5, 1, 3, 2, 4, 6).reshape(groups * COLS, nb * BLOCK)
    q = low.to(torch.int32) | (top << 4)
    sc = w.sub_scales.reshape(groups, nb, 2, COLS).permute(0, 3, 1, 2).reshape(groups * COLS, nb * 2).int()
    return q.to(torch.uint8), _unblock(w.scales).float(), sc


def dequantize_q4_0(w: Q40Weight) -> torch.Tensor:
    q = unpack_nibbles(w.packed).float()
    return _unblock(w.scales).float().repeat_interleave(BLOCK, 1) * (q - 8)


def dequantize_q4_k(w: Q4KWeight) -> torch.Tensor:
    """GGUF's order: (d*sc) * q - (dmin*mn), each product exact, the difference rounded once."""
    q, d, dmin, sc, mn = unpack_q4_k(w)
    scale = d.repeat_interleave(SUPER_BLOCKS, 1) * sc.float()
    offset = dmin.repeat_interleave(SUPER_BLOCKS, 1) * mn.float()
    return scale.repeat_interleave(BLOCK, 1) * q.float() - offset.repeat_interleave(BLOCK, 1)


def dequantize_q6_k(w: Q6KWeight) -> torch.Tensor:
    """GGUF's order: (d*sc) * (q - 32)."""
    q, d, sc = unpack_q6_k(w)
    scale = d.repeat_interleave(SUPER // 16, 1) * sc.float()
    return scale.repeat_interleave(16, 1) * (q.float() - 32)


# -- GGUF blocks -----------------------------------------------------------------------------------

def pack_gguf_q4_0(raw, shape: tuple[int, int]) -> Q40Weight:
    """GGUF Q4_0 blocks (fp16 d, 16 nibble bytes: value j low, j + 16 high) -> Q40Weight, exact."""
    blocks = _raw_blocks(raw, shape, 2 + BLOCK // 2)
    nibbles = blocks[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(shape)
    return pack_q4_0(torch.from_numpy(q), torch.from_numpy(_fp16_field(blocks, 0).astype(np.float32)))


def _super_blocks(raw, shape: tuple[int, int], nbytes: int) -> np.ndarray:
    return _raw_blocks(raw, shape, nbytes, SUPER, _check_super, "super-block")


def decode_q4_k(raw, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """GGUF Q4_K super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles) -> (q uint8 [N, K], d, dmin float32 [N, K/256], sc, mn uint8 [N, K/32])."""
    n, k = shape
    blocks = _super_blocks(raw, shape, Q4_K_BYTES)
    d, dmin = _fp16_field(blocks, 0).astype(np.float32), _fp16_field(blocks, 2).astype(np.float32)
    s = blocks[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(n, k // SUPER, 4, 32)  # pairs of sub-blocks: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
    return q, d, dmin, sc.reshape(n, k // BLOCK), mn.reshape(n, k // BLOCK)


def decode_q6_k(raw, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q6_K super-blocks (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales,
    fp16 d) -> (q uint8 0..63 [N, K], d float32 [N, K/256], sc int8 [N, K/16])."""
    n, k = shape
    blocks = _super_blocks(raw, shape, Q6_K_BYTES)
    ql = blocks[..., :128].reshape(n, k // SUPER, 2, 2, 32)  # [half of 128, first/second 32 bytes, l]
    qh = blocks[..., 128:192].reshape(n, k // SUPER, 2, 32)
    parts = [(ql[..., 0, :] & 0x0F) | (((qh >> 0) & 3) << 4), (ql[..., 1, :] & 0x0F) | (((qh >> 2) & 3) << 4),
             (ql[..., 0, :] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 1, :] >> 4) | (((qh >> 6) & 3) << 4)]
    q = np.stack(parts, axis=3).reshape(n, k)  # [.., half, part, l]: element 128*half + 32*part + l
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, k // 16)
    return q, _fp16_field(blocks, 208).astype(np.float32), sc


def pack_gguf_q4_k(raw, shape: tuple[int, int]) -> Q4KWeight:
    q, d, dmin, sc, mn = (torch.from_numpy(np.ascontiguousarray(a)) for a in decode_q4_k(raw, shape))
    return pack_q4_k(q, d, dmin, sc, mn)


def pack_gguf_q6_k(raw, shape: tuple[int, int]) -> Q6KWeight:
    q, d, sc = (torch.from_numpy(np.ascontiguousarray(a)) for a in decode_q6_k(raw, shape))
    return pack_q6_k(q, d, sc)


def quantize_q6_k(weight: torch.Tensor) -> Q6KWeight:
    """Float weight [N, K] -> 6-bit blocks like GGUF Q6_K (for a float LM head): each 16 weights
    get the scale amax/31 (so q - 32 stays within -32..31), stored as int8 multiples of the
    super-block's fp16 d = (largest such scale) / 127; codes rounded against the stored scales."""
    n, k = weight.shape
    _check_super(n, k)
    w = weight.detach().float().reshape(n, k // SUPER, SUPER // 16, 16)
    scale = w.abs().amax(-1) / 31
    d = (scale.amax(-1) / 127).half().float()  # [n, k/256]
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    sc = torch.where(d[..., None] == 0, torch.zeros_like(scale), (scale / safe_d[..., None]).round().clamp(1, 127))
    step = d[..., None] * sc  # the scale the kernel will use, float32 (exact: fp16 x int8)
    safe = torch.where(step == 0, torch.ones_like(step), step)
    q = (w / safe[..., None]).round().clamp(-32, 31) + 32
    q = torch.where(step[..., None] == 0, torch.full_like(q, 32), q)
    return pack_q6_k(q.to(torch.uint8).reshape(n, k), d, sc.to(torch.int8).reshape(n, k // 16))
