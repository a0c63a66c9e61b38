"""Every benchmark is a suite of `yggdrasil bench` (issue 39), and this table is the one list.

Two kinds share one runner and one way of writing results:
  * bundle suites (compare, ablation, trees, sensitivity) time generation on a compiled bundle
    through the shared harness (bench/harness.py): options in BenchOptions, rows checked against
    autoregressive greedy, SUITE.{txt,csv,json,md,png} in --out;
  * measurement suites (kernels, formats, serve, ...) each take their own options: the module
    named here has `add_arguments(parser)` and `run(args, results)`, and writes what it measured
    through `results.write(result, path)`.

Either way the result file gets the same provenance block (bench/provenance.py: commit, command,
CPU, torch, bundle, the machine's state before and after) and must name its statistic.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
from dataclasses import dataclass
from pathlib import Path

from yggdrasil.errors import InvalidRequestError

from . import common
from .provenance import Provenance


@dataclass(frozen=True)
class Suite:
    name: str
    module: str  # yggdrasil.bench.<module>
    summary: str


BUNDLE_SUITES = {
    "compare": "ours vs HF greedy/assisted, compiled AR, chain, static tree, EGT (and llama.cpp with --llama-cpp)",
    "ablation": "O1 EGT .. O5 +depth predictor, each step's speed-up and a one-sided never-slower test",
    "trees": "AAL and the objective against verify width; EGT's best shape against the chain",
    "sensitivity": "TPOT over the (D, W, V) grid and at temperatures 0, 0.6, 1",
}
MEASUREMENT_SUITES = tuple(Suite(*row) for row in (
    ("kernels", "kernels", "T(n) per weight format and model shape (AOTInductor step, symbolic rows)"),
    ("gemm-rows", "gemm_rows", "one linear's cost against rows for each CPU weight kernel, weights from memory"),
    ("attention-rows", "attention_rows", "batch-invariant attention and RMSNorm against PyTorch's"),
    ("invariance-cost", "invariance_cost", "what batch invariance costs per decode/verify step"),
    ("shim-overhead", "shim_overhead", "a graph calling our kernel through the C shim vs the ProxyExecutor"),
    ("head-cost", "head_cost", "the 8-bit LM head's time per token in a q4 model"),
    ("formats", "formats", "a recipe compiled in each weight format: step times, TPOT, agreement"),
    ("decode", "decode", "plain decoding: ours eager vs compiled vs HF transformers on the same weights"),
    ("spec", "spec", "speculative variants (chain, EGT, lookup, static) on one target, eager or compiled"),
    ("portable", "portable", "native against portable-ISA bundles of one recipe, interleaved"),
    ("cold-compile", "cold_compile", "a cold `yggdrasil compile`, phase by phase, and what it chose"),
    ("greedy-reference", "greedy_reference", "the formats phase's fp32 reference: sequential vs packed"),
    ("bundle", "bundle", "bundle size, cold compile, fresh-process first token and TPOT per recipe"),
    ("startup", "startup", "launch to first token of `generate --bundle`, phase by phase"),
    ("planner", "planner", "stage plans: predicted against measured iteration time"),
    ("serve", "serve", "`yggdrasil serve` under load: no, fixed and goodput speculation"),
    ("serve-graph", "serve_graph", "one serving forward: serve graph vs eager vs fixed-row step graph"),
    ("memory", "memory", "KV preemption under one budget: recompute, swap, cost-aware"),
    ("llama-cpp", "llama_cpp", "llama.cpp alone on a bundle's GGUF files (compare --llama-cpp runs it as peer rows)"),
))
MEASUREMENTS = {s.name: s for s in MEASUREMENT_SUITES}
NAMES = (*BUNDLE_SUITES, *MEASUREMENTS)


def command_line(suite: str, argv: list[str]) -> str:
    """The command as a person types it (recorded, and what `bench reproduce` runs again)."""
    return shlex.join(["yggdrasil", "bench", suite, *argv])


@dataclass(frozen=True)
class Results:
    """How a suite writes what it measured: the provenance block added, the statistic required,
    pretty JSON to `path` (when given) and the compact JSON as stdout's last line."""

    provenance: Provenance

    def write(self, result: dict, path: str | Path | None = None, bundle: Path | None = None) -> dict:
        if not result.get("statistic"):
            raise ValueError("a result must name its statistic (median of paired ratios, ratio of means, ...)")
        result = {**result, "provenance": self.provenance.record(bundle)}
        common.emit_json(result, path)
        return result


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
    results = Results(Provenance.start(command_line(name, argv)))
    status = module.run(args, results)
    return int(status or 0)


def listing() -> str:
    """`yggdrasil bench --help`'s list of suites."""
    rows = [(name, summary) for name, summary in BUNDLE_SUITES.items()]
    rows += [(s.name, s.summary) for s in MEASUREMENT_SUITES]
    rows.append(("reproduce", "run the command a result file records again, old and new side by side"))
    width = max(len(n) for n, _ in rows)
    return "\n".join(f"  {n:<{width}}  {s}" for n, s in rows)

