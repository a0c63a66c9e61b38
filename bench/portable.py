"""The price of a portable bundle (issue 35): time per output token of the same recipe compiled
for this CPU (native) and for a portable x86-64 level (`compile --isa avx2`), timed interleaved
in one run, plain decoding and the bundle's own speculation.

    yggdrasil bench portable --bundle native=DIR --bundle avx2=DIR \
        [--prompts 4] [--max-new-tokens 64] [--repeats 2] [--threads N] [--out FILE]

TPOT is decode time / (new tokens - 1) per prompt; the table gives the median over prompts and
repeats, and each ratio is the median of per-(repeat, prompt) ratios against the first bundle.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from yggdrasil.bundle import open_bundle
from yggdrasil.runtime.generate import generate
from yggdrasil.sampling import SamplingParams

from .common import environment, format_table, interleaved, log, paired_ratios, \
    set_threads, summarize
from .prompts import build_prompts
from .provenance import Results

GREEDY = SamplingParams(temperature=0.0)


def _timed(result) -> dict:
    steps = max(result.stats.new_tokens - 1, 1)
    return {"tpot": result.stats.decode_seconds / steps, "tokens": result.tokens}


def bundle_variants(name: str, runtime, prompts, max_new: int) -> dict:
    """name-ar (plain decoding on the bundle's graphs) and, where the bundle speculates, name-auto."""
    variants = {f"{name}-ar": lambda i: _timed(generate(runtime.runner, prompts[i].ids, max_new, GREEDY))}
    speculator = runtime.speculator()
    if speculator is not None:
        variants[f"{name}-auto"] = lambda i: _timed(speculator.generate(prompts[i].ids, max_new, GREEDY))
    return variants


def _named(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"error: --bundle takes NAME=DIR (e.g. avx2=bundles/smollm2-avx2), got {spec!r}")
    return name, Path(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", action="append", required=True, help="NAME=DIR; the first is the baseline")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per set (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON result here")


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = set_threads(args.threads)
    bundles = [_named(spec) for spec in args.bundle]
    runtimes = {name: open_bundle(path, quiet=True).generator() for name, path in bundles}
    first = runtimes[bundles[0][0]]
    prompts, prompt_info = build_prompts(first.tokenizer, args.prompts, "held-out")
    variants = {}
    for name, runtime in runtimes.items():
        variants.update(bundle_variants(name, runtime, prompts, args.max_new_tokens))
    samples = interleaved(args.repeats, len(prompts), variants, label="decode ")
    rows, numbers = [], {}
    for variant in variants:
        mode = variant.rsplit("-", 1)[1]
        baseline = f"{bundles[0][0]}-{mode}"
        tpot = summarize([s.values["tpot"] for s in samples if s.variant == variant])
        ratio = summarize(paired_ratios(samples, variant, baseline, "tpot")) if baseline in variants else None
        baseline_tokens = {(s.repeat, s.item): s.values["tokens"] for s in samples if s.variant == baseline}
        same = all(s.values["tokens"] == baseline_tokens.get((s.repeat, s.item)) for s in samples
                   if s.variant == variant and (s.repeat, s.item) in baseline_tokens)
        numbers[variant] = {"tpot_ms_median": tpot["median"] * 1e3, "tpot_ms_min": tpot["min"] * 1e3,
                            "tpot_ms_max": tpot["max"] * 1e3,
                            "tpot_ratio_vs_baseline_median": ratio["median"] if ratio else None,
                            "tokens_equal_baseline": same}
        rows.append([variant, f"{tpot['median'] * 1e3:.2f}", f"{tpot['min'] * 1e3:.2f}-{tpot['max'] * 1e3:.2f}",
                     f"{ratio['median']:.3f}x" if ratio else "-", "yes" if same else "NO"])
    print(format_table(["variant", "TPOT ms (median)", "range", f"time vs {bundles[0][0]} (median ratio)",
                        "same tokens"], rows))
    isas = {name: (r.manifest.isa.describe() if r.manifest.isa is not None else "not recorded")
            for name, r in runtimes.items()}
    log("graph ISA: " + "; ".join(f"{n}: {d}" for n, d in isas.items()))
    record.write({"benchmark": "portable", "environment": environment(threads=threads),
               "bundles": {name: {"path": str(path), "graph_isa": isas[name],
                                  "weights": runtimes[name].manifest.weights} for name, path in bundles},
               "prompts": {"count": len(prompts), "max_new_tokens": args.max_new_tokens, **prompt_info},
               "statistic": "TPOT median over (repeat, prompt); ratio = median of paired per-(repeat, prompt) ratios",
               "variants": numbers}, args.out)

