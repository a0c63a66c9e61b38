"""ablation: Yggdrasil's cumulative optimisations (paper Fig. 12), each step switching one on:

  O1 EGT                    a fixed Equal-Growth Tree (D, W) verified whole, eager steps
  O2 +graph compilation     the same on the bundle's ahead-of-time graphs
  O3 +verify-width pruning  the objective keeps the best V nodes of each tree (compiled widths)
  O4 +stage scheduling      the bundle's stage plans (ahead-of-time drafts, overlap)
  O5 +depth predictor       the bundle's full policy: per-iteration (D, W, V) from the predictor

(D, W) is the best bucket by the objective among those verifying the whole tree within the
bundle's compiled widths, so O1..O4 share one shape. Autoregressive eager and compiled rows are
timed beside them as references, and so is the best constant bucket (the same (D, W, V) every
iteration, on the bundle's graphs and stage plans): the shipped policy must never be slower than
it, and a kept depth predictor must beat it (issue 25), so the table ends with O5's paired speed-up
over it (the geometric mean of per-(prompt, repeat) TPOT ratios, with a 95 % bootstrap interval)
and a one-sided test: "never slower" only when the 95 % lower bound is within NEVER_SLOWER_MARGIN
of 1. When the bundle ships the constant policy, O5 and the constant row run the same picks and
the verdict is "no difference: same policy" (nothing to test).

Exactness (issue 22, as in compare): for an fp32 bundle every row is checked against eager
autoregressive greedy; for a bf16/int8/int4 bundle against the deployed model, the bundle's own
autoregressive graphs, except the rows on eager steps (O1, ar-eager), which are checked against
eager autoregressive greedy and say "(own reference)" (harness.deployed_reference).
"""

from __future__ import annotations

import math
import random
import statistics

from yggdrasil.policy.auto import AutoPolicy

from . import common, engines, plots, shapes
from .harness import (Setup, clipped_note, deployed_reference, measure, record, status, summary_row, text_table,
                      title, variant, write_outputs)

BASES = ("ar-compiled", "ar-eager")  # and O1, whatever its shape is named
CONSTANT = "const"  # the best constant bucket's row starts with this; its bucket follows
BOOTSTRAP = 2000  # resamples for the interval of O5's paired speed-up over the constant
NEVER_SLOWER_MARGIN = 0.02  # "never slower": O5 is, with 95 % confidence, at most this much slower
STATISTIC = ("geometric mean of paired per-(prompt, repeat) TPOT ratios, constant / O5, seeded percentile "
             "bootstrap")


def constant_row(rt, bundle) -> tuple[str, object]:
    """The best constant bucket on the bundle's graphs and plans: the bundle's selector without
    the predictor (the policy compile ships when the predictor does not win)."""
    grid = rt.policy.grid
    constant = rt.policy.selector.constant()[0]
    drafter = engines.drafter_for(bundle, grid.max_depth, grid.max_width, grid.widths)
    return (f"{CONSTANT} {constant}",
            engines.speculative(bundle, drafter, policy=AutoPolicy(rt.policy.selector, None), plans=rt.plans))


def _bootstrap(ratios: list[float], seed: int) -> tuple[float, list[float]] | None:
    """(geometric mean, sorted bootstrap geometric means) of paired ratios, by a seeded percentile
    bootstrap. A ratio of 0 (a TPOT clipped to 0 by timing noise, harness.timed_run) measured
    nothing: left out."""
    ratios = [r for r in ratios if r > 0]
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    means = sorted(math.exp(statistics.fmean(rng.choices(logs, k=len(logs)))) for _ in range(BOOTSTRAP))
    return math.exp(statistics.fmean(logs)), means


def never_slower(ratios: list[float], margin: float = NEVER_SLOWER_MARGIN, seed: int = 0) -> dict | None:
    """The one-sided test of "the policy is never slower than the constant": ratios are constant
    TPOT / policy TPOT; it holds when the 95 % lower bound of their geometric mean is at least
    1 - margin (the policy is at most `margin` slower, with 95 % confidence)."""
    booted = _bootstrap(ratios, seed)
    if booted is None:
        return None
    mean, means = booted
    lower = means[int(0.05 * BOOTSTRAP)]
    interval = [round(means[int(0.025 * BOOTSTRAP)], 4), round(means[int(0.975 * BOOTSTRAP) - 1], 4)]
    return {"speedup": round(mean, 4), "ci95": interval, "lower_95_one_sided": round(lower, 4), "margin": margin,
            "never_slower": lower >= 1.0 - margin, "statistic": STATISTIC, "pairs": sum(r > 0 for r in ratios)}


def steps(setup: Setup) -> tuple[dict, list[str]]:
    """name -> Generate for O1..O5 and the references, and notes on what each step could do here;
    sets the exactness reference of every row (harness.deployed_reference)."""
    rt = setup.runtime
    bundle = engines.bundle_runners(rt)
    eager = engines.fresh_runners(rt, compiled=False)
    ar_eager, ar_bundle = engines.autoregressive(eager), engines.autoregressive(bundle)
    generators, notes = ablation_steps(rt, bundle, eager, ar_eager, ar_bundle)
    eager_rows = [name for name in generators if name.startswith("O1") or name == "ar-eager"]
    footnote = deployed_reference(setup, engines.deployed_format(rt), ar_bundle, ar_eager, eager_rows)
    return generators, notes + ([footnote] if footnote else [])


