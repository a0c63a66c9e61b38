"""What tensor parallelism costs per token on one CPU box (issue 55): the target's eager decode
step split over 2 gloo ranks of 1 thread each, against the whole model in 1 rank of 2 threads and
of 1 thread, interleaved in one run (the ranks stay up, idle in their broadcast, while the whole
model runs). The difference is what the split adds per token: 2 all-reduces per layer, one
all-gather of the logits, the step's broadcast to the other rank, and 1-thread GEMMs; the greedy
tokens of both are compared too, and the largest difference of a prompt's last logits (split
sums run in another order: bitwise equal only by chance).

With --graphs (the default) the same steps also run on compiled graphs, as bundles run them:
each rank's decode and 64-row prefill packages, built by compile's own rank processes
(compile/rank_graphs.py, which checks them against the eager split steps), and the whole
model's, exported here; both in rows of their own in the same interleaved rounds.

    yggdrasil bench tensor-parallel [--model smollm2-135m] [--weights q4] [--no-graphs] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from yggdrasil.buckets import GraphKey
from yggdrasil.compile.rank_graphs import RankSets, package_rank_graphs
from yggdrasil.graphs.aoti import export_step
from yggdrasil.graphs.isa import NATIVE
from yggdrasil.models.loader import load
from yggdrasil.runtime.deployed import save_deployed
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.ranks import load_bundle_graphs, start_ranks
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.registry import load_graph_set

from .common import environment, log
from .provenance import Results

PROMPT = list(range(1000, 1064))  # 64 token ids: the steps attend over a short context
CONTEXT = 256
GRAPHS = (GraphKey("prefill", 64).name, GraphKey("decode", 1).name)  # what per_token's steps run
WHY = "`yggdrasil bench tensor-parallel`"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="catalog model or path")
    parser.add_argument("--weights", default="q4", help="its weight format (one that shards)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per timed generation")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="also run both on compiled graphs (compiled first: a few minutes)")
    parser.add_argument("--out", default=None, help="also write the JSON here")


def load_model(model: str, weights: str) -> torch.nn.Module:
    """The whole target (module level: the spawned rank unpickles it by name)."""
    loaded = load(model, quiet=True, weights=weights).model
    if weights == "q4":
        loaded.use_batch_invariant_ops()
    return loaded


def per_token(runner: StepRunner, threads: int, tokens: int) -> tuple[float, list[int]]:
    """Seconds per decode step: (greedy tokens+1 - greedy 1) / tokens, on `threads` threads."""
    prompt = [t % runner.model.config.vocab_size for t in PROMPT]
    torch.set_num_threads(threads)
    started = time.perf_counter()
    out = greedy_tokens(runner, prompt, tokens + 1)
    full = time.perf_counter() - started
    started = time.perf_counter()
    greedy_tokens(runner, prompt, 1)
    return (full - (time.perf_counter() - started)) / tokens, out


def package_split(args: argparse.Namespace, folder: Path) -> dict:
    """Each rank's GRAPHS, compiled into folder by compile's rank processes (which then check
    them against the eager split steps); their record: seconds and the check."""
    loaded = load(args.model, quiet=True, weights=args.weights)
    if args.weights == "q4":
        loaded.model.use_batch_invariant_ops()
    save_deployed(folder / "deployed", {"target": loaded})
    prompt = tuple(t % loaded.model.config.vocab_size for t in PROMPT)
    sets = RankSets(str(folder / "deployed"), str(folder), GRAPHS, CONTEXT, True, NATIVE, (64,),
                    (prompt[:16], prompt), WHY, "the suite's graphs")
    started = time.perf_counter()
    check = package_rank_graphs(sets, 2, {0: list(GRAPHS), 1: list(GRAPHS)},
                                lambda rank, name, seconds: log(f"rank {rank}: {name} compiled in {seconds:.0f} s"))
    log(f"split graphs: {check['greedy']}")
    return {"compile_seconds": round(time.perf_counter() - started, 1), "check": check["greedy"]}


def package_whole(model: torch.nn.Module, folder: Path):
    """The whole model's GRAPHS exported and packaged in this process as compile does, then
    loaded over the cache a bundle sets up (which the eager runner made after shares)."""
    model.setup_cache(1, CONTEXT)
    for name in GRAPHS:
        seconds = export_step(model, GraphKey.parse(name), CONTEXT, BundleLayout(folder).graph_named("target", name),
                              True)
        log(f"whole: {name} compiled in {seconds:.0f} s")
    model.setup_cache(1, CONTEXT, stacked=True)
    return load_graph_set(folder, "target", model, list(GRAPHS), WHY, "the suite's graphs")


def run(args: argparse.Namespace, record: Results) -> int | None:
    with tempfile.TemporaryDirectory(prefix="yggdrasil-tp-bench-") as folder:
        return measure(args, record, Path(folder))


def measure(args: argparse.Namespace, record: Results, folder: Path) -> int | None:
    whole_model = load_model(args.model, args.weights)
    graphs, whole_graphs = {}, None
    if args.graphs:
        graphs["split"] = package_split(args, folder / "split")
        started = time.perf_counter()
        whole_graphs = StepRunner(whole_model, CONTEXT, chunk_sizes=(64,), graphs=package_whole(whole_model, folder))
        graphs["whole_seconds"] = round(time.perf_counter() - started, 1)
    whole = StepRunner(whole_model, CONTEXT, chunk_sizes=(64,))
    load_graphs = (functools.partial(load_bundle_graphs, str(folder / "split"), GRAPHS, WHY, "the suite's graphs")
                   if args.graphs else None)
    shard_model = load_model(args.model, args.weights)
    leader = start_ranks(shard_model, functools.partial(load_model, args.model, args.weights), 2, threads=1,
                         load_graphs=load_graphs)
    try:
        rows = {"1 rank x 2 threads": (whole, 2), "1 rank x 1 thread": (whole, 1)}
        if args.graphs:  # rank 0's set first: it binds the cache the eager split runner then shares
            shard_model.setup_cache(1, CONTEXT, stacked=True)
            split_set = load_graphs(shard_model, 0)
            leader.mirror_graphs(split_set)
            rows["1 rank x 2 threads, compiled"] = (whole_graphs, 2)
            rows["2 ranks x 1 thread, compiled"] = (StepRunner(shard_model, CONTEXT, chunk_sizes=(64,),
                                                               graphs=split_set), 1)
        split = StepRunner(shard_model, CONTEXT, chunk_sizes=(64,))
        rows["2 ranks x 1 thread"] = (split, 1)
        times: dict[str, list[float]] = {name: [] for name in rows}
        tokens: dict[str, list[int]] = {}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, (runner, threads) in rows.items():
                seconds, tokens[name] = per_token(runner, threads, args.tokens)
                if repeat:
                    times[name].append(seconds)
        torch.set_num_threads(1)
        prompt = [t % whole.model.config.vocab_size for t in PROMPT]
        gap = (whole.prefill(prompt) - split.prefill(prompt)).abs().max().item()  # the last row's logits
    finally:
        leader.close()
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    for name, value in ms.items():
        log(f"{args.model} ({args.weights}) {name}: {value:.3f} ms per token")
    split_cost = ms["2 ranks x 1 thread"] - ms["1 rank x 2 threads"]
    log(f"2 ranks x 1 thread costs {split_cost:+.3f} ms per token against 1 rank x 2 threads "
        f"({ms['2 ranks x 1 thread'] / ms['1 rank x 2 threads']:.2f}x)")
    cfg = whole.model.config
    record.write({"benchmark": "tensor_parallel", "model": args.model, "weights": args.weights,
                  "layers": cfg.n_layers, "collectives_per_token": {"all_reduce": 2 * cfg.n_layers, "all_gather": 1},
                  "ms_per_token": {name: round(value, 4) for name, value in ms.items()},
                  "split_minus_two_threads_ms": round(split_cost, 4),
                  "split_over_two_threads": round(ms["2 ranks x 1 thread"] / ms["1 rank x 2 threads"], 4),
                  "prefill_logits_max_abs_difference": gap,
                  "greedy_equal": {name: tokens[name] == tokens["1 rank x 2 threads"] for name in tokens},
                  **({"graphs": {"compiled": list(GRAPHS), "split_compile_seconds": graphs["split"]["compile_seconds"],
                                 "split_check": graphs["split"]["check"],
                                 "whole_compile_seconds": graphs["whole_seconds"]}} if graphs else {}),
                  "environment": environment(),
                  "statistic": f"medians of {args.repeats} interleaved repeats (after one warm-up round) of "
                               f"(greedy {args.tokens + 1} tokens - greedy 1 token) / {args.tokens}; eager steps, "
                               "and compiled ones in the rows that say so"},
                 args.out)
    return 0
