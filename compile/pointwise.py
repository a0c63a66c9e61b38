"""Batch invariance by construction (issue 53): what a compiled step computes outside yggdrasil's
fixed-order ops must be the same bits whichever loop computes it.

A batch-invariant model runs its reductions and its one transcendental (SiLU) in yggdrasil's ops
(RMSNorm, attention, the linears, SiLU(gate) * up), which compute every row in one fixed order on
every path. What Inductor generates around them must then be exact elementwise arithmetic: one
IEEE add, subtract, multiply or negate per element, correctly rounded, whose result is the same in
a vector body and a scalar tail, in a 1-row step and a 17-row one; and moves of data (views,
concatenation, gathers, scatters into the cache, copies). That holds when

  * the exported graph calls nothing else (`unproven_ops`: an exp, a division, a square root, a
    matmul or a reduction outside our ops would each be a place where a vector routine and a
    scalar one can differ in the last bit, or where the blocking depends on the row count), and
  * Inductor's C++ is compiled without floating-point contraction (an a*b + c fused into an FMA
    in one loop and not in another) or unsafe math (reassociated sums) (`inductor_flags`).

This is checked on one exported step of the target (every bucket's graph is the same forward at
other shapes) and recorded beside the measured invariance (compile/invariance.py); the bundle
claims `bitwise` only where both the proof and the measurement pass.
"""

from __future__ import annotations

import torch
from torch._inductor import config

from yggdrasil.buckets import GraphKey

from yggdrasil.graphs.aoti import StepModule, example_inputs

_OPS = torch.ops.aten
# one correctly rounded IEEE operation per element, or a move of data: the same bits in any loop
EXACT = frozenset(str(op) for op in (
    _OPS.add.Tensor, _OPS.add.Scalar, _OPS.sub.Tensor, _OPS.sub.Scalar, _OPS.mul.Tensor, _OPS.mul.Scalar,
    _OPS.neg.default, _OPS.cat.default, _OPS.stack.default, _OPS.view.default, _OPS.reshape.default,
    _OPS._unsafe_view.default, _OPS.permute.default, _OPS.transpose.int, _OPS.t.default, _OPS.expand.default,
    _OPS.slice.Tensor, _OPS.select.int, _OPS.unsqueeze.default, _OPS.squeeze.dim, _OPS.squeeze.default,
    _OPS.split.Tensor, _OPS.split_with_sizes.default, _OPS.chunk.default, _OPS.index.Tensor,
    _OPS.index_put.default, _OPS.index_put_.default, _OPS.gather.default, _OPS.embedding.default,
    _OPS.clone.default, _OPS.copy_.default, _OPS.copy.default, _OPS.contiguous.default, _OPS.alias.default,
    _OPS.detach.default, _OPS.to.dtype, _OPS._to_copy.default, _OPS.arange.default, _OPS.arange.start,
    _OPS.arange.start_step, _OPS.zeros.default, _OPS.ones.default, _OPS.full.default, _OPS.zeros_like.default,
    _OPS.empty.memory_format, _OPS.lift_fresh_copy.default, _OPS.where.self, _OPS.bitwise_and.Tensor,
    _OPS.logical_and.default, _OPS.eq.Scalar, _OPS.ge.Scalar, _OPS.lt.Scalar, _OPS.masked_fill.Scalar,
    _OPS.sym_size.int, _OPS.repeat_interleave.self_int, _OPS.unbind.int, _OPS.flatten.using_ints, _OPS.unflatten.int,
    _OPS._assert_tensor_metadata.default, _OPS._assert_scalar.default,  # checks, no arithmetic
))
OURS = "yggdrasil."  # the fixed-order ops: every row in one order on every path


def unproven_ops(graph) -> list[str]:
    """The ops of an exported graph that are neither ours nor exact elementwise/data movement."""
    found = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name.startswith(OURS) or name in EXACT or name.startswith("_operator.") or "getitem" in name:
            continue
        found.add(name)
    return sorted(found)


def _to_copy_changes_float_type(graph) -> list[str]:
    """A dtype conversion between float types rounds (fp32 -> bf16): exact only when it does not."""
    out = []
    for node in graph.nodes:
        if node.op == "call_function" and str(node.target) in (str(_OPS._to_copy.default), str(_OPS.to.dtype)):
            source = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
            target = node.meta.get("val")
            if source is not None and target is not None and source.dtype.is_floating_point \
                    and target.dtype.is_floating_point and source.dtype != target.dtype:
                out.append(f"{str(node.target)} {source.dtype} -> {target.dtype}")
    return sorted(set(out))


def inductor_flags() -> list[str]:
    """Inductor settings under which its C++ would not compute each element by itself exactly."""
    wrong = []
    contract = getattr(config.cpp, "enable_floating_point_contract_flag", "off")
    if contract != "off":
        wrong.append(f"cpp.enable_floating_point_contract_flag={contract!r} (fused multiply-adds)")
    if getattr(config.cpp, "enable_unsafe_math_opt_flag", False):
        wrong.append("cpp.enable_unsafe_math_opt_flag (reassociated arithmetic)")
    return wrong


def prove(model, max_context: int) -> dict:
    """The proof for `model` as compile exports it: {"exact": bool, "unproven_ops": [...],
    "inductor": [...]}. One verify step of two rows is exported (no compilation)."""
    spec = GraphKey("verify", 2)
    model.setup_cache(1, max_context)
    with torch.no_grad():
        exported = torch.export.export(StepModule(model, False), example_inputs(spec, 64, model.device), strict=False)
    graph = exported.graph
    ops = unproven_ops(graph) + _to_copy_changes_float_type(graph)
    flags = inductor_flags()
    return {"exact": not ops and not flags, "unproven_ops": ops, "inductor": flags}
