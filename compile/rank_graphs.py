"""Phase "compile graphs" for a tensor-parallel target (issue 55, docs/tensor-parallel.md): one
graph set per rank, for the same graph keys (buckets, dispatcher keys) a whole target would have.

The compile runs as N ranks: N processes spawned here (torch.multiprocessing, gloo), each joining
the process group exactly as a bundle's ranks join it at run time (yggdrasil/runtime/ranks.py),
mapping the deployed target from the work cache, cutting its own shard and exporting and
packaging its stale graphs into the work cache (graphs/rank-K/target/); the collectives are inside
each graph (`_c10d_functional.all_reduce` + `wait_tensor`, the logits' all-gather). The
compile process itself joins no group: its whole target stays whole for the other phases.

Then the ranks check their fresh sets as a bundle runs them: rank 0 leads (its graph calls
mirrored to the others, each running the same graph of its own set), its greedy output on the
compiled graphs must equal the eager sharded forward's, or leave it only at a tie of the eager
logits (compile/check.py's rule), and it measures the graphs' batch invariance: the claim the
bundle records, since these are the graphs it runs.
"""

from __future__ import annotations

import dataclasses
import os
import queue as queues
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._inductor.runtime.cache_dir_utils import cache_dir

from yggdrasil.buckets import GraphKey
from yggdrasil.errors import YggdrasilError
from yggdrasil.models.quant import matmul_dtype
from yggdrasil.models.tensor_parallel import TensorParallelError
from yggdrasil.progress import Progress
from yggdrasil.runtime.deployed import DeployedWeights, save_deployed
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.ranks import Leader, RankSpec, follow, free_port, join, shard_loaded
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.registry import load_graph_set

from yggdrasil.graphs.aoti import export_step
from yggdrasil.graphs.isa import inductor_isa
from .check import PROBE_TOKENS, TIE_ULPS, logit_ulp
from .compile_graphs import graph_stamp, record, runs_here
from .context import BuildContext
from .graph_workers import DEPLOYED, load_kernels_for
from .invariance import Invariance, long_probe, measure_invariance, probe_ids
from .work_cache import reusable

# the group's timeout while compiling: a rank waits at the barrier until the slowest has packaged
# its graphs (a rank that dies is seen by this process, which stops the others at once)
COMPILE_TIMEOUT_S = 3600.0
# what the split graphs' batch invariance rests on: measured only, never proven (compile/pointwise.py
# proves a whole model's exported graph; the collectives' reductions are gloo's)
UNPROVEN = {"exact": False, "unproven_ops": ["the split graphs' collectives (gloo's sums)"], "inductor": []}


@dataclasses.dataclass(frozen=True)
class RankSets:
    """What every compile rank shares: where the deployed weights and the graph sets are, which
    graphs a set holds, what they are compiled for, and the check's prompts."""

    weights: str  # the deployed weights' folder (yggdrasil/runtime/deployed.py)
    root: str  # the folder whose graphs/rank-K/target/ hold the sets (a work cache, or any folder)
    names: tuple[str, ...]  # every target graph of a set, by name
    max_context: int
    dynamic_span: bool
    isa_target: str
    chunk_sizes: tuple[int, ...]
    probes: tuple[tuple[int, ...], ...]  # greedy check prompts (all but the last) and invariance prompts (all)
    rebuild: str
    hint: str

    @property
    def verify_widths(self) -> tuple[int, ...]:
        keys = [GraphKey.parse(name) for name in self.names]
        return tuple(sorted({k.rows for k in keys if k.stage == "verify"}))

    def path(self, name: str, rank: int) -> Path:
        return BundleLayout(Path(self.root)).graph_named("target", name, "aoti", rank)


@dataclasses.dataclass(frozen=True)
class RankJob:
    """One compile rank: join as `spec`, package the stale graphs (by name) of its set, check."""

    spec: RankSpec
    sets: RankSets
    stale: tuple[str, ...]


