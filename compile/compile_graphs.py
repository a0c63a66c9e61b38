"""Phase "compile graphs": one graph file per graph key into the work cache (an AOTInductor
package, or with steps inductor Inductor's saved compiled step: graphs/inductor_steps.py),
reusing each one whose key (model, dtype, device, context, torch, graph, ISA target, steps) is
unchanged and whose recorded ISA this CPU runs. Each is compiled for the build's ISA target
(compile/isa.py)."""

from __future__ import annotations

from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.graphs import inductor_steps
from yggdrasil.progress import Progress

from .aoti import export_pool_step, export_step, full_span
from .context import BuildContext, graph_code_hash, work_key
from .isa import inductor_isa, isa_key, record_isa, recorded_isa
from .work_cache import reusable, seal


def graph_stamp(ctx: BuildContext, role: str, name: str) -> str:
    """The cache key of one graph: exactly what its compiled code depends on."""
    recipe = ctx.recipe
    return work_key(ctx.models[role]["sha256"], recipe.dtype, recipe.device, recipe.max_context,
                    ctx.env.torch, ctx.env.triton, ctx.env.device, name, not recipe.device.startswith("cuda"),
                    *ctx.weight_key(role),  # graphs bind the format's own weight tensors
                    *isa_key(ctx.isa), f"code {graph_code_hash()}",
                    *(() if ctx.steps == "aoti" else (f"steps {ctx.steps}",)))  # aoti: keys as before


def _runs_here(ctx: BuildContext, key: GraphKey) -> bool:
    """Whether a cached graph's recorded ISA needs only features this CPU has (a work cache
    copied from another machine may hold graphs compiled for more); the log says when not."""
    isa = recorded_isa(ctx.work.graph(key, ctx.steps))
    missing = ctx.env.cpu.lacks(isa.requires) if isa is not None and ctx.env.cpu is not None else ()
    if missing:
        ctx.log(f"cached graph {key.role}/{key.name} was compiled for a CPU with {', '.join(missing)}, which this "
                "one lacks; compiling it again")
    return not missing


def compile_graphs(ctx: BuildContext, keys: list[GraphKey]) -> int:
    """Compile what is missing or stale; returns how many were compiled (each one's time is kept
    next to it, NAME.seconds, and what it was compiled for, NAME.isa)."""
    recipe, compiled = ctx.recipe, 0
    if ctx.steps == "eager":  # the bundle runs eager steps (loader_check.py): nothing to compile
        return 0
    dynamic = not recipe.device.startswith("cuda")
    bar = Progress("compiling graphs", len(keys))
    for key in keys:
        path = ctx.work.graph(key, ctx.steps)
        stamp = graph_stamp(ctx, key.role, key.name)
        stamp_file = path.with_suffix(".key")
        # same key, content hashes still match, and this CPU runs it
        if not (reusable(path, stamp, "graph", ctx.log) and _runs_here(ctx, key)):
            model = ctx.model(key.role)
            with inductor_isa(ctx.isa.target):
                if key.stage == SERVE_STAGE:
                    took = export_pool_step(model, path)
                elif ctx.steps == "inductor":  # the cache layout the bundle's steps run over
                    cache = model.setup_cache(1, recipe.max_context, stacked=False)
                    took = inductor_steps.compile_step(model, key.name, full_span(recipe.max_context),
                                                       cache.scratch_slot, path)
                else:
                    model.setup_cache(1, recipe.max_context)
                    took = export_step(model, key, recipe.max_context, path, dynamic)
            path.with_suffix(".seconds").write_text(f"{took:.1f}")
            record_isa(path, ctx.isa)
            compiled += 1
            seal(path)
            stamp_file.write_text(stamp)
        bar.update()
    bar.close(f"{compiled} compiled, {len(keys) - compiled} reused")
    return compiled
