"""Weight-format kernels on this CPU: T(n), the cost of a step of n rows, per format.

Two measurements per model shape (SmolLM2-135M and Qwen2.5-Coder-1.5B, random weights of their
shapes: kernel time does not depend on the values):

  per linear   each distinct big linear (wqkv, wo, w13, w2, head) alone, eager: the ATen kernel a
               compiled graph calls for it (the graphs lower these linears to the same extern calls)
  whole step   the model's step forward exported with symbolic rows (1..64) and compiled by
               AOTInductor exactly as compile does (no constants in the package; weights bound from
               the live model at load), run at each n

Build the graphs first (compiling is heavy: run it at low priority), then measure at normal priority:

    nice -n 19 yggdrasil bench kernels build
    yggdrasil bench kernels measure --tag cpu-epyc-zen5-2c

`measure` prints a table naming the CPU, writes bench/results/kernels-TAG.{json,png} and ends with
one JSON line. Times are the best of the repeats (the machine is shared: the best is the closest to
an unloaded run) with the median alongside; the load average is recorded.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.export import Dim

from .common import environment, format_table, load_average, log, set_threads, timed
from yggdrasil.bench.llama_cpp import find_tool
from .provenance import Results
from . import plots
from yggdrasil import kernels
from yggdrasil.buckets import SPAN_UNIT
from yggdrasil.models.catalog import resolve_model
from yggdrasil.graphs.aoti import StepModule, package_graph
from yggdrasil.config import ModelConfig
from yggdrasil.storage.registry import open_graph
from yggdrasil.models.model import Transformer
from yggdrasil.models.quant import WEIGHT_FORMATS, apply_weight_format, weight_bytes

ROWS = (1, 2, 4, 8, 16, 32, 64)
SHAPES = {
    "smollm2-135m": ModelConfig("llama", 49152, 576, 30, 9, 3, 64, 1536, 1e-5, 1e5, 8192,
                                tie_embeddings=True),
    "qwen2.5-coder-1.5b": ModelConfig("qwen2", 151936, 1536, 28, 12, 2, 128, 8960, 1e-6, 1e6, 32768,
                                      qkv_bias=True),
}
WORK = Path("/tmp/yggdrasil-bench-kernels")
MAX_CONTEXT = 2 * SPAN_UNIT


def random_model(cfg: ModelConfig, fmt: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    # a random tile repeated over each weight: values do not change kernel time, and filling a
    # 1.5B-parameter model with fresh random numbers takes minutes on two cores
    tile = torch.randn(1 << 20) * 0.02
    with torch.no_grad():
        for param in model.parameters():
            flat = param.view(-1)
            for start in range(0, flat.numel(), tile.numel()):
                chunk = flat[start:start + tile.numel()]
                chunk.copy_(tile[:chunk.numel()])
    model.inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float32)
    model = model.eval().requires_grad_(False)
    apply_weight_format(model, fmt)
    model.setup_cache(1, MAX_CONTEXT)
    return model


def step_inputs(rows: int) -> tuple:
    tokens = torch.randint(0, 1000, (1, rows))
    positions = torch.arange(rows)[None]
    mask = torch.ones(1, rows, SPAN_UNIT, dtype=torch.bool)
    return tokens, positions, positions.clone(), mask


def graph_path(model_name: str, fmt: str, work: Path = WORK) -> Path:
    return Path(work) / model_name / f"{fmt}.pt2"


def build(models: list[str], formats: list[str], work: Path = WORK) -> None:
    """One graph per model and format, rows symbolic (1..64), span fixed at one unit."""
    for name in models:
        for fmt in formats:
            path = graph_path(name, fmt, work)
            if path.is_file():
                log(f"{name} {fmt}: {path} exists")
                continue
            model = random_model(SHAPES[name], fmt)
            started = time.perf_counter()
            rows = Dim("rows", min=1, max=max(ROWS))
            dynamic = ({1: rows}, {1: rows}, {1: rows}, {1: rows})
            with torch.no_grad():
                exported = torch.export.export(StepModule(model, False), step_inputs(8),
                                               dynamic_shapes=dynamic, strict=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            package_graph(exported, path)
            log(f"{name} {fmt}: compiled in {time.perf_counter() - started:.0f}s")
            del model, exported
            gc.collect()


def best_and_median(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm
    times = sorted(timed(fn)[1] for _ in range(repeats))
    return times[0] * 1e3, times[len(times) // 2] * 1e3


def time_call(fn, args: tuple, repeats: int) -> tuple[float, float]:
    return best_and_median(lambda: fn(*args), repeats)


def linear_shapes() -> dict[str, str]:
    return {"wqkv": "layers.0.attention.wqkv", "wo": "layers.0.attention.wo",
            "w13": "layers.0.feed_forward.w13", "w2": "layers.0.feed_forward.w2", "head": "output"}


def measure_linears(model: Transformer, repeats: int) -> dict[str, dict[int, list[float]]]:
    out = {}
    with torch.no_grad():
        for short, name in linear_shapes().items():
            linear = model.get_submodule(name)
            out[short] = {n: time_call(linear, (torch.randn(1, n, linear.in_features),), repeats) for n in ROWS}
    return out


def measure_step(model: Transformer, path: Path, repeats: int) -> dict[int, list[float]]:
    graph = open_graph(path, model, "rows", "yggdrasil bench kernels build")
    with torch.no_grad():
        return {n: time_call(graph, step_inputs(n), repeats) for n in ROWS}


def measure_one(name: str, fmt: str, repeats: int, work: Path = WORK, library: Path | None = None) -> dict:
    """library: a built kernel library to measure instead of this checkout's (another version's)."""
    if library is not None:
        kernels.load(library)
    model = random_model(SHAPES[name], fmt)
    entry = {"weight_bytes": weight_bytes(model), "load_before": load_average()}
    if fmt == "q4":  # the kernel path that ran ($YGGDRASIL_KERNEL_ISA forces a lower one)
        entry["kernel_isa"] = kernels.kernel_isa()
    entry["linears"] = measure_linears(model, repeats)
    path = graph_path(name, fmt, work)
    entry["step"] = measure_step(model, path, repeats) if path.is_file() else None
    entry["load_after"] = load_average()
    return entry


def _rows_as_ints(entry: dict) -> dict:
    """JSON made the row counts strings; the table and plot index by int."""
    def rows(times):
        return None if times is None else {int(n): t for n, t in times.items()}
    return {**entry, "step": rows(entry["step"]),
            "linears": {k: rows(v) for k, v in entry["linears"].items()}}


def measure(models: list[str], formats: list[str], repeats: int, threads: int, work: Path = WORK,
            compare: tuple[str, Path] | None = None, rounds: int = 1) -> dict:
    """Each model and format in a process of its own: freed weights stay in the allocator's arenas,
    and four 1.5B-parameter models in one process run out of memory. compare (label, library):
    q4 is measured with that library too, alternating with this checkout's for `rounds` rounds,
    so a before/after pair shares the machine's state; each point is the best over the rounds."""
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        def one(name: str, fmt: str, library: Path | None) -> dict:
            out = Path(scratch) / f"{name}-{fmt}.json"
            subprocess.run([sys.executable, "-m", "yggdrasil.cli", "bench", "kernels", "measure-one", "--models", name,
                            "--formats", fmt, "--repeats", str(repeats), "--threads", str(threads),
                            "--work", str(work), "--out", str(out),
                            *(["--kernel-library", str(library)] if library else [])], check=True)
            return _rows_as_ints(json.loads(out.read_text()))

        for name in models:
            for fmt in formats:
                libraries = [(fmt, None)] + ([(f"{fmt} [{compare[0]}]", compare[1])] if compare and fmt == "q4" else [])
                runs = {key: [] for key, _ in libraries}
                for _ in range(rounds if len(libraries) > 1 else 1):
                    for key, library in libraries:
                        runs[key].append(one(name, fmt, library))
                for key, library in libraries:
                    results.setdefault(name, {})[key] = best_over_rounds(runs[key], library)
                log(f"{name} {fmt}: measured")
    return results


