"""A recipe's `tensor_parallel: N` at compile time (issue 55, docs/tensor-parallel.md).

Compile's phases run the whole target in this one process as for any bundle (calibration's
acceptance does not depend on how the target is split; its step times are the whole model's
eager steps on this process's threads). What tensor parallelism adds is checked before any of
them: that N divides the target's heads, K/V heads, MLP columns and vocabulary and that its
weight format cuts at those boundaries; then, with `steps: aoti` (or auto), the graphs phase
compiles one graph set per rank in N rank processes and checks them as a bundle runs them
(rank_graphs.py). The manifest records the world size, each rank's shard and that check.
"""

from __future__ import annotations

from yggdrasil.models.tensor_parallel import check_shardable

from .invariance import Invariance


def check(ctx) -> None:
    """Raise TensorParallelError (one line: what N does not divide, or which format cannot cut)."""
    if ctx.recipe.tensor_parallel > 1:
        check_shardable(ctx.target.model, ctx.recipe.tensor_parallel)


def record(ctx, rank_check: dict | None = None) -> dict:
    """The manifest stats entry: world size, each rank's shard, what runs their steps and how
    the graph sets were checked (empty without parallelism)."""
    world = ctx.recipe.tensor_parallel
    if world == 1:
        return {}
    shards = check_shardable(ctx.target.model, world)
    steps = ("aoti: one AOTInductor graph set per rank (graphs/rank-K/target/), the collectives inside each graph"
             if ctx.rank_graphs else "eager, sharded")
    body = {"world_size": world, "steps": f"{steps}; collectives over gloo",
            "draft": "whole, on rank 0", "shards": [s.as_dict() for s in shards]}
    if rank_check is not None:
        body["graphs_check"] = rank_check["greedy"]
        body["graphs_check_seconds"] = rank_check["seconds"]
    return {"tensor_parallel": body}


def invariance(rank_check: dict | None) -> Invariance | None:
    """The split graphs' measured batch invariance (what the bundle runs), if they were checked."""
    return None if rank_check is None else Invariance.from_dict(rank_check["invariance"])
