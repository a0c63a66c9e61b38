"""Phase "plan stages": each kept bucket's stage plan (ahead-of-time drafts, overlap), searched
on stage costs measured on the loaded graphs or forced by the recipe, and the draft_ahead
graphs those plans need; then the chosen plans are checked against eager."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from yggdrasil.buckets import Bucket, GraphKey
from yggdrasil.storage.registry import load_graph_set
from yggdrasil.planner.costs import stage_costs
from yggdrasil.planner.schedule import best_plan, iteration_time
from yggdrasil.runtime.dispatcher import Dispatcher
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.stage_plan import SEQUENTIAL, PlanTable, StagePlan, ahead_rows

from .check import Loaded, check_against_eager
from .context import BuildContext


@dataclass(frozen=True)
class Stages:
    """The bundle's stage_plans.yaml record (empty: none), the PlanTable it describes and the
    ahead-of-time graphs the plans need."""

    record: dict = field(default_factory=dict)
    plans: PlanTable = field(default_factory=PlanTable)
    extra: tuple[GraphKey, ...] = ()


def plan_stages(ctx: BuildContext, loaded: Loaded, selection) -> Stages:
    policy = loaded.policy
    if loaded.draft is None or policy is None:
        return Stages()
    speculator = build_speculator(loaded.target, policy=policy, draft_runner=loaded.draft)
    prompt = ctx.target.tokenizer.encode("def quicksort(items):\n")
    started = time.perf_counter()
    ctx.log("stage planning: measuring host stages and device contention")
    costs = stage_costs(speculator, policy.selector.profile, max(selection.verifies), prompt)
    forced = None if ctx.recipe.stage_plan == "auto" else StagePlan.parse(ctx.recipe.stage_plan)
    buckets, table = {}, {}
    for name in selection.picked:
        bucket = Bucket.parse(name)
        if not bucket.depth:
            continue
        sequential = iteration_time(bucket, costs, SEQUENTIAL)
        if forced is None:
            choice = best_plan(bucket, costs)
            chosen, seconds = choice.plan, choice.seconds
        else:
            chosen, seconds = forced, iteration_time(bucket, costs, forced)
        table[name] = chosen
        buckets[name] = {"plan": str(chosen), "predicted_ms": round(seconds * 1e3, 3),
                         "sequential_ms": round(sequential * 1e3, 3)}
    plans = PlanTable(table, forced or SEQUENTIAL)
    rows = ahead_rows(plans, [(w, v) for w in selection.widths for v in selection.verifies])
    extra = Dispatcher.draft_ahead_keys(rows)
    record = {"source": "forced by the recipe" if forced else "searched (yggdrasil.planner)",
              "default": str(forced or SEQUENTIAL),  # buckets not listed (not picked in calibration)
              "search_seconds": round(time.perf_counter() - started, 2),
              "costs": {"prune_ms": costs.prune * 1e3, "accept_host_ms": costs.accept_host * 1e3,
                        "accept_device_ms": costs.accept_device * 1e3, "compact_ms": costs.compact * 1e3,
                        "contention": costs.contention, "streams": costs.streams},
              "buckets": buckets}
    moved = sum(p != SEQUENTIAL for p in table.values())
    ctx.log(f"stage plans: {moved} of {len(table)} buckets run a non-sequential plan "
            f"(device contention {costs.contention:.2f}, {costs.streams} stream(s))")
    return Stages(record, plans, extra)


def check_stages(ctx: BuildContext, loaded: Loaded, stages: Stages) -> None:
    """Load the ahead-of-time graphs next to the others and check the chosen plans' greedy
    output against eager."""
    if stages.extra:
        added = load_graph_set(ctx.work.root, "draft", ctx.draft.model, [k.name for k in stages.extra],
                               ctx.rebuild, ctx.hint, ctx.steps)
        loaded.sets["draft"].graphs.update(added.graphs)
    if stages.plans.possible() != {SEQUENTIAL}:
        check_against_eager(ctx, (loaded.target, loaded.draft), loaded.policy, stages.plans,
                            exact=loaded.invariance is not None and loaded.invariance.bitwise)
