"""Stage planner benchmark (issue 6): for a bundle's buckets, every stage plan this device can
execute, its predicted iteration time (the planner's simulation over measured stage costs) next
to the measured one, and time per output token of the best plan versus the sequential plan.

    yggdrasil bench planner --bundle DIR [--buckets D1xW2/V2,D6xW2/V16] [--tokens 40] [--repeats 2]

Runs on the bundle's models with eager steps (an ahead-of-time head needs draft graphs a bundle
only compiles when its plans use them), with costs measured on those same eager steps, so the
prediction and the measurement describe the same execution. Each bucket runs at its fixed
shape (D, W, V); plans are timed interleaved (repeat → bucket → plan). Greedy outputs of every
plan must equal the sequential plan's (the row is marked invalid otherwise). Prints a table,
writes a PNG (predicted vs measured), ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


import torch
import yaml

from yggdrasil.buckets import Bucket
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.runtime.latency import LatencyProfile, measure_profile
from yggdrasil.models.loader import load, parse_dtype
from yggdrasil.planner.costs import stage_costs
from yggdrasil.planner.dag import StageCosts
from yggdrasil.planner.schedule import best_plan, iteration_time
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.stage_plan import SEQUENTIAL, all_plans
from yggdrasil.runtime.steps import StepInputs
from yggdrasil.runtime.assembly import assemble_runtime

from .common import environment, format_table, interleaved, log, timed
from .prompts import build_prompts
from .provenance import Results
from . import plots


def load_eager(bundle: Path, max_context: int):
    manifest = yaml.safe_load(BundleLayout(bundle).manifest.read_text())
    if "draft" not in manifest["models"]:
        raise SystemExit(f"{bundle} drafts by lookup: stage plans need a draft model (e.g. qwen-pair-cpu)")
    dtype = parse_dtype(manifest["dtype"])
    device = manifest["recipe"]["device"]
    target = load(manifest["models"]["target"]["name"], dtype=dtype, device=device, quiet=True)
    draft = load(manifest["models"]["draft"]["name"], dtype=dtype, device=device, quiet=True)
    runtime = assemble_runtime(target.model, draft.model, max_context, chunk_sizes=tuple(manifest["chunk_sizes"]))
    return target, runtime.runner, runtime.draft_runner, manifest


def forward_seconds(runner, rows: int, prefix: int, repeats: int = 5) -> float:
    """Median seconds of one draft forward of `rows` rows over a `prefix`-token context."""

    span = runner.span(prefix + rows + 1)
    mask = torch.zeros(1, rows, span, dtype=torch.bool)
    mask[..., :prefix] = True
    zeros = torch.zeros(1, rows, dtype=torch.long)
    slots = torch.full((1, rows), runner.cache.scratch_slot)
    inputs = StepInputs(zeros, zeros + prefix, slots, mask)
    runner.run(inputs, key="draft_ahead")
    return statistics.median(timed(runner.run, inputs, key="draft_ahead")[1] for _ in range(repeats))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True, type=Path)
    parser.add_argument("--buckets", default="", help="comma-separated (default: the bundle's two most picked)")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="result JSON (a PNG goes next to it)")


def run(args: argparse.Namespace, record: Results) -> int | None:
    log("loading the bundle's models (eager steps)")
    loaded, target, draft, manifest = load_eager(args.bundle, 1024)
    picked = BundleLayout(args.bundle).read_selection()["picked"]
    names = [b for b in args.buckets.split(",") if b] or [b for b in picked if b != "no-spec"][:2]
    # a verify wider than the tree runs at the tree's size (the speculator clamps it), so that
    # is the shape both predicted and measured
    shapes = [Bucket(s.depth, s.width, min(s.verify, 1 + s.depth * s.width)) for s in map(Bucket.parse, names)]
    prompt = build_prompts(loaded.tokenizer, 1)[0][0].ids
    streams = 2 if target.device.type == "cuda" else 1
    plans = all_plans(streams)
    depth, width = max(s.depth for s in shapes), max(s.width for s in shapes)
    verifies = sorted({s.verify for s in shapes})

    log("measuring stage costs on the eager steps")
    probe = ModelDrafter(draft, depth, width, tuple(sorted({s.width for s in shapes})))
    latency = measure_profile(target, probe, verifies, repeats=5, draft_widths=probe.widths)
    ahead = {s.verify + extra for s in shapes for extra in (0, s.width)}
    draft_points = dict(latency.draft)
    for rows in sorted(ahead - set(draft_points)):  # the ahead-of-time head's row counts
        draft_points[rows] = forward_seconds(draft, rows, len(prompt))
    latency = LatencyProfile(tuple(sorted(draft_points.items())), latency.verify)
    costs = stage_costs(build_speculator(target, probe, verify=verifies, latency=latency), latency, max(verifies), prompt)
    costs = StageCosts(**{**costs.__dict__, "draft": latency.draft})
    log(f"costs: {costs}")

    flat = LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0),))  # always verify the full V

    def runner_for(shape, plan):
        def run(_item: int) -> dict:
            drafter = ModelDrafter(draft, shape.depth, shape.width)
            gen = build_speculator(target, drafter, verify=[shape.verify], latency=flat, plans=plan)
            result = gen.generate(prompt, args.tokens, SamplingParams())
            decode = result.stats.decode_seconds
            return {"iteration_s": decode / result.spec.iterations, "tpot_s": decode / max(len(result.tokens) - 1, 1),
                    "aal": result.spec.aal, "tokens": result.tokens}
        return run

    variants = {f"{s}|{p}": runner_for(s, p) for s in shapes for p in plans}
    samples = interleaved(args.repeats, 1, variants, label="plans: ")
    rows, records = [], []
    for shape in shapes:
        choice = best_plan(shape, costs)
        ref = next(s.values["tokens"] for s in samples if s.variant == f"{shape}|{SEQUENTIAL}")
        for plan in plans:
            mine = [s.values for s in samples if s.variant == f"{shape}|{plan}"]
            measured = statistics.median(v["iteration_s"] for v in mine)
            predicted = iteration_time(shape, costs, plan)
            valid = all(v["tokens"] == ref for v in mine)
            entry = {"bucket": str(shape), "plan": str(plan), "predicted_ms": predicted * 1e3,
                      "measured_ms": measured * 1e3, "error_pct": 100 * (predicted - measured) / measured,
                      "tpot_ms": 1e3 * statistics.median(v["tpot_s"] for v in mine),
                      "aal": statistics.median(v["aal"] for v in mine), "valid": valid,
                      "chosen": plan == choice.plan}
            records.append(entry)
            rows.append([entry["bucket"], entry["plan"] + (" *" if entry["chosen"] else ""),
                         f"{entry['predicted_ms']:.1f}", f"{entry['measured_ms']:.1f}", f"{entry['error_pct']:+.1f}",
                         f"{entry['tpot_ms']:.1f}", f"{entry['aal']:.2f}", "yes" if valid else "INVALID"])
    print(format_table(["bucket", "plan (* = planner's choice)", "predicted ms/it", "measured ms/it", "error %",
                        "TPOT ms", "AAL", "same tokens"], rows))
    summary = {}
    for shape in shapes:
        mine = [r for r in records if r["bucket"] == str(shape)]
        sequential = next(r for r in mine if r["plan"] == "sequential")
        best = min(mine, key=lambda r: r["tpot_ms"])
        chosen = next(r for r in mine if r["chosen"])
        summary[str(shape)] = {"sequential_tpot_ms": sequential["tpot_ms"], "best_measured_plan": best["plan"],
                               "best_tpot_ms": best["tpot_ms"], "chosen_plan": chosen["plan"],
                               "chosen_tpot_ms": chosen["tpot_ms"],
                               "mean_abs_error_pct": statistics.mean(abs(r["error_pct"]) for r in mine)}
        print(f"{shape}: planner picks {chosen['plan']} ({chosen['tpot_ms']:.1f} ms/token); best measured "
              f"{best['plan']} ({best['tpot_ms']:.1f}); sequential {sequential['tpot_ms']:.1f}; mean |error| "
              f"{summary[str(shape)]['mean_abs_error_pct']:.1f} %")
    png = None
    if args.out:
        png = args.out.with_suffix(".png")
        plot(records, png, environment()["device"])
    record.write({"benchmark": "planner", "bundle": str(args.bundle), "recipe": manifest["recipe"]["name"],
               "execution": "eager steps", "tokens": args.tokens, "repeats": args.repeats,
               "costs": {k: v for k, v in costs.__dict__.items()}, "records": records, "summary": summary,
               "plot": str(png) if png else None, "environment": environment(),
               "statistic": f"per (bucket, plan): the median over {args.repeats} runs of iteration and TPOT ms; "
                            "error_pct: (predicted - measured) / measured of those medians"},
                 args.out, bundle=args.bundle)


def plot(records: list[dict], path: Path, device: str) -> None:
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 5))
    for bucket in dict.fromkeys(r["bucket"] for r in records):
        mine = [r for r in records if r["bucket"] == bucket]
        ax.scatter([r["measured_ms"] for r in mine], [r["predicted_ms"] for r in mine], label=bucket)
        for r in mine:
            ax.annotate(r["plan"].replace("device-accept", "dev-acc"), (r["measured_ms"], r["predicted_ms"]),
                        fontsize=6, alpha=0.7)
    top = max(max(r["measured_ms"], r["predicted_ms"]) for r in records) * 1.05
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="predicted = measured")
    ax.set_xlabel("measured ms per iteration")
    ax.set_ylabel("predicted ms per iteration (planner)")
    ax.set_title(f"Stage plans: predicted vs measured\n{device}", fontsize=9)
    ax.legend(fontsize=8)
    plots.save(fig, path, dpi=120)

