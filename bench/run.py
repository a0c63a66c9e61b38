"""`yggdrasil bench SUITE`: open the bundle and prompts once, run the suite, write its files."""

from __future__ import annotations

from . import common, suite_ablation, suite_compare, suite_sensitivity, suite_trees
from .harness import BenchOptions, open_setup
from .provenance import Provenance


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
