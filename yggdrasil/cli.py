"""Command line: argparse only. Each subcommand hands a frozen options object to its logic."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import YggdrasilError

DEFAULT_MODEL = "smollm2-135m"


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0 = greedy (default); > 0 samples from the softened distribution")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus cut in (0, 1] (default 1)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    group.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def _add_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--spec", choices=("none", "chain", "static-tree", "egt"), default="none",
                       help="none (autoregressive, default), chain, static-tree (Sequoia-style) or "
                            "egt (Equal-Growth Tree)")
    group.add_argument("--draft", default="lookup",
                       help="draft model (catalog name, HF dir, .gguf) sharing the target's tokenizer, "
                            "or 'lookup' for model-free prompt lookup (default)")
    group.add_argument("--depth", type=int, default=4, help="draft tree depth D (default 4)")
    group.add_argument("--width", type=int, default=3, help="EGT draft width W (default 3)")
    group.add_argument("--verify", default=None,
                       help="allowed verify widths, e.g. 4,8 (default: the whole tree); the latency "
                            "objective picks one per iteration")
    group.add_argument("--tree-branching", default=None,
                       help="static tree: children per node at each depth, e.g. 3,2,1 (default W,2,1,...)")
    group.add_argument("--profile", default=None,
                       help="device profile from `yggdrasil profile` for the verify-width objective "
                            "(default: measure the allowed widths briefly at start)")
    group.add_argument("--auto", action="store_true",
                       help="egt: pick depth, width and verify width every iteration with the depth "
                            "predictor and the latency objective (needs --calibration)")
    group.add_argument("--calibration", default=None,
                       help="calibration directory from `yggdrasil calibrate` (for --auto)")
    group.add_argument("--tree-file", default=None,
                       help="static tree: JSON list of rank paths, e.g. [[0],[1],[0,0]]")


def _add_runtime_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("runtime")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    group.add_argument("--dtype", default=None,
                       help="float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on CUDA)")
    group.add_argument("--max-context", type=int, default=2048,
                       help="KV cache size in tokens, prompt + reply (default 2048)")
    group.add_argument("--chunk-size", type=int, default=None,
                       help="prefill chunk in tokens (default 64 on CPU, 256 on CUDA)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the fixed-shape prefill and decode steps")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yggdrasil",
        description="Static-graph runtime for latency-optimal tree-based speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"yggdrasil {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    gen.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"catalog name, HF directory or .gguf file (default {DEFAULT_MODEL})")
    gen.add_argument("--prompt", required=True, help="the prompt text ('-' reads it from stdin)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template as a user turn")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="reply length limit (default 128)")
    gen.add_argument("--no-stats", action="store_true", help="do not print the stats line on stderr")
    gen.add_argument("--trace", default=None, metavar="FILE",
                     help="write a Chrome/Perfetto trace (JSON) of every stage of every iteration")
    gen.add_argument("--bundle", default=None,
                     help="run from a bundle made by `yggdrasil compile`: its models, graphs, predictor "
                          "and bucket selection (no compiling at run time)")
    _add_spec_args(gen)
    _add_sampling_args(gen)
    _add_runtime_args(gen)

    sub.add_parser("models", help="list the offline default models and whether they are installed")

    prof = sub.add_parser("profile", help="measure step times of a target (and draft) on this device")
    prof.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})")
    prof.add_argument("--draft", default=None, help="draft model to profile too (same tokenizer)")
    prof.add_argument("--out", required=True, help="profile YAML to write (a PNG plot goes next to it)")
    prof.add_argument("--sizes", default="1,2,4,8,16,32", help="new-token counts n (default 1,2,4,8,16,32)")
    prof.add_argument("--contexts", default="128,512,1024",
                      help="cached context lengths for the eager points (default 128,512,1024)")
    prof.add_argument("--chunks", default="32,64,128", help="prefill chunk sizes (default 32,64,128)")
    prof.add_argument("--repeats", type=int, default=5, help="timed repeats per point (default 5)")
    prof.add_argument("--no-compile", action="store_true", help="measure eager steps only (faster)")
    prof.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    prof.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    _add_calibrate_parser(sub)
    comp = sub.add_parser("compile", help="compile a recipe ahead of time into a graph bundle")
    comp.add_argument("recipe", help="recipe YAML (shipped ones are in recipes/)")
    comp.add_argument("--out", default=None, help="bundle directory (default: the user cache dir)")
    comp.add_argument("--force", action="store_true",
                      help="rebuild the bundle even if it is up to date (cached work is still reused)")
    insp = sub.add_parser("inspect", help="print what a bundle holds")
    insp.add_argument("bundle", help="bundle directory")
    _add_chat_parser(sub)
    _add_serve_parser(sub)
    _add_bench_parser(sub)
    plan = sub.add_parser("plan", help="show the stage plans (ahead-of-time drafts, overlap) of a bundle's buckets")
    plan.add_argument("--show", required=True, metavar="BUNDLE", help="bundle directory")
    plan.add_argument("--out", default="plans.png", help="Gantt chart PNG to write (default plans.png)")
    plan.add_argument("--top", type=int, default=4, help="how many of the most picked buckets (default 4)")
    return parser


def _add_chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="chat with a bundle: streaming, multi-turn with KV reuse",
                          description="Chat with a bundle. On a terminal: type a message, Ctrl-C stops "
                                      "a reply, Ctrl-D or /exit quits, /help lists commands. Otherwise "
                                      "each stdin line is a turn (or command) and replies go to stdout.")
    chat.add_argument("bundle", nargs="?", default=None,
                      help="bundle directory from `yggdrasil compile` (default: this machine's default "
                           "bundle, compiled once into the user cache dir)")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--max-new-tokens", type=int, default=512, help="reply length limit (default 512)")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chat.add_argument("--top-p", type=float, default=1.0, help="nucleus cut in (0, 1] (default 1)")
    chat.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    chat.add_argument("--trace", default=None, metavar="FILE",
                      help="write a Chrome/Perfetto trace (JSON) of the session's stages on exit")


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API",
                           description="Serve a bundle to a few concurrent clients: POST /v1/chat/completions "
                                       "and /v1/completions (streaming or not), GET /v1/models, /health and "
                                       "/metrics. Requests are batched per step with chunked prefill; "
                                       "speculation follows the load.")
    serve.add_argument("bundle", help="bundle directory from `yggdrasil compile`")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1, this machine only; 0.0.0.0 opens it to the LAN)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--max-batch", type=int, default=4, help="requests decoded together (default 4)")
    serve.add_argument("--max-queue", type=int, default=16,
                       help="requests that may wait for a batch slot; beyond it clients get 429 (default 16)")
    serve.add_argument("--speculation", default="goodput",
                       help="goodput (pick the speculation length per step for the load, default), "
                            "off, or fixed:K (always K draft tokens)")
    serve.add_argument("--kv-budget", default="auto",
                       help="bytes for the KV cache pool, e.g. 512MiB or 2GiB; past it requests are preempted "
                            "(auto: what the device has free, up to max-batch full contexts)")
    serve.add_argument("--swap-space", default="auto",
                       help="host bytes for the KV of preempted requests, e.g. 1GiB; 0 never swaps "
                            "(auto: a quarter of the free host memory)")
    serve.add_argument("--preemption", default="auto", choices=("auto", "swap", "recompute"),
                       help="how requests give up KV memory: auto picks the cheaper of swap and recompute "
                            "by measured cost (default auto)")
    serve.add_argument("--eager", action="store_true",
                       help="run eager forwards instead of the bundle's compiled serve graphs (for comparison)")
    serve.add_argument("--model-name", default=None, help="model id clients use (default: the recipe name)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="server log level (default info)")


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="evaluation suites: compare with peers, ablation, tree structures, sensitivity",
                           description="Run an evaluation suite on a bundle: a table on stdout ending with one JSON "
                                       "line, and SUITE.{txt,csv,json,md,png} in --out. Every greedy row's output is "
                                       "checked against autoregressive greedy (exit status 1 if any differs).")
    bench.add_argument("suite", choices=("compare", "ablation", "trees", "sensitivity"),
                       help="compare: HF greedy/assisted, ours AR eager/compiled, chain, static tree, EGT; "
                            "ablation: O1 EGT .. O5 +depth predictor; trees: AAL and objective vs verify width; "
                            "sensitivity: TPOT over the (D, W, V) grid and at temperatures 0, 0.6, 1")
    bench.add_argument("--bundle", required=True, help="bundle directory from `yggdrasil compile`")
    bench.add_argument("--prompts", default="humaneval,mtbench",
                       help="comma-separated: humaneval, mtbench, sharegpt or FILE.jsonl (default humaneval,mtbench; "
                            "the built-in sets' held-out split, which calibration never saw)")
    bench.add_argument("--n", type=int, default=4, help="prompts per set (default 4)")
    bench.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    bench.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (default 1)")
    bench.add_argument("--temperatures", default="0,0.6,1.0", help="sensitivity: temperatures (default 0,0.6,1.0)")
    bench.add_argument("--skip", default="", help="rows to leave out, e.g. hf-assisted,sequoia (compare)")
    bench.add_argument("--out", default="bench-results", help="directory for the result files (default bench-results)")


def _add_calibrate_parser(sub) -> None:
    cal = sub.add_parser("calibrate", help="run deep EGT over prompts, train the depth predictor, "
                                           "write the calibration directory for --spec egt --auto")
    cal.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})")
    cal.add_argument("--draft", default="lookup", help="draft model sharing the tokenizer, or lookup")
    cal.add_argument("--prompts", default="humaneval,mtbench",
                     help="comma-separated prompt sets: humaneval, mtbench, sharegpt or FILE.jsonl "
                          '(lines {"prompt": ...} or {"chat": ...}); the calibration split is used '
                          "(default humaneval,mtbench)")
    cal.add_argument("--num-prompts", type=int, default=24, help="prompts per set (default 24)")
    cal.add_argument("--max-new-tokens", type=int, default=64, help="reply length per prompt (default 64)")
    cal.add_argument("--depths", default="1,2,3,4,5,6", help="draft depths of the grid (default 1..6)")
    cal.add_argument("--widths", default="1,2,4", help="draft widths of the grid (default 1,2,4)")
    cal.add_argument("--verify", default="1,2,4,8,16,32", help="verify widths (default 1,2,4,8,16,32)")
    cal.add_argument("--profile", default=None,
                     help="device profile from `yggdrasil profile` (default: measure eager step times here)")
    cal.add_argument("--out", required=True, help="directory to write (created if missing)")
    cal.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    cal.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    cal.add_argument("--reuse", action="store_true",
                     help="keep the iterations already recorded in --out (same models and grid) and "
                          "only retrain the predictor, with --profile's latency if given")
    cal.add_argument("--max-context", type=int, default=2048,
                     help="cache size; longer prompts are skipped (default 2048)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            from .commands import GenerateOptions, run_generate

            return run_generate(GenerateOptions.from_args(args))
        if args.command == "profile":
            from .commands import ProfileOptions, run_profile

            return run_profile(ProfileOptions.from_args(args))
        if args.command == "calibrate":
            from .calibrate_cmd import CalibrateOptions, run_calibrate

            return run_calibrate(CalibrateOptions.from_args(args))
        if args.command == "compile":
            from .bundle_cmd import run_compile

            return run_compile(args.recipe, args.out, args.force)
        if args.command == "inspect":
            from .bundle_cmd import run_inspect

            return run_inspect(args.bundle)
        if args.command == "chat":
            from . import IMPORTED_AT
            from .chat_cmd import ChatOptions, run_chat

            return run_chat(ChatOptions.from_args(args), IMPORTED_AT)
        if args.command == "serve":
            from .serve_cmd import ServeOptions, run_serve

            return run_serve(ServeOptions.from_args(args))
        if args.command == "bench":
            from .bench_cmd import run_bench_command

            return run_bench_command(args)
        if args.command == "plan":
            from .plan_cmd import run_plan_show

            return run_plan_show(args.show, args.out, args.top)
        if args.command == "models":
            from .commands import run_models

            return run_models()
    except YggdrasilError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
