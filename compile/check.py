"""Phase "check": load the fresh packages as a bundle would and check them against eager: the
step graphs' greedy output (and, measured on them, the bundle's step-time profile), and each
serve graph's logits over a small KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yggdrasil import latency as step_times  # by module: tests patch its measure_profile
from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.bundle import greedy_generator
from yggdrasil.errors import YggdrasilError
from yggdrasil.graphs.registry import load_graph_set
from yggdrasil.serve.pool import Segment, SlotPool, run_segments

from .aoti import full_span
from .calibrate import reprofile_command
from .context import BuildContext


@dataclass
class Loaded:
    """The checked graphs, loaded: runners over them, the graph sets, the bucket policy on the
    measured step times, and those times (None when the bundle does not speculate)."""

    target: object  # StepRunner on the compiled graphs
    draft: object | None
    sets: dict
    policy: object | None
    latency: object | None


def warm_load_check(ctx: BuildContext, keys: list[GraphKey], selection) -> Loaded:
    """Load the fresh packages, check greedy output against eager on a probe prompt, and measure
    each verify graph's step time (the bundle's profile)."""

    sets = {}
    for role in ("target", "draft"):
        names = [k.name for k in keys if k.role == role and k.stage != SERVE_STAGE]
        if names:
            model = ctx.model(role)
            model.setup_cache(1, ctx.recipe.max_context)  # the graphs bind to this cache
            sets[role] = load_graph_set(ctx.work.root, role, model, names, ctx.rebuild, ctx.hint)
            if ctx.recipe.device.startswith("cuda"):  # exported over the whole context
                sets[role].fixed_span = full_span(ctx.recipe.max_context)
    target, draft = ctx.runners(sets)
    latency = None
    if selection.speculates:
        probe = ctx.policy(ctx.work.calibration, selection)
        # the run-time selection trusts these numbers: warm up and take the median of 7
        # (a fresh package's first calls are slow)
        # (a busy machine is noticed, warned about and measured again: yggdrasil/latency.py)
        drafter = probe.drafter(draft)
        latency = step_times.measure_checked(
            lambda: step_times.measure_profile(target, drafter, selection.verifies, repeats=7, warmup=4,
                                    draft_widths=() if draft is None else selection.widths, hidden=probe.needs_hidden),
            target.device, ctx.log, what="the compiled graphs' step times (the bundle's profile)",
            hint=f"; re-run {reprofile_command(ctx.recipe, ctx.out)} on a quiet machine")
    policy = ctx.policy(ctx.work.calibration, selection, latency) if selection.speculates else None
    check_against_eager(ctx, (target, draft), policy)
    ctx.log(f"warm-load check: {len(keys)} graphs load in "
            f"{sum(s.load_seconds for s in sets.values()):.2f} s; greedy output equals eager")
    return Loaded(target, draft, sets, policy, latency)


def check_against_eager(ctx: BuildContext, runners, policy, plans=None) -> None:
    prompt = ctx.target.tokenizer.encode("def fibonacci(n):")
    compiled = greedy_generator(*runners, policy, plans)
    eager = greedy_generator(*ctx.runners(), policy)
    outputs = [g(prompt, 24) for g in (compiled, eager)]
    if outputs[0] != outputs[1]:
        raise YggdrasilError(f"warm-load check failed: the compiled graphs' greedy output "
                             f"{outputs[0][:12]}… differs from eager {outputs[1][:12]}…"
                             f"{' with stage plans' if plans else ''}; please report this with the recipe")


def check_serve_graphs(ctx: BuildContext, keys: list[GraphKey]) -> None:
    """Run each serve graph and the eager forward over a small pool, two requests at once (a
    prompt chunk beside another's decode rows), and compare their logits."""

    prompt = (ctx.target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n") * 16)[:16]
    steps = [[Segment(1, tuple(prompt[:8]), 0, "last"), Segment(2, tuple(prompt[:5]), 0, "all")],
             [Segment(1, tuple(prompt[8:12]), 8, "all"), Segment(2, tuple(prompt[5:]), 5, "last")]]
    for key in keys:
        model = ctx.model(key.role)
        graph = load_graph_set(ctx.work.root, key.role, model, [key.name], ctx.rebuild, ctx.hint).get(key.name)
        pool = SlotPool(4, 16)
        for owner in (1, 2):
            pool.reserve(owner, 32)
        caches = [pool.new_cache(model) for _ in range(2)]
        for segments in steps:
            eager = torch.cat(run_segments(model, caches[0], pool, segments))
            compiled = torch.cat(run_segments(model, caches[1], pool, segments, graph))
            scale = eager.abs().max().item() or 1.0
            error = (eager - compiled).abs().max().item() / scale
            if error > (1e-3 if model.dtype == torch.float32 else 5e-2):  # fused kernels round differently
                raise YggdrasilError(f"warm-load check failed: the {key.role}'s serve graph differs from "
                                     f"the eager forward over the KV pool (relative error {error:.2g}); "
                                     "please report this with the recipe")
    ctx.log(f"warm-load check: {len(keys)} serve graph(s) agree with eager over the KV pool")
