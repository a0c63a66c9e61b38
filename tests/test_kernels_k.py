"""The GGUF block kinds as the file stores them (issue 53): Q4_0 without its offset, Q4_K with its
super-block and 6-bit sub-block scales, Q6_K's 6-bit codes. Each decodes to the `gguf` package's
own dequantization bit for bit, and each op equals its plain-PyTorch reference bit for bit on
every ISA path this CPU has (and is batch-invariant)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import yggdrasil.kernels as K
from kernel_fixtures import built, isa  # noqa: F401 (pytest fixtures)
from yggdrasil.kernels import pack_k

Q = gguf.GGMLQuantizationType
N, IN = 48, 512  # three column groups, two super-blocks


def _fp16_bytes(rng, shape, low=-3.0, high=3.0) -> np.ndarray:
    return (rng.uniform(low, high, shape) * 2.0 ** rng.integers(-10, -4, shape)).astype(np.float16).view(np.uint8)


def raw_blocks(qtype, n: int = N, k: int = IN, seed: int = 0) -> np.ndarray:
    """Random but valid GGUF blocks of a [n, k] tensor: every byte random except the fp16 scales,
    which are finite and of a weight's magnitude."""
    rng = np.random.default_rng(seed)
    if qtype == Q.Q4_0:
        blocks = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
        blocks[..., 0:2] = _fp16_bytes(rng, (n, k // 32)).reshape(n, k // 32, 2)
    elif qtype == Q.Q4_K:
        blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
        blocks[..., 0:2] = _fp16_bytes(rng, (n, k // 256), 0.1, 3).reshape(n, k // 256, 2)
        blocks[..., 2:4] = _fp16_bytes(rng, (n, k // 256), 0.1, 3).reshape(n, k // 256, 2)
    else:
        blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
        blocks[..., 208:210] = _fp16_bytes(rng, (n, k // 256), 0.01, 0.3).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


PACK = {Q.Q4_0: (pack_k.pack_gguf_q4_0, pack_k.dequantize_q4_0), Q.Q4_K: (pack_k.pack_gguf_q4_k, pack_k.dequantize_q4_k),
        Q.Q6_K: (pack_k.pack_gguf_q6_k, pack_k.dequantize_q6_k)}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_packed_blocks_dequantize_to_ggufs_own_weights_bit_for_bit(qtype):
    pack, dequantize = PACK[qtype]
    raw = raw_blocks(qtype)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(N, IN)
    ours = dequantize(pack(raw, (N, IN)))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), (ours - theirs).abs().max()


def test_q6_k_codes_and_scales_survive_packing():
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.integers(0, 64, (N, IN), dtype=np.uint8))
    sc = torch.from_numpy(rng.integers(-128, 128, (N, IN // 16)).astype(np.int8))
    d = torch.rand(N, IN // 256)
    back, _, scales = pack_k.unpack_q6_k(pack_k.pack_q6_k(q, d, sc))
    assert torch.equal(back, q) and torch.equal(scales, sc.int())


def test_bad_shapes_and_codes_are_refused_with_what_was_expected():
    with pytest.raises(K.KernelShapeError, match="super-blocks of 256"):
        pack_k.pack_q6_k(torch.zeros(16, 96, dtype=torch.uint8), torch.zeros(16, 1), torch.zeros(16, 6))
    with pytest.raises(K.KernelShapeError, match="0..63"):
        pack_k.pack_q4_k(torch.zeros(16, 256, dtype=torch.uint8), torch.zeros(16, 1), torch.zeros(16, 1),
                         torch.full((16, 8), 64), torch.zeros(16, 8))
    with pytest.raises(K.KernelShapeError, match="bytes of super-blocks"):
        pack_k.pack_gguf_q4_k(np.zeros(10, dtype=np.uint8), (16, 256))


def _weights() -> dict:
    return {kind: PACK[q][0](raw_blocks(q, seed=5), (N, IN)) for kind, q in
            (("q4_0", Q.Q4_0), ("q4_k", Q.Q4_K), ("q6_k", Q.Q6_K))}


OPS = {"q4_0": (K.q4_0_linear, K.q4_0_linear_reference), "q4_k": (K.q4_k_linear, K.q4_k_linear_reference),
       "q6_k": (K.q6_k_linear, K.q6_k_linear_reference)}


def _activations(rows: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g) * 3
    if rows >= 3:  # an all-zero block, a block below the threshold, ties that round to even
        x[1, :32] = 0
        x[1, 32:64] = 1e-31
        x[2, :32] = torch.arange(32) - 15.5
        x[2, 0] = 127.0
    return x


@pytest.mark.parametrize("kind", list(OPS))
def test_op_equals_reference_bit_for_bit(isa, kind):
    op, reference = OPS[kind]
    w = _weights()[kind]
    for rows in (1, 2, 3, 5, 16, 17):
        x = _activations(rows)
        assert torch.equal(op(x, w), reference(x, w)), (isa, kind, rows)
    x = _activations(6).bfloat16().reshape(2, 3, IN)
    out = op(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, N) and torch.equal(out, reference(x, w))


@pytest.mark.parametrize("kind", list(OPS))
def test_rows_are_batch_invariant(isa, kind):
    op, _ = OPS[kind]
    w = _weights()[kind]
    x = _activations(33, seed=7)
    alone = torch.cat([op(x[i:i + 1], w) for i in range(33)])
    for rows in (2, 4, 7, 16, 17, 33):
        assert torch.equal(op(x[:rows], w), alone[:rows]), (isa, kind, rows)


@pytest.mark.parametrize("kind", list(OPS))
def test_ops_compute_the_linear_of_the_dequantized_weight(built, kind):
    op, _ = OPS[kind]
    w = _weights()[kind]
    dense = {"q4_0": pack_k.dequantize_q4_0, "q4_k": pack_k.dequantize_q4_k, "q6_k": pack_k.dequantize_q6_k}[kind](w)
    x = torch.randn(8, IN)
    exact = x @ dense.t()
    err = (op(x, w) - exact).abs().max()
    assert 0 < err < 0.02 * exact.abs().max()  # int8 activations: a rounding error, not a wrong weight


def test_ops_refuse_mismatched_pieces(built):
    w = _weights()["q4_k"]
    with pytest.raises(RuntimeError, match="sub_scales has shape"):
        K.q4_k_linear(torch.randn(1, IN), w._replace(sub_scales=w.sub_scales[:, :1]))
    with pytest.raises(RuntimeError, match="whole super-blocks"):
        q6 = _weights()["q6_k"]
        torch.ops.yggdrasil.q6_k_linear(torch.randn(1, 96), q6.packed[:, :3].contiguous(), q6.high[:, :3].contiguous(),
                                        q6.scales, q6.sub_scales[:, :3].contiguous())
