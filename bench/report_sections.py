"""Sections of docs/results.md for the single-subsystem benchmarks (the retired decode and spec
suites' committed files; bundle.py, planner.py, serve.py, serve_graph.py, memory.py) and for the committed profile,
calibration and chat records, plus the helpers bench/report.py shares.

Every renderer reads one committed file and returns Markdown lines. Tables, bullet points and the
device line come from the file. The hand-written explanation under a section is in
bench/commentary.yaml (commentary_on); any number in it is filled in from the file, never typed in."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path


from .common import fmt, markdown_table
from yggdrasil.yaml_files import parse_yaml

DESIGN_31 = "[design §3.1](design.md#31-latency-aware-objective-yggdrasil-41)"

# How the files without a recorded command line were produced (fixed text, not measurements).
COMMANDS = {
    "decode-cpu-xeon2c.json": "python bench/decode.py --models smollm2-135m,qwen2.5-coder-1.5b --repeats 2",
    "spec-qwen-cpu-xeon2c.json": "python bench/spec.py --n-prompts 2 --repeats 1",
    "spec-smollm2-lookup-cpu-xeon2c.json": (
        "python bench/spec.py --target smollm2-135m --draft lookup --specs lookup:4x1,lookup:4x3:6,lookup:6x2:4 "
        "--compiled-spec --n-prompts 5 --repeats 2"),
    "auto-qwen-cpu-xeon2c.json": (
        "python bench/spec.py --specs auto,best,sequoia:4 --calibration qwen-cal --profile "
        "bench/results/profile-qwen-pair-compiled-cpu-xeon2c.yaml --split held-out --n-prompts 3 "
        "--compiled-spec --no-eager-spec"),
    "auto-smollm2-lookup-cpu-xeon2c.json": (
        "python bench/spec.py --target smollm2-135m --draft lookup --specs auto,lookup:4x1,lookup:6x4:32 "
        "--calibration smol-cal --split held-out --n-prompts 5 --new-tokens 96 --repeats 2 --compiled-spec "
        "--no-eager-spec"),
    "bundle-smollm2-lookup-cpu-xeon2c.json": (
        "python bench/bundle.py --recipe recipes/smollm2-lookup-cpu.yaml --bundle DIR --prompts 4 --repeats 2"),
    "bundle-qwen-pair-cpu-xeon2c.json": (
        "python bench/bundle.py --recipe recipes/qwen-pair-cpu.yaml --bundle DIR --prompts 2 --max-new-tokens 48 "
        "--repeats 1 --load-repeats 2"),
    "profile-smollm2-cpu-xeon2c.yaml": "yggdrasil profile --model smollm2-135m --out FILE.yaml",
    "profile-qwen-pair-cpu-xeon2c.yaml": (
        "yggdrasil profile --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --no-compile --out FILE.yaml"),
    "profile-qwen-pair-compiled-cpu-xeon2c.yaml": (
        "yggdrasil profile --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --sizes 1,2,4,8,16,32 "
        "--contexts 512 --chunks 64 --out FILE.yaml"),
}


# ------------------------------------------------------------------------------------ helpers

num = fmt  # the one number formatter (bench/common.py)


def med(stat):
    """The median of a {'median', 'min', ...} record, or the value itself."""
    return stat.get("median") if isinstance(stat, dict) else stat


def span(values, digits: int = 2, unit: str = "") -> str:
    """'lo–hi' over the values that are there (one value if they agree at this precision)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    lo, hi = f"{min(vals):.{digits}f}", f"{max(vals):.{digits}f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def times(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


table = markdown_table  # the one Markdown table (bench/common.py)


def load(path: Path):
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    return parse_yaml(text)


def device_line(env: dict, dtype: str | None = None) -> str:
    """The device a file says it ran on, as the file records it."""
    bits = [env.get("device") or env.get("cpu") or "device not recorded"]
    if env.get("cpu_capability"):
        bits.append(env["cpu_capability"])
    if env.get("torch_threads"):
        bits.append(f"{env['torch_threads']} torch threads")
    torch = env.get("torch") or env.get("torch_version")
    if torch:
        bits.append(f"torch {torch}")
    if dtype or env.get("dtype"):
        bits.append(dtype or env["dtype"])
    date = env.get("date") or env.get("created")
    if date:
        bits.append(f"run {str(date)[:10]}")
    return "Device: " + ", ".join(bits) + "."