def ablation_steps(rt, bundle, eager, ar_eager, ar_bundle) -> tuple[dict, list[str]]:
    """The rows: O1 on eager steps, O2..O5 and the constant on the bundle's graphs, and the
    autoregressive references on each."""
    notes = []
    if rt.policy is None:
        # the bundle compiled no speculative bucket: nothing to ablate beyond its plain decoding
        notes.append("the bundle does not speculate (no bucket paid on calibration): O1..O5 are not defined")
        return {"ar-eager": ar_eager, "ar-compiled": ar_bundle}, notes
    grid = rt.policy.grid
    shape = shapes.best_whole_tree(rt.policy.selector)
    d, w, v = shape.depth, shape.width, shape.verify
    notes.append(f"fixed EGT shape for O1-O4: D{d} W{w}, whole tree ({1 + d * w} nodes) in verify width {v}")
    widths = tuple(x for x in grid.widths if x <= w)
    plans = rt.plans
    if not plans.any_moves:
        notes.append("O4: the bundle's planner kept the sequential plan for every bucket on this device "
                     "(no overlap pays), so O4 runs what O3 runs")
    if rt.policy.model is None:
        notes.append("O5: the depth predictor did not beat the best constant bucket on held-out calibration "
                     "data, so the bundle left it off; O5 adds only the per-iteration bucket choice")
    verifies = tuple(grid.verifies)
    constant_name, constant = constant_row(rt, bundle)
    return {
        f"O1 EGT D{d}xW{w}": engines.speculative(eager, engines.drafter_for(eager, d, w), [v]),
        "O2 +graphs": engines.speculative(bundle, engines.drafter_for(bundle, d, w, widths), [v]),
        "O3 +pruning": engines.speculative(bundle, engines.drafter_for(bundle, d, w, widths), verifies,
                                           profile=rt.latency),
        "O4 +stage plans": engines.speculative(bundle, engines.drafter_for(bundle, d, w, widths), verifies,
                                               profile=rt.latency, plans=plans),
        "O5 +predictor": engines.bundle_policy(rt),
        constant_name: constant,
        "ar-eager": ar_eager,
        "ar-compiled": ar_bundle,
    }, notes


def policy_verdict(setup: Setup, samples, constant: str, notes: list[str]) -> dict | None:
    """O5 against the best constant bucket: "no difference: same policy" when the bundle ships the
    constant policy (both rows run the same picks), else the one-sided never-slower test."""
    shape = constant[len(CONSTANT) + 1:]
    policy = setup.runtime.policy
    if policy.model is None and policy.confidence is None:
        notes.append(f"shipped policy (O5) over the best constant bucket ({shape}): no difference: same policy "
                     "(the bundle ships the constant policy, so both rows run the same picks)")
        return {"constant": constant, "same_policy": True, "verdict": "no difference: same policy"}
    ratios = common.paired_ratios(samples, constant, "O5 +predictor", "tpot")  # constant TPOT / O5's
    test = never_slower(ratios)
    if test is None:
        return None
    low, high = test["ci95"]
    said = ("never slower" if test["never_slower"] else "SLOWER than the constant")
    notes.append(f"shipped policy (O5) over the best constant bucket ({shape}): x{test['speedup']:.3f} (geometric "
                 f"mean of {test['pairs']} paired TPOT ratios), 95 % interval {low:.3f}-{high:.3f}; one-sided 95 % "
                 f"lower bound {test['lower_95_one_sided']:.3f} against 1 - {NEVER_SLOWER_MARGIN:.0%}: {said}")
    return {"constant": constant, "same_policy": False, **test}


def run(setup: Setup) -> dict:
    generators, notes = steps(setup)
    variants = {name: variant(setup, gen) for name, gen in generators.items()}
    samples = measure(setup, variants, label="ablation ")
    first = next((n for n in variants if n.startswith("O1")), None)
    rows = []
    for name in variants:
        row = summary_row(setup, samples, name, BASES + ((first,) if first else ()))
        if first:  # one column name whatever O1's shape is
            row["x_O1"] = 1.0 if name == first else row.pop(f"x_{first}")
            row.pop(f"x_{first}", None)
        rows.append({**row, "status": status(row)})
    heading = title(setup, "ablation")
    table = heading + "\n" + text_table(rows, [
        ("step", "variant"), ("TPOT ms", "tpot_ms"), ("min", "tpot_min_ms"), ("max", "tpot_max_ms"),
        ("AAL", "aal"), ("x O1", "x_O1"), ("x AR compiled", "x_ar-compiled"), ("x AR eager", "x_ar-eager"),
        ("tokens", "status")])
    constant = next((n for n in variants if n.startswith(CONSTANT)), None)
    verdict = policy_verdict(setup, samples, constant, notes) if constant is not None else None
    table += "\n" + "\n".join(f"note: {n}" for n in notes) + clipped_note(rows)
    result = {**record(setup), "notes": notes, "rows": rows, "policy_vs_constant": verdict}
    return write_outputs(setup, "ablation", result, table, rows, lambda p: plots.ablation(rows, heading, p))
