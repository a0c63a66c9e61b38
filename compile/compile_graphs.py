"""Phase "compile graphs": one graph file per graph key into the work cache (an AOTInductor
package, or with steps inductor Inductor's saved compiled step: yggdrasil/storage/inductor_steps.py),
reusing each one whose key (model, dtype, device, context, torch, graph, ISA target, steps) is
unchanged and whose recorded ISA this CPU runs. Each is compiled for the build's ISA target
(graphs/isa.py)."""

from __future__ import annotations

from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.storage import inductor_steps
from yggdrasil.progress import Progress
from yggdrasil.runtime.deployed import save_deployed

from yggdrasil.graphs.aoti import export_pool_step, export_step, full_span
from .context import BuildContext, graph_code_hash, work_key
from .graph_workers import DEPLOYED, Job, compile_in_workers, worker_count
from yggdrasil.graphs.isa import inductor_isa, isa_key, record_isa, recorded_isa
from .work_cache import reusable, seal


def graph_stamp(ctx: BuildContext, role: str, name: str, rank: int | None = None) -> str:
    """The cache key of one graph: exactly what its compiled code depends on (rank: of a
    tensor-parallel target's set, over that rank's shard of recipe.tensor_parallel)."""
    recipe = ctx.recipe
    whole = work_key(ctx.models[role]["sha256"], recipe.dtype, recipe.device, recipe.max_context,
                    ctx.env.torch, ctx.env.triton, ctx.env.device, name, not recipe.device.startswith("cuda"),
                    *ctx.weight_key(role),  # graphs bind the format's own weight tensors
                    *isa_key(ctx.isa), f"code {graph_code_hash()}",
                    *(() if ctx.steps == "aoti" else (f"steps {ctx.steps}",)))  # aoti: keys as before
    return whole if rank is None else work_key(whole, f"rank {rank} of {recipe.tensor_parallel}")


def runs_here(ctx: BuildContext, key: GraphKey, rank: int | None = None) -> bool:
    """Whether a cached graph's recorded ISA needs only features this CPU has (a work cache
    copied from another machine may hold graphs compiled for more); the log says when not."""
    isa = recorded_isa(ctx.work.graph(key, ctx.steps, rank))
    missing = ctx.env.cpu.lacks(isa.requires) if isa is not None and ctx.env.cpu is not None else ()
    if missing:
        ctx.log(f"cached graph {key.role}/{key.name} was compiled for a CPU with {', '.join(missing)}, which this "
                "one lacks; compiling it again")
    return not missing


def compile_graphs(ctx: BuildContext, keys: list[GraphKey], workers: int | None = None) -> int:
    """Compile what is missing or stale; returns how many were compiled (each one's time is kept
    next to it, NAME.seconds, and what it was compiled for, NAME.isa). AOTInductor packages are
    compiled by worker processes where the machine has the cores and memory for more than one
    (graph_workers.py; workers: how many, default as many as pay)."""
    if ctx.steps == "eager":  # the bundle runs eager steps (loader_check.py): nothing to compile
        return 0
    bar = Progress("compiling graphs", len(keys))
    stale = []
    for key in keys:
        # same key, content hashes still match, and this CPU runs it: reused
        if reusable(ctx.work.graph(key, ctx.steps), graph_stamp(ctx, key.role, key.name), "graph", ctx.log) \
                and runs_here(ctx, key):
            bar.update()
        else:
            stale.append(key)
    workers = worker_count(len(stale)) if workers is None else workers
    if ctx.steps == "aoti" and workers > 1:
        _compile_in_workers(ctx, stale, workers, bar)
    else:
        for key in stale:
            record(ctx, key, _compile_here(ctx, key))
            bar.update()
    bar.close(f"{len(stale)} compiled, {len(keys) - len(stale)} reused"
              + (f" ({workers} worker processes)" if ctx.steps == "aoti" and workers > 1 else ""))
    return len(stale)


def _compile_here(ctx: BuildContext, key: GraphKey) -> float:
    """One graph compiled in this process; returns its seconds."""
    recipe, path, model = ctx.recipe, ctx.work.graph(key, ctx.steps), ctx.model(key.role)
    with inductor_isa(ctx.isa.target):
        if key.stage == SERVE_STAGE:
            return export_pool_step(model, path)
        if ctx.steps == "inductor":  # the cache layout the bundle's steps run over
            cache = model.setup_cache(1, recipe.max_context, stacked=False)
            return inductor_steps.compile_step(model, key.name, full_span(recipe.max_context), cache.scratch_slot,
                                               path)
        model.setup_cache(1, recipe.max_context)
        return export_step(model, key, recipe.max_context, path, not recipe.device.startswith("cuda"))


def _compile_in_workers(ctx: BuildContext, keys: list[GraphKey], workers: int, bar: Progress) -> None:
    """The graphs compiled by worker processes over the deployed models, written into the work
    cache once (memory-mapped by every worker)."""
    weights = ctx.work.root / DEPLOYED
    save_deployed(weights, {"target": ctx.target, **({"draft": ctx.draft} if ctx.draft is not None else {})})
    jobs = [Job(k.role, k.stage, k.rows, k.hidden, ctx.recipe.max_context, str(ctx.work.graph(k, ctx.steps)),
                not ctx.recipe.device.startswith("cuda"), ctx.isa.target) for k in keys]

    def done(job: Job, seconds: float) -> None:
        record(ctx, job.key, seconds)
        bar.update()

    compile_in_workers(weights, jobs, workers, done)


def record(ctx: BuildContext, key: GraphKey, seconds: float, rank: int | None = None) -> None:
    """What the work cache keeps beside a compiled graph: its seconds, ISA, content hashes and key."""
    path = ctx.work.graph(key, ctx.steps, rank)
    path.with_suffix(".seconds").write_text(f"{seconds:.1f}")
    record_isa(path, ctx.isa)
    seal(path)
    path.with_suffix(".key").write_text(graph_stamp(ctx, key.role, key.name, rank))
