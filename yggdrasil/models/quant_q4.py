"""Weight format q4: 4-bit weights x int8 activations on our own CPU kernel (yggdrasil.kernels).

The big linears keep the weights as the GGUF file has them (issue 53), each tensor in the block
kind the kernels take for its type (quant_blocks.py): Q4_0 without its stored offset (4.5 bits a
weight), Q4_1 as stored, Q4_K with its super-block scales and 6-bit sub-block scales and mins,
Q6_K with its 6-bit codes, Q8_0 as stored. Only tensors of another type are requantized from the
loaded weights: 4-5-bit types (Q5_0, Q5_K, ...) into 4-bit blocks of 32 (min/max per block, like
Q4_1), 6+-bit ones (floats, Q8_1, ...) into 8-bit blocks. The LM head is at least 6-bit: as stored
when the file keeps it at 6 bits or more (Q6_K, Q8_0), a 6-bit Q6_K-like head when it is a float,
8-bit when it is a narrower type. A fused linear whose parts differ in type runs one op per run of
equal parts (MixedLinear). A model loaded from another source (safetensors) gets 4-bit blocks and
a 6-bit head. Every op multiplies the weights by activations rounded to int8 per block of 32, and
accumulates in int32: its T(n) stays nearly flat to 8-16 rows, where ATen's int4 kernel (which
multiplies in floats) costs n times its one-row time.

The ops are batch-invariant: a row's output is bitwise the same alone or among any other rows.
With float32 activations the format also runs RMSNorm and attention on the kernels' fixed-order
ops (Transformer.use_batch_invariant_ops), so a whole step computes a token the same in a
decode, verify or prefill step (measured by compile/invariance.py and recorded in the bundle).

The kernels build on first use (a C++ compiler); without one the format is unavailable and says
so (`kernels_available`), and compile falls back to ATen's int4.
"""

from __future__ import annotations

import numpy as np
import torch

from yggdrasil import kernels
from yggdrasil.models.quant_base import PackedLinear
from yggdrasil.models.quant_blocks import Q4Linear, Q8Linear, block_module  # noqa: F401 (Q4Linear, Q8Linear: re-exported)
from yggdrasil.models.quant_gguf import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, WIDE_TYPES, decode_q4_dm, decode_q8_0, \
    linear_sources, unpermute

Q4_FORMAT, Q8_FORMAT = "q4", "q8"
HEAD = "output"
# a GGUF type the kernels take as stored -> (kind, decode raw [rows, row bytes] -> row-major
# arrays, pack those arrays); rows un-permuted between the two where llama.cpp permuted them
_AS_STORED = {
    Q4_0: ("q4_0", lambda raw, shape: decode_q4_dm(raw, Q4_0)[:2], kernels.pack_q4_0),
    Q4_1: ("q4", lambda raw, shape: decode_q4_dm(raw, Q4_1), kernels.pack_q4),
    Q4_K: ("q4_k", lambda raw, shape: kernels.pack_k.decode_q4_k(raw, shape), kernels.pack_q4_k),
    Q6_K: ("q6_k", lambda raw, shape: kernels.pack_k.decode_q6_k(raw, shape), kernels.pack_q6_k),
    Q8_0: ("q8", lambda raw, shape: decode_q8_0(raw), kernels.pack_q8),
}
_AT_LEAST_6_BITS = {Q6_K, Q8_0}  # a head stored in one of these is kept as stored


def kernels_available() -> str | None:
    """None when our kernels load here (building them once if needed), else why not (one line)."""
    try:
        kernels.load()
    except kernels.KernelBuildError as exc:
        return str(exc).splitlines()[0]
    return None


def invariant_ops_fit(model) -> bool:
    """Whether the model can run RMSNorm and attention on the kernels' batch-invariant ops:
    float32 activations and a head size they take (a multiple of 16, 16..256)."""
    head = model.config.head_dim
    return model.dtype == torch.float32 and head % 16 == 0 and 16 <= head <= 256


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernels take this [out, in] weight (whole blocks of 32 inputs, 16 outputs)."""
    out_features, in_features = weight.shape
    return in_features % kernels.BLOCK == 0 and out_features % kernels.COLS == 0


def _requantized(name: str, rows: torch.Tensor, qtype: int | None) -> tuple[str, object]:
    """A part the kernels do not take as stored, from the loaded float rows: the head 6-bit (8-bit
    where its width is not whole super-blocks), 6+-bit types 8-bit, the rest 4-bit."""
    if name == HEAD:
        if rows.shape[1] % kernels.pack_k.SUPER == 0:
            return "q6_k", kernels.quantize_q6_k(rows)
        return "q8", kernels.quantize_q8(rows)
    if qtype in WIDE_TYPES:
        return "q8", kernels.quantize_q8(rows)
    return "q4", kernels.quantize_q4(rows)


def _as_stored(gguf, info, heads: int | None) -> tuple[str, object]:
    kind, decode, pack = _AS_STORED[info.qtype]
    arrays = decode(gguf.raw(info), tuple(info.shape))
    if heads is not None:
        arrays = [unpermute(a, heads) for a in arrays]
    return kind, pack(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))


def _keeps(name: str, qtype: int) -> bool:
    """Whether a part of this type is taken as stored: always, except a head narrower than 6 bits."""
    return qtype in _AS_STORED and (name != HEAD or qtype in _AT_LEAST_6_BITS)


def q4_modules(model, linears: dict[str, torch.nn.Linear], gguf=None) -> dict[str, PackedLinear]:
    """Our linear name -> its q4-format module: each GGUF part as stored where the kernels take
    its type, the rest requantized from the loaded weights (the module docstring)."""
    sources = linear_sources(gguf, model) if gguf is not None else {}
    modules = {}
    for name, linear in linears.items():
        parts, start, as_stored = [], 0, True
        for info, heads in sources.get(name) or [(None, None)]:
            rows = info.shape[0] if info is not None else linear.out_features
            if info is not None and _keeps(name, info.qtype):
                parts.append(_as_stored(gguf, info, heads))
            else:
                parts.append(_requantized(name, linear.weight[start:start + rows], getattr(info, "qtype", None)))
                as_stored = False
            start += rows
        modules[name] = block_module(parts, linear.bias)
        # compile's activation-cost measurement asks (not saved in a bundle: the weights are)
        modules[name].as_stored = as_stored
    return modules
