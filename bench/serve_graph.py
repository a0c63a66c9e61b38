"""Serve-graph benchmark (issue 8): what one serving forward costs on the bundle's symbolic-row
serve graph, against the eager forward over the same KV pool and against a fixed-row step graph
of the bundle padded to its bucket (the alternative: a graph per row bucket).

    yggdrasil bench serve-graph --bundle DIR [--rows 1,2,3,5,6,8] [--context 512] [--repeats 15]
                                [--out FILE.json]

Each row count is one request's root plus chained proposals after `context` tokens. The three
forwards are timed interleaved (repeat > row count > variant), median per cell. The fixed-row
graphs are the bundle's verify graphs (over the model's own cache), so only row counts up to the
widest compiled verify have a padded column. Prints a table, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from yggdrasil.buckets import SERVE_STAGE
from yggdrasil.bundle import open_bundle
from yggdrasil.serve.pool import Segment, SlotPool, run_segments
from yggdrasil.runtime.steps import SPAN_ROUNDING

from .common import environment, fmt, format_table, log, timed
from .provenance import Results


def pool_variants(bundle, rows: int, context: int):
    """(eager, compiled) forwards of `rows` decode rows after `context` tokens over a pool."""

    model, graph = bundle.models().target.model, bundle.serve_graphs()["target"].get(SERVE_STAGE)
    pool = SlotPool(-(-(context + rows) // 16) + 1, 16)
    pool.reserve(1, context + rows)
    caches = [pool.new_cache(model), pool.new_cache(model)]
    segments = [Segment(1, tuple(range(5, 5 + rows)), context, "all")]
    return (lambda: run_segments(model, caches[0], pool, segments),
            lambda: run_segments(model, caches[1], pool, segments, graph))


def padded_variant(steps, rows: int, context: int):
    """The smallest compiled verify graph that holds `rows`, its padding rows on the scratch
    slot (None when no verify graph is that wide)."""

    widths = sorted(int(n.rsplit("_w", 1)[1]) for n in steps.graphs if n.startswith("verify"))
    width = next((w for w in widths if w >= rows), None)
    if width is None:
        return None, None
    graph = steps.get(next(n for n in steps.graphs if n.startswith("verify") and n.endswith(f"_w{width}")))
    span = -(-(context + width) // SPAN_ROUNDING) * SPAN_ROUNDING
    positions = torch.arange(context, context + width)[None]
    slots = positions.clone()
    mask = (torch.arange(span)[None, :] <= positions[0][:, None])[None]
    tokens = torch.full((1, width), 5, dtype=torch.long)

    def run():
        with torch.inference_mode():
            return graph(tokens, positions, slots, mask)

    return run, width


VARIANTS = ("eager pool", "serve graph", "padded step graph")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--rows", default="1,2,3,5,6,8")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="JSON result file")


def run(args: argparse.Namespace, record: Results) -> int | None:
    served = open_bundle(Path(args.bundle), quiet=True)
    runtime = served.generator()
    steps = runtime.graph_sets["target"]
    row_counts = [int(r) for r in args.rows.split(",")]
    calls, widths = {}, {}  # (rows, variant) -> forward; rows -> the padded graph's width
    for rows in row_counts:
        eager, compiled = pool_variants(served, rows, args.context)
        padded, widths[rows] = padded_variant(steps, rows, args.context)
        calls.update({(rows, "eager pool"): eager, (rows, "serve graph"): compiled})
        if padded is not None:
            calls[(rows, "padded step graph")] = padded
    for call in list(calls.values()) * 2:  # warm-up
        call()
    log(f"timing {len(row_counts)} row counts x {len(VARIANTS)} forwards x {args.repeats} repeats "
        f"at context {args.context}")
    times = {key: [] for key in calls}
    for repeat in range(args.repeats):
        order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]
        for key in ((rows, name) for rows in row_counts for name in order if (rows, name) in calls):
            times[key].append(timed(calls[key])[1])

    def median_ms(rows: int, name: str) -> float | None:
        return statistics.median(times[(rows, name)]) * 1e3 if (rows, name) in times else None

    result_rows = [{"rows": rows, "padded_to": widths[rows], "eager_ms": median_ms(rows, "eager pool"),
                    "serve_graph_ms": median_ms(rows, "serve graph"),
                    "padded_step_graph_ms": median_ms(rows, "padded step graph")} for rows in row_counts]

    print(format_table(["rows", "eager pool ms", "serve graph ms", "padded to", "padded step graph ms",
                        "eager / serve", "padded / serve"],
                       [[r["rows"], fmt(r["eager_ms"], 1), fmt(r["serve_graph_ms"], 1), r["padded_to"] or "-",
                         fmt(r["padded_step_graph_ms"], 1), f"{r['eager_ms'] / r['serve_graph_ms']:.2f}",
                         "-" if r["padded_step_graph_ms"] is None
                         else f"{r['padded_step_graph_ms'] / r['serve_graph_ms']:.2f}"] for r in result_rows]))
    record.write({"bench": "serve_graph", "bundle": args.bundle, "context": args.context, "repeats": args.repeats,
               "rows": result_rows, "env": environment(),
               "statistic": f"ms per forward: the median of {args.repeats} timed calls, the forwards rotated"},
                 args.out, bundle=Path(args.bundle))

