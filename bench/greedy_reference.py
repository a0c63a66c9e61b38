"""The formats phase's fp32 reference two ways, side by side in one process (issue 37):

    yggdrasil bench greedy-reference RECIPE [--repeats 1] [--out FILE]

`sequential`: each calibration prompt's greedy continuation decoded alone, one token per forward
(generate.greedy_tokens, what compile did before), plus the teacher-forced pass over each
continuation that recomputed fp32's argmax; `packed`: every prompt in the same forwards
(compile/greedy_path.py), whose tokens are the argmax. Reports wall seconds of each (median over
--repeats), whether the continuations are identical, and at how many positions the
teacher-forced argmax differs from the packed continuation. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from yggdrasil.compile.format_quality import reference_jobs, sequence_logits
from yggdrasil.compile.context import load_context
from yggdrasil.compile.greedy_path import greedy_paths
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.steps import StepRunner

from .common import environment, log, timed
from .provenance import Results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)


def run(args: argparse.Namespace, record: Results) -> int | None:
    recipe = load_recipe(args.recipe)
    with tempfile.TemporaryDirectory(prefix="ygg-reference-") as scratch:  # load_context makes a work dir there
        result = measure(load_context(recipe, Path(scratch) / "bundle", log), args)
    log(f"{args.recipe}: sequential {result['sequential_seconds']} s + teacher-forced {result['teacher_forced_seconds']} s "
        f"vs packed {result['packed_seconds']} s; identical {result['identical_continuations']}/{result['prompts']}; "
        f"argmax differs at {result['argmax_differs_at']}/{result['positions']}")
    record.write(result, args.out)
    return 0


def measure(ctx, args) -> dict:
    recipe = ctx.recipe
    model = ctx.target.model
    runner = StepRunner(model, recipe.max_context, chunk_sizes=recipe.buckets.prefill_chunks)
    work = reference_jobs(ctx)
    prompts, counts = [p for p, _ in work], [n for _, n in work]
    greedy_tokens(runner, prompts[0], 2)  # first-call warm-up for both ways
    greedy_paths(model, prompts[:1], [2], runner.chunk_size)
    sequential, teacher, packed = [], [], []
    for _ in range(args.repeats):
        old, seconds = timed(lambda: [greedy_tokens(runner, p, n) for p, n in work])
        sequential.append(seconds)
        argmax, seconds = timed(lambda: [sequence_logits(runner, p + c[:-1])[len(p) - 1:].argmax(-1).tolist()
                                         for p, c in zip(prompts, old)])
        teacher.append(seconds)
        new, seconds = timed(lambda: greedy_paths(model, prompts, counts, runner.chunk_size))
        packed.append(seconds)
    return {"environment": environment(), "recipe": str(args.recipe),
              "statistic": f"median wall seconds over {args.repeats} repeat(s), the ways interleaved",
              "prompts": len(work), "positions": sum(counts),
              "sequential_seconds": round(statistics.median(sequential), 2),
              "teacher_forced_seconds": round(statistics.median(teacher), 2),
              "packed_seconds": round(statistics.median(packed), 2),
              "identical_continuations": sum(a == b for a, b in zip(old, new)),
              "argmax_differs_at": sum(a != b for am, c in zip(argmax, new) for a, b in zip(am, c))}

