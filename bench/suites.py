"""Every benchmark is a suite of `yggdrasil bench` (issue 39), and this table is the one list (no
torch here: the command line builds its parsers from it without importing the benchmarks).

Two kinds share one runner (bench/run.py) and one way of writing results:
  * bundle suites (compare, ablation, trees, sensitivity) time generation on a compiled bundle
    through the shared harness (bench/harness.py): options in BenchOptions, rows checked against
    autoregressive greedy, SUITE.{txt,csv,json,md,png} in --out;
  * measurement suites (kernels, formats, serve, ...) each take their own options: the module
    named here has `add_arguments(parser)` and `run(args, record)`, and writes what it measured
    through `record.write(result, path)` (bench/provenance.py's Results).

Either way the result file gets the same provenance block (bench/provenance.py: commit, command,
CPU, torch, bundle, the machine's state before and after) and must name its statistic.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass


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
    ("invariance", "invariance", "a bundle's batch invariance at rows 1..17 and full contexts, and speculative "
                                 "vs plain output over 16 prompts x 256 tokens"),
    ("shim-overhead", "shim_overhead", "a graph calling our kernel through the C shim vs the ProxyExecutor"),
    ("head-cost", "head_cost", "the LM head's time per token in a q4 model"),
    ("activation-cost", "activation_cost", "q4 weights with float vs int8 activations vs the GGUF's own model: "
                                           "agreement and held-out perplexity"),
    ("draft-cost", "draft_cost", "T_draft(n) with the trimmed and the full head, T_verify(n), acceptance with each"),
    ("host-time", "host_time", "where the host time of a bundle's speculative iterations goes, stage by stage"),
    ("formats", "formats", "a recipe compiled in each weight format: step times, TPOT, agreement"),
    ("portable", "portable", "native against portable-ISA bundles of one recipe, interleaved"),
    ("cold-compile", "cold_compile", "a cold `yggdrasil compile`, phase by phase, and what it chose"),
    ("greedy-reference", "greedy_reference", "the formats phase's fp32 reference: sequential vs packed"),
    ("bundle", "bundle", "bundle size, cold compile, fresh-process first token and TPOT per recipe"),
    ("startup", "startup", "launch to first token of `generate --bundle`, phase by phase"),
    ("planner", "planner", "stage plans: predicted against measured iteration time"),
    ("serve", "serve", "`yggdrasil serve` under load: no, fixed and goodput speculation"),
    ("serve-graph", "serve_graph", "one serving forward: serve graph vs eager vs fixed-row step graph"),
    ("memory", "memory", "KV preemption under one budget: recompute, swap, cost-aware"),
    ("structured", "structured", "TPOT with a JSON schema vs without (speculation and plain); prefix-cache TTFT"),
    ("tensor-parallel", "tensor_parallel", "the target's decode step on 2 gloo ranks x 1 thread vs 1 rank x 2 "
                                           "threads, eager and compiled: what the all-reduces cost per token on one "
                                           "CPU box"),
    ("draft-placement", "draft_placement", "a split target's draft whole on rank 0 vs replicated on each rank: "
                                           "drafting alone + the verify's message vs drafting at once"),
    ("llama-cpp", "llama_cpp", "llama.cpp alone on a bundle's GGUF files (compare --llama-cpp runs it as peer rows)"),
    ("llama-agreement", "llama_agreement", "our q4 model's greedy text against llama-completion's on its GGUF, "
                                           "and the weight bytes each reads per token"),
    ("report", "report", "docs/results.md (and --readme's table) from the committed results; measures nothing"),
))
MEASUREMENTS = {s.name: s for s in MEASUREMENT_SUITES}
NAMES = (*BUNDLE_SUITES, *MEASUREMENTS)


def command_line(suite: str, argv: list[str]) -> str:
    """The command as a person types it (recorded, and what `bench reproduce` runs again)."""
    return shlex.join(["yggdrasil", "bench", suite, *argv])
