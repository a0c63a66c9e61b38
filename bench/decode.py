"""Decode speed (time per output token, TPOT): ours eager vs ours compiled vs HF transformers.

All three run greedy, fp32, batch 1, on the SAME GGUF weights, in one process, interleaved
(repeat → prompt → variant, variant order rotating each repeat). Every variant's TPOT is taken
the same way, so they are comparable:

    TPOT = (wall(generate N tokens) - wall(generate 1 token)) / (N - 1)

i.e. the whole call minus a separately timed prefill-plus-first-token call on the same prompt.
For ours, the runtime's own TPOT (GenerationStats.time_per_output_token: time after the first
token / (N-1)) is reported beside it as a cross-check. Greedy tokens are compared with HF's, so
a speed-up can never come from doing different work.

    yggdrasil bench decode                       # every installed small/target catalog model
    yggdrasil bench decode --quick --models smollm2-135m
    yggdrasil bench decode --models smollm2-135m,qwen2.5-coder-1.5b --out bench/results/decode.json
"""

from __future__ import annotations

import argparse
import gc

import torch

from yggdrasil.bench import common
from yggdrasil.errors import InvalidRequestError

from yggdrasil.bench.engines import load_hf_model
from .provenance import Results
from yggdrasil.models.catalog import find_entry, model_statuses
from yggdrasil.runtime.generate import generate
from yggdrasil.models.loader import load
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.steps import StepRunner, context_bucket

VARIANTS = ("eager", "compiled", "hf")
METHOD = ("TPOT = (wall(generate N) - wall(generate 1)) / (N-1) for every variant, same prompt, "
          "same process, interleaved; ratios are per (prompt, repeat) pair, then the median")

