"""Speculative decoding on CPU: autoregressive eager/compiled vs chain, EGT and lookup speculation.

One process, one target model, greedy, fp32, batch 1. Every variant generates the same N tokens
on the same prompts (HumanEval code completions and MT-Bench chat questions), interleaved
(repeat → prompt → variant, variant order rotating each repeat):

  * ar-eager, ar-compiled: plain autoregressive decoding (StepRunner eager / torch.compile'd,
    compiled warmed up before anything is timed);
  * draft-DxW[/vV]: speculation, eager, with a draft model (a catalog model, or the target's first
    K layers with --draft self:K) growing a chain (W = 1) or an Equal-Growth Tree of depth D and
    width W, pruned to V verified nodes;
  * lookup-DxW[/vV]: speculation, eager, with the model-free prompt-lookup drafter;
  * with --calibration DIR (from `yggdrasil calibrate`): egt-auto (EGT with the calibrated depth
    predictor + objective choosing (D, W, V) each iteration, the runtime's --spec egt --auto), best
    (the calibration's best constant bucket, run as a fixed-shape variant) and sequoia:V (Sequoia's
    best static tree for verify budget V from the measured rank acceptance). Use --split held-out
    for prompts calibration never saw.

TPOT is the wall time per output token after the first:

    TPOT = (GenerationStats.decode_seconds - draft prefill seconds) / (N - 1)

decode_seconds is the wall time from the first token (target prefill + first sample) to the end of
the call. Speculation prefills the draft model after the first token, inside decode_seconds; that
one-off per-prompt cost is timed separately (around drafter.start) and taken out, so TPOT is the
steady decode rate for every variant alike. GenerationStats.time_per_output_token (with the draft
prefill) is kept beside it as tpot_internal. Speed-ups are per (prompt, repeat) ratios
AR TPOT / spec TPOT, then the median. Every variant's greedy tokens must equal ar-eager's on every
prompt (no stop ids, so all runs emit exactly N tokens); a spec row that does not is INVALID and
the exit status is 1. Results are given per prompt set (HumanEval, MT-Bench) and over all prompts.
Each run's process CPU / wall and, over the timed phase, other processes' share of the cores and
steal time are recorded: a busy machine shows there rather than only as odd numbers.

The default (qwen pair, 3 + 3 prompts, 64 tokens, 2 repeats) takes very roughly 45-60 minutes on
2 cores and ~10 GB of RAM; --repeats 1 halves it.

    yggdrasil bench spec                                  # qwen2.5-coder-1.5b + 0.5b draft
    yggdrasil bench spec --quick                          # smollm2-135m, self-draft + lookup, ~2 min
    yggdrasil bench spec --target smollm2-135m --draft lookup
    yggdrasil bench spec --out bench/results/spec.json --repeats 3
    yggdrasil bench spec --specs auto,best,sequoia:8 --calibration qwen-cal --split held-out --compiled-spec --no-eager-spec
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from statistics import median

import torch

from yggdrasil.bench import common
from yggdrasil.errors import InvalidRequestError
from yggdrasil.bench.prompts import SETS, Prompt, build_prompts
from yggdrasil.bench.variants import DEFAULT_SPECS, SpecConfig, ar_variant, parse_specs, spec_variant
from .provenance import Results

from yggdrasil.models.catalog import find_entry
from yggdrasil.errors import YggdrasilError
from yggdrasil.runtime.latency import from_device_profile
from yggdrasil.models.loader import load
from yggdrasil.policy.calibration import load_run
from yggdrasil.policy.auto import check_draft, load_policy
from yggdrasil.policy.device_profile import DeviceProfile
from yggdrasil.runtime.steps import StepRunner, context_bucket

METHOD = ("TPOT = (GenerationStats.decode_seconds - draft prefill seconds) / (N-1): wall time after "
          "the first token, without the one-off draft-model prefill; greedy, no stop ids, same "
          "prompts and N for every variant, same process, interleaved; speed-up = AR TPOT / spec "
          "TPOT per (prompt, repeat) pair, then the median")

# ---------------------------------------------------------------- setup

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="catalog name of the target (default qwen2.5-coder-1.5b; "
                   "--quick: smollm2-135m)")
    p.add_argument("--draft", help="draft for the model-drafter variants: a catalog name with the "
                   "target's tokenizer, 'self:K' (the target's first K layers), or 'lookup' "
                   "(no draft model: lookup variants only). Default qwen2.5-coder-0.5b; "
                   "--quick: self:4")
    p.add_argument("--specs", type=parse_specs, help="speculative variants, comma-separated "
                   f"kind:DEPTHxWIDTH[:VERIFY] (default {DEFAULT_SPECS})")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: smollm2-135m, self:4 + lookup, 2 prompts per set, 32 tokens")
    p.add_argument("--n-prompts", type=int, help="prompts per set (default 3; --quick 2)")
    p.add_argument("--new-tokens", "-n", type=int, help="N tokens per generation (default 64; "
                   "--quick 32)")
    p.add_argument("--repeats", type=int, help="timed passes over the prompts (default 2; --quick 1)")
    p.add_argument("--no-compiled", action="store_true", help="skip ar-compiled (saves the compile)")
    p.add_argument("--no-eager-spec", action="store_true",
                   help="with --compiled-spec: run the speculative variants compiled only")
    p.add_argument("--compiled-spec", action="store_true",
                   help="also run every speculative variant with compiled target/draft steps (c-*)")
    p.add_argument("--calibration", help="calibration directory (yggdrasil calibrate) for the 'auto' "
                   "variant (EGT --auto) and the 'best' one (its best constant (D, W, V))")
    p.add_argument("--profile", help="device profile for the auto policy's latency objective "
                   "(default: the one the calibration used)")
    p.add_argument("--split", default="all", choices=("all", "calibration", "held-out"),
                   help="which prompts of each set (held-out: never seen by calibration)")
    p.add_argument("--chunk-size", type=int, default=64, help="prefill chunk (CLI default on CPU)")
    p.add_argument("--out", help="also write the JSON (pretty-printed) to this file")


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """The options, derived and checked (what argparse cannot say)."""
    quick = args.quick
    args.target = args.target or ("smollm2-135m" if quick else "qwen2.5-coder-1.5b")
    args.draft = args.draft or ("self:4" if quick else "qwen2.5-coder-0.5b")
    args.specs = args.specs if args.specs is not None else parse_specs(DEFAULT_SPECS)
    args.n_prompts = args.n_prompts or (2 if quick else 3)
    args.new_tokens = args.new_tokens or (32 if quick else 64)
    args.repeats = args.repeats or (1 if quick else 2)
    if args.new_tokens < 2 or args.repeats < 1 or args.n_prompts < 1:
        raise InvalidRequestError("need --new-tokens >= 2, --repeats >= 1, --n-prompts >= 1")
    if find_entry(args.target) is None:
        raise InvalidRequestError(f"{args.target!r} is not a catalog model")
    if args.draft == "lookup":
        args.specs = [s for s in args.specs if s.kind in ("lookup", "auto", "best")]
    elif args.draft.startswith("self:"):
        try:
            if int(args.draft[5:]) < 1:
                raise ValueError
        except ValueError:
            raise InvalidRequestError(f"--draft self:K needs a layer count K >= 1, got {args.draft!r}")
    elif find_entry(args.draft) is None:
        raise InvalidRequestError(f"--draft {args.draft!r} is not a catalog model, self:K or lookup")
    if args.no_eager_spec and (not args.compiled_spec or args.no_compiled):
        raise InvalidRequestError("--no-eager-spec needs --compiled-spec (and not --no-compiled)")
    if any(s.kind in ("auto", "best", "sequoia") for s in args.specs) and not args.calibration:
        raise InvalidRequestError("the auto, best and sequoia variants need --calibration DIR")
    names = [s.name for s in args.specs]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"duplicate speculative variants in {names}")
    return args


def model_record(loaded) -> dict:
    return {"name": loaded.source.name, "sha256": loaded.source.sha256,
            "path": str(loaded.source.path), "format": loaded.source.format,
            "params": sum(p.numel() for p in loaded.model.parameters()),
            "n_layers": loaded.config.n_layers, "load_seconds": round(loaded.load_seconds, 2)}


def load_draft(args, target_loaded) -> tuple[object | None, dict | None]:
    """The draft Transformer (None for lookup-only) and its record."""
    if args.draft == "lookup" or not any(s.kind in ("model", "static", "auto", "best", "sequoia")
                                         for s in args.specs):
        return None, None
    if args.draft.startswith("self:"):
        k = int(args.draft[5:])
        if k > target_loaded.config.n_layers:
            sys.exit(f"error: --draft {args.draft}: the target has {target_loaded.config.n_layers} layers")
        record = {**model_record(target_loaded), "name": f"{target_loaded.source.name} first {k} layers",
                  "n_layers": k, "self_draft_of": target_loaded.source.name, "load_seconds": 0.0}
        record.pop("params")
        return target_loaded.model.truncated(k), record
    common.log(f"loading draft {args.draft} (fp32)")
    draft = load(args.draft, dtype=torch.float32)
    if draft.tokenizer.fingerprint() != target_loaded.tokenizer.fingerprint():
        sys.exit(f"error: draft {args.draft} does not share the target's tokenizer "
                 "(vocabulary fingerprints differ); speculation needs the same token ids")
    return draft.model, {**model_record(draft), "tokenizer_fingerprint": draft.tokenizer.fingerprint()}


def load_auto_policy(args, target_loaded):
    """The calibrated policy for 'auto', and 'best' resolved to its constant (D, W, V) in place."""
    if not args.calibration:
        return None, None

    calibration = load_run(args.calibration)
    meta = calibration[1]
    try:
        check_draft(args.calibration, meta, args.draft)
    except YggdrasilError as exc:
        sys.exit(f"error: {exc}")
    latency = (from_device_profile(DeviceProfile.load(args.profile), args.draft != "lookup")
               if args.profile else None)
    policy, note = load_policy(args.calibration, calibration, latency, target_loaded.config.dim,
                               target_loaded.source.sha256)
    best = policy.selector.constant()[0]
    specs = []
    for cfg in args.specs:
        if cfg.kind == "sequoia":
            path = Path(args.calibration) / f"sequoia-v{cfg.verify}.json"
            if not path.is_file():
                sys.exit(f"error: {path} does not exist (the calibration's verify budgets: "
                         f"{[int(f.stem[9:]) for f in Path(args.calibration).glob('sequoia-v*.json')]})")
            specs.append(dataclasses.replace(cfg, tree_file=str(path)))
        elif cfg.kind != "best":
            specs.append(cfg)
        elif best.depth == 0:
            common.log("the calibration's best constant bucket is no speculation: 'best' dropped")
        else:
            specs.append(SpecConfig("lookup" if args.draft == "lookup" else "model", best.depth,
                                    best.width, best.verify))
    args.specs = specs
    common.log(f"auto policy: {note}; best constant bucket {best}")
    return policy, f"{note}; best constant bucket {best}"


# ---------------------------------------------------------------- summaries

def pooled_depth_acceptance(samples: list[common.Sample], variant: str) -> list[float | None]:
    """Σ accepted / Σ offered per depth over all of the variant's runs (not a mean of ratios)."""
    acc: list[int] = []
    off: list[int] = []
    for s in samples:
        if s.variant != variant:
            continue
        for d, (a, o) in enumerate(zip(s.values["accepted_at_depth"], s.values["offered_at_depth"])):
            if d == len(acc):
                acc.append(0)
                off.append(0)
            acc[d] += a
            off[d] += o
    return [round(a / o, 4) if o else None for a, o in zip(acc, off)]