def compile_rank_graphs(ctx: BuildContext, keys: list[GraphKey]) -> tuple[int, dict]:
    """Compile the target's stale per-rank graphs into the work cache and check every rank's
    set; returns (graphs compiled, the check's record: greedy agreement and the split graphs'
    batch invariance)."""
    if ctx.steps != "aoti":
        raise TensorParallelError(f"tensor parallel: a split target's graphs are AOTInductor packages per rank, "
                                  f"but this build's steps are {ctx.steps}; compile with steps: aoti or eager")
    world, recipe = ctx.recipe.tensor_parallel, ctx.recipe
    stale = {rank: [k.name for k in keys if not (reusable(ctx.work.graph(k, ctx.steps, rank),
                                                          graph_stamp(ctx, k.role, k.name, rank), "graph", ctx.log)
                                                 and runs_here(ctx, k, rank))] for rank in range(world)}
    weights = ctx.work.root / DEPLOYED
    save_deployed(weights, {"target": ctx.target, **({"draft": ctx.draft} if ctx.draft is not None else {})})
    tokenizer, widest = ctx.target.tokenizer, max((k.rows for k in keys if k.stage == "verify"), default=1)
    probes = probe_ids(tokenizer) + [long_probe(tokenizer, recipe.max_context, widest)]
    sets = RankSets(str(weights), str(ctx.work.root), tuple(k.name for k in keys), recipe.max_context,
                    not recipe.device.startswith("cuda"), ctx.isa.target, recipe.buckets.prefill_chunks,
                    tuple(map(tuple, probes)), ctx.rebuild, ctx.hint)
    count = sum(map(len, stale.values()))
    bar = Progress(f"compiling {world} ranks' graphs", count)
    by_name = {k.name: k for k in keys}

    def compiled(rank: int, name: str, seconds: float) -> None:
        record(ctx, by_name[name], seconds, rank)
        bar.update()

    check = package_rank_graphs(sets, world, stale, compiled)
    bar.close(f"{count} compiled, {len(keys) * world - count} reused ({world} rank processes)")
    ctx.log(f"tensor parallel: {world} ranks' graph sets checked as a bundle runs them: {check['greedy']}; "
            f"batch invariance {Invariance.from_dict(check['invariance']).verdict()}")
    return count, check


def package_rank_graphs(sets: RankSets, world: int, stale: dict[int, list[str]], compiled) -> dict:
    """Run `world` compile ranks: each packages its stale graphs (compiled(rank, name, seconds) as
    each is done), then they check their sets together; returns rank 0's check."""
    port = free_port()
    jobs = [RankJob(RankSpec(rank, world, "127.0.0.1", port, 1, COMPILE_TIMEOUT_S), sets, tuple(stale[rank]))
            for rank in range(world)]
    return _run_ranks(jobs, compiled)


def _run_ranks(jobs: list[RankJob], compiled) -> dict:
    """Spawn the ranks, hand each compiled graph to compiled(rank, name, seconds), and return
    rank 0's check; the first rank that fails (or dies) stops them all with one error."""
    context = mp.get_context("spawn")
    messages = context.Queue()
    processes = [context.Process(target=rank_main, args=(job, messages), daemon=True,
                                 name=f"yggdrasil-compile-rank{job.spec.rank}") for job in jobs]
    for process in processes:
        process.start()
    done, check = set(), None
    try:
        while len(done) < len(jobs):
            try:
                message = messages.get(timeout=1.0)
            except queues.Empty:
                dead = [f"rank {i} (exit code {p.exitcode})" for i, p in enumerate(processes)
                        if p.exitcode is not None and i not in done]
                if dead:
                    raise YggdrasilError(f"compiling the tensor-parallel graphs failed: {', '.join(dead)} stopped "
                                         "without a word; see its output above") from None
                continue
            rank = message["rank"]
            if "error" in message:
                raise YggdrasilError(f"compiling the tensor-parallel graphs failed on rank {rank}: {message['error']}")
            if "graph" in message:
                compiled(rank, message["graph"], message["seconds"])
            if "check" in message:
                check = message["check"]
            if message.get("done"):
                done.add(rank)
    finally:
        for process in processes:
            process.join(timeout=30 if len(done) == len(jobs) else 0.1)
            if process.is_alive():
                process.terminate()
                process.join()
    return check


