"""`yggdrasil plan --show BUNDLE`: the stage plans of a bundle's buckets on this machine, as a
table (predicted iteration time of the best plan vs the sequential one) and a Gantt PNG."""

from __future__ import annotations

from pathlib import Path

from yggdrasil.errors import InvalidRequestError

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="show the stage plans (ahead-of-time drafts, overlap) of a bundle's buckets")
    plan.add_argument("--show", required=True, metavar="BUNDLE", help="bundle directory")
    plan.add_argument("--out", default="plans.png", help="Gantt chart PNG to write (default plans.png)")
    plan.add_argument("--top", type=int, default=4, help="how many of the most picked buckets (default 4)")


def run(bundle: str, out: str, top: int) -> int:
    from yggdrasil.buckets import Bucket
    from yggdrasil.bundle import open_bundle
    from yggdrasil.planner.costs import bundle_stage_costs
    from yggdrasil.planner.gantt import draw_plans
    from yggdrasil.planner.schedule import best_plan

    opened = open_bundle(Path(bundle))
    runtime = opened.generator()
    if runtime.draft is None or runtime.policy is None:
        raise InvalidRequestError(
            f"{bundle} {'drafts by prompt lookup' if runtime.policy is not None else 'does not speculate'}: "
            "its iterations have no draft-model stages to schedule; stage plans apply to bundles "
            "with a draft model (e.g. recipes/qwen-pair-cpu.yaml)")
    print("measuring stage costs (host stages from a traced generation, device contention from "
          "two forwards at once) ...", flush=True)
    costs = bundle_stage_costs(runtime, runtime.target.tokenizer.encode(PROMPT))
    picked = opened.layout.read_selection()["picked"]
    buckets = [b for b in map(Bucket.parse, list(picked)[:top]) if b.depth]
    grid = runtime.policy.grid  # the largest compiled bucket, as a reference
    largest = Bucket(grid.max_depth, grid.max_width, max(grid.verifies))
    if largest not in buckets:
        buckets.append(largest)
    choices = [best_plan(b, costs) for b in buckets]
    print(f"stage costs: prune {costs.prune * 1e3:.2f} ms, accept {costs.accept_host * 1e3:.2f} ms, "
          f"compact {costs.compact * 1e3:.2f} ms (host); device contention {costs.contention:.2f} "
          "(1 = overlap is free, 2 = none)")
    print(f"{'bucket':<14} {'sequential':>11} {'best plan':<42} {'predicted':>10} {'gain':>6} {'extra rows':>10}")
    for c in choices:
        b = c.bucket
        print(f"{f'D{b.depth}xW{b.width}/V{b.verify}':<14} {c.sequential_seconds * 1e3:>8.2f} ms "
              f"{str(c.plan):<42} {c.seconds * 1e3:>7.2f} ms {c.gain:>5.2f}x {c.extra_tokens:>10}")
    path = draw_plans(choices, costs, Path(out), f"{runtime.manifest.recipe['name']}: stage plans "
                                                 f"(simulated from measured costs)")
    print(f"Gantt chart: {path}")
    stored = runtime.plans
    print("the bundle runs: " + ", ".join(f"{b} {p}" for b, p in stored.plans.items()) +
          f"; other buckets {stored.default}" if stored.plans else
          "the bundle stores no stage plans (built before stage planning): it runs sequentially")
    return 0


def main(args) -> int:
    return run(args.show, args.out, args.top)