def correctness(samples: list[common.Sample], variants: list[str], prompts: list[Prompt]) -> dict:
    """Per variant: prompts whose tokens (every repeat) equal ar-eager's first run, divergences."""
    ref = {s.item: s.values["tokens"] for s in samples if s.variant == "ar-eager" and s.repeat == 0}
    out = {}
    for v in variants:
        diverge: dict[str, int] = {}
        for s in samples:
            if s.variant == v:
                d = common.first_divergence(s.values["tokens"], ref[s.item])
                if d is not None:
                    key = prompts[s.item].id
                    diverge[key] = min(d, diverge.get(key, d))
        exact = len(prompts) - len(diverge)
        out[v] = {"exact": exact, "of": len(prompts), "valid": not diverge,
                  "first_divergence": diverge}
    return out


def summarize_set(samples: list[common.Sample], variants: list[str], spec_names: set[str]) -> dict:
    out = {}
    for v in variants:
        tpot = common.values_of(samples, v, "tpot")
        med = common.summarize(tpot)["median"]
        entry = {"tpot_ms": common.scaled(common.summarize(tpot), 1e3),
                 "tok_per_s": round(1 / med, 2) if med else None,
                 "tpot_internal_ms": common.scaled(
                     common.summarize(common.values_of(samples, v, "tpot_internal")), 1e3)}
        for base in ("ar-compiled", "ar-eager"):
            if base != v and any(s.variant == base for s in samples):
                ratios = common.paired_ratios(samples, base, v, "tpot")  # base TPOT / this TPOT
                entry[f"speedup_vs_{base}"] = common.scaled(common.summarize(ratios), 1, 4)
        if v in spec_names:
            runs = [s.values for s in samples if s.variant == v]
            committed = sum(r["committed"] for r in runs)
            iterations = sum(r["iterations"] for r in runs)
            entry.update({
                "aal": round(committed / iterations, 4) if iterations else None,  # pooled
                "aal_per_run": common.scaled(common.summarize([r["aal"] for r in runs]), 1, 4),
                "depth_acceptance": pooled_depth_acceptance(samples, v),
                "iterations": iterations,
                "host_overhead_pct": common.scaled(
                    common.summarize([r["host_frac"] for r in runs]), 100, 2),
                "draft_pct": common.scaled(common.summarize([r["draft_frac"] for r in runs]), 100, 2),
                "draft_prefill_ms": common.scaled(
                    common.summarize([r["draft_prefill_s"] for r in runs]), 1e3),
                "verify_widths": runs[0]["verify_widths"] if runs else None})
            buckets: dict[str, int] = {}
            for r in runs:
                for k, c in r.get("buckets", {}).items():
                    buckets[k] = buckets.get(k, 0) + c
            if buckets:
                entry["buckets"] = dict(sorted(buckets.items(), key=lambda kv: -kv[1]))
        out[v] = entry
    return out


