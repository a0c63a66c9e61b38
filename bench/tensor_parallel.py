"""What tensor parallelism costs per token on one CPU box (issue 55): the target's eager decode
step split over 2 gloo ranks of 1 thread each, against the whole model in 1 rank of 2 threads and
of 1 thread, interleaved in one run (the ranks stay up, idle in their broadcast, while the whole
model runs). The difference is what the split adds per token: 2 all-reduces per layer, one
all-gather of the logits, the step's broadcast to the other rank, and 1-thread GEMMs; the greedy
tokens of both are compared too, and the largest difference of a prompt's last logits (split
sums run in another order: bitwise equal only by chance).

    yggdrasil bench tensor-parallel [--model smollm2-135m] [--weights q4] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from yggdrasil.models.loader import load
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.ranks import start_ranks
from yggdrasil.runtime.steps import StepRunner

from .common import environment, log
from .provenance import Results

PROMPT = list(range(1000, 1064))  # 64 token ids: the steps attend over a short context


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="catalog model or path")
    parser.add_argument("--weights", default="q4", help="its weight format (one that shards)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per timed generation")
    parser.add_argument("--repeats", type=int, default=7)
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


def run(args: argparse.Namespace, record: Results) -> int | None:
    whole = StepRunner(load_model(args.model, args.weights), 256, chunk_sizes=(64,))
    shard_model = load_model(args.model, args.weights)
    leader = start_ranks(shard_model, functools.partial(load_model, args.model, args.weights), 2, threads=1)
    try:
        split = StepRunner(shard_model, 256, chunk_sizes=(64,))
        rows = {"1 rank x 2 threads": (whole, 2), "1 rank x 1 thread": (whole, 1), "2 ranks x 1 thread": (split, 1)}
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
                  "environment": environment(),
                  "statistic": f"medians of {args.repeats} interleaved repeats (after one warm-up round) of "
                               f"(greedy {args.tokens + 1} tokens - greedy 1 token) / {args.tokens}, eager steps"},
                 args.out)
    return 0
