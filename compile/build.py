"""`yggdrasil compile RECIPE` (docs/design.md §4): named phases that pass values, one module each:

    load models (context.py) -> choose the weight format (formats.py)
    -> calibrate (calibrate.py) -> select buckets (select.py)
    -> compile graphs (compile_graphs.py) -> check against eager (check.py)
    -> plan stages (stages.py) -> write the bundle (write.py)

The phases after loading run from one list (PHASE_STEPS). A phase that finds an earlier one must
run again says so by returning a Redo (the objective prefers another weight format: calibrate
again in it; judged on the graphs, the depth predictor ships and needs graphs that also return
hidden states: compile those and check again), and the list goes back to that phase.

Work that is still valid is reused: a finished bundle for the same recipe, models and machine is
kept as is (one that runs here but was measured on another CPU is re-profiled, keeping its graphs:
adopt.py); otherwise the calibration and every compiled graph are cached in a work directory
next to the bundle, keyed by exactly what they depend on, so changing one bucket recompiles one
graph. Cached work is checked against its recorded content hashes before reuse, and what is
damaged is rebuilt (work_cache.py); --force clears the cache. The bundle itself is written
atomically, and only ever replaces a bundle (graphs/manifest.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from yggdrasil import kernels
from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.device import memory_bandwidth
from yggdrasil.errors import YggdrasilError
from yggdrasil.graphs.describe import describe_phases
from yggdrasil.storage.manifest import Manifest, measured_elsewhere
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.policy.calibration import load_run
from yggdrasil.progress import format_duration

from .adopt import adopt_bundle
from .calibrate import calibrate, measurement_stats, noisy_warning
from .check import Loaded, check_serve_graphs, warm_load_check
from .compile_graphs import compile_graphs
from . import rank_graphs, tensor_parallel
from .loader_check import decide_steps
from .context import BuildContext, graph_code_hash, kernel_source_hash, load_context, rebuild_command, up_to_date
from .draft_vocab import VocabChoice, choose_phase
from .format_choice import choose_format, deploy, prefer_by_objective
from .formats import FormatChoice
from .recipe import PHASES, Recipe
from .select import BucketSelection, graph_keys, keep_all, select_buckets
from .stages import Stages, check_stages, plan_stages
from .work_cache import check_calibration, clear_work_cache, seal
from .write import predictor_stats, seconds_spent, write

__all__ = ["BuildResult", "build_bundle", "rebuild_command"]


@dataclass(frozen=True)
class BuildResult:
    bundle: Path
    reused: bool
    manifest: Manifest


def build_bundle(recipe: Recipe, out: Path, force: bool = False, log=print, reprofile: bool = False) -> BuildResult:
    """The whole pipeline; returns the bundle (reused when already up to date). reprofile:
    measure the step times again and redo what depends on them, reusing the calibrated
    acceptance and the compiled graphs (the bundle's own, where the work cache lacks them).
    A recipe's `threads` holds for the build only: the caller's thread count comes back."""
    threads = torch.get_num_threads()
    try:
        return _build(recipe, out, force, log, reprofile)
    finally:
        torch.set_num_threads(threads)


def _build(recipe: Recipe, out: Path, force: bool, log, reprofile: bool) -> BuildResult:
    started = time.perf_counter()
    clock = PhaseClock(started)
    ctx = load_context(recipe, out, log)
    clock.lap("load")
    if force:  # from scratch: nothing cached is trusted, so --force works whatever the cache holds
        clear_work_cache(ctx.work.root, log)
    else:
        existing = up_to_date(ctx)
        elsewhere = measured_elsewhere(existing, ctx.env) if existing is not None else None
        if existing is not None and not reprofile and elsewhere is None:
            log(f"bundle {out} is up to date (id {existing.bundle_id}); nothing to do")
            warning = noisy_warning(existing.stats, recipe, Path(out))
            if warning:
                log(warning)
            return BuildResult(Path(out), True, existing)
        if elsewhere is not None and not reprofile:
            log(f"bundle {out} runs here but its step times were measured on another CPU ({elsewhere}); "
                "measuring them here and keeping its graphs, as --reprofile does")
            reprofile = True
        if reprofile and existing is not None:
            adopt_bundle(ctx, existing)
    if not recipe.device.startswith("cuda"):
        ctx = replace(ctx, bandwidth=memory_bandwidth())
    log(expected_time(recipe, ctx.env.device, ctx.bandwidth))
    build = run_phases(Build(ctx, reprofile), PHASE_STEPS, clock)
    ctx, loaded, keys = build.ctx, build.loaded, build.keys
    stats = {"compile_seconds": clock.phases.get("graphs", 0.0), "graphs_compiled": build.compiled,
             "graphs_reused": len(keys) - build.compiled,
             "cold_graph_compile_seconds": round(float(sum(seconds_spent(path) for k in keys
                                                           for path, _ in ctx.graph_files(k))), 1),
             "cold_calibration_seconds": seconds_spent(ctx.work.calibration),
             "total_seconds": round(time.perf_counter() - started, 1),
             **predictor_stats(loaded.calibration, loaded.latency),
             **measurement_stats(build.calibration, loaded.latency),
             **invariance_stats(tensor_parallel.invariance(build.rank_check) or loaded.invariance),
             **kernel_stats(ctx), "graph_code": graph_code_hash(), **tensor_parallel.record(ctx, build.rank_check),
             **({"draft_vocab": build.draft_vocab.as_dict()} if build.draft_vocab is not None else {}),
             "phase_seconds": clock.phases}
    final = write(ctx, keys, loaded.calibration, build.selection, build.stages, loaded.latency or LatencyProfile(),
                  stats, build.formats.as_dict(), loaded.piece_seconds)
    log(f"phases: {describe_phases(clock.phases)}; write {time.perf_counter() - clock.last:.1f} s")
    warning = noisy_warning(stats, recipe, Path(out))
    if warning:
        log(warning)
    return BuildResult(Path(out), False, final)


def expected_time(recipe: Recipe, device: str, bandwidth: float | None = None) -> str:
    """What to expect, said before the long phases start: the recipe's measured cold compile,
    phase by phase and where it was measured, scaled to this machine by the ratio of the two
    machines' memory bandwidth where both are known (compile's phases are mostly decode steps,
    which read every weight: a machine with half the bandwidth takes about twice as long)."""
    measured = recipe.measured_cold_compile
    if measured is None:
        return (f"no measured compile time for {recipe.name}: each long phase shows its progress and the time "
                "left once it has some")
    phases = ", ".join(f"{phase} {format_duration(seconds)}" for phase, seconds in measured.seconds)
    said = f"a cold compile of {recipe.name} took {format_duration(measured.total)} on {measured.cpu} ({phases})"
    if bandwidth and measured.bandwidth_gb_s:
        scale = measured.bandwidth_gb_s * 1e9 / bandwidth
        return (f"{said}; this machine ({device}) moves {bandwidth / 1e9:.1f} GB/s against its "
                f"{measured.bandwidth_gb_s:.1f}: expect about {format_duration(measured.total * scale)} cold (cached "
                "work makes it shorter, a busy machine longer)")
    return f"{said}; this machine: {device}; cached work makes it shorter, a busy or smaller machine longer"


@dataclass
class PhaseClock:
    """Wall seconds per compile phase, in order (the manifest's phase_seconds; `inspect`)."""

    last: float
    phases: dict = field(default_factory=dict)

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self.last, 1)
        seconds, self.last = now - self.last, now
        return seconds