def speed(entry: dict, key: str) -> str:
    s = entry.get(key)
    return common.fmt(s["median"], 2) if s else "-"


def set_table(summary: dict, check: dict) -> str:
    rows = []
    for v, e in summary.items():
        t = e["tpot_ms"]
        acc = e.get("depth_acceptance")
        ok = check[v]
        if v == "ar-eager":
            status = "reference"
        elif ok["valid"]:
            status = "ok"
        else:
            status = ("differs" if v.startswith("ar-") else "INVALID") + \
                f" ({ok['exact']}/{ok['of']})"
        rows.append((v, common.fmt(t["median"]), common.fmt_spread(t),
                     common.fmt(e["tok_per_s"], 1), speed(e, "speedup_vs_ar-compiled"),
                     speed(e, "speedup_vs_ar-eager"), common.fmt(e.get("aal")),
                     " ".join("-" if a is None else f"{a:.2f}" for a in acc) if acc else "-",
                     common.fmt(e["host_overhead_pct"]["median"], 1) if "host_overhead_pct" in e else "-",
                     common.fmt(e["draft_pct"]["median"], 0) if "draft_pct" in e else "-",
                     status))
    head = ("variant", "TPOT ms", "spread ms: min–max (IQR)", "tok/s", "x compiled", "x eager",
            "AAL", "accept/depth", "host %", "draft %", "tokens")
    return common.format_table(head, rows)


