"""Weight formats, measured (issue 22): for each format, a bundle of the recipe compiled in it and
measured on this CPU.

    yggdrasil bench formats --recipe recipes/smollm2-lookup-cpu.yaml
    yggdrasil bench formats --recipe recipes/qwen-pair-cpu.yaml --formats fp32,int8 --tokens 48

Per format: eager T(n) for n = 1..64 (one verify step of n rows, the objective's cost curve),
the compiled bundle's own T(1) and T(V) (its decode and verify graphs, measured at compile's
warm-load check; "-" in the table and null in the JSON for a bundle that chose no speculation,
which keeps no verify graph and measures none), AR TPOT and speculative TPOT (the bundle's own
policy: EGT over a draft model, or prompt lookup) from the bundle's graphs, greedy next-token agreement with fp32 and
held-out perplexity (as compile measured them), weight bytes, bundle size and compile time.
Every format's bundle is compiled with the quality floor lowered to 0.01, so int4 is measured
too; the table says which formats pass the recipe's own floor. Prints a table naming the CPU,
writes JSON and a PNG of T(n) per format, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml
from .common import cpu_name, environment, format_table, log, set_threads, timed
from .provenance import Results
from . import plots

from yggdrasil.runtime import latency
from yggdrasil.errors import InvalidRequestError
from yggdrasil.bundle import open_bundle
from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.runtime.generate import generate
from yggdrasil.models.loader import load, parse_dtype
from yggdrasil.models.quant import weight_bytes
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.steps import StepRunner

FORMATS = ("fp32", "bf16", "int8", "int4")
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PROMPTS = ("def fibonacci(n):",
           "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
           "The three laws of thermodynamics can be summarised as follows:")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="the recipe each format's bundle is compiled from")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated (default all four)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="rows n for the eager T(n) curve")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per timed generation (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (default 3)")
    p.add_argument("--work", default=str(Path.home() / ".cache" / "yggdrasil" / "bench-formats"),
                   help="where the recipes and bundles go, reused when up to date (default ~/.cache/yggdrasil/"
                        "bench-formats)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/formats-RECIPE.json)")


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """The options, derived and checked (what argparse cannot say)."""
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if unknown := set(args.formats) - set(FORMATS):
        raise InvalidRequestError(f"unknown formats {sorted(unknown)}; choose from {','.join(FORMATS)}")
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    if args.tokens < 2 or args.repeats < 1:
        raise InvalidRequestError("need --tokens >= 2 and --repeats >= 1")
    return args


def format_recipe(recipe: Path, fmt: str, work: Path) -> Path:
    """The recipe in this weight format (quality floor lowered so every format is measured),
    written beside copies of what it names relative to itself."""
    raw = yaml.safe_load(recipe.read_text())
    quality = {**(raw.get("quality") or {}), "min_agreement": 0.01, "allow_int4": True}
    raw.update(weights=fmt, quality=quality, name=f"{raw['name']}-{fmt}")
    base = load_recipe(recipe)
    for key in ("target", "draft"):
        if raw.get(key) and raw[key] != "lookup":
            raw[key] = base.resolve(raw[key])
    raw["calibration"]["prompts"] = [base.resolve(p) if p.endswith(".jsonl") else p
                                     for p in raw["calibration"]["prompts"]]
    path = work / f"{recipe.stem}-{fmt}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def eager_curve(name: str, dtype: str, fmt: str, sizes: list[int], max_context: int) -> dict[int, float]:
    """Milliseconds of one n-row verify step of the model in this format, eager (median of 5)."""
    loaded = load(name, dtype=parse_dtype(dtype), quiet=True, weights=fmt)
    runner = StepRunner(loaded.model, max_context, chunk_size=64)
    profile = latency.measure_profile(runner, None, sizes, repeats=5, draft_widths=(), warmup=2)
    return {n: round(t * 1e3, 4) for n, t in profile.verify if n in sizes}


def tpot(generator, prompts: list[list[int]], tokens: int, repeats: int, speculate: bool) -> dict:
    """Median time per output token (after the first) from the bundle's graphs, AR or with its
    own speculation policy; and the mean tokens per target step when speculating."""
    times, steps = [], []
    for _ in range(repeats):
        for ids in prompts:
            speculator = generator.speculator() if speculate else None
            if speculator is not None:
                result = speculator.generate(ids, tokens, SamplingParams(temperature=0.0))
                steps.append(result.spec.summary())
            else:
                result = generate(generator.runner, ids, tokens, SamplingParams())
            times.append(result.stats.time_per_output_token)
    return {"tpot_ms": round(statistics.median(times) * 1e3, 3), "spec": steps[-1] if steps else None}


def bench_format(recipe_path: Path, fmt: str, args, work: Path) -> dict:
    recipe = load_recipe(recipe_path)
    out = work / f"bundle-{recipe_path.stem}"
    log(f"[{fmt}] compiling {recipe_path} into {out}")
    result, compile_s = timed(build_bundle, recipe, out, log=lambda m: log(f"[{fmt}] {m}"))
    manifest = result.manifest
    bundle = open_bundle(out, quiet=True)
    generator = bundle.generator()
    # A recipe naming fp32 skips the formats phase: fp32 is the reference itself.
    measured = next((c for c in manifest.formats.get("candidates", ()) if c["format"] == fmt), None) or {
        "agreement": 1.0, "positions": None, "perplexity": None,
        "weight_bytes": weight_bytes(generator.runner.model)}
    prompts = [generator.tokenizer.encode(p) for p in PROMPTS]
    log(f"[{fmt}] timing AR and speculative decoding from the bundle")
    ar, spec = (tpot(generator, prompts, args.tokens, args.repeats, s) for s in (False, True))
    log(f"[{fmt}] eager T(n) for n = {args.sizes}")
    curve = eager_curve(manifest.models["target"]["name"], manifest.dtype, fmt, args.sizes, recipe.max_context)
    return {"format": fmt, "eager_t_ms": curve, **bundle_step_times(bundle), "ar_tpot_ms": ar["tpot_ms"],
            "spec_tpot_ms": spec["tpot_ms"], "spec": spec["spec"],
            "agreement": measured["agreement"], "positions": measured["positions"],
            "perplexity": measured["perplexity"], "weight_bytes": measured["weight_bytes"],
            "bundle_bytes": sum(a["bytes"] for a in manifest.artifacts.values()),
            "compile_seconds": round(compile_s, 1), "reused_bundle": result.reused,
            "measurement_quality": manifest.stats.get("measurement_quality"),
            "passes_recipe_floor": fmt == "fp32" or (measured["agreement"] or 0) >= args.floor}


def bundle_step_times(bundle) -> dict:
    """The bundle's own T(1) and T(V) at its widest verify graph, in ms, as compile's warm-load check
    measured them. A bundle that chose no speculation dropped its verify graphs and measured nothing:
    its profile is the unmeasured default (1 s a step), so both are None ("-" in the table)."""
    if not bundle.layout.read_selection()["draft_widths"]:
        return {"bundle_t1_ms": None, "bundle_widest_verify": None}
    profile = bundle.latency()
    widest = max(n for n, _ in profile.verify)
    return {"bundle_t1_ms": round(profile.t_verify(1) * 1e3, 3),
            f"bundle_t{widest}_ms": round(profile.t_verify(widest) * 1e3, 3), "bundle_widest_verify": widest}


def plot(rows: list[dict], title: str, path: Path) -> None:
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for row in rows:
        sizes = sorted(int(n) for n in row["eager_t_ms"])
        ax.plot(sizes, [row["eager_t_ms"][n] for n in sizes], marker="o", label=row["format"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, labels=[str(n) for n in sizes])
    ax.set_xlabel("rows n (tokens verified in one step)")
    ax.set_ylabel("T(n), ms (eager)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    plots.save(fig, path)


def dash(value):
    return "-" if value is None else value


def table(rows: list[dict]) -> str:
    def ratio(row, n):
        curve = row["eager_t_ms"]
        return round(curve[n] / curve[1], 2) if n in curve and 1 in curve else "-"

    return format_table(
        ["format", "T(1) ms", "T(16)/T(1)", "T(64)/T(1)", "bundle T(1)", "bundle T(V)", "AR TPOT", "spec TPOT",
         "agreement", "ppl", "weights MB", "compile s", "passes"],
        [[r["format"], r["eager_t_ms"].get(1, "-"), ratio(r, 16), ratio(r, 64), dash(r["bundle_t1_ms"]),
          dash(r.get(f"bundle_t{r['bundle_widest_verify']}_ms")), r["ar_tpot_ms"], r["spec_tpot_ms"],
          f"{r['agreement']:.4f}", r["perplexity"] if r["perplexity"] is not None else "-",
          round(r["weight_bytes"] / 1e6, 1), r["compile_seconds"], "yes" if r["passes_recipe_floor"] else "no"]
         for r in rows])


def run(args: argparse.Namespace, record: Results) -> int | None:
    args = checked(args)
    threads = set_threads(args.threads)
    recipe = Path(args.recipe)
    args.floor = load_recipe(recipe).quality.min_agreement
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = [bench_format(format_recipe(recipe, fmt, work), fmt, args, work) for fmt in args.formats]
    cpu = cpu_name()
    print(f"\nweight formats for {recipe.name} on {cpu}, {threads} thread(s); T(n) eager, TPOT from the bundle")
    print(table(rows))
    out = Path(args.out or f"bench/results/formats-{recipe.stem}.json")
    png = out.with_suffix(".png")
    plot(rows, f"T(n) per weight format, {recipe.stem} on {cpu} ({threads} threads)", png)
    log(f"wrote {png}")
    record.write({"suite": "formats", "recipe": str(recipe), "cpu": cpu, "threads": threads,
               "environment": environment(), "tokens": args.tokens, "repeats": args.repeats, "rows": rows,
               "statistic": "T(n): median of 5 eager steps; TPOT: median over (repeat, prompt) runs of the bundle; "
                            "agreement: share of teacher-forced positions whose argmax equals fp32's"}, out)
    return 0