@dataclass
class Build:
    """What compile's phases have made so far: each phase reads it and fills in its part."""

    ctx: BuildContext
    reprofile: bool
    formats: FormatChoice | None = None
    calibration: Path | None = None
    selection: BucketSelection | None = None
    needs_hidden: bool = False  # the graphs also return the final hidden states (the depth predictor reads them)
    objective_chose: bool = False  # the objective has weighed the formats on a calibration (once)
    draft_vocab: VocabChoice | None = None  # the draft head's K, chosen once (compile/draft_vocab.py)
    keys: list[GraphKey] = field(default_factory=list)
    compiled: int = 0  # graphs compiled by this run (the others came from the work cache)
    loaded: Loaded | None = None
    stages: Stages | None = None
    rank_check: dict | None = None  # a split target's graph sets, checked (compile/rank_graphs.py)


@dataclass(frozen=True)
class Redo:
    """A phase's finding that compile must go back to an earlier phase, and why (logged)."""

    phase: str
    reason: str


def formats_phase(build: Build) -> None:
    tensor_parallel.check(build.ctx)  # a world size that cannot split the target: before any measuring
    build.ctx, build.formats = choose_format(build.ctx, build.reprofile)


def calibrate_phase(build: Build) -> Redo | None:
    build.calibration = _calibrate(build.ctx, build.reprofile)
    if len(build.formats.usable) < 2 or build.objective_chose:  # a redo calibrates in its choice
        return None
    preferred = prefer_by_objective(build.formats, build.calibration)  # on the calibration's acceptance
    changed, build.formats = preferred.chosen != build.formats.chosen, preferred
    build.objective_chose = True
    if not changed:
        return None
    build.ctx = deploy(build.ctx, preferred.chosen)
    return Redo("calibrate", f"the latency objective prefers weight format {preferred.chosen} on the calibration "
                             f"data ({preferred.reason}); calibrating in it")


def draft_vocab_phase(build: Build) -> Redo | None:
    reason = choose_phase(build)
    return None if reason is None else Redo("calibrate", reason)


