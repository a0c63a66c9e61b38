"""bench/gpu_session.py's measure step: the CUDA path of one bundle, measured (issues 23, 36).

Variants, each on every prompt after one untimed warm run, compared with the bundle's own
autoregressive greedy output: eager, aoti_plain (packages not captured), cuda_graphs (the bundle's
runner: the reference), egt_policy (its shipped policy), egt_fixed_* (one fixed tree, sequential
and under the bundle's stage plans), and serve (the serving engine over every prompt at once).
TPOT is the median over prompts of seconds per generated token; exactness per variant names the
first divergence and whether it is a tie within compile's rule. Speculative rows add AAL, host
reads, synchronizing CUDA calls and GPU idle time per iteration; the decode floor is (weight
bytes + one step's KV bytes) / measured device-to-device bandwidth.
"""

from __future__ import annotations

import statistics
import warnings
from pathlib import Path

import torch

from yggdrasil.bundle import open_bundle
from yggdrasil.graphs.aoti import full_span
from yggdrasil.compile.check import compare_greedy
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.storage.cuda_graphs import replay_counts
from yggdrasil.storage.registry import load_graph_set
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.sampling import SamplingParams
from yggdrasil.serve.requests import GenerationRequest
from yggdrasil.serve.setup import ServeSettings
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.stage_plan import SEQUENTIAL
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.runtime.assembly import grid_drafter

from .common import timed

GREEDY = SamplingParams(temperature=0.0)
TIMED_PROMPTS = 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run, device: torch.device):
    _sync(device)
    return timed(lambda: (run(), _sync(device))[0])


