"""A recipe's `tensor_parallel: N` at compile time (issue 55, docs/tensor-parallel.md).

Compile's phases run the whole target in this one process as for any bundle (calibration's
acceptance does not depend on how the target is split; its step times are the whole model's on
this process's threads). What tensor parallelism adds is checked before any of them: that N
divides the target's heads, K/V heads, MLP columns and vocabulary and that its weight format cuts
at those boundaries, and recorded in the manifest's stats: the world size and each rank's shard.
The bundle runs eager sharded steps (the recipe forces `steps: eager`): AOTInductor does package
a step with the functional all-reduce inside it on CPU (gloo), but one graph set per rank is not
built yet.
"""

from __future__ import annotations

from yggdrasil.models.tensor_parallel import check_shardable


def check(ctx) -> None:
    """Raise TensorParallelError (one line: what N does not divide, or which format cannot cut)."""
    if ctx.recipe.tensor_parallel > 1:
        check_shardable(ctx.target.model, ctx.recipe.tensor_parallel)


def record(ctx) -> dict:
    """The manifest stats entry: world size and each rank's shard (empty without parallelism)."""
    world = ctx.recipe.tensor_parallel
    if world == 1:
        return {}
    shards = check_shardable(ctx.target.model, world)
    return {"tensor_parallel": {"world_size": world, "steps": "eager, sharded; collectives over gloo (CPU) or nccl",
                                "draft": "whole, on rank 0", "shards": [s.as_dict() for s in shards]}}