def select_phase(build: Build) -> None:
    ctx = build.ctx
    run = load_run(build.calibration)[0]
    probe = ctx.policy(build.calibration)
    selection = select_buckets(probe, run.hidden, run.grid)
    if ctx.recipe.selection == "all":
        selection = keep_all(run.grid, selection)
    ctx.log(f"bucket selection on {run.hidden.shape[0]} calibration iterations: picked "
            f"{', '.join(f'{k} x{v}' for k, v in list(selection.picked.items())[:6])}")
    if selection.dropped_widths or selection.dropped_verifies:
        ctx.log(f"dropped (never picked): draft widths {list(selection.dropped_widths) or '-'}, "
                f"verify widths {list(selection.dropped_verifies) or '-'}")
    build.selection, build.needs_hidden = selection, probe.needs_hidden


def graphs_phase(build: Build) -> None:
    keys = graph_keys(build.ctx.recipe, build.selection, build.needs_hidden)
    build.ctx = decide_steps(build.ctx)
    if build.ctx.steps != "aoti":  # no serve package; the server runs its eager step over the KV pool
        keys = [k for k in keys if k.stage != SERVE_STAGE]
    elif build.ctx.rank_graphs:  # nor for a split target (its KV pool is not sharded): the draft's stays
        keys = [k for k in keys if not (k.role == "target" and k.stage == SERVE_STAGE)]
    build.keys = keys
    if build.ctx.rank_graphs:  # the target's graphs per rank, compiled and checked by N rank processes
        build.compiled += compile_graphs(build.ctx, [k for k in keys if k.role != "target"])
        compiled, build.rank_check = rank_graphs.compile_rank_graphs(build.ctx, [k for k in keys if k.role == "target"])
        build.compiled += compiled
    else:
        build.compiled += compile_graphs(build.ctx, keys)


def check_phase(build: Build) -> Redo | None:
    loaded = warm_load_check(build.ctx, build.keys, build.selection)
    if loaded.needs_hidden_graphs:
        build.needs_hidden = True
        return Redo("graphs", "judged on the compiled graphs, the depth predictor runs: compiling the graphs that "
                              "also return the hidden states it reads, then measuring, judging and checking again "
                              "on them")
    check_serve_graphs(build.ctx, [k for k in build.keys if k.stage == SERVE_STAGE])
    build.loaded = loaded
    return None


def stage_plans_phase(build: Build) -> None:
    build.stages = plan_stages(build.ctx, build.loaded, build.selection)
    if build.stages.extra:
        build.compiled += compile_graphs(build.ctx, list(build.stages.extra))
        build.keys = build.keys + list(build.stages.extra)
    check_stages(build.ctx, build.loaded, build.stages)


# compile after loading its models, in order (recipe.PHASES names them for the manifest and inspect)
PHASE_STEPS = (("formats", formats_phase), ("calibrate", calibrate_phase), ("draft vocab", draft_vocab_phase),
               ("select", select_phase),
               ("graphs", graphs_phase), ("check", check_phase), ("stage plans", stage_plans_phase))
assert tuple(name for name, _ in PHASE_STEPS) == PHASES[1:]


def run_phases(build: Build, steps, clock: PhaseClock) -> Build:
    """Each phase in turn; a phase that returns a Redo sends compile back to that earlier phase
    (its time adds to that phase's). The same redo asked twice is a bug, never a loop."""
    order = [name for name, _ in steps]
    redone: set[tuple[str, str]] = set()
    at = 0
    while at < len(steps):
        name, phase = steps[at]
        redo = phase(build)
        clock.lap(name)
        if redo is None:
            at += 1
            continue
        if (name, redo.phase) in redone or order.index(redo.phase) > at:
            raise YggdrasilError(f"compile's {name} phase asked to redo {redo.phase} again ({redo.reason}); "
                                 "this is a bug in yggdrasil, please report it")
        redone.add((name, redo.phase))
        build.ctx.log(redo.reason)
        at = order.index(redo.phase)
    return build


def invariance_stats(invariance) -> dict:
    """The manifest's record of batch invariance: one line `inspect` prints ("bitwise" or "up to
    ties" with the largest difference), and the measurement."""
    if invariance is None:
        return {}
    return {"batch_invariance": invariance.summary(), "batch_invariance_measured": invariance.as_dict()}


def kernel_stats(ctx) -> dict:
    """Which build of yggdrasil's CPU kernels a q4 bundle carries, and the path it took here."""
    if "q4" not in ctx.weights.values():
        return {}
    return {"kernels": {"source_hash": kernel_source_hash(), "isa_at_compile": kernels.kernel_isa(),
                        "isas_here": kernels.kernel_isas()}}


def _calibrate(ctx, reprofile: bool) -> Path:
    check_calibration(ctx.work.calibration, ctx.log)  # a damaged cached calibration is redone, not reused
    calibration = calibrate(ctx, reprofile)
    seal(calibration)  # its content hashes, checked before the next compile reuses it
    return calibration
