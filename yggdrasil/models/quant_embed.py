"""The token embedding in a compact form whose rows are exactly the deployed model's (issue 41).

A GGUF stores the embedding in blocks (Q8_0 in SmolLM2's, Q4_K in Qwen2.5-Coder-1.5B's, Q5_0 in
0.5B's); loading dequantizes it to float32, which is 4 bytes a value where the file spends 0.5-1
(0.9 GB of an int4 Qwen-1.5B's 2.1 GB). Every type it uses computes a value the same way: an
integer code, and per sub-block of 16 or 32 values a float32 scale and offset,

    value = fl(fl(scale * code) - offset)          (each product and difference rounded once)

(Q8_0, Q4_0, Q5_0, Q6_K: offset 0; Q4_1, Q5_1: offset = -m; Q4_K, Q5_K: offset = dmin * m).
BlockEmbedding keeps int8 codes and the two float32 tables (1.25 bytes a value) and computes a
row's values with exactly those two roundings, so its rows are bit for bit the float32 rows the
model was loaded with: `compact_embedding` checks that over the whole table and keeps the float32
embedding where it does not hold (a type not listed, or a file whose rows differ).

The decoders mirror the `gguf` package's dequantization (its operations, in its order).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14  # GGML type codes
QK_K = 256


def _f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n_blocks: int, half: int) -> np.ndarray:
    """Low nibbles then high nibbles of each run of `half` bytes."""
    q = qs.reshape(n_blocks, -1, 1, half) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n_blocks, -1)


def _high_bits(qh: np.ndarray, n_blocks: int) -> np.ndarray:
    bits = qh.view(np.uint32).reshape(n_blocks, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _legacy(blocks: np.ndarray, qtype: int):
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])[:, None]
    if qtype == Q8_0:
        return blocks[:, 2:].view(np.int8), d, np.zeros_like(d)
    if qtype == Q4_0:
        return _nibbles(blocks[:, 2:], n, 16).astype(np.int8) - np.int8(8), d, np.zeros_like(d)
    if qtype == Q5_0:
        q = _nibbles(blocks[:, 6:], n, 16) | (_high_bits(blocks[:, 2:6], n) << np.uint8(4))
        return q.astype(np.int8) - np.int8(16), d, np.zeros_like(d)
    m = _f16(blocks[:, 2:4])[:, None]
    if qtype == Q4_1:
        return _nibbles(blocks[:, 4:], n, 16).astype(np.int8), d, -m
    q = _nibbles(blocks[:, 8:], n, 16) | (_high_bits(blocks[:, 4:8], n) << np.uint8(4))  # Q5_1
    return q.astype(np.int8), d, -m


def _scale_min_k(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: eight 6-bit scales and mins packed in 12 bytes."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc, mins


def _k_quant(blocks: np.ndarray, qtype: int):
    n = blocks.shape[0]
    if qtype == Q6_K:
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        scales, d = blocks[:, 192:208].view(np.int8).astype(np.float32), _f16(blocks[:, 208:210])
        low = _nibbles(ql.reshape(n, 2, 64), n * 2, 64).reshape(n, -1, 32)
        high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = (low | (high.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
        scale = d * scales
        return q.reshape(n, -1), scale, np.zeros_like(scale)
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mins = _scale_min_k(blocks[:, 4:16])
    scale, offset = d * sc.astype(np.float32), dmin * mins.astype(np.float32)
    if qtype == Q4_K:
        q = (blocks[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
        return q.reshape(n, -1).astype(np.int8), scale, offset
    qh, qs = blocks[:, 16:48], blocks[:, 48:]  # Q5_K
    low = (qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    high = (qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    q = low.reshape(n, -1, 32) | (high.reshape(n, -1, 32) << np.uint8(4))
    return q.reshape(n, -1).astype(np.int8), scale, offset


BLOCK_BYTES = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
               Q4_K: (QK_K, 144), Q5_K: (QK_K, 176), Q6_K: (QK_K, 210)}


def decode_codes(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """raw: [rows, row_bytes] blocks of one GGML type -> (codes int8 [rows, cols], scales and
    offsets float32 [rows, cols / group]) with value = scale * code - offset, or None for a type
    this module does not know."""
    if qtype not in BLOCK_BYTES:
        return None
    values, size = BLOCK_BYTES[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    codes, scale, offset = (_legacy if values == 32 else _k_quant)(blocks, qtype)
    return (np.ascontiguousarray(codes).reshape(rows, -1), np.ascontiguousarray(scale, np.float32).reshape(rows, -1),
            np.ascontiguousarray(offset, np.float32).reshape(rows, -1))


class BlockEmbedding(nn.Module):
    """Embedding rows as int8 codes [vocab, dim] with a float32 scale and offset per group of
    values [vocab, dim / group]: row = scale * code - offset, two roundings, in float32. Types
    without offsets (Q8_0, Q4_0, Q5_0, Q6_K) store none: subtracting 0 changes no value."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.group = self.embedding_dim // scales.shape[1]
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)

    @classmethod
    def from_buffers(cls, buffers: dict[str, torch.Tensor]) -> "BlockEmbedding":
        return cls(buffers["codes"], buffers["scales"], buffers.get("offsets"))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        codes = self.codes[tokens].float()
        grouped = codes.unflatten(-1, (-1, self.group))
        # two ops, not an addcmul: each result rounded as the file's dequantization rounds it
        scaled = grouped * self.scales[tokens].unsqueeze(-1)
        if self.offsets is None:
            return scaled.flatten(-2)
        return (scaled - self.offsets[tokens].unsqueeze(-1)).flatten(-2)

    @property
    def weight(self) -> torch.Tensor:
        """Every row, dequantized (plain PyTorch; what the exactness check compares)."""
        return self.forward(torch.arange(self.num_embeddings, device=self.codes.device))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 codes in groups of {self.group}"


def compact_embedding(model: nn.Module, gguf) -> str:
    """Replace the model's float32 embedding with a BlockEmbedding of the GGUF's own blocks when
    its rows are bitwise the loaded ones; returns what was done, in words."""
    info = next((t for t in gguf.tensors if t.name == "token_embd.weight"), None) if gguf is not None else None
    embedding = model.tok_embeddings
    if info is None or not isinstance(embedding, nn.Embedding) or embedding.weight.dtype != torch.float32:
        return "embedding kept in float32 (no GGUF blocks to keep)"
    decoded = decode_codes(gguf.raw(info), int(info.qtype))
    if decoded is None:
        return f"embedding kept in float32 ({info.qtype.name} blocks are not mapped)"
    codes, scales, offsets = (torch.from_numpy(a.copy()) for a in decoded)
    compact = BlockEmbedding(codes, scales, offsets if bool(offsets.any()) else None)
    if tuple(compact.codes.shape) != tuple(embedding.weight.shape) or not torch.equal(compact.weight, embedding.weight):
        return f"embedding kept in float32 (its {info.qtype.name} rows do not reproduce the loaded ones bitwise)"
    model.tok_embeddings = compact
    return f"embedding as {info.qtype.name} codes (exact rows)"
