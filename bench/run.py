"""`yggdrasil bench SUITE`: a bundle suite opens the bundle and prompts once, runs and writes its
files; a measurement suite parses its own options and runs (bench/suites.py lists both)."""

from __future__ import annotations

import argparse
import importlib

from yggdrasil.errors import InvalidRequestError

from . import common, suite_ablation, suite_compare, suite_sensitivity, suite_trees
from .harness import BenchOptions, open_setup
from .provenance import Provenance, Results
from .suites import MEASUREMENTS, NAMES, Suite, command_line


def run_bench(options: BenchOptions, command: str | None = None) -> int:
    """Exit status 1 when any greedy row's output differed from autoregressive greedy. command:
    as typed, for the result's provenance."""

    suites = {"compare": suite_compare, "ablation": suite_ablation, "trees": suite_trees,
              "sensitivity": suite_sensitivity}
    common.set_threads(options.threads)
    setup = open_setup(options, Provenance.start(command))
    result = suites[options.suite].run(setup)
    invalid = [r["variant"] for r in result["rows"] if r.get("valid") is False]
    if invalid:
        common.log(f"INVALID rows (output differs from autoregressive greedy): {', '.join(invalid)}")
    return 1 if invalid else 0


def measurement_parser(suite: Suite):
    module = importlib.import_module(f"yggdrasil.bench.{suite.module}")
    parser = argparse.ArgumentParser(prog=f"yggdrasil bench {suite.name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    if "--threads" not in parser._option_string_actions:  # every suite takes it (the CLI's --threads)
        parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    return module, parser


def run_measurement(name: str, argv: list[str]) -> int:
    """`yggdrasil bench NAME ARGS` for a measurement suite; its exit status."""
    if name not in MEASUREMENTS:
        raise InvalidRequestError(f"unknown suite {name!r}: choose one of {', '.join(NAMES)}")
    module, parser = measurement_parser(MEASUREMENTS[name])
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    status = module.run(args, Results(Provenance.start(command_line(name, argv))))
    return int(status or 0)