def commentary(text: str) -> list[str]:
    return ["", f"> *Commentary.* {text}", ""]


@functools.cache  # read once per report run; the file does not change under it
def _commentaries() -> dict[str, str]:
    return parse_yaml((Path(__file__).parent / "commentary.yaml").read_text())


def commentary_on(section: str, **fill: str) -> list[str]:
    """The hand-written commentary for a section (bench/commentary.yaml), its {names} filled in."""
    return commentary(_commentaries()[section].format(**fill))


@dataclass
class Ctx:
    """Where the document goes: links are relative to it, shown paths to the working directory."""
    out_dir: Path

    def show(self, path: Path) -> str:
        try:
            return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
        except ValueError:
            return Path(path).as_posix()

    def link(self, path: Path) -> str:
        return Path(os.path.relpath(Path(path).resolve(), self.out_dir.resolve())).as_posix()

    def image(self, path: Path, alt: str) -> list[str]:
        return ["", f"![{alt}]({self.link(path)})"] if path.is_file() else []

    def source(self, path: Path, command: str | None = None) -> str:
        cmd = command or COMMANDS.get(path.name)
        if not cmd:
            return f"File `{self.show(path)}`."
        if not cmd.startswith("python bench/"):
            return f"File `{self.show(path)}`, from `{cmd}`."
        # the command as it was run then: a script, now `yggdrasil bench NAME` or retired
        retired = cmd.startswith(("python bench/spec.py", "python bench/decode.py"))
        now = ("retired since: `bench compare` runs the same rows on a bundle" if retired
               else "now a `yggdrasil bench` suite")
        return f"File `{self.show(path)}`, from `{cmd}` (then a script; {now})."


# ------------------------------------------------------------------------ autoregressive decode

def decode(path: Path, ctx: Ctx) -> list[str]:
    d = load(path)
    lines = [ctx.source(path), device_line(d["environment"]), "",
             f"{d['config']['prompts']} prompts x {d['config']['new_tokens']} tokens x "
             f"{times(d['config']['repeats'], 'repeat')}; TPOT in ms per token (median).", ""]
    rows = []
    for m in d["models"]:
        v, match = m["variants"], m.get("greedy_match", {})
        same = all(x.get("exact") == x.get("of") for k, x in match.items() if isinstance(x, dict))
        rows.append([m["name"], num(med(v["eager"]["tpot_ms"]), 1), num(med(v["compiled"]["tpot_ms"]), 1),
                     num(med(v["hf"]["tpot_ms"]), 1), num(med(m["ratios"]["compiled/hf"])),
                     "yes" if same else "NO", num(m["load_seconds"], 1),
                     num(m.get("memory_after_all_loads", {}).get("peak_rss_mb"), 0)])
    lines += table(["model", "ours eager", "ours compiled", "HF `generate`", "compiled / HF",
                    "same greedy tokens", "load s", "peak RSS MB (ours + HF)"], rows) + [""]
    if d["environment"].get("dtype") == "float32":
        for m in d["models"]:
            gb = m["params"] * 4 / 1e9
            tpot = med(m["variants"]["compiled"]["tpot_ms"]) / 1e3
            lines.append(f"- {m['name']}: {gb:.1f} GB of fp32 weights per token at the compiled TPOT is "
                         f"{gb / tpot:.0f} GB/s of weight traffic.")
    return lines + commentary_on("decode")


# --------------------------------------------------------------- speculative decoding and --auto

def _spec_label(name: str, specs: dict) -> str:
    compiled = name.startswith("c-")
    s = specs.get(name[2:] if compiled else name)
    if s is None:
        label = {"ar-eager": "autoregressive, eager", "ar-compiled": "autoregressive, compiled"}.get(name, name)
    elif s["kind"] == "auto":
        label = "EGT `--auto`"
    elif s["kind"] == "sequoia":
        label = f"Sequoia tree for V = {s['verify']}"
    elif s["kind"] == "static":
        label = f"static tree {name.split('static-')[-1]}"
    else:
        prefix = "lookup " if s["kind"] == "lookup" else ""
        label = (f"{prefix}chain D={s['depth']}" if s["shape"] == "chain" else
                 f"{prefix}EGT D={s['depth']} W={s['width']}" + (f" V={s['verify']}" if s["verify"] else ""))
    return label + (", compiled" if compiled else "")


