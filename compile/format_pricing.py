"""Formats settled without timing them in full (issue 50, part 1): priced by their bytes, or
probed.

Priced: a format whose linear weights' bytes (LINEAR_BITS per weight, a lower bound), read
from memory at the bandwidth measured at load, take longer than every step of a format that
passes quality cannot win; it is not even loaded. Only for weights far larger than the
last-level cache (CACHE_MULTIPLE), which smaller ones can stay in.

Probed: once a format passes quality, a slower one is usually slower at every step size, and
timing all of its steps (every verify width five times, every draft width, with the busy-machine
retries) only to find that out cost 26-45 s a format on the Qwen pair and, on a noisy 2-core
Xeon, 41-50 s a format of SmolLM2's 5-minute formats phase. The probe times as few of its
steps as showing that takes: steps take longer with more rows, so a format's time at a width is
a floor (less MONOTONE_SLACK) for every wider one. Widths are probed from the narrowest: one
where the winner's time lies below the floor of the widths probed so far needs no timing; at
any other the format's step is timed (the fastest of PROBE_REPEATS after a warm-up:
interference only ever slows a step), and if it is no slower there than the winner's, the probe
stops and the format is timed in full. The same for the draft's steps. A format slower at every
probed step is dominated, with the probed times as its profile. A burst of other work during a
probe can only make the format look slower, so a probe is judged for interference like every
other step timing (probe_checked): a disturbed "dominated" is probed again after a wait, and
one still disturbed after the retries is timed in full instead of settled.

`quality.time_every_format: true` prices and probes nothing: every format is timed in full.
"""

from __future__ import annotations

from typing import Callable

import torch

from yggdrasil.device import last_level_cache_bytes
from yggdrasil.runtime import latency
from yggdrasil.runtime.latency import MONOTONE_SLACK, LatencyProfile
from yggdrasil.runtime.steps import StepRunner

# bits a format spends per linear weight, at least (scales and offsets not counted): a lower bound
# of the bytes a decode step reads, and so of its time on a machine that streams them from memory
LINEAR_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "q4": 4}
CACHE_MULTIPLE = 4  # weights this many times the last-level cache are read from memory every step


def linear_weights(model) -> int:
    """How many weights the model's linear layers hold (the LM head included, tied or not): what
    every decode step reads, whatever the format."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def step_floors(ctx, candidates: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """Per format, (target, draft) seconds a decode step takes at least: its linear weights'
    bits (LINEAR_BITS, a lower bound) over the measured bandwidth. Only for weights far larger
    than the last-level cache (smaller ones can stay in it) and unless the recipe times every
    format."""
    if ctx.recipe.quality.time_every_format or not ctx.bandwidth:
        return {}
    counts = {"target": linear_weights(ctx.target.model),
              "draft": linear_weights(ctx.draft.model) if ctx.draft is not None else 0}
    floors = {}
    for fmt in candidates:
        draft_fmt = ctx.recipe.draft_format(fmt)
        nbytes = {"target": counts["target"] * LINEAR_BITS.get(fmt, 0) / 8,
                  "draft": counts["draft"] * LINEAR_BITS.get(draft_fmt, 0) / 8}
        if nbytes["target"] > CACHE_MULTIPLE * last_level_cache_bytes():
            floors[fmt] = (nbytes["target"] / ctx.bandwidth, nbytes["draft"] / ctx.bandwidth)
    return floors


def floor_profile(floor: tuple[float, float], measured: list[LatencyProfile]) -> LatencyProfile:
    """A stand-in whose every step takes the floor (at the sizes the others were timed at), for
    the dominance check: a format whose floor no passing format's step reaches cannot win."""
    sizes = sorted({n for profile in measured for n, _ in profile.verify}) or [1]
    widths = sorted({n for profile in measured for n, _ in profile.draft}) or [1]
    return LatencyProfile(draft=tuple((w, floor[1]) for w in widths), verify=tuple((n, floor[0]) for n in sizes))


PROBE_REPEATS = 2  # the floor a probed width sets for the wider ones is its time less MONOTONE_SLACK


def probe_dominated(winner: LatencyProfile, target: StepRunner, drafter, device) -> LatencyProfile | None:
    """The steps of a format (its target runner, and drafter when its draft's format differs
    from the winner's; None: the same draft steps, or none) probed against the winner's profile:
    the probed times when the winner is at least as fast at every step, and strictly at one;
    None at the first step where the format is no slower."""
    verify = cover(winner.verify, lambda n: min(latency.verify_step_seconds(
        target, n, PROBE_REPEATS, warmup=1, kernel_time=True)))
    if verify is None:
        return None
    if drafter is None:  # the winner's draft steps are this format's own
        return LatencyProfile(draft=winner.draft, verify=verify, spread=0.0)
    history = latency.draft_history(drafter)
    draft = cover(winner.draft, lambda w: min(latency.draft_step_seconds(
        drafter, history, w, PROBE_REPEATS, 1, device)))
    return None if draft is None else LatencyProfile(draft=draft, verify=verify, spread=0.0)


def probe_checked(winner: LatencyProfile, target: StepRunner, drafter, device,
                  log: Callable[[str], None] = print, limits: latency.NoiseLimits | None = None,
                  probe: Callable[..., LatencyProfile | None] = probe_dominated) -> LatencyProfile | None:
    """probe_dominated, judged like measure_checked judges a profile (what else used the CPUs,
    the reference matmul's drift): the probed times only from an undisturbed probe; None (time
    the format in full) when it is no slower somewhere or every attempt was disturbed."""
    device = torch.device(device)
    limits = latency.retry_limits(limits or latency.NoiseLimits(), device)
    for attempt in range(1 + limits.retries):
        probed, quality = latency.judged_run(lambda: probe(winner, target, drafter, device), device, limits)
        if probed is None:
            return None  # the full timing that follows is checked in its own right
        if quality.verdict == latency.GOOD:
            return probed
        log(f"WARNING: the machine looks busy while probing a format's steps: {'; '.join(quality.reasons)}")
        if attempt < limits.retries:
            latency.wait_quietly(limits.wait_seconds)
    log("WARNING: every probe was disturbed; timing the format in full instead of settling it by the probe")
    return None


def cover(winner_points, time_at: Callable[[int], float]) -> tuple[tuple[int, float], ...] | None:
    """The format's times at the widths that needed probing, in width order, when each of the
    winner's points (width, seconds) is no slower than the format there (probed, or below the
    floor of a narrower probed width); None at the first width where the format is faster."""
    probed: list[tuple[int, float]] = []
    floor = 0.0
    for width, winner_seconds in sorted(winner_points):
        if winner_seconds < floor:
            continue  # a narrower step of the format already takes longer than this one of the winner
        seconds = time_at(width)
        if seconds <= winner_seconds:
            return None
        probed.append((width, seconds))
        floor = max(floor, seconds * (1 - MONOTONE_SLACK))
    return tuple(probed)
