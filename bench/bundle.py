"""Bundle benchmark (issue 5): for each recipe, cold compile time and bundle size, fresh-process
load → first token, and time per output token from the bundle versus `generate --compile`
(torch.compile, no bundle) versus eager, same mode and same policy, timed interleaved in one run.

    yggdrasil bench bundle --recipe recipes/smollm2-lookup-cpu.yaml --bundle DIR [--cold]

Modes: "auto" is the bundle's own speculation policy (depth predictor + objective over the
compiled buckets); "ar" is plain autoregressive decoding. The compiled and eager variants run the
same policy from the bundle's calibration, so only the graphs differ. Prints a table and ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from yggdrasil.bundle import open_bundle
from yggdrasil.compile.work_cache import work_root
from yggdrasil.runtime.generate import generate
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.models.loader import load
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.steps import StepRunner

from .common import environment, format_table, interleaved, log, paired_ratios, set_threads, summarize, timed
from .prompts import build_prompts
from .provenance import Results


def cold_compile(recipe: Path, bundle: Path, cold: bool) -> dict:
    """Compile (from scratch with --cold: bundle and its work cache removed) and report."""

    if cold:
        shutil.rmtree(bundle, ignore_errors=True)
        shutil.rmtree(work_root(bundle), ignore_errors=True)
    run, wall = timed(subprocess.run, [sys.executable, "-m", "yggdrasil.cli", "compile", str(recipe), "--out",
                                       str(bundle)], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"compile failed:\n{run.stderr[-3000:]}")

    manifest = yaml.safe_load(BundleLayout(bundle).manifest.read_text())
    size = sum(a["bytes"] for a in manifest["artifacts"].values())
    graphs = sum(a["bytes"] for k, a in manifest["artifacts"].items() if k.startswith("graphs/"))
    return {"wall_seconds_this_run": round(wall, 1), "cold": cold, "stats": manifest["stats"],
            "bundle_bytes": size, "graph_bytes": graphs, "graphs": len(manifest["buckets"]),
            "buckets": manifest["buckets"]}


def fresh_load(bundle: Path, repeats: int) -> dict:
    """`yggdrasil generate --bundle` in a new process: bundle load and first token after start."""
    loads, firsts = [], []
    for _ in range(repeats):
        run = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "generate", "--bundle", str(bundle),
                              "--prompt", "def fibonacci(n):", "--max-new-tokens", "8"],
                             capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"generate --bundle failed:\n{run.stderr[-3000:]}")
        loads.append(float(re.search(r"bundle load ([\d.]+) s", run.stderr).group(1)))
        firsts.append(float(re.search(r"first token ([\d.]+) s after (?:process start|import)", run.stderr).group(1)))
        if "0 compilations" not in run.stderr:
            raise SystemExit("a fresh process compiled something")
    return {"bundle_load_seconds": summarize(loads), "first_token_seconds": summarize(firsts)}


def fresh_model(runtime, role: str):
    """Another copy of the bundle's role model in its deployed format (None: no such model)."""
    loaded = runtime.target if role == "target" else runtime.draft
    if loaded is None:
        return None
    return load(runtime.manifest.models[role]["name"], dtype=loaded.model.dtype, device=runtime.device,
                quiet=True, weights=runtime.manifest.weight_format(role)).model


