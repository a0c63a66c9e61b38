"""`yggdrasil bench`: argparse values -> BenchOptions -> yggdrasil.bench (which is not part of the
runtime an edge box needs, so it is imported only here)."""

from __future__ import annotations

from pathlib import Path

from .errors import InvalidRequestError


def _numbers(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"{what} must be comma-separated numbers, got {text!r}") from None


def run_bench_command(args) -> int:
    from yggdrasil.bench.harness import BenchOptions
    from yggdrasil.bench.run import run_bench

    options = BenchOptions(
        suite=args.suite, bundle=Path(args.bundle),  # open_bundle says what is wrong with a bad one
        prompts=tuple(p.strip() for p in args.prompts.split(",") if p.strip()),
        n=args.n, max_new_tokens=args.max_new_tokens, repeats=args.repeats, out=Path(args.out),
        temperatures=_numbers(args.temperatures, "--temperatures"),
        skip=tuple(s.strip() for s in args.skip.split(",") if s.strip()))
    return run_bench(options)