def spec(path: Path, ctx: Ctx) -> list[str]:
    d = load(path)
    cfg, res = d["config"], d["results"]
    specs = {s["name"]: s for s in cfg["specs"]}
    sets = [k for k in res if k != "all"]
    models = d["models"]
    lines = [ctx.source(path), device_line(d["environment"]), "",
             f"Target {models['target']['name']}, draft {(models.get('draft') or {}).get('name', cfg['draft'])}; "
             f"{cfg['n_prompts_per_set']} prompts per set ({cfg.get('split', 'first prompts')}) x {cfg['new_tokens']} "
             f"tokens x {times(cfg['repeats'], 'repeat')}; speculation: {cfg['spec_mode']}. "
             "Each cell: TPOT ms (median), "
             "AAL, speed-up over compiled autoregressive decoding (median of paired ratios).", ""]
    rows = []
    for name in cfg["variants"]:
        cells = []
        for group in sets + ["all"]:
            r = res[group][name]
            x = med(r.get("speedup_vs_ar-compiled"))
            cells.append(f"{num(med(r['tpot_ms']), 1)} ms" + (f", AAL {num(r['aal'])}" if r.get("aal") else "")
                         + (f", {num(x)}x" if x is not None else ""))
        rows.append([_spec_label(name, specs)] + cells)
    lines += table(["variant"] + sets + ["all prompts"], rows)
    bad = d["correctness"]["invalid"]
    lines += ["", "- Greedy tokens: " + ("every variant equals autoregressive greedy on every prompt."
                                         if not bad else f"INVALID: {', '.join(map(str, bad))}.")]
    spec_rows = {n: r for n, r in res["all"].items() if r.get("aal")}

    def lookup(name: str) -> bool:
        kind = specs.get(name[2:] if name.startswith("c-") else name, {}).get("kind")
        return kind == "lookup" or (kind == "auto" and cfg["draft"] == "lookup")

    drafted = [med(r["draft_pct"]) for n, r in spec_rows.items() if not lookup(n)]
    if spec_rows:
        lines.append("- Share of decode time: host-side tree work "
                     f"{span([med(r['host_overhead_pct']) for r in spec_rows.values()], 1)} %"
                     + (f"; draft-model forwards {span(drafted, 1)} %." if drafted else "."))
    for name, r in res["all"].items():
        if r.get("buckets"):
            total = sum(r["buckets"].values())
            picks = ", ".join(f"{k} {v / total:.0%}" if v / total >= 0.005 else f"{k} <1%"
                              for k, v in r["buckets"].items())
            lines.append(f"- {_spec_label(name, specs)} chose, over {total} iterations: {picks}.")
    if d.get("setup", {}).get("auto_policy"):
        lines.append(f"- Policy: {d['setup']['auto_policy']}.")
    return lines


# ------------------------------------------------------------------------ profiles, calibration

def profile(path: Path, ctx: Ctx) -> list[str]:
    d = load(path)
    lines = [ctx.source(path), device_line(d), ""]
    for role in ("target", "draft"):
        m = d.get(role)
        if not m:
            continue
        cols = sorted({(s["mode"], s["context"]) for s in m["steps"]}, key=lambda c: (c[0] != "compiled", c[1]))
        at = {(s["mode"], s["context"], s["n"]): s["median_s"] for s in m["steps"]}
        sizes = sorted({s["n"] for s in m["steps"]})
        lines += [f"**{role} {m['name']}**, step time in ms for n new tokens:", ""]
        lines += table(["n"] + [f"{mode}, context {c}" for mode, c in cols],
                       [[n] + [num(at[(mode, c, n)] * 1e3 if (mode, c, n) in at else None, 1) for mode, c in cols]
                        for n in sizes])
        first = cols[0]
        if all((first[0], first[1], n) in at for n in (1, 2, 4)):
            one = at[(first[0], first[1], 1)]
            lines += ["", f"- {first[0]}, context {first[1]}: T(2) = {at[(first[0], first[1], 2)] / one:.2f} x T(1), "
                          f"T(4) = {at[(first[0], first[1], 4)] / one:.2f} x T(1)."]
        chunks = ", ".join(f"{c['n']} tokens {c['mode']} {c['median_s'] * 1e3:.0f} ms"
                           for c in m.get("prefill_chunks", []))
        lines += (["", f"Prefill chunks: {chunks}."] if chunks else []) + [""]
    return lines + ctx.image(path.with_suffix(".png"), path.stem)