def decode_variants(runtime, prompts, max_new: int, context: int):
    """name -> fn(prompt index) -> {tpot, tokens}: bundle / torch.compile / eager, auto and ar."""

    greedy = SamplingParams(temperature=0.0)
    chunks = tuple(runtime.manifest.chunk_sizes)
    bundle_context = int(runtime.manifest.recipe["max_context"])
    runners = {"bundle": (runtime.runner, runtime.draft_runner)}
    # generate --compile sizes its cache to the request; one size that holds every prompt here,
    # on a second copy of each model: the bundle's graphs are bound to the model's own cache
    copies = [fresh_model(runtime, role) for role in ("target", "draft")]
    runners["compile"] = tuple(StepRunner(m, context, chunk_sizes=chunks, compile=True) if m is not None else None
                               for m in copies)
    # eager steps share the bundle's models and cache (the bundle's context)
    runners["eager"] = tuple(StepRunner(loaded.model, bundle_context, chunk_sizes=chunks) if loaded is not None
                             else None for loaded in (runtime.target, runtime.draft))
    variants, speculators = {}, {}
    for kind, (runner, draft_runner) in runners.items():
        if runtime.policy is not None:  # the same (stateless) policy drives every variant
            speculators[kind] = build_speculator(runner, policy=runtime.policy, draft_runner=draft_runner)
        if kind == "compile":
            log("compiling the torch.compile variants' shapes (not timed)")
            (speculators.get(kind) or runner).warm_up()
            runner.warm_up()

    def run_one(fn, i):
        # graph time from the first token on: what decoding spent inside the bundle's graphs
        mark = {}
        result = fn(prompts[i].ids, lambda ids: mark.setdefault("graphs", runtime.graph_seconds()))
        steps = max(result.stats.new_tokens - 1, 1)
        iterations = getattr(getattr(result, "spec", None), "iterations", steps) or 1
        outside = result.stats.decode_seconds - (runtime.graph_seconds() - mark["graphs"])
        return {"tpot": result.stats.decode_seconds / steps, "tokens": result.tokens,
                "host_ms_per_iteration": outside / iterations * 1e3,
                "host_share": outside / max(result.stats.decode_seconds, 1e-9)}

    for kind, (runner, _) in runners.items():
        variants[f"{kind}-ar"] = (lambda r: lambda i: run_one(
            lambda ids, cb: generate(r, ids, max_new, greedy, on_tokens=cb), i))(runner)
        if kind in speculators:
            variants[f"{kind}-auto"] = (lambda s: lambda i: run_one(
                lambda ids, cb: s.generate(ids, max_new, greedy, on_tokens=cb), i))(speculators[kind])
    return variants


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--bundle", required=True, help="bundle directory (compiled here if missing)")
    parser.add_argument("--cold", action="store_true", help="delete the bundle and its cache first")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per set (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", default=None, help="also write the JSON result here")


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = set_threads(args.threads)
    recipe, bundle = Path(args.recipe), Path(args.bundle)
    log(f"compiling {recipe} -> {bundle}")
    compiled = cold_compile(recipe, bundle, args.cold)
    log("fresh-process loads")
    load = fresh_load(bundle, args.load_repeats)

    runtime = open_bundle(bundle, quiet=True).generator()
    prompts, prompt_info = build_prompts(runtime.target.tokenizer, args.prompts, "held-out")
    prompts = [p for p in prompts if len(p.ids) + args.max_new_tokens + 64 < args.context]
    variants = decode_variants(runtime, prompts, args.max_new_tokens, args.context)
    samples = interleaved(args.repeats, len(prompts), variants, label="decode ")
    reference = {s.item: s.values["tokens"] for s in samples if s.variant == "eager-ar"}
    mismatched = sorted({s.variant for s in samples if s.values["tokens"] != reference[s.item]})
    rows, numbers = [], {}
    for name in variants:
        tpot = summarize([s.values["tpot"] for s in samples if s.variant == name])
        vs_compile_ar = summarize(paired_ratios(samples, "compile-ar", name, "tpot"))
        vs_eager = summarize(paired_ratios(samples, "eager-" + name.split("-")[1], name, "tpot"))
        numbers[name] = {"tpot_ms": tpot["median"] * 1e3, "speedup_vs_compile_ar": vs_compile_ar["median"],
                         "speedup_vs_eager_same_mode": vs_eager["median"]}
        rows.append([name, f"{tpot['median'] * 1e3:.1f}", f"{tpot['min'] * 1e3:.1f}-{tpot['max'] * 1e3:.1f}",
                     f"{vs_compile_ar['median']:.2f}x", f"{vs_eager['median']:.2f}x"])
    host = {name: {"ms_per_iteration": summarize([s.values["host_ms_per_iteration"] for s in samples
                                                  if s.variant == name])["median"],
                   "share_of_decode": summarize([s.values["host_share"] for s in samples
                                                 if s.variant == name])["median"]}
            for name in variants if name.startswith("bundle")}
    bundle_vs_compile = {m: summarize(paired_ratios(samples, f"compile-{m}", f"bundle-{m}", "tpot"))["median"]
                         for m in ("ar", "auto") if f"bundle-{m}" in variants}
    print(f"\n{recipe.name}: {compiled['graphs']} graphs, {compiled['graph_bytes'] / 1e6:.1f} MB of graphs "
          f"({compiled['bundle_bytes'] / 1e6:.1f} MB bundle), compile {compiled['stats'].get('compile_seconds')} s, "
          f"whole pipeline {compiled['stats'].get('total_seconds')} s")
    print(f"fresh process: bundle load {load['bundle_load_seconds']['median']:.2f} s, first token "
          f"{load['first_token_seconds']['median']:.2f} s after start (median of {args.load_repeats})")
    print(format_table(["variant", "TPOT ms (median)", "range", "vs compile-ar", "vs eager same mode"], rows))
    print("bundle / generate --compile time per token: " +
          ", ".join(f"{m} {1 / v:.2f}" for m, v in bundle_vs_compile.items() if v))
    for name, h in host.items():
        print(f"{name}: host time outside the graphs {h['ms_per_iteration']:.2f} ms per iteration "
              f"({h['share_of_decode']:.1%} of decode)")
    print(f"greedy outputs identical to eager AR: {'yes' if not mismatched else 'NO: ' + ', '.join(mismatched)}")
    record.write({"benchmark": "bundle", "recipe": str(recipe), "environment": environment(threads=threads),
               "device": runtime.manifest.environment.device, "compile": compiled, "fresh_load": load,
               "prompts": {"count": len(prompts), "max_new_tokens": args.max_new_tokens, **prompt_info},
               "variants": numbers, "bundle_over_compile_tpot": {m: 1 / v for m, v in bundle_vs_compile.items() if v},
               "host_overhead": host, "mismatched": mismatched,
               "statistic": f"TPOT: median over (repeat, prompt) of {args.repeats} repeats; speed-ups: medians of "
                            "paired per-(repeat, prompt) ratios; loads: median of fresh processes"},
                 args.out, bundle=bundle)

