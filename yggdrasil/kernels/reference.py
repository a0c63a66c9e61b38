"""Plain-PyTorch definitions of the q4/q8 ops: what the C++ kernels must equal bit for bit.

Activations: each row of x (as float32) is cut into blocks of 32; a block with amax >= 1e-30 gets
scale s = amax / 127 and codes xq = round_half_even(x * (127 / amax)) clamped to -127..127 (a
block below that quantizes to zero with s = 0). Per output (row, column), blocks in order 0, 1, ...,
acc = acc + part * s, where the block's part is, by the weight's kind (pack.py, pack_k.py):

    q4:    d * float(dot) + m * float(sum(xq))
    q4_0:  d * float(dot - 8 * sum(xq))
    q4_k:  d * float(sc * dot) - dmin * float(mn * sum(xq))     (d, dmin: the block's super-block's)
    q6_k:  d * float(sc_lo * (dot_lo - 32 * sum_lo) + sc_hi * (dot_hi - 32 * sum_hi))
           (lo, hi: the block's first and last 16 weights and codes; q 0..63)
    q8:    d * float(dot)

with dot = sum(q * xq) and the sums exact integers, each float operation rounded to float32 once
(no fused multiply-add), acc starting at 0. The result is cast to x's dtype (round to nearest
even for bfloat16). A row's value depends only on that row: the ops are batch-invariant.
Slow (a Python loop over blocks); for tests.
"""

from __future__ import annotations

import torch

from .pack import BLOCK, Q4Weight, Q8Weight, unpack_q4, unpack_q8
from .pack_k import SUPER_BLOCKS, Q40Weight, Q4KWeight, Q6KWeight, unpack_nibbles, unpack_q4_k, unpack_q6_k

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


def _blockwise(x: torch.Tensor, q: torch.Tensor, part) -> torch.Tensor:
    """acc = acc + part(b, dots, xq) * s over blocks in order; dots [rows, N, 2] are the exact
    integer dots of each block's two halves (k 0..15 and 16..31), xq [rows, 32] its codes."""
    k, n = x.shape[-1], q.shape[0]
    x2 = x.reshape(-1, k)
    xq, scale, _ = quantize_activations(x2)
    nb = k // BLOCK
    halves = torch.einsum("rbht,nbht->rnbh", xq.double().reshape(-1, nb, 2, 16),
                          q.double().reshape(n, nb, 2, 16)).round().long()
    acc = torch.zeros(x2.shape[0], n)
    for b in range(nb):
        acc = acc + part(b, halves[:, :, b], xq[:, b].long()) * scale[:, b, None]
    return acc.to(x.dtype).reshape(*x.shape[:-1], n)


def q4_0_linear_reference(x: torch.Tensor, weight: Q40Weight) -> torch.Tensor:
    q = unpack_nibbles(weight.packed)
    d = weight.scales.permute(0, 2, 1).reshape(q.shape[0], -1).float()

    def part(b, dots, xq):
        return d[:, b] * (dots.sum(-1) - 8 * xq.sum(-1, keepdim=True)).float()
    return _blockwise(x, q, part)


def q4_k_linear_reference(x: torch.Tensor, weight: Q4KWeight) -> torch.Tensor:
    q, d, dmin, sc, mn = unpack_q4_k(weight)

    def part(b, dots, xq):
        s = b // SUPER_BLOCKS
        return (d[:, s] * (sc[:, b] * dots.sum(-1)).float()
                - dmin[:, s] * (mn[:, b] * xq.sum(-1, keepdim=True)).float())
    return _blockwise(x, q, part)


