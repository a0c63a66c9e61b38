"""Where the host time of a bundle's speculative iterations goes (issue 51, part 5).

`generate --bundle B` prints `host time outside the graphs X ms per iteration (Y % of decode)`:
decode wall time minus the time spent inside compiled graph calls. This suite splits X by stage
from the trace (yggdrasil/trace.py): each stage of each iteration (draft, prune, verify, accept,
compact) minus the model forwards inside it is that stage's host work; the forwards' own spans
minus the graph calls inside them is the step runners' input staging and dispatch; what is left
of decode is the loop between iterations (emitting tokens, the stop checks).

    yggdrasil bench host-time --bundle B [--prompt "def fizzbuzz(n):"] [--max-new-tokens 96] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from yggdrasil.bundle import open_bundle
from yggdrasil.runtime.hybrid import hybrid_speculator
from yggdrasil.sampling import SamplingParams
from yggdrasil.trace import Tracer, tracing

from .common import environment, log
from .provenance import Results

RUNNER_LANES = ("target", "draft")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--prompt", default="def fizzbuzz(n):")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hybrid", action="store_true", help="draft with the hybrid lookup/model drafter")
    parser.add_argument("--out", default=None)


def breakdown(events: list[dict], graph_seconds: float, decode_seconds: float) -> dict[str, float]:
    """Seconds of host work by stage over the decode iterations of one traced generation."""
    decode = [e for e in events if e["args"]["iteration"] >= 0]
    stages = [e for e in decode if e["cat"] == "iteration"]
    forwards = [e for e in decode if e["cat"] in RUNNER_LANES]
    out: dict[str, float] = {}
    for stage in stages:
        start, end = stage["ts"], stage["ts"] + stage["dur"]
        inside = sum(f["dur"] for f in forwards if start <= f["ts"] and f["ts"] + f["dur"] <= end)
        out[stage["name"]] = out.get(stage["name"], 0.0) + (stage["dur"] - inside) / 1e6
    out["runner staging and dispatch"] = sum(f["dur"] for f in forwards) / 1e6 - graph_seconds
    out["loop between iterations"] = decode_seconds - sum(s["dur"] for s in stages) / 1e6
    return out


def run(args: argparse.Namespace, record: Results) -> int | None:
    generator = open_bundle(Path(args.bundle), quiet=True).generator()
    policy = generator.policy
    if policy is None:
        raise SystemExit(f"{args.bundle} does not speculate: no iterations to split")
    ids = generator.tokenizer.encode(args.prompt)

    def speculator():
        if args.hybrid:
            return hybrid_speculator(generator.runner, generator.draft_runner, policy)
        return generator.speculator()

    speculator().generate(ids, args.max_new_tokens, SamplingParams())  # warm-up
    samples, totals = [], []
    for _ in range(args.repeats):
        spec, tracer, marks = speculator(), Tracer(), []

        def first(tokens):
            if not marks:
                marks.append(generator.graph_seconds())
        with tracing(tracer, generator.runner, spec):
            result = spec.generate(ids, args.max_new_tokens, SamplingParams(), on_tokens=first)
        decode = result.stats.decode_seconds
        graphs = generator.graph_seconds() - marks[0]
        parts = breakdown(tracer.events, graphs, decode)
        iterations = result.spec.iterations
        samples.append({k: v / iterations * 1e3 for k, v in parts.items()})
        totals.append({"host_ms_per_iteration": (decode - graphs) / iterations * 1e3,
                       "host_share": (decode - graphs) / decode, "iterations": iterations, "aal": result.spec.aal,
                       "decode_ms_per_iteration": decode / iterations * 1e3})
    median = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    total = {k: statistics.median(t[k] for t in totals) for k in totals[0]}
    log(f"host time outside the graphs {total['host_ms_per_iteration']:.2f} ms per iteration "
        f"({total['host_share']:.1%} of decode), AAL {total['aal']:.2f}; by stage (ms per iteration):")
    for name, ms in sorted(median.items(), key=lambda kv: -kv[1]):
        log(f"  {name:<30} {ms:7.3f}")
    record.write({"benchmark": "host_time", "bundle": str(args.bundle), "prompt": args.prompt,
                  "max_new_tokens": args.max_new_tokens, "drafter": "hybrid" if args.hybrid else "the bundle's",
                  "total": total, "ms_per_iteration_by_stage": median, "repeats": samples,
                  "environment": environment(),
                  "statistic": f"medians over {args.repeats} traced generations (after one warm-up) of per-iteration "
                               "means; host = decode wall time minus time inside graph calls"},
                 args.out, bundle=Path(args.bundle))
    return 0