def rank_main(job: RankJob, messages) -> None:
    """One compile rank: join, shard, package its stale graphs, then check its set (rank 0
    leads, the others follow as at run time); every outcome goes to `messages`."""
    rank = job.spec.rank
    try:
        own_inductor_cache(rank)
        control = join(job.spec)
        sets = job.sets
        weights = DeployedWeights(Path(sets.weights))
        load_kernels_for(weights)
        model = shard_loaded(weights.load("target", "cpu").model, rank, job.spec.world)
        with inductor_isa(sets.isa_target):
            model.setup_cache(1, sets.max_context)
            for name in job.stale:
                try:
                    seconds = export_step(model, GraphKey.parse(name), sets.max_context, sets.path(name, rank),
                                          sets.dynamic_span)
                except Exception as exc:  # which graph, then what went wrong
                    raise YggdrasilError(f"graph target/{name}: {type(exc).__name__}: {str(exc)[:400]}") from None
                messages.put({"rank": rank, "graph": name, "seconds": seconds})
        dist.barrier(control)  # every rank's set is packaged: load and check them together

        def own_set():
            return load_graph_set(Path(sets.root), "target", model, list(sets.names), sets.rebuild, sets.hint, "aoti",
                                  rank)

        if rank == 0:
            messages.put({"rank": rank, "check": _lead_check(model, control, own_set, sets, job.spec.world)})
        else:
            follow(model, control, own_set)
            dist.destroy_process_group()
        messages.put({"rank": rank, "done": True})
    except Exception as exc:  # noqa: BLE001 - reported to the compile process, which names the rank
        messages.put({"rank": rank, "error": f"{type(exc).__name__}: {str(exc)[:600]}"})
    messages.close()
    messages.join_thread()  # the messages reach the compile process before this one ends
    # skip interpreter teardown, as a run's ranks do (runtime/ranks.run_rank)
    os._exit(0)


def own_inductor_cache(rank: int) -> None:
    """Give compile rank `rank` (after the first) an Inductor cache of its own, below the shared
    one. The ranks' shards have the same shapes and the packages carry no weights, so AOTInductor
    writes the same generated files for every rank at once; in a shared cache one rank packaged
    another's half-written metadata once (CI: 'parse error ... attempting to parse an empty
    input'). Each rank's own cache still warms its next compile."""
    if rank:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), f"tp-rank-{rank}")


def _lead_check(model, control, own_set, sets: RankSets, world: int) -> dict:
    """Rank 0: greedy output on the compiled sets against the eager sharded forward, and the
    sets' batch invariance; then tell the other ranks to stop."""
    leader = Leader(model, world, [], control)
    try:
        model.setup_cache(1, sets.max_context, stacked=True)  # as a bundle sets it up (mirrored)
        graphs = own_set()
        leader.mirror_graphs(graphs)
        compiled = StepRunner(model, sets.max_context, graphs=graphs, chunk_sizes=sets.chunk_sizes)
        eager = StepRunner(model, sets.max_context, chunk_sizes=sets.chunk_sizes)  # over the same cache
        started = time.perf_counter()
        ties = []
        for ids in sets.probes[:-1]:
            said = _greedy_agreement(model, compiled, eager, list(ids))
            if said is None:
                break
            ties.append(said)
        greedy = ("greedy output equals the eager sharded steps" if not ties else
                  "greedy output equals the eager sharded steps up to ties: " + "; ".join(ties))
        invariance = measure_invariance(compiled, [list(p) for p in sets.probes], sets.verify_widths, UNPROVEN)
        return {"greedy": greedy, "invariance": invariance.as_dict(),
                "seconds": round(time.perf_counter() - started, 1)}
    finally:
        leader.close()


def _greedy_agreement(model, compiled: StepRunner, eager: StepRunner, ids: list[int]) -> str | None:
    """None when the compiled greedy tokens equal eager's; a tie's description where they part
    at a tie of eager's logits; raises where they part anywhere else."""
    with torch.inference_mode():
        reference, candidate = greedy_tokens(eager, ids, PROBE_TOKENS), greedy_tokens(compiled, ids, PROBE_TOKENS)
    if reference == candidate:
        return None
    at = next(i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b)
    with torch.inference_mode():
        logits = eager.prefill(ids + reference[:at]).float()
    best = logits.max()
    gap = max((best - logits[reference[at]]).item(), (best - logits[candidate[at]]).item())
    tolerance = TIE_ULPS * logit_ulp(logits, matmul_dtype(model))
    if gap > tolerance:
        raise YggdrasilError(f"warm-load check failed: the split target's compiled greedy output {candidate[:12]}... "
                             f"differs from its eager sharded steps {reference[:12]}... at token {at} (eager's logit "
                             f"gap there, {gap:.3g}, is no tie: over {TIE_ULPS} ulps, {tolerance:.3g}); please report "
                             "this with the recipe")
    return f"{at} tokens, then a tie (logit gap {gap:.3g} <= {tolerance:.3g})"
