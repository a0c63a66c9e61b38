"""`yggdrasil bench SUITE` and `yggdrasil bench reproduce RESULT.json`: argparse values ->
BenchOptions -> yggdrasil.bench (which is not part of the runtime an edge box needs, so it is
imported only when this command runs)."""

from __future__ import annotations

from pathlib import Path

from yggdrasil.errors import InvalidRequestError

from .common import names, numbers


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="evaluation suites: compare with peers, ablation, tree structures, sensitivity",
                           description="Run an evaluation suite on a bundle: a table on stdout ending with one JSON "
                                       "line, and SUITE.{txt,csv,json,md,png} in --out. Every greedy row's output is "
                                       "checked against autoregressive greedy (exit status 1 if any differs). "
                                       "`bench reproduce RESULT.json` re-runs the command a result file records, "
                                       "here, and prints its numbers beside the recorded ones.")
    bench.add_argument("suite", choices=("compare", "ablation", "trees", "sensitivity", "reproduce"),
                       help="compare: HF greedy/assisted, ours AR eager/compiled, chain, static tree, EGT; "
                            "ablation: O1 EGT .. O5 +depth predictor; trees: AAL and objective vs verify width; "
                            "sensitivity: TPOT over the (D, W, V) grid and at temperatures 0, 0.6, 1; "
                            "reproduce RESULT.json: run a result's recorded command again")
    bench.add_argument("result", nargs="?", help="reproduce: the result file (JSON) to re-run")
    bench.add_argument("--bundle", help="bundle directory from `yggdrasil compile` (suites; with reproduce: "
                                        "use this copy of the bundle the result names)")
    bench.add_argument("--other-machine", action="store_true",
                       help="reproduce: run a result measured on another CPU anyway (its ratios then mix machines)")
    bench.add_argument("--prompts", default="humaneval,mtbench",
                       help="comma-separated: humaneval, mtbench, sharegpt or FILE.jsonl (default humaneval,mtbench; "
                            "the built-in sets' held-out split, which calibration never saw)")
    bench.add_argument("--n", type=int, default=4, help="prompts per set (default 4)")
    bench.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    bench.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (default 1)")
    bench.add_argument("--temperatures", default="0,0.6,1.0", help="sensitivity: temperatures (default 0,0.6,1.0)")
    bench.add_argument("--skip", default="", help="rows to leave out, e.g. hf-assisted,sequoia (compare)")
    bench.add_argument("--out", default="bench-results", help="directory for the result files (default bench-results)")
    bench.add_argument("--llama-cpp", metavar="DIR", default=None,
                       help="compare: also run llama.cpp's llama-completion, llama-speculative-simple and "
                            "llama-lookup from this build directory (DIR, DIR/bin or DIR/build/bin) on the same "
                            "GGUF files, prompts, threads and token count; rows it cannot run are skipped with a note")


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

        if not args.result:
            raise InvalidRequestError("bench reproduce needs the result file: yggdrasil bench reproduce RESULT.json")
        return reproduce(Path(args.result), Path(args.bundle) if args.bundle else None, args.other_machine)
    if args.result:
        raise InvalidRequestError(f"bench {args.suite} takes no positional file (did you mean `bench reproduce {args.result}`?)")
    if not args.bundle:
        raise InvalidRequestError(f"bench {args.suite} needs --bundle DIR (a bundle from `yggdrasil compile`)")
    from yggdrasil.bench.run import run_bench

    return run_bench(options(args))