def best_over_rounds(entries: list[dict], library: Path | None) -> dict:
    """One entry from several rounds: each point's best over the rounds, its median of medians."""
    def merge(series: list[dict | None]) -> dict | None:
        if series[0] is None:
            return None
        return {n: [min(s[n][0] for s in series), statistics.median(s[n][1] for s in series)] for n in series[0]}

    first = entries[0]
    merged = {**first, "rounds": len(entries), "step": merge([e["step"] for e in entries]),
              "linears": {k: merge([e["linears"][k] for e in entries]) for k in first["linears"]}}
    if library is not None:
        merged["library"] = {"path": str(library), "sha256": hashlib.sha256(Path(library).read_bytes()).hexdigest()}
    return merged


GGUF_OF = {"smollm2-135m": "smollm2-135m", "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b"}  # catalog names


def llama_bench(directory: Path, name: str, threads: int, repeats: int) -> dict | None:
    """llama.cpp's own step curve on the model's GGUF: `llama-bench -p n` processes n tokens in
    one batch (its prompt path, which is what a verify of n rows is), reported in tokens/s;
    returned in this module's shape (step: {n: [best ms, mean ms]}), None without a GGUF."""
    tool = find_tool(directory, "llama-bench")
    if tool is None or name not in GGUF_OF:
        return None
    gguf = resolve_model(GGUF_OF[name]).path
    done = subprocess.run([str(tool), "-m", str(gguf), "-p", ",".join(map(str, ROWS)), "-n", "0",
                           "-t", str(threads), "-r", str(repeats), "-o", "json"],
                          capture_output=True, text=True, check=True)
    step = {}
    for test in json.loads(done.stdout):
        n = int(test["n_prompt"])
        step[n] = [1e3 * n / max(test["samples_ts"]), 1e3 * n / test["avg_ts"]]  # best, mean
    return {"weight_bytes": Path(gguf).stat().st_size, "linears": {}, "step": step,
            "what": f"llama-bench -p (batched prompt tokens), {Path(gguf).name}"}