def calibration(paths: list[Path], ctx: Ctx) -> list[str]:
    """One row per calibration-*.yaml with its predictor-*.yaml."""
    rows, lines = [], []
    for path in paths:
        cal = load(path)
        pred_path = path.with_name(path.name.replace("calibration-", "predictor-"))
        pred = load(pred_path) if pred_path.is_file() else {}
        held, obj = pred.get("held_out", {}), pred.get("objective", {})
        lines.append(f"- {ctx.source(path)} {device_line(cal)}")
        rows.append([f"{cal['target']} + {cal['draft']}", f"{cal['prompts']} x {cal['max_new_tokens']}",
                     cal["iterations"], " ".join(f"{a:.2f}" for a in cal["depth_acceptance"]),
                     f"{held.get('accuracy', 0):.0%} ({held.get('majority_accuracy', 0):.0%})",
                     f"{num(held.get('log_loss'), 3)} ({num(held.get('constant_log_loss'), 3)})",
                     f"{obj.get('constant_shape')}: {num(obj.get('constant_speedup'))}",
                     num(obj.get("predicted_speedup")), num(obj.get("oracle_speedup")),
                     num(held.get("inference_us"), 0)])
    lines += [""] + table(["pair", "prompts x tokens", "iterations", "per-depth acceptance",
                           "predictor accuracy (majority)", "log-loss (constant)", "best constant bucket",
                           "predictor", "oracle", "µs per prediction"], rows)
    for path in paths:
        lines += ctx.image(path.with_suffix(".png"), path.stem)
    return lines + commentary_on("calibration", design_31=DESIGN_31)


# --------------------------------------------------------------------------------------- bundles

def bundle(path: Path, ctx: Ctx) -> list[str]:
    d = load(path)
    c, st, load_ = d["compile"], d["compile"]["stats"], d["fresh_load"]
    p = d["prompts"]
    lines = [ctx.source(path), device_line(d["environment"]), "",
             f"Recipe `{d['recipe']}`; {p['count']} prompts x {p['max_new_tokens']} tokens; split: {p['split']}.", "",
             f"- Compiling from cold: calibration {num(st['cold_calibration_seconds'], 0)} s, "
             f"{c['graphs']} AOTInductor graphs {num(st['cold_graph_compile_seconds'], 0)} s. "
             f"This run reused {st['graphs_reused']} graphs and took {num(c['wall_seconds_this_run'], 1)} s.",
             f"- Size: {c['graph_bytes'] / 1e6:.1f} MB of graphs, {c['bundle_bytes'] / 1e6:.1f} MB in all, no weights.",
             f"- Depth predictor ({st['predictor']}): objective {num(st['objective_predicted'])} against "
             f"{num(st['objective_constant'])} for the best constant bucket, oracle {num(st['objective_oracle'])}.",
             f"- Fresh process: bundle load {num(med(load_['bundle_load_seconds']))} s, first token "
             f"{num(med(load_['first_token_seconds']))} s after the process starts "
             f"(median of {load_['first_token_seconds']['n']}); nothing compiled.", ""]
    names = {"bundle": "bundle", "compile": "`torch.compile` (`generate --compile`)", "eager": "eager"}
    rows = [[f"{names[k.split('-')[0]]} {k.split('-')[1]}", num(v["tpot_ms"], 1), num(v["speedup_vs_compile_ar"]),
             num(v["speedup_vs_eager_same_mode"])] for k, v in d["variants"].items()]
    lines += table(["variant (`ar` = autoregressive, `auto` = the bundle's policy)", "TPOT ms (median)",
                    "x compiled AR", "x eager, same mode"], rows)
    b = d["bundle_over_compile_tpot"]
    lines += ["", f"- Per token the bundle takes {num(b['ar'])}x the time of `generate --compile` in AR mode and "
                  f"{num(b['auto'])}x in auto mode (median of paired ratios)."]
    for k, h in d["host_overhead"].items():
        lines.append(f"- Host time outside the graphs, {k}: {num(h['ms_per_iteration'])} ms per iteration "
                     f"({h['share_of_decode']:.1%} of decode).")
    lines.append("- Greedy output of every variant equals eager AR on every prompt." if not d["mismatched"]
                 else f"- MISMATCHED: {d['mismatched']}")
    return lines


