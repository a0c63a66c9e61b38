"""What batch invariance costs per step (issue 40): the same q4 model's decode and verify steps
with yggdrasil's fixed-order RMSNorm, attention, SiLU-times-up and rope tables, and with torch's
own (F.rms_norm-style RMSNorm, SDPA, F.silu, rope computed per call), toggled on one loaded model and timed
interleaved (repeat -> mode, the order alternating), eager.

    yggdrasil bench invariance-cost --model qwen2.5-coder-1.5b [--context 320]
        [--widths 1,4,16] [--steps 20] [--repeats 5] [--threads N] [--out FILE]

The linears are the q4 kernel in both modes; only the float ops around them change. Eager step
times include Python overhead the compiled graphs do not have, so the table gives the absolute
difference per step (ms) as well as the ratio; divide the difference by the bundle's compiled
step time to get the share of a compiled step. Statistic: median over repeats of the mean step
time of `steps` back-to-back steps. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from yggdrasil.errors import InvalidRequestError
from yggdrasil.models.loader import load
from yggdrasil.models.model import Attention, FeedForward, RMSNorm
from yggdrasil.runtime.steps import StepRunner, verify_inputs
from yggdrasil.runtime.tree import TokenTree

from .common import environment, format_table, set_threads, timed
from .provenance import Results


def set_invariant(model, on: bool, tables) -> None:
    """Switch the model's float ops between the fixed-order kernels and torch's own."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, FeedForward)):
            module.invariant = on
    model.rope_cos, model.rope_sin = tables if on else (None, None)


def step_seconds(runner: StepRunner, ids: list[int], width: int, steps: int) -> float:
    """Mean seconds of one step of `width` rows (1: decode) after the prompt, over `steps` steps
    that rewrite the same slots."""
    base = len(ids) - width
    runner.prefill(ids[:base])
    if width == 1:
        run = lambda: runner.decode(ids[base], base)  # noqa: E731
    else:
        tree = TokenTree.from_lists(ids[base:], [-1] + list(range(width - 1)), [0.0] * width)
        inputs = verify_inputs(runner, tree, torch.arange(width), base, width)
        run = lambda: runner.run(inputs, key="verify")  # noqa: E731
    with torch.inference_mode():
        run()  # warm
        return timed(lambda: [run() for _ in range(steps)])[1] / steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--context", type=int, default=320, help="tokens before the step (default 320)")
    parser.add_argument("--widths", default="1,4,16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = set_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    loaded = load(args.model, quiet=True, weights="q4")
    model = loaded.model
    if not model.batch_invariant:
        raise InvalidRequestError(f"{args.model} in q4 does not use the batch-invariant ops here (they need float32 "
                         "activations and a head size that is a multiple of 16, 16..256); pick a model that "
                         "fits, e.g. --model smollm2-135m")
    tables = (model.rope_cos, model.rope_sin)
    runner = StepRunner(model, args.context + max(widths) + 8, chunk_sizes=(64,))
    ids = (list(range(1000, 1000 + args.context + max(widths))))
    times = {(mode, w): [] for mode in ("invariant", "torch") for w in widths}
    for r in range(args.repeats):
        for mode in (("invariant", "torch") if r % 2 == 0 else ("torch", "invariant")):
            set_invariant(model, mode == "invariant", tables)
            for w in widths:
                times[(mode, w)].append(step_seconds(runner, ids[:args.context + w], w, args.steps))
    set_invariant(model, True, tables)
    rows, numbers = [], {}
    for w in widths:
        inv, ref = statistics.median(times[("invariant", w)]), statistics.median(times[("torch", w)])
        numbers[w] = {"invariant_ms": inv * 1e3, "torch_ms": ref * 1e3, "difference_ms": (inv - ref) * 1e3,
                      "ratio": inv / ref}
        rows.append([w, f"{inv * 1e3:.2f}", f"{ref * 1e3:.2f}", f"{(inv - ref) * 1e3:+.2f}", f"{inv / ref:.3f}"])
    print(format_table(["rows", "invariant ms", "torch ops ms", "difference ms", "ratio"], rows))
    record.write({"benchmark": "invariance_cost", "environment": environment(threads=threads),
                  "model": args.model, "weights": "q4", "context": args.context, "mode": "eager",
                  "statistic": f"median over {args.repeats} repeats of the mean of {args.steps} steps; ratio: "
                               "of those medians",
                  "steps": numbers}, args.out)

