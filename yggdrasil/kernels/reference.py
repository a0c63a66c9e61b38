"""Plain-PyTorch definitions of the q4/q8 ops: what the C++ kernels must equal bit for bit.

Activations: each row of x (as float32) is cut into blocks of 32; a block with amax >= 1e-30 gets
scale s = amax / 127 and codes xq = round_half_even(x * (127 / amax)) clamped to -127..127 (a
block below that quantizes to zero with s = 0). Per output (row, column), blocks in order 0, 1, ...:

    q4:  acc = acc + (d * float(dot) + m * float(sum(xq))) * s
    q8:  acc = acc + (d * float(dot)) * s

with dot = sum(q * xq) and sum(xq) exact integers, each float operation rounded to float32 once
(no fused multiply-add), acc starting at 0. The result is cast to x's dtype (round to nearest
even for bfloat16). A row's value depends only on that row: the ops are batch-invariant.
Slow (a Python loop over blocks); for tests.
"""

from __future__ import annotations

import torch

from .pack import BLOCK, Q4Weight, Q8Weight, unpack_q4, unpack_q8

TINY_AMAX = 1e-30


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq float32 integer codes [M, K/32, 32], s [M, K/32], float(sum xq) [M, K/32])."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    live = amax >= TINY_AMAX
    full = torch.full_like(amax, 127.0)  # tensor / tensor: a true division, as the kernels do
    zero = torch.zeros_like(amax)
    inv = torch.where(live, full / torch.where(live, amax, full), zero)
    scale = torch.where(live, amax / full, zero)
    xq = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    return xq, scale, xq.sum(-1)


def _linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    n = q.shape[0]
    x2 = x.reshape(-1, k)
    xq, scale, sums = quantize_activations(x2)
    nb = k // BLOCK
    # exact integer dots: products and sums stay far below 2**53
    dots = torch.einsum("rbt,nbt->rnb", xq.double(), q.double().reshape(n, nb, BLOCK)).float()
    acc = torch.zeros(x2.shape[0], n)
    for b in range(nb):
        part = d[:, b] * dots[:, :, b]
        if m is not None:
            part = part + m[:, b] * sums[:, b, None]
        acc = acc + part * scale[:, b, None]
    return acc.to(x.dtype).reshape(*x.shape[:-1], n)


def q4_linear_reference(x: torch.Tensor, weight: Q4Weight) -> torch.Tensor:
    q, d, m = unpack_q4(weight)
    return _linear(x, q, d, m)


def q8_linear_reference(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    q, d = unpack_q8(weight)
    return _linear(x, q, d, None)