# ---------------------------------------------------------------- main

def run(args: argparse.Namespace, record: Results) -> int | None:
    args = checked(args)
    threads = common.set_threads(args.threads)
    load_before = common.load_average()
    spec_names = [s.name for s in args.specs]
    common.log(f"target {args.target}, draft {args.draft}; {args.n_prompts} prompts per set x "
               f"{args.new_tokens} tokens x {args.repeats} repeats; spec {spec_names}; {threads} threads")

    common.log(f"loading target {args.target} (fp32)")
    target_loaded = load(args.target, dtype=torch.float32)
    target_record = model_record(target_loaded)
    prompts, prompt_info = build_prompts(target_loaded.tokenizer, args.n_prompts, args.split)
    lengths = [len(p.ids) for p in prompts]
    max_context = context_bucket(max(lengths) + args.new_tokens + 64, 4096)
    if max(lengths) + args.new_tokens + 64 > max_context:
        sys.exit(f"error: prompts up to {max(lengths)} tokens + {args.new_tokens} new do not fit "
                 f"the 4096-slot cache")
    draft_model, draft_record = load_draft(args, target_loaded)

    policy, policy_note = load_auto_policy(args, target_loaded)
    n = args.new_tokens
    eager = StepRunner(target_loaded.model, max_context, args.chunk_size, compile=False)
    draft_runner = (StepRunner(draft_model, max_context, args.chunk_size, compile=False)
                    if draft_model is not None else None)
    variants = {"ar-eager": ar_variant(eager, prompts, n, "ar-eager")}
    extra: dict = {}
    if not args.no_compiled:
        compiled = StepRunner(target_loaded.model, max_context, args.chunk_size, compile=True)
        common.log("compiling ar-compiled (warm-up of prefill and decode shapes)")
        extra["inductor_cache_had_entries"] = common.inductor_cache_had_entries()
        _, seconds = common.timed(compiled.warm_up)
        extra["compile_seconds"] = round(seconds, 2)
        variants["ar-compiled"] = ar_variant(compiled, prompts, n, "ar-compiled")
    for cfg in args.specs if not args.no_eager_spec else ():
        variants[cfg.name] = spec_variant(eager, draft_runner, cfg, prompts, n, policy)
    if args.compiled_spec and not args.no_compiled:
        draft_compiled = (StepRunner(draft_model, max_context, args.chunk_size, compile=True)
                          if draft_model is not None else None)
        for cfg in args.specs:
            common.log(f"compiling c-{cfg.name} (every verify and draft shape)")
            variants[f"c-{cfg.name}"] = spec_variant(compiled, draft_compiled, cfg, prompts, n, policy)
    extra["memory_after_loads"] = common.memory_mb()

    warm_n = min(n, 16)  # untimed: first-call allocations, oneDNN setup for each step shape
    for name, run in variants.items():
        common.log(f"warm-up run: {name} ({warm_n} tokens)")
        run(0, warm_n)
    snapshot = common.cpu_snapshot()
    samples = common.interleaved(args.repeats, len(prompts), variants)
    extra["machine_load_during_timing"] = common.machine_load(snapshot, common.cpu_snapshot())
    names = list(variants)
    check = correctness(samples, names, prompts)

    results = {}
    for set_name in SETS + ("all",):
        items = {i for i, p in enumerate(prompts) if set_name in (p.set, "all")}
        subset = [s for s in samples if s.item in items]
        results[set_name] = summarize_set(subset, names, {v for v in names if not v.startswith("ar-")})
    stable = all(s.values["tokens"] == next(t.values["tokens"] for t in samples
                                            if t.variant == s.variant and t.item == s.item)
                 for s in samples)

    titles = {"humaneval": "HumanEval (code completion)", "mtbench": "MT-Bench (chat, turn 1)",
              "all": "all prompts"}
    draft_name = draft_record["name"] if draft_record else "none"
    print(f"speculative decoding, CPU fp32, target {target_record['name']}, draft {draft_name}, "
          f"N={n}, {args.n_prompts} prompts per set x {args.repeats} repeats, {threads} threads")
    for set_name in SETS + ("all",):
        ids = [p.id for p in prompts if set_name in (p.set, "all")]
        print()
        print(f"{titles[set_name]}: {', '.join(ids) if set_name != 'all' else f'{len(ids)} prompts'}")
        print(set_table(results[set_name], check))
    for v, e in results["all"].items():
        if "buckets" in e:
            print(f"{v}: buckets chosen " + ", ".join(f"{k} x{c}" for k, c in list(e["buckets"].items())[:6]))
    if policy_note:
        print(f"auto policy: {policy_note}")
    print()
    print("method: " + METHOD + ".")
    print("x compiled / x eager: speed-up over ar-compiled / ar-eager (> 1 = faster). AAL: tokens "
          "committed per target forward (pooled). accept/depth: P(depth d accepted | depth d-1 "
          "reached), pooled. host %: SpeculativeGenerator tree bookkeeping (SpecStats.host_seconds) "
          "/ decode time; draft %: drafter.build (draft forwards + tree growth) / decode time. "
          "tokens: greedy tokens vs ar-eager on every prompt and repeat.")
    bits = [f"target load {target_record['load_seconds']} s"]
    if draft_record and draft_record.get("load_seconds"):
        bits.append(f"draft load {draft_record['load_seconds']} s")
    if "compile_seconds" in extra:
        cache = "non-empty" if extra["inductor_cache_had_entries"] else "empty"
        bits.append(f"compile {extra['compile_seconds']:.1f} s (Inductor disk cache {cache}; not timed)")
    bits.append(f"prompt tokens {lengths}, max_context {max_context}")
    bits.append(f"peak RSS {common.memory_mb()['peak_rss_mb']:.0f} MB")
    util = [s.values["cpu_per_wall"] for s in samples]
    starved = [f"{prompts[s.item].id} {s.variant}" for s in samples
               if s.values["cpu_per_wall"] < 0.75 * threads]
    bits.append(f"process CPU/wall per run: median {median(util):.2f}, min {min(util):.2f} "
                f"({threads} threads)")
    machine = extra["machine_load_during_timing"]
    if machine:
        bits.append(f"while timing, other processes used {machine['others_pct']}% of the cores, "
                    f"steal {machine['steal_pct']}%")
    if starved:
        bits.append(f"WARNING: {len(starved)} runs got under 0.75 x {threads} cores of CPU (machine "
                    "busy? their times are suspect): "
                    + ", ".join(starved[:6]) + (" ..." if len(starved) > 6 else ""))
    if not stable:
        bits.append("WARNING: tokens changed between repeats")
    print("; ".join(bits))
    invalid = [v for v in names if not check[v]["valid"]]
    if invalid:
        print(f"INVALID (greedy tokens differ from ar-eager): {invalid}")

    result = {
        "benchmark": "spec", "method": METHOD,
        "environment": common.environment(dtype="float32", load_average_before=load_before),
        "config": {"target": args.target, "draft": args.draft, "new_tokens": n, "split": args.split,
                   "calibration": args.calibration, "profile": args.profile,
                   "n_prompts_per_set": args.n_prompts, "repeats": args.repeats,
                   "chunk_size": args.chunk_size, "max_context": max_context, "quick": args.quick,
                   "variants": names,
                   "specs": [{"name": s.name, "kind": s.kind, "shape": s.shape, "depth": s.depth,
                              "width": s.width, "verify": s.verify} for s in args.specs],
                   "spec_mode": ("compiled only (c-* variants)" if args.no_eager_spec else
                                 "eager, and compiled for the c-* variants" if args.compiled_spec else
                                 "eager (target and draft StepRunners compile=False)"),
                   "warm_up_tokens": warm_n,
                   "interleave": "repeat > prompt > variant, variant order rotated per repeat"},
        "models": {"target": target_record, "draft": draft_record},
        "prompt_sets": {name: {"source": prompt_info[name],
                               "ids": [p.id for p in prompts if p.set == name],
                               "prompt_tokens": [len(p.ids) for p in prompts if p.set == name]}
                        for name in SETS},
        "setup": {**extra, "auto_policy": policy_note},
        "correctness": {"reference": "ar-eager", "same_tokens_every_repeat": stable,
                        "variants": check,
                        "invalid": invalid},
        "results": results,
        "samples": [{"repeat": s.repeat, "prompt": prompts[s.item].id, "variant": s.variant,
                     **{k: (round(v, 6) if isinstance(v, float) else v)
                        for k, v in s.values.items() if k != "tokens"}}
                    for s in samples],
        "memory": common.memory_mb(),
        "statistic": "TPOT: median over (repeat, prompt) runs; speed-ups: medians of paired per-(repeat, prompt) "
                     "TPOT ratios; AAL: tokens per target forward, pooled",
    }
    record.write(result, args.out)
    return 1 if invalid else 0

