"""GGUF 4-bit blocks → the int4 format's group-32 values, scales and zeros, with no float round trip.

Q4_0 and Q4_1 store blocks of 32 weights along a row, the same groups the int4 kernel takes:

    Q4_0  fp16 d, 16 bytes of nibbles: w = (q - 8) * d            → scale d, zero 0 (exact)
    Q4_1  fp16 d, fp16 m, 16 bytes:    w = q * d + m              → scale d, zero m + 8d
                                                                     (one fp32 rounding of m + 8d)

Byte j of a block holds value j in its low nibble and value j + 16 in its high one. Other GGUF types
(k-quants, Q5_0, Q8_0, floats) are not mapped here: apply_weight_format quantizes those from the
dequantized weights.
"""

from __future__ import annotations

import numpy as np
import torch

from yggdrasil.models.gguf_file import GGUFFile, TensorInfo

BLOCK = 32
# GGML type codes (the values of gguf.GGMLQuantizationType: this module imports no `gguf`)
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
_DIRECT = (Q4_0, Q4_1)
# types a file uses to keep a tensor wide (6+ bits a weight): the int4 format stores those as int8
# (Q6_K, Q8_0, Q8_1, Q8_K, F16, BF16, F32, F64)
WIDE_TYPES = _WIDE = frozenset({14, 8, 9, 15, 1, 30, 0, 28})


def decode_q4_dm(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw: [rows, row_bytes] of Q4_0/Q4_1 blocks → (q uint8 0..15 [rows, cols], d, m float32
    [rows, cols/32]) with w = d * q + m, exactly as stored (Q4_0: m = -8d, exact in fp16)."""
    rows = raw.shape[0]
    head = 2 if qtype == Q4_0 else 4
    blocks = raw.reshape(rows, -1, head + BLOCK // 2)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., head:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    m = -8 * d if qtype == Q4_0 else np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return q, d, m


def decode_q4_blocks(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw: [rows, row_bytes] of Q4_0/Q4_1 blocks → (q uint8 0..15 [rows, cols], scales, zeros
    float32 [rows, cols/32]) with w = (q - 8) * scale + zero (the int4 format's convention)."""
    q, d, m = decode_q4_dm(raw, qtype)
    zeros = np.zeros_like(d) if qtype == Q4_0 else m + np.float32(8) * d
    return q, d, zeros


def decode_q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """raw: [rows, row_bytes] of Q8_0 blocks (fp16 d, 32 int8) → (q int8 [rows, cols], d float32
    [rows, cols/32]) with w = d * q."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 + BLOCK)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    return np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1).copy(), d


def unpermute(a: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's rotary halves (see gguf_loader._unpermute_rows); blocks run
    # along a row, so the same row order applies to values, scales and zeros
    rows = a.shape[0]
    return a.reshape(n_heads, rows // n_heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _sources(cfg, tied: bool) -> dict[str, list[tuple[str, int | None]]]:
    """Our linear name → its GGUF tensors in fused row order, each with the head count its rows are
    un-permuted by (llama only) or None."""
    llama = cfg.arch == "llama"
    out = {}
    for i in range(cfg.n_layers):
        blk = f"blk.{i}."
        out[f"layers.{i}.attention.wqkv"] = [
            (blk + "attn_q.weight", cfg.n_heads if llama else None),
            (blk + "attn_k.weight", cfg.n_kv_heads if llama else None),
            (blk + "attn_v.weight", None)]
        out[f"layers.{i}.attention.wo"] = [(blk + "attn_output.weight", None)]
        out[f"layers.{i}.feed_forward.w13"] = [(blk + "ffn_gate.weight", None), (blk + "ffn_up.weight", None)]
        out[f"layers.{i}.feed_forward.w2"] = [(blk + "ffn_down.weight", None)]
    out["output"] = [("token_embd.weight" if tied else "output.weight", None)]
    return out


def _decoded(gguf_file: GGUFFile, parts: list[tuple[TensorInfo, int | None]], decode):
    """Each part's blocks decoded, rows un-permuted where llama.cpp permuted them, concatenated
    in fused row order: one torch tensor per decoded field."""
    fields = []
    for info, heads in parts:
        arrays = decode(gguf_file.raw(info), info.qtype)
        fields.append([unpermute(a, heads) if heads is not None else a for a in arrays])
    return tuple(torch.from_numpy(np.ascontiguousarray(np.concatenate(f, axis=0))) for f in zip(*fields))


def _all_of(gguf_file: GGUFFile, model, types, skip: set[str]):
    """Our linear name → its GGUF parts, for the linears every part of which has one of `types`."""
    cfg = model.config
    infos = {t.name: t for t in gguf_file.tensors}
    for name, sources in _sources(cfg, cfg.tie_embeddings).items():
        parts = [(infos.get(tensor), heads) for tensor, heads in sources]
        if name not in skip and all(info is not None and info.qtype in types for info, _ in parts):
            yield name, parts


def linear_sources(gguf_file: GGUFFile, model) -> dict[str, list[tuple[TensorInfo, int | None]] | None]:
    """Our linear name -> its GGUF tensors in fused row order, each with the head count its rows
    are un-permuted by (None: not permuted); None where a tensor is missing from the file."""
    cfg = model.config
    infos = {t.name: t for t in gguf_file.tensors}
    out = {}
    for name, sources in _sources(cfg, cfg.tie_embeddings).items():
        parts = [(infos.get(tensor), heads) for tensor, heads in sources]
        out[name] = None if any(info is None for info, _ in parts) else parts
    return out


def gguf_int4_groups(gguf_file: GGUFFile, model, skip: set[str] = frozenset()
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each big linear whose GGUF tensors are all Q4_0/Q4_1: (q [out, in], scales, zeros
    [out, in/32]) straight from the file's blocks. skip: linears not stored in int4 (not decoded)."""
    return {name: _decoded(gguf_file, parts, decode_q4_blocks)
            for name, parts in _all_of(gguf_file, model, _DIRECT, skip)}


def gguf_wide_linears(gguf_file: GGUFFile, model) -> set[str]:
    """Big linears any of whose GGUF tensors the file stores with 6 or more bits a weight."""
    cfg = model.config
    qtypes = {t.name: t.qtype for t in gguf_file.tensors}
    return {name for name, sources in _sources(cfg, cfg.tie_embeddings).items()
            if any(qtypes.get(tensor) in _WIDE for tensor, _ in sources)}
