"""sensitivity: time per output token over the (D, W, V) grid (paper Fig. 13) and at sampling
temperatures (Fig. 15), on the bundle's graphs.

Grid: every recipe depth D x every compiled draft width W x every compiled verify width V with
1 < V <= 1 + D·W, each a fixed-shape EGT pruned to its V most probable nodes, greedy.
Temperatures: autoregressive decoding and the bundle's EGT policy at each temperature (seeded;
speculative sampling keeps the target's distribution, so sampled rows are not compared token for
token, and acceptance falls as the temperature rises).
"""

from __future__ import annotations

from yggdrasil.sampling import SamplingParams

from . import engines, plots
from .harness import (Setup, compute_reference, measure, record, status, summary_row, text_table, title,
                      variant, write_outputs)

AR = "ar-compiled T=0"


def grid_points(rt) -> list[tuple[int, int, int]]:
    grid = rt.policy.grid
    return [(d, w, v) for d in grid.depths for w in grid.widths for v in grid.verifies if 1 < v <= 1 + d * w]


def build(setup: Setup) -> tuple[dict, dict]:
    """name -> fn(prompt) -> Run, and name -> (kind, fields) for the rows."""
    rt, options = setup.runtime, setup.options
    bundle = engines.bundle_runners(rt)
    compute_reference(setup, engines.autoregressive(bundle))
    variants, meta = {}, {}
    egt = engines.bundle_policy(rt)
    for t in options.temperatures:
        sampling = SamplingParams(temperature=t, seed=options.seed)
        variants[f"ar-compiled T={t:g}"] = variant(setup, engines.autoregressive(bundle), sampling)
        meta[f"ar-compiled T={t:g}"] = ("temperature", {"temperature": t, "kind": "ar-compiled"})
        if egt is not None:
            variants[f"egt T={t:g}"] = variant(setup, egt, sampling)
            meta[f"egt T={t:g}"] = ("temperature", {"temperature": t, "kind": "egt"})
    if rt.policy is not None:
        widths = rt.policy.grid.widths
        for d, w, v in grid_points(rt):
            drafter = engines.drafter_for(bundle, d, w, tuple(x for x in widths if x <= w))
            name = f"D{d}xW{w}/V{v}"
            variants[name] = variant(setup, engines.speculative(bundle, drafter, [v]))
            meta[name] = ("grid", {"depth": d, "width": w, "verify": v})
    return variants, meta


def run(setup: Setup) -> dict:
    variants, meta = build(setup)
    samples = measure(setup, variants, label="sensitivity ")
    grid_rows, temp_rows = [], []
    for name in variants:
        kind, fields = meta[name]
        sampled = kind == "temperature" and fields["temperature"] > 0
        base = f"ar-compiled T={fields['temperature']:g}" if kind == "temperature" else AR
        row = summary_row(setup, samples, name, (base,), greedy=not sampled)
        row["x_ar"] = row.pop(f"x_{base}")
        row.update(fields)
        row["status"] = status(row)
        (grid_rows if kind == "grid" else temp_rows).append(row)
    heading = title(setup, "sensitivity")
    best = min(grid_rows, key=lambda r: r["tpot_ms"]) if grid_rows else None
    table = heading + "\n(D, W, V) grid, greedy, fixed shape on the bundle's graphs\n" + text_table(grid_rows, [
        ("bucket", "variant"), ("TPOT ms", "tpot_ms"), ("AAL", "aal"), ("x AR compiled", "x_ar"),
        ("tokens", "status")])
    if best:
        table += f"\nfastest bucket: {best['variant']} at {best['tpot_ms']:.2f} ms"
    table += "\n\ntemperatures (seeded)\n" + text_table(temp_rows, [
        ("variant", "variant"), ("TPOT ms", "tpot_ms"), ("AAL", "aal"), ("x AR same T", "x_ar"),
        ("tokens", "status")])
    rows = grid_rows + temp_rows
    result = {**record(setup), "grid": grid_rows, "temperatures": temp_rows, "rows": rows,
              "fastest_bucket": best["variant"] if best else None}
    return write_outputs(setup, "sensitivity", result, table, rows,
                         lambda p: plots.sensitivity(grid_rows, temp_rows, heading, p))
