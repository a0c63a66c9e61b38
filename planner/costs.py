"""Stage costs for the planner, measured on a loaded bundle.

Model forwards come from the bundle's warm-load profile (draft and verify seconds by rows).
Host stages (prune, accept, compact) are the medians of their spans in a traced generation.
Device contention is measured directly: a verify forward and a draft forward run alone, then at
once from two threads; under processor sharing the pair takes c·t_draft + (t_verify - t_draft)
when t_draft <= t_verify, which gives c (1 = free overlap, 2 = none, as on a CPU whose every
core each forward already uses). On CUDA every timing ends with a device synchronize (a call
returns once its kernels are queued, not run), and the second forward runs on a stream of its
own, as a stage plan runs it.
"""

from __future__ import annotations

import statistics
import threading

import torch

from yggdrasil.device import device_sync, median_time
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.stage_plan import PlanTable, StagePlan
from yggdrasil.runtime.steps import verify_inputs
from yggdrasil.trace import Tracer, tracing
from yggdrasil.runtime.tree import TokenTree

from .dag import StageCosts


def _timed(fn, repeats: int, sync=lambda: None) -> float:
    """Median seconds of fn, each run ended by sync (the device's queued work counted)."""
    return median_time(fn, repeats, warmup=0, sync=sync)[0]


def _on_side_stream(fn, device: torch.device | None):
    """fn run on a CUDA stream of its own (a stage plan's second stream); fn itself elsewhere."""
    if device is None or device.type != "cuda":
        return fn
    stream = torch.cuda.Stream(device)

    def run() -> None:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # per thread: the other thread keeps its own stream
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)

    return run


def measure_contention(run_a, run_b, repeats: int = 5, device: torch.device | None = None) -> float:
    """c from timing two forwards alone and at once, from two threads (on CUDA, on two streams,
    each timing synchronized)."""
    sync = device_sync(device) if device is not None else (lambda: None)
    run_b = _on_side_stream(run_b, device)
    run_a(), run_b()  # warm
    t_a, t_b = _timed(run_a, repeats, sync), _timed(run_b, repeats, sync)
    t_long, t_short = max(t_a, t_b), min(t_a, t_b)

    def together() -> None:
        other = threading.Thread(target=run_b)
        other.start()
        run_a()
        other.join()

    t_both = _timed(together, repeats, sync)
    if t_short <= 0:
        return 1.0
    return min(max((t_both - t_long + t_short) / t_short, 1.0), 4.0)


def host_stage_seconds(speculator, prompt_ids: list[int], new_tokens: int = 32) -> dict[str, float]:
    """Median seconds of the prune, accept and compact stages over a traced greedy generation."""

    tracer = Tracer(sync_cuda=speculator.target.device.type == "cuda")  # spans end when their work does
    with tracing(tracer, speculator.target, speculator):
        speculator.generate(prompt_ids, new_tokens, SamplingParams())
    spans: dict[str, list[float]] = {}
    for event in tracer.events:
        if event["cat"] == "iteration":
            spans.setdefault(event["name"], []).append(event["dur"] * 1e-6)
    return {name: statistics.median(spans.get(name, [0.0])) for name in ("prune", "accept", "compact")}


def stage_costs(speculator, latency, widest_verify: int, prompt_ids: list[int], repeats: int = 5) -> StageCosts:
    """StageCosts of a speculator with a draft model on this machine: model forwards from its
    measured step times, host stages from a traced generation, contention measured live."""

    if speculator is None or not isinstance(speculator.drafter, ModelDrafter):
        raise ValueError("stage planning needs a bundle that speculates with a draft model")
    host = host_stage_seconds(speculator, prompt_ids)
    plans, speculator.plans = speculator.plans, PlanTable(default=StagePlan(accept_on_device=True))
    try:
        on_device = host_stage_seconds(speculator, prompt_ids)
    finally:
        speculator.plans = plans
    drafter, target = speculator.drafter, speculator.target
    tree = TokenTree.with_root(drafter.capacity, 0)  # trees live on the host (verify_inputs stages them)
    root = torch.zeros(1, dtype=torch.long)
    verify = verify_inputs(target, tree, root, 1, widest_verify)
    # the draft side: one pass over every head and step shape (what warm_up runs)
    contention = measure_contention(lambda: target.run(verify, key="verify"), drafter.warm_up, repeats,
                                    target.device)
    return StageCosts(draft=latency.draft, verify=latency.verify, prune=host["prune"],
                      accept_host=host["accept"], accept_device=on_device["accept"], compact=host["compact"],
                      contention=contention, streams=2 if target.device.type == "cuda" else 1)


def bundle_stage_costs(runtime, prompt_ids: list[int], repeats: int = 5) -> StageCosts:
    """StageCosts of a loaded bundle (its speculator must use a draft model)."""
    return stage_costs(runtime.speculator(), runtime.policy.selector.profile if runtime.policy else None,
                       max(runtime.policy.grid.verifies) if runtime.policy else 1, prompt_ids, repeats)
