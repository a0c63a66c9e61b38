"""Phase "compile graphs": one AOTInductor package per graph key into the work cache, reusing
each one whose key (model, dtype, device, context, torch, graph) is unchanged."""

from __future__ import annotations

from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.progress import Progress

from .aoti import export_pool_step, export_step
from .context import BuildContext, graph_code_hash, work_key
from .work_cache import reusable, seal


def compile_graphs(ctx: BuildContext, keys: list[GraphKey]) -> int:
    """Compile what is missing or stale; returns how many were compiled (each one's time is kept
    next to it, NAME.seconds)."""
    recipe, compiled = ctx.recipe, 0
    dynamic = not recipe.device.startswith("cuda")
    bar = Progress("compiling graphs", len(keys))
    for key in keys:
        path = ctx.work.graph(key)
        stamp = work_key(ctx.models[key.role]["sha256"], recipe.dtype, recipe.device, recipe.max_context,
                         ctx.env.torch, ctx.env.triton, ctx.env.device, key.name, dynamic,
                         *ctx.weight_key(key.role),  # graphs bind the format's own weight tensors
                         f"code {graph_code_hash()}")
        stamp_file = path.with_suffix(".key")
        if not reusable(path, stamp, "graph", ctx.log):  # same key, and content hashes still match
            model = ctx.model(key.role)
            if key.stage == SERVE_STAGE:
                took = export_pool_step(model, path)
            else:
                model.setup_cache(1, recipe.max_context)
                took = export_step(model, key, recipe.max_context, path, dynamic)
            path.with_suffix(".seconds").write_text(f"{took:.1f}")
            compiled += 1
            seal(path)
            stamp_file.write_text(stamp)
        bar.update()
    bar.close(f"{compiled} compiled, {len(keys) - compiled} reused")
    return compiled
