"""Choosing the weight format from the measured candidates (compile/formats.py measures them):
the quality gate, the provisional choice, the latency objective's preference once calibration
has measured acceptance, and deploying the chosen format into the build context."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from yggdrasil.policy.calibration import load_run
from yggdrasil.policy.auto import selector_for

from .context import BuildContext
from .formats import FormatChoice, FormatError, FormatMeasurement, fastest_usable, load_in, measure_formats, released


def gate(ctx: BuildContext, measured: list[FormatMeasurement]) -> FormatChoice:
    """Refuse what is below the floor; a named format that is refused stops compile. Among
    several usable formats the provisional choice is the fastest plain decode step (T(1)),
    which prefer_by_objective revisits once calibration has measured acceptance."""
    recipe = ctx.recipe
    if recipe.weights != "auto":
        only = measured[0]
        if not only.usable:
            raise FormatError(f"{recipe.source}: weights {only.format} is below the quality floor: greedy "
                              f"next-token agreement with fp32 {only.agreement:.4f} over {only.positions} "
                              f"positions < quality.min_agreement {recipe.quality.min_agreement:g}; use "
                              "weights: auto (or a wider format), or lower quality.min_agreement")
        return FormatChoice(only.format, "named by the recipe; passes the quality floor", tuple(measured))
    best = fastest_usable(measured)
    return FormatChoice(best.format, f"fastest plain decode step, T(1) {best.t_ms(1):.2f} ms, among formats "
                        "passing quality", tuple(measured))


def prefer_by_objective(choice: FormatChoice, calibration: Path) -> FormatChoice:
    """Each usable format's expected seconds per token under the latency objective: its step
    times with the calibration's acceptance (the best constant bucket; formats above the floor
    generate the same tokens nearly always, so acceptance carries over); the lowest wins."""
    run = load_run(calibration)[0]
    rows = torch.ones(run.accepted.shape[0], dtype=torch.bool)
    scored = []
    for c in choice.candidates:
        if not c.usable:
            scored.append(c)
            continue
        profile = c.latency()
        _, speedup = selector_for(run, rows, profile).constant()
        scored.append(replace(c, objective_speedup=speedup, expected_tpot_ms=profile.t_verify(1) * 1e3 / speedup))
    usable = [c for c in scored if c.usable]
    best = min(usable, key=lambda c: c.expected_tpot_ms)
    if len(usable) == 1:
        reason = choice.reason
    else:
        reason = (f"lowest expected time per token under the latency objective, {best.expected_tpot_ms:.2f} ms "
                  f"(speedup {best.objective_speedup:.2f}x over its own plain decoding), among formats passing "
                  "quality")
    return FormatChoice(best.format, reason, tuple(scored))


def deploy(ctx: BuildContext, fmt: str, loaded: tuple | None = None) -> BuildContext:
    """The context with its models in this format (what calibration, the graphs and the
    eager reference of the compile check then use). loaded: (target, draft) already in it."""
    draft_fmt = ctx.recipe.draft_format(fmt)
    in_place = not released(ctx.target) and not released(ctx.draft)
    if fmt == ctx.weights.get("target") and (ctx.draft is None or draft_fmt == ctx.weights.get("draft")) and in_place:
        return ctx
    if loaded is not None:
        ctx.log(f"deploying weight format {fmt}: the models measured in it")
        target, draft = loaded
    else:
        ctx.log(f"loading the models in weight format {fmt}" + (f" (draft {draft_fmt})" if ctx.draft else ""))
        target = load_in(ctx, "target", fmt)
        draft = load_in(ctx, "draft", draft_fmt) if ctx.draft is not None else None
    weights = {"target": fmt, **({"draft": draft_fmt} if draft is not None else {})}
    return replace(ctx, target=target, draft=draft, weights=weights)


def choose_format(ctx: BuildContext, reprofile: bool = False) -> tuple[BuildContext, FormatChoice]:
    """Measure and gate the candidates; returns the context in the provisional choice."""
    recipe = ctx.recipe
    if recipe.weights == "fp32" and recipe.draft_format("fp32") == "fp32":
        return ctx, FormatChoice("fp32", "named by the recipe", measured=False)
    keep: dict = {}
    choice = gate(ctx, measure_formats(ctx, reprofile, keep, let_go=True))
    for c in choice.candidates:
        ctx.log(f"  {c.format:<5} T(1) {_ms(c.t_ms(1))}  T(16) {_ms(c.t_ms(16))}  agreement "
                f"{'-' if c.agreement is None else f'{c.agreement:.4f}'}"
                + (f" (95 % {c.agreement_interval[0]:.3f}-{c.agreement_interval[1]:.3f})" if c.agreement_interval else "")
                + f"  steps {c.invariance_verdict() or '-'}  "
                f"{c.verdict}{': ' + c.note if c.note else ''}"
                + (f"  ({', '.join(f'{k} {v:.0f} s' for k, v in c.seconds.items())})" if c.seconds else ""))
    ctx.log(f"weight format: {choice.chosen} ({choice.reason})")
    return deploy(ctx, choice.chosen, keep.get(choice.chosen)), choice


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"