# different kinds and lengths (roughly 5 to 120 tokens), so TPOT is not one context length's
PROMPTS = (
    "def fibonacci(n):",
    "The three laws of thermodynamics can be summarised as follows:",
    "import numpy as np\n\n\nclass Matrix:\n    \"\"\"A small dense matrix with the usual operations.\"\"\"\n\n"
    "    def __init__(self, rows, cols, fill=0.0):\n        self.rows = rows\n        self.cols = cols\n"
    "        self.data = np.full((rows, cols), fill)\n\n    def transpose(self):",
    "Release notes, version 2.4\n\nThis release focuses on start-up time and memory use. The model "
    "loader now memory-maps checkpoint files and dequantizes one tensor at a time, so peak memory "
    "stays close to the size of the loaded model. Split model packages are joined once into the "
    "cache directory and verified with sha256; later starts only compare a small stamp file. "
    "Known issues:\n1.",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", help="comma-separated catalog names (default: every installed "
                   "catalog model of role small or target)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 16 tokens, 1 repeat")
    p.add_argument("--new-tokens", "-n", type=int, help="N tokens per generation (default 64)")
    p.add_argument("--repeats", type=int, help="timed passes over the prompts (default 3)")
    p.add_argument("--prompts", type=int, help=f"use the first K of {len(PROMPTS)} built-in prompts")
    p.add_argument("--variants", default=",".join(VARIANTS), help="subset of eager,compiled,hf")
    p.add_argument("--chunk-size", type=int, default=64, help="our prefill chunk (CLI default on CPU)")
    p.add_argument("--out", help="also write the JSON (pretty-printed) to this file")


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """The options, derived and checked (what argparse cannot say)."""
    quick = args.quick
    args.new_tokens = args.new_tokens or (16 if quick else 64)
    args.repeats = args.repeats or (1 if quick else 3)
    args.prompts = min(args.prompts or (2 if quick else len(PROMPTS)), len(PROMPTS))
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.new_tokens < 2 or args.repeats < 1 or args.prompts < 1:
        raise InvalidRequestError("need --new-tokens >= 2, --repeats >= 1, --prompts >= 1")
    if unknown := set(args.variants) - set(VARIANTS):
        raise InvalidRequestError(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    args.models = args.models.split(",") if args.models else default_models()
    for name in args.models:
        if find_entry(name) is None:
            raise InvalidRequestError(f"{name!r} is not a catalog model")
    return args


def default_models() -> list[str]:
    return [s.name for s in model_statuses() if s.role in ("small", "target") and s.installed]


def max_context_for(prompt_lengths: list[int], n: int) -> int:
    """The cache size the CLI would pick for the longest prompt (the compiled decode attends
    over the whole cache, so this is the size a real run uses)."""
    return context_bucket(max(prompt_lengths) + n + 1, limit=1 << 16)


# ---------------------------------------------------------------- the three variants

def ours_runner(runner: StepRunner, prompts: list[list[int]], n: int):
    """fn(prompt index) → numbers for one timed slot of one of our runners."""
    greedy = SamplingParams()

    def run(i: int) -> dict:
        full, full_s = common.timed(generate, runner, prompts[i], n, greedy, stop_ids=frozenset())
        _, first_s = common.timed(generate, runner, prompts[i], 1, greedy, stop_ids=frozenset())
        return {"tpot": (full_s - first_s) / (n - 1), "full_s": full_s, "first_s": first_s,
                "tpot_internal": full.stats.time_per_output_token,
                "prefill_s": full.stats.prefill_seconds, "tokens": full.tokens}
    return run


def hf_runner(model, prompts: list[list[int]], n: int):
    def call(ids: list[int], count: int) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():  # ours runs under inference_mode too
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=count, min_new_tokens=count,
                                 eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    def run(i: int) -> dict:
        tokens, full_s = common.timed(call, prompts[i], n)
        _, first_s = common.timed(call, prompts[i], 1)
        return {"tpot": (full_s - first_s) / (n - 1), "full_s": full_s, "first_s": first_s,
                "tokens": tokens}
    return run


# ---------------------------------------------------------------- one model

def bench_model(name: str, args, tag: str) -> tuple[dict, list[common.Sample]]:
    common.log(f"{tag}loading ours (fp32)")
    loaded = load(name, dtype=torch.float32)  # not quiet: a first join/verify of qwen takes a while
    record = {"name": name, "sha256": loaded.source.sha256, "path": str(loaded.source.path),
              "format": loaded.source.format,
              "params": sum(p.numel() for p in loaded.model.parameters()),
              "load_seconds": round(loaded.load_seconds, 2), "memory_after_ours_load": common.memory_mb()}
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
    record["prompt_tokens"] = [len(p) for p in prompts]
    record["max_context"] = max_context_for(record["prompt_tokens"], args.new_tokens)
    variants, hf_model = {}, None
    if "eager" in args.variants:
        eager = StepRunner(loaded.model, record["max_context"], args.chunk_size, compile=False)
        variants["eager"] = ours_runner(eager, prompts, args.new_tokens)
    if "compiled" in args.variants:
        compiled = StepRunner(loaded.model, record["max_context"], args.chunk_size, compile=True)
        common.log(f"{tag}compiling (warm-up of both step shapes)")
        record["inductor_cache_had_entries"] = common.inductor_cache_had_entries()
        _, seconds = common.timed(compiled.warm_up)
        record["compile_seconds"] = round(seconds, 2)
        variants["compiled"] = ours_runner(compiled, prompts, args.new_tokens)
    if "hf" in args.variants:
        common.log(f"{tag}loading HF transformers from the same GGUF")
        hf_model, seconds = common.timed(load_hf_model, loaded.source, torch.float32)
        record["hf_load_seconds"] = round(seconds, 2)
        record["hf_attn_implementation"] = hf_model.config._attn_implementation
        variants["hf"] = hf_runner(hf_model, prompts, args.new_tokens)
    record["memory_after_all_loads"] = common.memory_mb()
    for variant, run in variants.items():  # untimed: first-call allocations, oneDNN setup
        common.log(f"{tag}warm-up run: {variant}")
        run(0)
    samples = common.interleaved(args.repeats, len(prompts), variants, label=tag)
    record.update(summarize_model(samples, list(variants), len(prompts)))
    torch._dynamo.reset()  # compiled graphs hold the weights; drop them before the next model
    return record, samples


def summarize_model(samples, variants: list[str], n_prompts: int) -> dict:
    out = {"variants": {}, "ratios": {}, "greedy_match": {}}
    for v in variants:
        tpot = common.values_of(samples, v, "tpot")
        entry = {"tpot_ms": common.scaled(common.summarize(tpot), 1e3),
                 "tok_per_s": round(1 / common.summarize(tpot)["median"], 2)}
        if v != "hf":
            entry["tpot_internal_ms"] = common.scaled(
                common.summarize(common.values_of(samples, v, "tpot_internal")), 1e3)
        out["variants"][v] = entry
    for num, den in (("compiled", "hf"), ("eager", "hf"), ("compiled", "eager")):
        if num in variants and den in variants:
            ratios = common.paired_ratios(samples, num, den, "tpot")
            out["ratios"][f"{num}/{den}"] = common.scaled(common.summarize(ratios), 1, 4)
    out["greedy_match"] = greedy_match(samples, variants, n_prompts)
    out["samples"] = [{"repeat": s.repeat, "prompt": s.item, "variant": s.variant,
                       **{k: round(v, 6) for k, v in s.values.items() if k != "tokens"}}
                      for s in samples]
    return out


def greedy_match(samples, variants: list[str], n_prompts: int) -> dict:
    """Per pair of variants: prompts whose tokens match exactly, and where the others diverge."""
    first = {(s.variant, s.item): s.values["tokens"] for s in samples if s.repeat == 0}
    stable = all(s.values["tokens"] == first[(s.variant, s.item)] for s in samples)
    result = {"same_tokens_every_repeat": stable}
    pairs = [(a, b) for a, b in (("eager", "hf"), ("compiled", "hf"), ("compiled", "eager"))
             if a in variants and b in variants]
    for a, b in pairs:
        diverge = {i: common.first_divergence(first[(a, i)], first[(b, i)]) for i in range(n_prompts)}
        result[f"{a}_vs_{b}"] = {
            "exact": sum(d is None for d in diverge.values()), "of": n_prompts,
            "first_divergence": {str(i): d for i, d in diverge.items() if d is not None}}
    return result


# ---------------------------------------------------------------- report

def table(records: list[dict]) -> str:
    rows = []
    for r in records:
        for v, e in r["variants"].items():
            t = e["tpot_ms"]
            vs_hf = r["ratios"].get(f"{v}/hf", {}).get("median") if v != "hf" else 1.0
            internal = e.get("tpot_internal_ms", {}).get("median")
            rows.append((r["name"], v, common.fmt(t["median"]), common.fmt_spread(t),
                         common.fmt(e["tok_per_s"], 1), common.fmt(vs_hf, 3), common.fmt(internal)))
    head = ("model", "variant", "TPOT ms (median)", "spread ms: min–max (IQR)", "tok/s",
            "TPOT / HF", "ours internal TPOT ms")
    return common.format_table(head, rows)


def notes(records: list[dict]) -> list[str]:
    lines = []
    for r in records:
        bits = [f"{r['name']}: load {r['load_seconds']} s"]
        if "compile_seconds" in r:
            cache = "non-empty" if r["inductor_cache_had_entries"] else "empty"
            bits.append(f"compile {r['compile_seconds']:.1f} s (Inductor disk cache {cache} "
                        "before; not in TPOT)")
        if "compiled/eager" in r["ratios"]:
            bits.append(f"compiled/eager TPOT {r['ratios']['compiled/eager']['median']:.3f}")
        bits.append(f"peak RSS {r['memory_after_all_loads']['peak_rss_mb']:.0f} MB")
        bits.append(f"prompt tokens {r['prompt_tokens']}, max_context {r['max_context']}")
        match = r["greedy_match"]
        for key, m in match.items():
            if key.endswith("_vs_hf") or key == "compiled_vs_eager":
                extra = f" (diverge at {m['first_divergence']})" if m["first_divergence"] else ""
                bits.append(f"greedy {key.replace('_', ' ')}: {m['exact']}/{m['of']} exact{extra}")
        if not match["same_tokens_every_repeat"]:
            bits.append("WARNING: tokens changed between repeats")
        lines.append("; ".join(bits))
    return lines


def run(args: argparse.Namespace, record: Results) -> int | None:
    args = checked(args)
    threads = common.set_threads(args.threads)
    common.log(f"models {args.models}; {args.prompts} prompts x {args.new_tokens} tokens x "
               f"{args.repeats} repeats; variants {args.variants}; {threads} threads")
    if "hf" in args.variants:
        import transformers  # optional and slow to import: only the HF baseline needs it

        transformers.logging.set_verbosity_error()  # its generation warnings would bury progress
        transformers.logging.disable_progress_bar()
    load_before = common.load_average()
    records = []
    for k, name in enumerate(args.models, 1):
        measured, _ = bench_model(name, args, tag=f"[{name} {k}/{len(args.models)}] ")
        records.append(measured)
        gc.collect()  # the model's locals are gone now; free its memory before the next load
    print(table(records))
    print()
    print("method: " + METHOD + ". 'TPOT / HF' < 1 means faster than HF.")
    for line in notes(records):
        print(line)
    result = {"benchmark": "decode", "method": METHOD,
              "environment": common.environment(dtype="float32", load_average_before=load_before),
              "config": {"models": args.models, "variants": args.variants, "prompts": args.prompts,
                         "prompt_texts": list(PROMPTS[:args.prompts]), "new_tokens": args.new_tokens,
                         "repeats": args.repeats, "chunk_size": args.chunk_size, "quick": args.quick,
                         "interleave": "repeat > prompt > variant, variant order rotated per repeat"},
              "models": records,
              "statistic": "TPOT: median over (repeat, prompt) runs; ratios: medians of paired per-(repeat, prompt) "
                           "TPOT ratios"}
    record.write(result, args.out)
    return 0