def q6_k_linear_reference(x: torch.Tensor, weight: Q6KWeight) -> torch.Tensor:
    q, d, sc = unpack_q6_k(weight)

    def part(b, dots, xq):
        lo_sum, hi_sum = xq[:, :16].sum(-1, keepdim=True), xq[:, 16:].sum(-1, keepdim=True)
        isum = sc[:, 2 * b] * (dots[..., 0] - 32 * lo_sum) + sc[:, 2 * b + 1] * (dots[..., 1] - 32 * hi_sum)
        return d[:, b // SUPER_BLOCKS] * isum.float()
    return _blockwise(x, q, part)


# --- the batch-invariant float ops (csrc/float_common.h): every path's bits, in PyTorch ---------
#
# Each is spelled as separate float32 tensor operations (one rounding each, no fused multiply-add),
# in the kernels' order, so op == reference bit for bit on every ISA path. Against the usual
# formulas (F.rms_norm, F.scaled_dot_product_attention) they differ by float rounding only: a few
# ulp (rms_norm), ~1e-6 relative (attention). Slow (Python loops over chunks and keys); for tests.

LANES = 16
_LOG2E, _EXP_C1, _EXP_C2 = 1.44269504088896341, 0.693359375, -2.12194440e-4
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
EXP_MIN = -87.0


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def tree16(p: torch.Tensor) -> torch.Tensor:
    """Sum of the last dim's 16 lanes: halves, quarters, pairs (the kernels' horizontal sum)."""
    a = p[..., :8] + p[..., 8:]
    b = a[..., :4] + a[..., 4:]
    c = b[..., :2] + b[..., 2:]
    return c[..., 0] + c[..., 1]


def lane_sums(terms: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [..., 16]: lane i adds, from +0 and in increasing index, the terms at i mod 16
    (zero padding at the end changes nothing: the terms summed this way are >= +0 or padded once)."""
    n = terms.shape[-1]
    padded = torch.nn.functional.pad(terms, (0, -n % LANES)).unflatten(-1, (-1, LANES))
    lanes = torch.zeros(padded.shape[:-2] + (LANES,))
    for c in range(padded.shape[-2]):
        lanes = lanes + padded[..., c, :]
    return lanes


def exp_fixed(x: torch.Tensor) -> torch.Tensor:
    """The kernels' exp (Cephes expf): 2^n * p(r), n = round_half_even(x * log2 e); 0 below -87."""
    n = torch.round(x * _f32(_LOG2E))
    r = x - n * _f32(_EXP_C1)
    r = r - n * _f32(_EXP_C2)
    z = r * r
    y = _f32(_EXP_P[0]).expand_as(x)
    for coefficient in _EXP_P[1:]:
        y = y * r + _f32(coefficient)
    y = y * z + r
    y = y + _f32(1.0)
    finite = torch.where(x < EXP_MIN, _f32(0.0), n)  # keep the int conversion defined
    pow2 = ((finite.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x < EXP_MIN, _f32(0.0), y * pow2)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * (x * (1 / sqrt(tree16(lane sums of x*x) / D + eps))), all float32."""
    d = x.shape[-1]
    ss = tree16(lane_sums(x * x))[..., None]
    # the correctly rounded float32 sqrt, via float64 (torch.sqrt on float32 may be off by an ulp)
    root = torch.sqrt((ss / _f32(float(d)) + _f32(eps)).double()).float()
    return weight * (x * (_f32(1.0) / root))


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Per row (b, h, t), query head h reading kv head h // (H / Hkv), keys s in increasing order:
    score = tree16(lane sums over D of q*k) * scale (-inf where masked); m = max score;
    w = exp_fixed(score - m); l = the sum of w from +0, one s at a time in increasing s; acc starts at 0 and, for each s with
    w != 0, acc = acc + w * v[s]; out = acc / l. A row with no key allowed is 0."""
    b, h, t, d = q.shape
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    allowed = mask.expand(b, 1, t, k.shape[2])
    chunks = d // LANES
    lanes = torch.zeros(b, h, t, k.shape[2], LANES)
    for c in range(chunks):
        part = slice(c * LANES, (c + 1) * LANES)
        lanes = lanes + q[..., None, part] * k[:, :, None, :, part]
    scores = torch.where(allowed, tree16(lanes) * _f32(scale), _f32(float("-inf")))
    m = scores.amax(-1, keepdim=True)
    live = m > float("-inf")
    w = torch.where(live, exp_fixed(scores - torch.where(live, m, _f32(0.0))), _f32(0.0))
    denominator = torch.zeros(b, h, t, 1)
    acc = torch.zeros(b, h, t, d)
    for s in range(k.shape[2]):
        ws = w[..., s, None]
        denominator = denominator + ws
        acc = torch.where(ws != 0, acc + ws * v[:, :, None, s], acc)
    return torch.where(live, acc / torch.where(live, denominator, _f32(1.0)), _f32(0.0))


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2F] (gate, then up) -> silu(gate) * up, in the kernels' operations: e = exp_fixed(-|g|),
    silu(g) = (g >= 0 ? g : g * e) / (1 + e), each rounded once. Every element alone: no reduction."""
    g, u = x.chunk(2, dim=-1)
    positive = g >= 0
    e = exp_fixed(torch.where(positive, -g, g))
    num = torch.where(positive, g, g * e)
    return (num / (_f32(1.0) + e)) * u
