"""trees: AAL and objective-3.1 speed-up against verify width V for a chain, a static tree and
EGT at several draft widths (paper Fig. 11), on the same prompts:

  chain      D = V - 1 draft tokens in a line, verified whole
  egt        the Equal-Growth Tree the objective picks for V over every draft width and depth
             on calibration data, among the shapes that accepted at least as many tokens there
             as the chain (width 1 is a chain, and a grid with width 1 calibrates depth V - 1:
             so EGT is never capped below the chain; issue 25)
  egt-W<w>   an Equal-Growth Tree of width w, its depth the objective's best for (w, V) on
             calibration data among the depths whose tree fills V, pruned to its V most
             probable nodes
  sequoia    the calibration's best static tree for budget V (needs a draft model)

AAL is measured (tokens per target forward); the objective speed-up puts it against the
bundle's profiled step times: AAL · T_verify(1) / (draft steps + T_verify(V)). Trees run on eager
steps (AAL does not depend on the backend, and eager runs every shape without compiling it);
their eager TPOT is recorded too.

Exactness (issue 22, as in compare): every row runs on eager steps, so it is checked against eager
autoregressive greedy; for a bf16/int8/int4 bundle the rows say "(own reference)" and the table
says on how many prompts eager greedy equals the deployed model's (the bundle's own graphs).
"""

from __future__ import annotations

from . import engines, plots, shapes
from .harness import (Setup, clipped_note, deployed_reference, measure, record, status, summary_row, text_table,
                      title, variant, write_outputs)


def configurations(setup: Setup) -> tuple[list[dict], str | None]:
    """One entry per (structure, V): name, shape, draft cost in seconds, the decoder; and the
    table's footnote on the exactness reference it set (None for fp32)."""
    rt = setup.runtime
    eager = engines.fresh_runners(rt, compiled=False)
    full = shapes.full_selector(rt)
    grid, latency = full.grid, rt.latency
    sequoia = shapes.sequoia_files(rt) if rt.draft is not None else {}
    configs = []
    for v in (x for x in grid.verifies if x > 1):
        depth = v - 1  # a chain fills V with V - 1 drafted tokens (drafters go deeper than the grid)
        configs.append({"structure": "chain", "verify": v, "shape": f"D{depth}xW1",
                        "draft_seconds": depth * latency.t_draft(1),
                        "make": lambda d=depth, v=v: engines.speculative(eager, engines.drafter_for(eager, d, 1), [v])})
        chosen = full.best_at_verify(v)
        configs.append({"structure": "egt", "verify": v, "shape": f"D{chosen.depth}xW{chosen.width}",
                        "draft_seconds": chosen.depth * latency.t_draft(chosen.width),
                        "make": lambda d=chosen.depth, w=chosen.width, v=v: engines.speculative(
                            eager, engines.drafter_for(eager, d, w), [v])})
        for w in (x for x in grid.widths if x > 1):
            # the best depth among those whose tree fills V (the calibration's depths)
            found = shapes.best(full, lambda s, w=w, v=v: s.width == w and s.verify == v and 1 + s.depth * w >= v)
            if found is None:  # even the deepest tree of this width cannot fill V
                continue
            d = found[0].depth
            configs.append({"structure": f"egt-W{w}", "verify": v, "shape": f"D{d}xW{w}",
                            "draft_seconds": d * latency.t_draft(w),
                            "make": lambda d=d, w=w, v=v: engines.speculative(
                                eager, engines.drafter_for(eager, d, w), [v])})
        if v in sequoia:
            drafter = engines.static_tree_drafter(eager, sequoia[v])
            levels = [1] + [len(level) for level in drafter.fed_levels if level]
            configs.append({"structure": "sequoia", "verify": v, "shape": f"{drafter.capacity - 1} node(s), depth {drafter.depth}",
                            "draft_seconds": sum(latency.t_draft(n) for n in levels),
                            "make": lambda drafter=drafter: engines.speculative(eager, drafter, [drafter.capacity])})
    footnote = deployed_reference(setup, engines.deployed_format(rt),
                                  engines.autoregressive(engines.bundle_runners(rt)),
                                  engines.autoregressive(eager), row_names(configs))
    return configs, footnote


def row_names(configs: list[dict]) -> list[str]:
    return [f"{c['structure']}/V{c['verify']}" for c in configs]


def run(setup: Setup) -> dict:
    configs, footnote = configurations(setup)
    names = row_names(configs)
    rt = setup.runtime
    variants = {name: variant(setup, c["make"]()) for name, c in zip(names, configs)}
    samples = measure(setup, variants, label="trees ")
    t1 = setup.runtime.latency.t_verify(1)
    rows = []
    for name, c in zip(names, configs):
        row = summary_row(setup, samples, name, ())
        cost = c["draft_seconds"] + setup.runtime.latency.t_verify(c["verify"])
        row.update({"structure": c["structure"], "verify": c["verify"], "shape": c["shape"],
                    "objective_speedup": round(row["aal"] * t1 / cost, 3) if row["aal"] else None,
                    "eager_tpot_ms": row["tpot_ms"], "status": status(row)})
        rows.append(row)
    heading = title(setup, "trees")
    table = heading + "\n" + text_table(rows, [
        ("structure", "structure"), ("V", "verify"), ("shape", "shape"), ("AAL", "aal"),
        ("objective speed-up", "objective_speedup"), ("eager TPOT ms", "eager_tpot_ms"), ("tokens", "status")])
    table += ("\nobjective speed-up = AAL x T_verify(1) / (draft steps + T_verify(V)) with the bundle's "
              "profiled step times; AAL measured")
    if footnote:
        table += "\n" + footnote
    table += clipped_note(rows)
    result = {**record(setup), "latency": rt.latency.as_dict(), "rows": rows, "reference": footnote}
    return write_outputs(setup, "trees", result, table, rows, lambda p: plots.trees(rows, heading, p))
