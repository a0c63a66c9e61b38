"""`compile --reprofile` on a bundle whose work cache is not here: a bundle copied to another
machine (its `.NAME.work` stayed behind), or one whose cache was deleted.

The bundle holds everything a re-profile keeps: its graphs, its calibration (the recorded
acceptance) and, in the manifest, each weight format's agreement and perplexity. They are taken
into the work cache under this machine's keys, so the ordinary --reprofile path then measures
the step times here and re-judges the policy on them without compiling or calibrating again.
Each adopted graph keeps the record of what it was compiled for (graphs/isa.py), so the new
manifest describes the graphs it really holds; only a bundle that runs here is adopted
(context.up_to_date checked it: models, torch, and every CPU feature its graphs use).
"""

from __future__ import annotations

import shutil
from dataclasses import replace

from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.manifest import Manifest
from yggdrasil.models.quant import WEIGHT_FORMATS

from . import formats as format_cache
from .calibrate import adopt_calibration
from .compile_graphs import graph_stamp
from .context import BuildContext
from yggdrasil.graphs.isa import record_isa
from .work_cache import reusable, seal


def adopt_bundle(ctx: BuildContext, manifest: Manifest) -> None:
    """Take what the work cache lacks of the bundle at ctx.out into it (nothing when the cache
    already holds it, as on the machine that compiled it)."""
    layout = BundleLayout(ctx.out)
    # the keys are those of the bundle's weight formats, which its graphs and calibration are in
    as_built = replace(ctx, weights={**{role: "fp32" for role in ctx.models}, **manifest.weights})
    graphs = _adopt_graphs(as_built, manifest, layout)
    calibration = adopt_calibration(as_built, layout.calibration)
    if calibration:
        seal(ctx.work.calibration)
    measured = _adopt_formats(ctx, manifest)
    taken = [what for what, done in ((f"{graphs} graph(s)", graphs), ("the calibration", calibration),
                                     ("the weight formats' agreement and perplexity", measured)) if done]
    if taken:
        ctx.log(f"--reprofile: the work cache beside the bundle lacks its work (the bundle was copied here, or the "
                f"cache deleted); taking {', '.join(taken)} from the bundle itself")


def _adopt_graphs(ctx: BuildContext, manifest: Manifest, layout: BundleLayout) -> int:
    seconds = (layout.read_profile().get("graph_compile_seconds") or {}) if layout.profile.is_file() else {}
    adopted, steps = 0, manifest.steps
    ctx = replace(ctx, steps=steps)  # the graph files' keys are those of the steps they were built for
    for graph in manifest.buckets if steps != "eager" else ():  # eager steps ship no graph files
        role, name = graph.split("/", 1)
        # a split target's graphs: one per rank (graphs/rank-K/target/)
        for rank in range(manifest.world_size) if role == "target" and manifest.rank_graphs else [None]:
            share = float(seconds.get(graph, 0.0)) / (manifest.world_size if rank is not None else 1)
            adopted += _adopt_graph(ctx, manifest, layout, role, name, rank, share)
    return adopted


def _adopt_graph(ctx: BuildContext, manifest: Manifest, layout: BundleLayout, role: str, name: str,
                 rank: int | None, seconds: float) -> int:
    """One graph file of the bundle into the work cache (1), or 0 when the cache holds it already."""
    steps = manifest.steps
    cached, stamp = ctx.work.graph_named(role, name, steps, rank), graph_stamp(ctx, role, name, rank)
    if reusable(cached, stamp, "graph", ctx.log):
        return 0
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(layout.graph_named(role, name, steps, rank), cached)  # a copy: the bundle is replaced later
    cached.with_suffix(".seconds").write_text(f"{float(seconds):.1f}")  # a rank's share of the key's recorded sum
    if manifest.isa is not None:
        record_isa(cached, manifest.isa)
    seal(cached)
    cached.with_suffix(".key").write_text(stamp)
    return 1


def _adopt_formats(ctx: BuildContext, manifest: Manifest) -> bool:
    """The manifest's format measurements as the work cache's (formats.py): --reprofile then
    re-times each format here and keeps its agreement and perplexity."""
    candidates = manifest.formats.get("candidates")
    if not candidates:
        return False
    # formats.py's own cache file, key and reader, so its --reprofile path finds them
    path = ctx.work.root / format_cache.FORMATS_FILE
    key = format_cache._cache_key(ctx, ctx.recipe.candidate_formats(WEIGHT_FORMATS))
    if format_cache._cached(path, key) is not None:
        return False
    format_cache._save(path, key, [_measurement(c) for c in candidates])
    return True


def _measurement(c: dict) -> format_cache.FormatMeasurement:
    """One candidate as the manifest records it (FormatMeasurement.as_dict), less its step
    times, which --reprofile measures again."""
    return format_cache.FormatMeasurement(
        c["format"], str(c["verdict"]).split(":", 1)[0], c.get("note") or "", c.get("draft_format"), None,
        c.get("agreement"), int(c.get("positions") or 0), c.get("perplexity"), c.get("weight_bytes"))