def table(results: dict) -> str:
    lines = []
    for name, by_fmt in results.items():
        headers = ["format", "what", "MB"] + [f"T({n}) ms" for n in ROWS] + ["T(8)/T(1)", "T(16)/T(1)"]
        rows = []
        for fmt, entry in by_fmt.items():
            # llama.cpp's curve is llama-bench's batched prompt path, not one of our compiled steps
            step = "llama-bench -p n" if fmt == "llama.cpp" else "step (AOTI)"
            series = {step: entry["step"], **{f"{k} (eager)": v for k, v in entry["linears"].items()}}
            for what, times in series.items():
                if times is None:
                    continue
                best = [times[n][0] for n in ROWS]
                label = f"{fmt} ({entry['kernel_isa']})" if "kernel_isa" in entry else fmt
                rows.append([label, what, f"{entry['weight_bytes'] / 1e6:.0f}"] + [f"{t:.2f}" for t in best]
                            + [f"{best[ROWS.index(n)] / best[0]:.2f}" for n in (8, 16)])
        lines.append(f"{name}: best of repeats (ms)\n" + format_table(headers, rows))
    return "\n\n".join(lines)


def plot(results: dict, path: Path, title: str) -> None:
    plt = plots.pyplot()

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, by_fmt) in zip(axes[0], results.items()):
        for fmt, entry in by_fmt.items():
            if entry["step"] is None:
                continue
            best = [entry["step"][n][0] for n in ROWS]
            ax.plot(ROWS, [t / best[0] for t in best], marker="o",
                    label=f"{fmt} (T(1) {best[0]:.1f} ms)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ROWS, labels=[str(n) for n in ROWS])
        ax.set_xlabel("rows n")
        ax.set_ylabel("T(n) / T(1), compiled step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    plots.save(fig, path)


def summary(results: dict) -> dict:
    out = {}
    for name, by_fmt in results.items():
        for fmt, entry in by_fmt.items():
            if entry["step"]:
                t1, t8, t16 = (entry["step"][n][0] for n in (1, 8, 16))
                out[f"{name}/{fmt}"] = {"t1_ms": round(t1, 2), "t8_over_t1": round(t8 / t1, 2),
                                        "t16_over_t1": round(t16 / t1, 2),
                                        **({"kernel_isa": entry["kernel_isa"]} if "kernel_isa" in entry else {})}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build", "measure", "measure-one"])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--formats", default=",".join(WEIGHT_FORMATS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--work", type=Path, default=WORK, help=f"where build puts the graphs (default {WORK})")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--kernel-library", type=Path, default=None, help=argparse.SUPPRESS)  # measure-one
    parser.add_argument("--compare-library", default=None, metavar="LABEL=PATH",
                        help="measure: q4 also with this built kernel library (another version's, e.g. before a "
                             "change), alternating with this checkout's; its rows are labelled q4 [LABEL]")
    parser.add_argument("--rounds", type=int, default=3, help="with --compare-library: alternations (default 3)")
    parser.add_argument("--llama-bench", default=None, metavar="DIR",
                        help="measure: also run llama.cpp's llama-bench (from this build directory) on the "
                             "model's GGUF at the same rows and threads, for its curve beside ours")


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = set_threads(args.threads)
    models, formats = args.models.split(","), args.formats.split(",")
    if args.action == "build":
        build(models, formats, args.work)
        return
    if args.action == "measure-one":
        entry = measure_one(models[0], formats[0], args.repeats, args.work, args.kernel_library)
        Path(args.out).write_text(json.dumps(entry))
        return
    compare = None
    if args.compare_library:
        label, _, path = args.compare_library.partition("=")
        if not path or not Path(path).is_file():
            raise SystemExit(f"--compare-library takes LABEL=PATH of a built kernel library, got {args.compare_library!r}")
        compare = (label, Path(path))
    curves = measure(models, formats, args.repeats, threads, args.work, compare, args.rounds)
    if args.llama_bench:
        for name in models:
            peer = llama_bench(Path(args.llama_bench), name, threads, args.repeats)
            if peer is not None:
                curves[name]["llama.cpp"] = peer
    env = environment(threads=threads, rows=list(ROWS), repeats=args.repeats,
                      timing="best of repeats (median alongside); step: AOTInductor graph, symbolic rows")
    print(f"{env['device']}, torch {torch.__version__}, {threads} threads, load {load_average()}")
    print(table(curves))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(curves, out / f"kernels-{args.tag}.png",
         f"T(n)/T(1) per weight format, {env['device']}, {threads} thread(s), load {load_average()}")
    result = {"bench": "kernels", "environment": env, "results": curves, "summary": summary(curves),
              "statistic": f"ms per step: the best of {args.repeats} repeats (their median alongside)"
                           + (f", best over {args.rounds} alternating rounds per library" if compare else "")
                           + "; summary ratios T(n)/T(1) of those bests"}
    record.write(result, out / f"kernels-{args.tag}.json")