def counting_syncs(run, device: torch.device):
    """(run(), synchronizing CUDA calls during it as set_sync_debug_mode('warn') reports them;
    None off CUDA, where nothing synchronizes)."""
    if device.type != "cuda":
        return run(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            value = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return value, sum("synchroniz" in str(w.message) for w in caught)


def device_bandwidth(device: torch.device, mib: int = 1024) -> float | None:
    """Bytes per second of a large device-to-device copy (read + written), median of 5."""
    if device.type != "cuda":
        return None
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def decode_bytes(model, span: int) -> dict:
    """Bytes one decode step must read: every weight once (a tied embedding is the head's), and
    the K/V of `span` positions."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * span * model.dtype.itemsize
    return {"weights": weights, "kv": kv}


def _plain_aoti_runner(runtime, bundle: Path, device: torch.device) -> StepRunner:
    """The bundle's target graphs loaded again but not captured: plain AOTInductor calls."""
    model = runtime.target.model
    names = list(runtime.graph_sets["target"].graphs)
    graphs = load_graph_set(bundle, "target", model, names, "rerun --step compile", "the recipe")
    if device.type == "cuda":
        graphs.fixed_span = full_span(runtime.runner.max_context)
    return StepRunner(model, runtime.runner.max_context, chunk_sizes=runtime.runner.chunk_sizes, graphs=graphs)


def fixed_speculator(runtime, plans):
    """One fixed tree over the bundle's draft graphs: the grid's deepest and widest, verified at
    its widest width (a flat profile: no timing decides the width)."""
    grid = runtime.policy.grid
    drafter = grid_drafter(grid, runtime.draft_runner)
    flat = LatencyProfile(draft=((grid.max_width, 0.0),), verify=((1, 1.0), (max(grid.verifies), 1.0)))
    return build_speculator(runtime.runner, drafter, verify=grid.verifies, latency=flat, plans=plans)


def _variants(runtime, bundle: Path, device: torch.device) -> dict:
    """name -> generate(ids, n) returning (tokens, SpecStats or None)."""
    model = runtime.target.model
    eager = StepRunner(model, runtime.runner.max_context, chunk_sizes=runtime.runner.chunk_sizes)
    variants = {"eager": lambda ids, n: (greedy_tokens(eager, ids, n), None)}
    if runtime.manifest.steps == "aoti":  # an eager-steps bundle has no packages to call plainly
        plain = _plain_aoti_runner(runtime, bundle, device)
        variants["aoti_plain"] = lambda ids, n: (greedy_tokens(plain, ids, n), None)
    variants.update({
        "cuda_graphs" if device.type == "cuda" else "aoti_bundle": lambda ids, n: (greedy_tokens(runtime.runner, ids, n), None),
    })

    def spec(make):
        def generate(ids, n):
            result = make().generate(ids, n, GREEDY)
            return result.tokens, result.spec
        return generate

    if runtime.speculator() is not None:
        variants["egt_policy"] = spec(runtime.speculator)
    if runtime.draft_runner is not None and runtime.policy is not None:
        variants["egt_fixed_sequential"] = spec(lambda: fixed_speculator(runtime, SEQUENTIAL))
        if runtime.plans.possible() != {SEQUENTIAL}:
            plan = "+".join(sorted({str(p) for p in runtime.plans.possible()} - {"sequential"}))
            variants[f"egt_fixed_{plan}"] = spec(lambda: fixed_speculator(runtime, runtime.plans))
    return variants


def _reads(runtime) -> int:
    return sum(r.reads.count for r in (runtime.runner, runtime.draft_runner) if r is not None)


def measure_variant(name: str, generate, runtime, prompts: list[list[int]], references: list[list[int]],
                    n: int, device: torch.device) -> dict:
    model = runtime.target.model
    generate(prompts[0], n)  # warm: lazy set-up, first replays
    seconds, exact, divergences, stats = [], 0, [], []
    for ids, want in zip(prompts, references):
        (tokens, spec), took = _timed(lambda: generate(ids, n), device)
        seconds.append(took / n)
        if tokens == want:
            exact += 1
        else:
            agreement = compare_greedy(model, ids, want, tokens)
            divergences.append({"at": agreement.at, "gap": agreement.gap, "tolerance": agreement.tolerance,
                                "tie": agreement.ok})
        if spec is not None:
            stats.append(spec)
    row = {"tpot_ms": round(1e3 * statistics.median(seconds), 4),
           "tpot_ms_all": [round(1e3 * s, 4) for s in seconds],
           "exact": f"{exact}/{len(prompts)}", "divergences": divergences,
           "ok": all(d["tie"] for d in divergences)}
    if stats:
        iterations = sum(s.iterations for s in stats)
        row["aal"] = round(sum(s.committed for s in stats) / max(iterations, 1), 3)
        reads_before = _reads(runtime)
        (_, spec), syncs = counting_syncs(lambda: generate(prompts[0], n), device)
        row["host_reads_per_iteration"] = round((_reads(runtime) - reads_before) / max(spec.iterations, 1), 3)
        row["syncs_per_iteration"] = None if syncs is None else round(syncs / max(spec.iterations, 1), 3)
        row["gpu_idle_us_per_iteration"] = gpu_idle_us(runtime, lambda: generate(prompts[0], n), device)
        row["note"] = ("reads, syncs and GPU idle time include the prefill's, spread over the iterations; idle: wall "
                       "time less the captured graphs' own device time (CUDA events)")
    return row


def gpu_idle_us(runtime, run, device: torch.device) -> float | None:
    """Microseconds per iteration the GPU had no captured graph to run: the run's wall time less
    its replays' device time (CUDA events around each), over its iterations (None off CUDA)."""
    captured = [g for s in runtime.graph_sets.values() for g in s.graphs.values() if hasattr(g, "timing")]
    if device.type != "cuda" or not captured:
        return None
    for graph in captured:
        graph.timing = []
    try:
        (_, spec), wall = _timed(run, device)
        busy = sum(start.elapsed_time(end) / 1e3 for g in captured for start, end in g.timing)
    finally:
        for graph in captured:
            graph.timing = None
    return round(1e6 * (wall - busy) / max(spec.iterations, 1), 1)


class _Reply:
    """A serve request's sink: its tokens, and how it ended."""

    def __init__(self) -> None:
        self.ids, self.reason, self.error = [], None, None

    def tokens(self, ids, text) -> None:
        self.ids += ids

    def finish(self, reason, usage) -> None:
        self.reason = reason

    def fail(self, message) -> None:
        self.error = message


def measure_serve(opened, runtime, prompts, references, n: int, device: torch.device) -> dict:
    """Every prompt at once through the serving engine (plain decoding: speculation off, so the
    replies are comparable token for token), twice: a warm run, then the timed one."""

    notes = []
    engine = opened.engine(ServeSettings(max_batch=len(prompts), speculation="off"), notes.append)
    for _ in range(2):
        replies = [_Reply() for _ in prompts]
        for ids, reply in zip(prompts, replies):
            engine.submit(GenerationRequest(tuple(ids), n), reply)
        steps, seconds = _timed(lambda: sum(1 for _ in iter(engine.step, None)), device)
    model, exact, divergences = runtime.target.model, 0, []
    for ids, want, reply in zip(prompts, references, replies):
        if reply.ids == want:
            exact += 1
        elif reply.error is None:
            agreement = compare_greedy(model, ids, want, reply.ids)
            divergences.append({"at": agreement.at, "gap": agreement.gap, "tie": agreement.ok})
    graph = engine.forward.graph
    return {"requests": len(prompts), "steps": steps, "seconds": round(seconds, 4),
            "tokens_per_second": round(sum(len(r.ids) for r in replies) / seconds, 1),
            "ms_per_step": round(1e3 * seconds / max(steps, 1), 4), "exact": f"{exact}/{len(prompts)}",
            "divergences": divergences, "errors": [r.error for r in replies if r.error],
            "ok": all(d["tie"] for d in divergences) and not any(r.error for r in replies),
            "captured_replays": dict(getattr(graph, "replays", {})) or None, "engine_notes": notes}


def measure(bundle: Path, texts: list[str], n: int, stage_plan: str | None) -> dict:
    opened = open_bundle(bundle, quiet=True)
    runtime = opened.generator()
    device = runtime.runner.device
    model = runtime.target.model
    prompts = [runtime.tokenizer.encode(t) for t in texts[:TIMED_PROMPTS]]
    references = [greedy_tokens(runtime.runner, ids, n) for ids in prompts]
    result = {"capture_bytes": runtime.capture_bytes, "load_seconds": round(runtime.load_seconds, 2),
              "new_tokens": n, "prompts": len(prompts), "stage_plan_forced": stage_plan,
              "steps": opened.manifest.steps,  # aoti packages, or eager steps (captured on CUDA)
              "profile": {"verify": [list(p) for p in runtime.latency.verify],
                          "draft": [list(p) for p in runtime.latency.draft]} if runtime.latency else None,
              "policy": opened.manifest.stats.get("policy_shipped") if opened.manifest else None,
              "variants": {}}
    replays_before = sum(replay_counts(runtime.graph_sets).values())
    for name, generate in _variants(runtime, bundle, device).items():
        try:
            result["variants"][name] = measure_variant(name, generate, runtime, prompts, references, n, device)
        except Exception as exc:  # one variant's failure is a finding, not the end of the report
            result["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    try:
        result["serve"] = measure_serve(opened, runtime, prompts, references, n, device)
    except Exception as exc:
        result["serve"] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    result["replays"] = replay_counts(runtime.graph_sets)
    result["replays_total"] = sum(result["replays"].values()) - replays_before
    bandwidth = device_bandwidth(device)
    span = full_span(runtime.runner.max_context)
    nbytes = decode_bytes(model, span)
    result["floor"] = {"bandwidth_gb_s": None if bandwidth is None else round(bandwidth / 1e9, 1),
                       "weight_bytes": nbytes["weights"], "kv_bytes_full_span": nbytes["kv"], "span": span}
    if bandwidth:
        floor_ms = 1e3 * (nbytes["weights"] + nbytes["kv"]) / bandwidth
        result["floor"]["decode_floor_ms"] = round(floor_ms, 4)
        for row in result["variants"].values():
            if "tpot_ms" in row:
                row["fraction_of_floor"] = round(floor_ms / row["tpot_ms"], 3)
    ok_rows = [r for r in result["variants"].values() if "ok" in r]
    result["agree"] = bool(ok_rows) and all(r["ok"] for r in ok_rows)
    return result
