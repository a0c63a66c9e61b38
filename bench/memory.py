"""KV memory pressure benchmark (issue 9): always-recompute, always-swap and cost-aware
preemption under one fixed KV budget and one request stream, side by side in one run.

    yggdrasil bench memory --bundle DIR [--kv-budget 16MiB] [--swap-space auto] [--requests 16]
                           [--rate 4] [--max-tokens 96] [--max-batch 4] [--repeats 3] [--out FILE.json]

The engine runs in this process on the main thread, as `yggdrasil serve` runs it, without HTTP:
requests arrive as a seeded Poisson process (ShareGPT prompts) and are submitted when their time
comes; the three engines share the loaded models and one set of measured preemption costs, and
take turns (rotating which goes first) so drift hits all alike. Reported per mode: throughput
(generated tokens / makespan), average weighted turnaround (AdaptiveLLM's: (finish - send) /
(finish - first scheduled), 1 = never queued), preemptions by mode, swap bytes, recompute
tokens, and predicted vs measured preemption cost. Replies are checked equal across modes.
Prints a table, writes a PNG next to --out, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from yggdrasil.bundle import open_bundle
from yggdrasil.predictor import prompts as sets
from yggdrasil.serve.requests import GenerationRequest
from yggdrasil.serve.setup import ServeSettings
from yggdrasil.models.tokenizer import Message

from .common import environment, format_table, log
from .provenance import Results
from . import plots

MODES = ("recompute", "swap", "auto")


class Collector:
    """A Sink that remembers when the request ended and what it said."""

    def __init__(self, sent: float) -> None:
        self.sent, self.ids, self.finished, self.error = sent, [], None, None

    def tokens(self, ids, text) -> None:
        self.ids += ids

    def finish(self, reason, usage) -> None:
        self.finished = time.perf_counter()

    def fail(self, message) -> None:
        self.error, self.finished = message, time.perf_counter()


def load_prompts(tokenizer, n: int, seed: int, max_length: int) -> list[list[int]]:
    """n ShareGPT first turns in the chat template, each at most max_length tokens."""

    texts = [p.text for p in sets.sharegpt() if 20 <= len(p.text) <= 4000]
    random.Random(seed).shuffle(texts)
    encoded = (tokenizer.encode_chat([Message("user", t)]) for t in texts)
    return [ids for ids in encoded if len(ids) <= max_length][:n]


def run_stream(engine, prompts: list[list[int]], arrivals: list[float], max_tokens: int) -> dict:
    """Submit each prompt at its arrival time, step until all are done; per-mode numbers."""

    states, scheduled, sinks, start = {}, {}, [], time.perf_counter()
    pending = list(zip(arrivals, prompts))
    while pending or engine.running or engine.scheduler.queued:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, prompt = pending.pop(0)
            sink = Collector(time.perf_counter())
            rid = engine.submit(GenerationRequest(tuple(prompt), max_tokens), sink)
            sinks.append(sink)
            states[rid] = sink
        if engine.step() is None and pending:
            time.sleep(min(0.01, max(pending[0][0] - (time.perf_counter() - start), 0)))
        for state in engine.running:  # a request needs at least a step more, so none is missed
            scheduled.setdefault(state.rid, state.scheduled_at)
    makespan = max(s.finished for s in sinks) - start
    weighted = [(s.finished - s.sent) / max(s.finished - scheduled[rid], 1e-9) for rid, s in states.items()]
    metrics, preemptions = engine.metrics, list(engine.scheduler.preemptions)
    return {"ok": sum(s.error is None for s in sinks), "requests": len(sinks),
            "tokens": sum(len(s.ids) for s in sinks), "makespan_s": round(makespan, 3),
            "tokens_per_s": round(sum(len(s.ids) for s in sinks) / makespan, 3),
            "weighted_turnaround": round(statistics.mean(weighted), 4),
            "turnaround_s": round(statistics.mean(s.finished - s.sent for s in sinks), 3),
            "preemptions": {m: sum(p.mode == m for p in preemptions) for m in ("swap", "recompute")},
            "swap_bytes": metrics.swap_bytes, "recompute_tokens": metrics.recompute_tokens,
            "cost_error": {m: metrics.preemption_error(m) for m in ("swap", "recompute")},
            "cost_seconds": {m: {"predicted": round(c[1], 4), "actual": round(c[2], 4), "resumes": c[0]}
                             for m, c in metrics.preemption_costs.items()},
            "replies": [s.ids for s in sinks]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--kv-budget", default="16MiB", help="KV pool bytes (default 16MiB)")
    parser.add_argument("--swap-space", default="auto", help="host bytes for swapped KV (default auto)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second (default 4)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, rotated (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON result file (the PNG goes next to it)")


def run(args: argparse.Namespace, record: Results) -> int | None:
    bundle = open_bundle(Path(args.bundle), quiet=True)

    def settings(mode: str) -> ServeSettings:
        return ServeSettings(args.max_batch, 4 * args.requests, "off", args.kv_budget, args.swap_space, mode)

    engines, costs = {}, None
    for mode in MODES:
        engines[mode] = bundle.engine(settings(mode), report=log if costs is None else (lambda m: None))
        costs = costs or engines[mode].costs
        engines[mode].costs = costs  # one measurement for all three
    limit = engines["auto"].request_limit
    prompts = load_prompts(bundle.models().target.tokenizer, args.requests, args.seed, limit - args.max_tokens)
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    pool = engines["auto"].pool
    log(f"{len(prompts)} ShareGPT prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"rate {args.rate}/s, KV pool {pool.n_blocks} blocks x {pool.block_size} tokens")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for i in range(len(MODES)):
            mode = MODES[(i + repeat) % len(MODES)]
            engine = bundle.engine(settings(mode)) if repeat else engines[mode]
            engine.costs = costs
            result = run_stream(engine, prompts, arrivals, args.max_tokens)
            runs[mode].append(result)
            log(f"repeat {repeat + 1} {mode}: {result['tokens_per_s']} tok/s, weighted turnaround "
                f"{result['weighted_turnaround']}, preemptions {result['preemptions']}")
    report(args, runs, costs, pool, record)


def report(args, runs: dict[str, list[dict]], costs, pool, record: Results) -> None:
    reference = runs["recompute"][0]["replies"]
    equal = all(r["replies"] == reference for results in runs.values() for r in results)
    rows, summary = [], {}
    for mode, results in runs.items():
        mean = lambda key: statistics.mean(r[key] for r in results)  # noqa: E731
        errors = {m: [r["cost_error"][m] for r in results if r["cost_error"][m] is not None]
                  for m in ("swap", "recompute")}
        summary[mode] = {"tokens_per_s": round(mean("tokens_per_s"), 3),
                         "weighted_turnaround": round(mean("weighted_turnaround"), 4),
                         "turnaround_s": round(mean("turnaround_s"), 3),
                         "preemptions": {m: sum(r["preemptions"][m] for r in results) for m in ("swap", "recompute")},
                         "swap_bytes": sum(r["swap_bytes"] for r in results),
                         "recompute_tokens": sum(r["recompute_tokens"] for r in results),
                         "cost_error": {m: round(statistics.mean(v), 4) if v else None for m, v in errors.items()},
                         "ok": sum(r["ok"] for r in results), "requests": sum(r["requests"] for r in results)}
        s = summary[mode]
        rows.append([mode, f"{s['ok']}/{s['requests']}", s["tokens_per_s"], s["weighted_turnaround"],
                     s["turnaround_s"], s["preemptions"]["swap"], s["preemptions"]["recompute"],
                     round(s["swap_bytes"] / 2**20, 1), s["recompute_tokens"],
                     _pct(s["cost_error"]["swap"]), _pct(s["cost_error"]["recompute"])])
    print(format_table(["mode", "ok", "tok/s", "w. turnaround", "turnaround s", "swaps", "recomputes",
                        "swap MiB", "recompute tok", "swap cost err", "recomp. cost err"], rows))
    best_fixed = max(summary["swap"]["tokens_per_s"], summary["recompute"]["tokens_per_s"])
    print(f"replies equal across modes: {equal}; cost-aware throughput vs the better fixed mode: "
          f"{summary['auto']['tokens_per_s'] / best_fixed:.3f}x")
    result = {"bench": "memory", "bundle": args.bundle, "kv_budget": args.kv_budget,
              "pool_blocks": pool.n_blocks, "block_size": pool.block_size, "swap_space": args.swap_space,
              "requests": args.requests, "rate": args.rate, "max_tokens": args.max_tokens,
              "max_batch": args.max_batch, "repeats": args.repeats, "replies_equal_across_modes": equal,
              "costs": {"swap": vars(costs.swap), "prefill": vars(costs.prefill)}, "modes": summary,
              "env": environment(),
              "statistic": f"per mode: the mean over {args.repeats} runs of tokens/s and turnaround; counts summed"}
    if args.out:
        plot(summary, Path(args.out).with_suffix(".png"))
    record.write(result, args.out, bundle=Path(args.bundle))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def plot(summary: dict, path: Path) -> None:
    plt = plots.pyplot()

    modes = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in ((axes[0], "tokens_per_s", "throughput (tokens/s, higher is better)"),
                           (axes[1], "weighted_turnaround", "avg weighted turnaround (lower is better)")):
        bars = ax.bar(modes, [summary[m][key] for m in modes], color=["#999", "#69c", "#3a3"])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_title(label, fontsize=10)
    fig.suptitle("KV pressure: always-recompute vs always-swap vs cost-aware")
    plots.save(fig, path, dpi=120)
    log(f"wrote {path}")

