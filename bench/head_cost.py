"""What the LM head costs per token (issue 39): a q4 model keeps its head at 6 bits or more (as the
GGUF stores it, Q6_K or Q8_0; 4-bit heads cost most of the 4-bit formats' agreement with fp32:
docs/cpu.md), and this measures that price. The head linear alone on one row against one eager decode step of the whole model, same
process, interleaved, medians of repeats; --tpot-ms divides by the bundle's own time per token too.

    yggdrasil bench head-cost --model qwen2.5-coder-1.5b [--tpot-ms 25.17] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from yggdrasil.models.loader import load
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.steps import StepRunner

from .common import environment, log, timed
from .provenance import Results

PROMPT = list(range(1000, 1064))  # 64 token ids: the steps attend over a short context
STEPS = 8  # decode steps per timed generation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="catalog model, loaded in q4")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="head calls per timed repeat")
    parser.add_argument("--tpot-ms", type=float, default=None,
                        help="the bundle's measured time per token, to state the head's share of it too")
    parser.add_argument("--out", default=None, help="also write the JSON here")


def run(args: argparse.Namespace, record: Results) -> int | None:
    model = load(args.model, quiet=True, weights="q4").model
    runner = StepRunner(model, 512, chunk_sizes=(64,))
    row = torch.randn(1, 1, model.config.dim)

    def head_calls() -> None:
        with torch.inference_mode():
            for _ in range(args.calls):
                model.output(row)

    def head_seconds() -> float:
        return timed(head_calls)[1] / args.calls

    def step_seconds() -> float:  # the prefill and first token cancel out
        full, first = (timed(greedy_tokens, runner, PROMPT, n)[1] for n in (STEPS + 1, 1))
        return (full - first) / STEPS

    for _ in range(3):  # warm-up
        head_seconds(), step_seconds()
    heads, steps = [], []
    for _ in range(args.repeats):
        heads.append(head_seconds())
        steps.append(step_seconds())
    head_ms, step_ms = statistics.median(heads) * 1e3, statistics.median(steps) * 1e3
    log(f"{args.model}: head ({type(model.output).__name__}) {head_ms:.3f} ms, eager decode step {step_ms:.3f} ms "
        f"({head_ms / step_ms:.1%})" + (f", {head_ms / args.tpot_ms:.1%} of {args.tpot_ms} ms per token"
                                         if args.tpot_ms else ""))
    record.write({"benchmark": "head_cost", "model": args.model, "weights": "q4", "head": type(model.output).__name__,
                  "head_ms": round(head_ms, 4), "eager_decode_step_ms": round(step_ms, 4),
                  "head_share_of_eager_step": round(head_ms / step_ms, 4),
                  "tpot_ms": args.tpot_ms,
                  "head_share_of_tpot": round(head_ms / args.tpot_ms, 4) if args.tpot_ms else None,
                  "environment": environment(),
                  "statistic": f"medians of {args.repeats} interleaved repeats: head = the mean of {args.calls} "
                               f"one-row calls; step = (greedy {STEPS + 1} tokens - greedy 1 token) / {STEPS}"},
                 args.out)
    return 0
