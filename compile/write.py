"""Phase "write": the bundle directory, atomically (graphs/manifest.py's write_bundle): the
compiled graphs and the calibration (copies of the work cache's), the deployed models' weights
as the graphs consume them (yggdrasil/runtime/deployed.py), the bucket selection, the stage plans, the
profile measured on the graphs, the recipe, and the manifest with the build's stats."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from functools import reduce
from pathlib import Path

import yaml

from yggdrasil import kernels
from yggdrasil.buckets import Bucket, GraphKey
from yggdrasil.runtime.deployed import save_deployed
from yggdrasil.device import now_iso
from yggdrasil.storage.layout import PREDICTOR_SUMMARY, BundleLayout
from yggdrasil.storage.manifest import Manifest
from yggdrasil.graphs.manifest import write_bundle
from yggdrasil.policy.confidence import load_confidence
from yggdrasil.policy.auto import predictor_pays, shipped_policy

from .context import BuildContext
from yggdrasil.graphs.isa import recorded_isa
from .stages import Stages


def seconds_spent(path: Path) -> float:
    """What the cached piece of work at `path` took when it was done (0 if unknown)."""
    record = path.with_suffix(".seconds")
    return float(record.read_text()) if record.is_file() else 0.0


def predictor_stats(calibration: Path, latency=None) -> dict:
    """The manifest's record of the speculation policy: whether the depth predictor ships, the
    held-out objective of each policy, and per bucket each policy picked on held-out
    calibration prompts the AAL and step time it was predicted vs realised (issue 25).
    latency: the profile measured on the compiled graphs, which gives each bucket's nominal
    step time on the bundle beside the per-tree estimates the verdict was judged with (eager in
    a calibration, the graphs' in a bundle's judged copy: calibrate.judge_on_graphs)."""
    summary = calibration / PREDICTOR_SUMMARY
    raw = yaml.safe_load(summary.read_text()) if summary.is_file() else None
    report = load_confidence(calibration)[1]
    runs = shipped_policy(raw, report)
    confidence = confidence_stats(report, runs)
    if raw is None:
        skipped = calibration / "predictor.skipped"
        return {"predictor": "not trained: " + (skipped.read_text()[:120] if skipped.is_file() else "no data"),
                "policy_shipped": runs, **confidence}
    held, objective = raw.get("held_out", {}), raw.get("objective", {})
    policy = raw.get("policy") or {}
    used = ("used" if runs == "predictor" else
            "beat the constant, but draft confidence gained more (unused)" if predictor_pays(raw) else
            "not better than the constant (unused)")
    return {"predictor": used, "policy_shipped": runs, **confidence,
            "predictor_accuracy": held.get("accuracy"),
            "objective_constant": objective.get("constant_speedup"),
            "objective_predicted": objective.get("predicted_speedup"),
            "objective_oracle": objective.get("oracle_speedup"),
            "policy": policy,
            "policy_buckets": {name: _bucket_rows(rows, latency)
                               for name, rows in (objective.get("buckets") or {}).items()}}


def confidence_stats(report: dict | None, runs: str) -> dict:
    """The manifest's record of draft confidence choosing V (report: confidence.yaml's): whether
    it ships (runs: shipped_policy's choice), on which (D, W), its held-out objective against the
    best constant's, and its AAL predicted vs realised."""
    if report is None:
        return {}
    mine, constant = report["confidence"], report["constant"]
    return {"confidence": {"shipped": runs == "confidence", "beat_constant": report["shipped"] == "confidence",
                           "shape": report["confidence_shape"],
                           "gain": report["gain"], "objective": mine["speedup"],
                           "objective_constant": constant["speedup"], "aal_predicted": mine["aal_estimate"],
                           "aal_realised": mine["aal_realised"], "held_out_records": report["held_out_records"]}}


def _bucket_rows(rows: dict, latency) -> dict:
    """Per bucket: AAL and step ms predicted (training split) vs realised (held-out acceptance;
    step ms for each tree's real size), both on the profile the verdict was judged with, and the
    bucket's nominal step ms on the graphs."""
    out = {}
    for name, row in rows.items():
        shape = Bucket.parse(name)
        entry = {"picked": row["picked"], "aal_predicted": row["aal_estimate"], "aal_realised": row["aal_realised"],
                 "step_ms_predicted": round(1e3 * row["seconds_estimate"], 3),
                 "step_ms_realised": round(1e3 * row["seconds_realised"], 3)}
        if latency is not None:
            seconds = (latency.t_verify(1) if shape.depth == 0 else
                       shape.depth * latency.t_draft(shape.width) + latency.t_verify(shape.verify))
            entry["step_ms_graphs"] = round(1e3 * seconds, 3)
        out[name] = entry
    return out


def _copy(src: Path, dst: Path) -> None:
    """A copy, not a hard link: a link makes the bundle's file and the cache's one file, so
    damage to a bundle (an editor, a truncating copy) would damage the cache that is meant to
    rebuild it (issue 24). Graphs hold no weights (a few MB each), so copies cost little disk."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def write(ctx: BuildContext, keys: list[GraphKey], calibration: Path, selection, stages: Stages, latency,
          stats: dict, formats: dict | None = None, piece_seconds: dict | None = None) -> Manifest:
    """formats: the weight-format choice and its measured alternatives (compile/formats.py).
    piece_seconds: per role, each graph's forward seconds (what prefill pieces are chosen by)."""
    recipe, work = ctx.recipe, ctx.work

    def fill(tmp: Path) -> None:
        layout = BundleLayout(tmp)
        for key in keys:  # eager steps: no graph files; a split target's: one per rank
            for path, rank in ctx.graph_files(key):
                _copy(path, layout.graph(key, ctx.steps, rank))
        shutil.copytree(calibration, layout.calibration)
        save_deployed(layout.weights, {"target": ctx.target, **({"draft": ctx.draft} if ctx.draft is not None else {})})
        layout.write_selection(selection.as_dict())
        if stages.record:
            layout.write_stage_plans(stages.record)
        layout.write_profile(
            {"device": ctx.env.device, "cpu": ctx.env.cpu.as_dict() if ctx.env.cpu is not None else None,
             "source": "compiled graphs, measured at warm-load check",
             "latency": latency.as_dict(),
             # per role, one forward of each graph a prompt piece can run on (yggdrasil/runtime/prefill_plan.py)
             **({"piece_seconds": piece_seconds} if piece_seconds else {}),
             # what each graph took when it was compiled, in this run or an earlier one
             "graph_compile_seconds": {f"{k.role}/{k.name}": sum(seconds_spent(path) for path, _ in ctx.graph_files(k))
                                       for k in keys if ctx.steps != "eager"}})
        layout.write_recipe(Path(recipe.source).read_text() if recipe.source else "")
        if "q4" in ctx.weights.values():  # the graphs call our kernels: the bundle carries them
            _copy(kernels.load(), layout.kernel_library)

    recipe_body = json.loads(json.dumps({**asdict(recipe), "source": str(Path(recipe.source).resolve())}))
    manifest = Manifest(recipe=recipe_body, recipe_identity=recipe.identity(), models=ctx.models,
                        environment=ctx.env, buckets=tuple(f"{k.role}/{k.name}" for k in keys), dtype=recipe.dtype,
                        tile=recipe.tile, chunk_sizes=recipe.buckets.prefill_chunks, stats=stats, created=now_iso(),
                        weights=dict(ctx.weights), formats=formats or {}, isa=graphs_isa(ctx, keys),
                        steps=ctx.steps)
    return write_bundle(ctx.out, manifest, fill)


def graphs_isa(ctx: BuildContext, keys: list[GraphKey]):
    """What the bundle's graphs were compiled for, as each cached graph recorded it (graphs kept
    by a --reprofile of a bundle compiled elsewhere record that CPU), with the run-time paths
    of the kernel library a q4 bundle carries."""
    files = [path for k in keys for path, _ in ctx.graph_files(k)]  # eager steps have none: the context's ISA
    isa = reduce(lambda a, b: a.merge(b), [recorded_isa(path) or ctx.isa for path in files] or [ctx.isa])
    if "q4" in ctx.weights.values():
        isa = replace(isa, kernel_paths=tuple(kernels.kernel_isas()))
    return isa