# ------------------------------------------------------------------------------------------ chat

def chat(path: Path, ctx: Ctx) -> list[str]:
    text = path.read_text()
    header = text.splitlines()[0].lstrip("# ")
    stderr = text.split("## stderr\n", 1)[1].split("\n## ", 1)[0].rstrip() if "## stderr" in text else ""
    stdin = text.split("## stdin\n", 1)[1].split("\n## ", 1)[0].rstrip() if "## stdin" in text else ""
    lines = [f"File `{ctx.show(path)}`: {header}.", "", "Script (stdin):", "", "```", stdin, "```", "",
             "What chat printed on stderr (banner and `/stats`):", "", "```", stderr, "```"]
    return lines + commentary_on("chat")


# ---------------------------------------------------------------------------------- stage plans

def planner(path: Path, ctx: Ctx) -> list[str]:
    d = load(path)
    co = d["costs"]
    lines = [ctx.source(path, f"python bench/planner.py --bundle BUNDLE --tokens {d['tokens']} "
                              f"--repeats {d['repeats']}"), device_line(d["environment"]), "",
             f"Recipe `{d['recipe']}`, execution: {d['execution']}. Measured stage costs: prune "
             f"{co['prune'] * 1e3:.2f} ms, accept {co['accept_host'] * 1e3:.2f} ms (host) / "
             f"{co['accept_device'] * 1e3:.2f} ms (device walk), compact {co['compact'] * 1e3:.2f} ms; device "
             f"contention {co['contention']:.2f} (1 = overlap is free, 2 = none); {co['streams']} stream(s).", ""]
    rows = [[r["bucket"], f"**{r['plan']}** (chosen)" if r["chosen"] else r["plan"], num(r["predicted_ms"], 1),
             num(r["measured_ms"], 1), f"{r['error_pct']:+.1f} %", num(r["tpot_ms"], 1),
             "ok" if r["valid"] else "INVALID"] for r in d["records"]]
    lines += table(["bucket", "plan", "predicted ms/iteration", "measured", "error", "ms/token", "tokens"], rows)
    lines.append("")
    for bucket, s in d["summary"].items():
        lines.append(f"- {bucket}: chosen `{s['chosen_plan']}` at {num(s['chosen_tpot_ms'], 1)} ms/token; best "
                     f"measured `{s['best_measured_plan']}` at {num(s['best_tpot_ms'], 1)}; mean absolute "
                     f"prediction error {s['mean_abs_error_pct']:.1f} %.")
    plans_txt = path.with_name(path.name.replace("planner-", "plans-")).with_suffix(".txt")
    if plans_txt.is_file():
        lines.append(f"- The planner's own search at compile time (`yggdrasil plan --show`): `{ctx.show(plans_txt)}`.")
    return lines + ctx.image(path.with_suffix(".png"), "predicted against measured") + commentary_on("planner")


# -------------------------------------------------------------------------------------- serving

_MODE_ORDER = {"off": 0, "goodput": 2, "goodput+eager": 3}


