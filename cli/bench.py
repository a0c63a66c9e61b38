"""`yggdrasil bench SUITE` and `yggdrasil bench reproduce RESULT.json`: argparse values ->
BenchOptions -> yggdrasil.bench (which is not part of the runtime an edge box needs, so its
benchmarks are imported only when this command runs; the parsers come from its suite table,
which imports nothing heavy)."""

from __future__ import annotations

import shlex
from pathlib import Path

from .common import names, numbers

HELP = "benchmark suites: compare with peers, ablation, kernels, compile time, serving, ..."


def add_stub(sub) -> None:
    """`bench` in the command list only: another command's run never imports the bench layer."""
    sub.add_parser("bench", help=HELP)


def add_parser(sub) -> None:
    # the table only (no torch, for --help), and only when the command is bench (cli.build_parser)
    from yggdrasil.bench.suites import BUNDLE_SUITES, MEASUREMENT_SUITES

    bench = sub.add_parser("bench", help=HELP,
                           description="Run a benchmark suite. Bundle suites (compare, ablation, trees, sensitivity) "
                                       "time generation on a bundle: a table on stdout ending with one JSON line, and "
                                       "SUITE.{txt,csv,json,md,png} in --out; every greedy row's output is checked "
                                       "against autoregressive greedy (exit status 1 if any differs). Measurement "
                                       "suites take their own options (`yggdrasil bench kernels --help`). Every result "
                                       "records its provenance (commit, command, CPU, machine load before and after). "
                                       "`bench reproduce RESULT.json` re-runs the command a result file records, here, "
                                       "and prints its numbers beside the recorded ones.")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, summary in BUNDLE_SUITES.items():
        _bundle_suite(suites.add_parser(name, help=summary))
    for suite in MEASUREMENT_SUITES:  # each parses its own options in yggdrasil.bench.run (they import torch)
        suites.add_parser(suite.name, add_help=False, help=f"{suite.summary} (options: --help)"
                          ).set_defaults(passes_through=True)
    again = suites.add_parser("reproduce", help="run the command a result file records again, old and new side by side")
    again.add_argument("result", help="the result file (JSON) to re-run")
    again.add_argument("--bundle", help="use this copy of the bundle the result names")
    again.add_argument("--rebuild", action="store_true",
                       help="when the bundle the result names is not here, compile it from the result's recipe first")
    again.add_argument("--other-machine", action="store_true",
                       help="run a result measured on another CPU anyway (its ratios then mix machines)")


def _bundle_suite(parser) -> None:
    from .common import add_threads_arg

    parser.add_argument("--bundle", required=True, help="bundle directory from `yggdrasil compile`")
    parser.add_argument("--prompts", default="humaneval,mtbench",
                        help="comma-separated: humaneval, mtbench, sharegpt or FILE.jsonl (default humaneval,mtbench; "
                             "the built-in sets' held-out split, which calibration never saw)")
    parser.add_argument("--n", type=int, default=4, help="prompts per set (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (default 1)")
    parser.add_argument("--temperatures", default="0,0.6,1.0", help="sensitivity: temperatures (default 0,0.6,1.0)")
    parser.add_argument("--skip", default="", help="rows to leave out, e.g. hf-assisted,sequoia (compare)")
    parser.add_argument("--out", default="bench-results", help="directory for the result files (default bench-results)")
    parser.add_argument("--llama-cpp", metavar="DIR", default=None,
                        help="compare: also run llama.cpp's llama-completion, llama-speculative-simple and "
                             "llama-lookup from this build directory (DIR, DIR/bin or DIR/build/bin) on the same "
                             "GGUF files, prompts, threads and token count; rows it cannot run are skipped with a note")
    add_threads_arg(parser)


def options(args):
    from yggdrasil.bench.harness import BenchOptions

    return BenchOptions(
        suite=args.suite, bundle=Path(args.bundle),  # open_bundle says what is wrong with a bad one
        prompts=names(args.prompts), n=args.n, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
        out=Path(args.out), temperatures=numbers(args.temperatures, "--temperatures"), skip=names(args.skip),
        llama_cpp=Path(args.llama_cpp).expanduser() if args.llama_cpp else None, threads=args.threads)


def main(args) -> int:
    if args.suite == "reproduce":
        from yggdrasil.bench.reproduce import reproduce

        return reproduce(Path(args.result), Path(args.bundle) if args.bundle else None, args.other_machine,
                         rebuild=args.rebuild)
    if getattr(args, "passes_through", False):
        from yggdrasil.bench.run import run_measurement

        return run_measurement(args.suite, list(args.extra))
    from yggdrasil.bench.run import run_bench

    return run_bench(options(args), command_line(args))


def command_line(args) -> str | None:
    """The command as typed, for the result's provenance (None: not from the command line)."""
    argv = getattr(args, "argv", None)
    return shlex.join(["yggdrasil", *argv]) if argv else None
