"""The command line (front end): one module per command with its parser, typed options and run
function; argparse only. The command modules import the runtime, the compiler and the
benchmarks inside their run functions, on purpose: torch takes seconds to import, and `--help`,
argument errors and a `yggdrasil chat` (which never needs the compiler) should not wait for what
they do not use. These are the only function-level imports of the package besides optional
dependencies (matplotlib, httpx, transformers), which say so where they are imported."""

from __future__ import annotations

import argparse
import atexit
import os
import sys

from yggdrasil import __version__
from yggdrasil.errors import YggdrasilError
from . import bench, calibrate, chat, compile, generate, inspect, models, plan, profile, serve
from .common import add_threads_arg, apply_threads

# the order `yggdrasil --help` lists them in
COMMANDS = {"generate": generate, "models": models, "profile": profile, "calibrate": calibrate,
            "compile": compile, "inspect": inspect, "chat": chat, "serve": serve, "bench": bench, "plan": plan}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` (the one argv names), the bench suites' parsers
    only when it is bench, so a bundle run never imports the bench layer (issue 50)."""
    parser = argparse.ArgumentParser(
        prog="yggdrasil",
        description="Static-graph runtime for latency-optimal tree-based speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"yggdrasil {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if module is bench and command not in (None, name):
            bench.add_stub(sub)
        else:
            module.add_parser(sub)
    for command in sub.choices.values():  # once here rather than in each command's parser
        add_threads_arg(command)
    return parser


def named_command(argv: list[str]) -> str | None:
    """The command argv names: its first word that is not an option (None for `--help` alone)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(named_command(argv))
    # a measurement suite of `bench` parses its own options (yggdrasil.bench.suites): they pass through
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra, args.argv = extra, argv
    try:
        apply_threads(args)
        return COMMANDS[args.command].main(args)
    except YggdrasilError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


# one-shot commands whose process ends when the reply is out: the interpreter's teardown after
# them (freeing torch's modules and the mapped weights) only delays the shell's prompt
LEAVE_WITHOUT_TEARDOWN = ("generate",)


def console(argv: list[str] | None = None) -> None:
    """The `yggdrasil` command (and `python -m yggdrasil.cli`): main(), then exit. After a
    one-shot command the process runs its exit handlers (a split bundle's ranks are stopped by
    one) and leaves without the interpreter's teardown: on the Qwen bundle, a Cascade Lake Xeon,
    that teardown took 0.7 s after the last token (0.93 s from the last token to exit, 0.25 s
    now; 3 runs each)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    code = main(argv)
    if named_command(argv) in LEAVE_WITHOUT_TEARDOWN:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()  # what sys.exit would run before the teardown (CPython's own hook)
        os._exit(code)
    sys.exit(code)


__all__ = ["COMMANDS", "build_parser", "console", "main"]