def serve(path: Path, ctx: Ctx) -> list[str]:
    d = load(path)
    rates = sorted({r["rate"] for r in d["rows"]})
    cmd = (f"python bench/serve.py --bundle BUNDLE --rates {','.join(f'{r:g}' for r in rates)} "
           f"--requests {d['requests_per_rate']} --max-tokens {d['max_tokens']} --max-batch {d['max_batch']} "
           f"--prompts {d['prompts']} --eager-too")
    rows = sorted(d["rows"], key=lambda r: (r["rate"], _MODE_ORDER.get(r["mode"], 1)))
    lines = [ctx.source(path, cmd), device_line(d["env"]), "",
             f"{d['requests_per_rate']} {d['prompts']} prompts per rate, Poisson arrivals, {d['max_tokens']}-token "
             f"greedy replies, `--max-batch {d['max_batch']}`. Modes run one server at a time, in rotating order; "
             "`goodput+eager` is goodput on eager forwards (`serve --eager`).", ""]
    lines += table(["rate/s", "mode", "ok", "tok/s", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 s", "draft tokens/step"],
                   [[f"{r['rate']:g}", r["mode"], f"{r['ok']}/{r['requests']}", num(r["tokens_per_s"]),
                     num(r["tpot_p50_ms"], 1), num(r["tpot_p99_ms"], 1), num(r["ttft_p50_s"]),
                     num(r["proposed_per_step"])] for r in rows])
    by = {(r["rate"], r["mode"]): r for r in d["rows"]}
    gaps = []
    for rate in rates:
        best = max(r["tokens_per_s"] for (at, mode), r in by.items()
                   if at == rate and (mode == "off" or mode.startswith("fixed")))
        gaps.append(f"{rate:g}/s {by[(rate, 'goodput')]['tokens_per_s'] / best:.3f}")
    lines += ["", "- Replies identical across modes: " + ("yes." if d["replies_equal_across_modes"] else "NO."),
              f"- Goodput's throughput over the better of off and fixed speculation: {', '.join(gaps)}.",
              "- Compiled serve graphs over eager forwards (goodput, throughput): "
              + ", ".join(f"{k}/s {v:.2f}x" for k, v in d["compiled_over_eager_throughput"].items()) + "."]
    return lines + ctx.image(path.with_suffix(".png"), "serving") + commentary_on("serve")


def serve_graph(path: Path, ctx: Ctx) -> list[str]:
    d = load(path)
    rows = d["rows"]
    cmd = (f"python bench/serve_graph.py --bundle BUNDLE --rows {','.join(str(r['rows']) for r in rows)} "
           f"--context {d['context']} --repeats {d['repeats']}")
    lines = [ctx.source(path, cmd), device_line(d["env"]), "",
             f"One serving forward of the target: a request's root plus proposals after {d['context']} tokens of "
             f"context, median of {d['repeats']}, three ways, interleaved: the eager forward over the KV pool "
             "(`serve --eager`), the bundle's serve graph over the same pool (symbolic rows), and the fixed-row "
             "verify graph that holds the rows, padded to its width.", ""]
    lines += table(["rows", "eager pool ms", "serve graph ms", "padded to", "padded step graph ms", "eager / serve",
                    "padded / serve"],
                   [[r["rows"], num(r["eager_ms"], 1), num(r["serve_graph_ms"], 1), r["padded_to"],
                     num(r["padded_step_graph_ms"], 1), num(r["eager_ms"] / r["serve_graph_ms"]),
                     num(r["padded_step_graph_ms"] / r["serve_graph_ms"])] for r in rows])
    exact = [r["padded_step_graph_ms"] / r["serve_graph_ms"] for r in rows if r["padded_to"] == r["rows"]]
    padded = [r["padded_step_graph_ms"] / r["serve_graph_ms"] for r in rows if r["padded_to"] != r["rows"]]
    lines += ["", f"- Serve graph against eager: {span([r['eager_ms'] / r['serve_graph_ms'] for r in rows])}x faster.",
              f"- At a compiled width the symbolic graph costs {span(exact)}x the fixed-row graph; between widths "
              f"padding costs {span(padded)}x."]
    return lines + commentary_on("serve_graph")


def memory(path: Path, ctx: Ctx) -> list[str]:
    d = load(path)
    cmd = (f"python bench/memory.py --bundle BUNDLE --kv-budget {d['kv_budget']} --swap-space {d['swap_space']} "
           f"--requests {d['requests']} --rate {d['rate']:g} --max-tokens {d['max_tokens']} "
           f"--max-batch {d['max_batch']} --repeats {d['repeats']}")
    m = d["modes"]
    lines = [ctx.source(path, cmd), device_line(d["env"]), "",
             f"{d['requests']} ShareGPT prompts at {d['rate']:g} requests/s (Poisson, seeded), {d['max_tokens']}-token "
             f"greedy replies, `--max-batch {d['max_batch']}`, no speculation; `--kv-budget {d['kv_budget']}` = "
             f"{d['pool_blocks']} blocks of {d['block_size']} tokens; {d['repeats']} runs per mode, rotated.", ""]
    rows = []
    for name, r in m.items():
        err = r["cost_error"]
        rows.append([name, num(r["tokens_per_s"], 1), num(r["weighted_turnaround"]), num(r["turnaround_s"], 1),
                     r["preemptions"]["swap"], r["preemptions"]["recompute"], r["recompute_tokens"],
                     f"{r['swap_bytes'] / 2**20:.1f}",
                     " / ".join(f"{k} {v:.1%}" for k, v in err.items() if v is not None) or "-"])
    lines += table(["mode", "tok/s", "avg weighted turnaround", "turnaround s", "swaps", "recomputes",
                    "recomputed tokens", "swapped MiB", "cost prediction error"], rows)
    lines.append("")
    lines.append("- Replies identical across modes: " + ("yes." if d["replies_equal_across_modes"] else "NO."))
    if {"auto", "recompute", "swap"} <= set(m):
        a, rc, sw = m["auto"], m["recompute"], m["swap"]
        lines += [f"- Cost-aware (`auto`) against always-recompute: {a['tokens_per_s'] / rc['tokens_per_s'] - 1:+.0%} "
                  f"throughput, {a['weighted_turnaround'] / rc['weighted_turnaround'] - 1:+.0%} weighted turnaround.",
                  f"- Against always-swap: {a['tokens_per_s'] / sw['tokens_per_s'] - 1:+.0%} throughput, "
                  f"{a['weighted_turnaround'] / sw['weighted_turnaround'] - 1:+.0%} weighted turnaround."]
    sc, pc = d["costs"]["swap"], d["costs"]["prefill"]
    lines.append(f"- Fitted costs: swap round trip {sc['delta'] * 1e3:.1f} ms + {sc['gamma'] * 2**20 * 1e3:.2f} ms "
                 f"per MiB; prefill {pc['delta'] * 1e3:.0f} ms + {pc['gamma'] * 1e3:.2f} ms per row + "
                 f"{pc['alpha'] * 1e3:.3f} ms per slot of span.")
    return lines + ctx.image(path.with_suffix(".png"), "KV memory pressure") + commentary_on(
        "memory", run_date=d["env"]["date"][:10])


def structured(path: Path, ctx: Ctx) -> list[str]:
    """bench structured: TPOT with a JSON schema against none, and prefix reuse's first token."""
    d = load(path)
    j, p = d["json"], d["prefix"]
    lines = [ctx.source(path, d["provenance"]["command"]), device_line(d["environment"]), "",
             f"Chat prompts asking for a record as JSON, greedy, the same prompts with the schema (a nested object "
             f"with an array and an enum) and without it (as many tokens as the constrained reply); "
             f"{'the bundle speculates' if j['speculates'] else 'the bundle decodes plainly (its policy)'}.", ""]
    lines += table(["decoding", "TPOT free ms", "TPOT JSON ms", "JSON / free (paired median)"],
                   [[mode, num(j["tpot_ms"][f"{mode} free"], 2), num(j["tpot_ms"][f"{mode} json"], 2),
                     num(j["json_over_free"][mode]["median"], 3)] for mode in ("spec", "plain")])
    lines += ["", f"- Speculation's speed-up over plain decoding: {num(j['spec_speedup']['free']['median'], 3)}x free, "
                  f"{num(j['spec_speedup']['json']['median'], 3)}x with the schema.",
              f"- The grammar's host cost per output token: {j['grammar_us_per_token']} us "
              f"({j['masks_per_token']} masks per token; mask worker: {j['mask_worker']}).",
              f"- Constrained speculative output equals constrained plain output: {j['spec_equals_plain']}; complete "
              f"and parsing: {j['valid_json']}.",
              f"- A second request sharing a {p['pairs'][0]['prompt_tokens'][0]}-token prompt's prefix: first token "
              f"{num(p['ttft_speedup']['median'], 1)}x sooner (median over {len(p['pairs'])} pairs; "
              f"{p['pairs'][0]['second_cached_tokens']} tokens cached; replies unchanged: "
              f"{all(x['second_reply_unchanged'] for x in p['pairs'])})."]
    return lines
