"""Phase "formats": which weight format the bundle deploys (issue 22, part 3).

For each candidate format (the recipe's `weights`, or with `auto` every format this device
supports, int4 only when `quality.allow_int4`), the target (and draft) are loaded in that
format and measured here, on this device:

- step times T(n) over the recipe's verify widths (and 1 and 16 rows), and the draft's, with
  the checks for a busy machine compile measures everything with (yggdrasil/runtime/latency.py);
- greedy next-token agreement with the fp32 model: the format is teacher-forced along the
  fp32 model's greedy continuations of the calibration prompts (compile/greedy_path.py), and at
  each continuation position its argmax is compared with fp32's, the continuation's next token;
- perplexity on the held-out split of the recipe's prompt sets (their own text, teacher-forced);
- batch invariance of its eager steps (compile/invariance.py): a probe's row computed by decode,
  prefill, and chain and tree verify steps of every measured width, compared bitwise; the
  deployed format's compiled graphs are measured again in the warm-load check.

A format below `quality.min_agreement` is refused (a named format: compile stops, naming the
measured agreement). Among the rest, the latency objective decides: each format's step times
with the calibration's acceptance give its expected seconds per token (`prefer_by_objective`).
fp32 is the reference and always passes.

Verify step times are what the deployed steps spend: the summed time of the operators an eager
step runs (torch.profiler), not its wall time, whose Python and dispatch overhead the compiled
graphs do not pay and which, for a small model, hid the format that is fastest deployed (issue
50). Draft builds are timed by the wall clock (reading a deep build's profile cost more than it).

The order saves time and memory. After the fp32 reference its models are let go; the other
formats follow smallest weights first, one model pair at a time beside the one kept, and fp32
comes last. A format is settled without being timed where its weights cannot be read faster
than a format already passing quality runs every step (`priced`), and one slower at every step
is settled by a probe of as few of its steps as show it (`dominated`; compile/format_pricing.py;
`quality.time_every_format: true` times them all in full instead); neither has its quality
measured, and fp32 is reloaded only if neither settles it. --reprofile retimes
and keeps every verdict. The measurements are cached in the work directory.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import yaml

from yggdrasil.runtime import latency
from yggdrasil.errors import YggdrasilError
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.models.loader import LoadedModel, load, parse_dtype
from yggdrasil.progress import Progress
from yggdrasil.models.quant import WEIGHT_FORMATS, weight_bytes
from yggdrasil.runtime.steps import StepRunner

from . import activation_cost
from .format_pricing import floor_profile, probe_checked, step_floors
from .context import BuildContext, work_key
from .format_quality import AGREEMENT_METHOD, Reference, agreement, build_reference, perplexity, wilson
from .invariance import Invariance, measure_invariance, probe_ids
from yggdrasil.runtime.assembly import assemble_runtime, grid_drafter

FORMATS_FILE = "formats.yaml"  # in the work cache: the measurements, under their key
FORMATS_VERSION = 7  # 2: batch invariance measured too; 3: the time each part took; 4: dominated formats;
# 5: operator-time step profiles, priced formats, reference runs of 32+ positions, agreement intervals;
# 6: q4 keeps a GGUF's blocks as stored, and its int8 activations are measured apart (activation_cost.py);
# 7: dominated formats settled by a probe of their steps (format_pricing.py)
REPEATS = 5
REFERENCE, PASSES, REFUSED, UNSUPPORTED = "reference", "passes", "refused", "unsupported"
DOMINATED = "dominated"  # slower at every step than a format that passes: its quality is not measured
PRICED = "priced"  # its weight bytes alone take longer to read than a passing format's every step: not timed
# the order formats are measured in: smallest weights first, since decoding on a CPU reads every
# weight, so the smaller format is usually the faster one and, once it passes quality, a larger
# format it beats at every step size is settled by its bytes or step times alone; fp32 (the
# reference, whose models are let go after it) last
MEASURE_ORDER = ("q4", "int4", "int8", "bf16", "fp32")


class FormatError(YggdrasilError):
    """A weight format the recipe names cannot be deployed (below the quality floor, unsupported)."""


@dataclass(frozen=True)
class FormatMeasurement:
    """One candidate format as measured here. verdict: reference (fp32), passes, refused
    (below the floor) or unsupported (this device or build cannot run it); note says why."""

    format: str
    verdict: str  # reference, passes, refused, unsupported or dominated
    note: str = ""
    draft_format: str | None = None
    profile: dict | None = None  # LatencyProfile.as_dict() of the eager steps in this format
    agreement: float | None = None
    positions: int = 0  # how many positions agreement was measured over
    agreement_interval: tuple[float, float] | None = None  # Wilson's 95 % interval over those positions
    perplexity: float | None = None
    weight_bytes: int | None = None
    objective_speedup: float | None = None  # the objective's best constant bucket, vs plain decoding
    expected_tpot_ms: float | None = None  # T(1) / that speedup
    invariance: dict | None = None  # Invariance.as_dict() of the format's eager steps
    seconds: dict | None = None  # wall seconds of each part of measuring it (load, steps, agreement, ...)
    activation_cost: dict | None = None  # q4: its weights with float activations (compile/activation_cost.py)
    probed: bool = False  # dominated by a probe: its profile holds only the steps the probe timed

    @property
    def usable(self) -> bool:
        return self.verdict in (REFERENCE, PASSES)

    def latency(self) -> LatencyProfile:
        return LatencyProfile.from_dict(self.profile)

    def t_ms(self, n: int) -> float | None:
        if self.profile is None or (self.probed and n not in dict(self.latency().verify)):
            return None  # a probed format's other steps were not timed
        return self.latency().t_verify(n) * 1e3

    def invariance_verdict(self) -> str | None:
        """"bitwise" or "up to ties (max gap ...)" for the format's eager steps; None: not measured."""
        return None if self.invariance is None else Invariance.from_dict(self.invariance).verdict()

    def as_dict(self) -> dict:
        """What the manifest records (and `inspect` prints)."""
        body = {"format": self.format, "draft_format": self.draft_format, "verdict": self.verdict,
                "note": self.note, "agreement": self.agreement, "positions": self.positions,
                "agreement_interval": None if self.agreement_interval is None else list(self.agreement_interval),
                "perplexity": self.perplexity, "weight_bytes": self.weight_bytes,
                "t1_ms": _round(self.t_ms(1)), "t16_ms": _round(self.t_ms(16)),
                "t_ms": None if self.profile is None else
                {int(n): round(t * 1e3, 4) for n, t in self.latency().verify},
                "objective_speedup": _round(self.objective_speedup), "expected_tpot_ms": _round(self.expected_tpot_ms),
                "batch_invariance": self.invariance_verdict(), "batch_invariance_measured": self.invariance,
                "seconds": self.seconds, **({"activation_cost": self.activation_cost} if self.activation_cost else {})}
        if self.verdict != PASSES or self.note:
            body["verdict"] = f"{self.verdict}: {self.note}" if self.note else self.verdict
        return body


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(frozen=True)
class FormatChoice:
    chosen: str
    reason: str
    candidates: tuple[FormatMeasurement, ...] = ()
    measured: bool = True  # False: the recipe names fp32, nothing was measured

    def get(self, fmt: str) -> FormatMeasurement:
        return next(c for c in self.candidates if c.format == fmt)

    @property
    def usable(self) -> tuple[FormatMeasurement, ...]:
        return tuple(c for c in self.candidates if c.usable)

    def as_dict(self) -> dict:
        if not self.measured:
            return {}
        return {"chosen": self.chosen, "reason": self.reason, "agreement_method": AGREEMENT_METHOD,
                "candidates": [c.as_dict() for c in self.candidates]}


# -- measuring -------------------------------------------------------------------------------
def measure_sizes(ctx: BuildContext) -> tuple[int, ...]:
    """The verify widths each format's T(n) is measured at: the recipe's, and 1 and 16 rows."""
    return tuple(sorted(n for n in {1, 16, *ctx.recipe.buckets.verify_widths} if n < ctx.recipe.max_context))


def step_profile(ctx: BuildContext, target: StepRunner, draft: StepRunner | None, what: str) -> LatencyProfile:
    """The format's step times: the time the operators of its eager verify steps spend (what its
    compiled graphs will run, without the eager Python overhead they do not pay); draft builds
    by the wall clock."""
    grid = ctx.grid()
    drafter = grid_drafter(grid, draft)
    return latency.measure_checked(
        lambda: latency.measure_profile(target, drafter, measure_sizes(ctx), repeats=REPEATS,
                                        draft_widths=() if draft is None else grid.widths, kernel_time=True),
        target.device, ctx.log, what=f"step times in {what}")


def release(loaded: LoadedModel | None) -> None:
    """Free a model's weights (its tensors move to the meta device). The fp32 models compile
    loads first are let go once the reference and fp32's own measurement are done, so measuring
    the other formats holds one of them at a time beside the one kept: with the Qwen pair's
    fp32 (9.6 GB) held throughout, a 24 GB machine ran out of memory loading the fifth format."""
    if loaded is not None:
        loaded.model.to("meta")


def released(loaded: LoadedModel | None) -> bool:
    return loaded is not None and any(p.is_meta for p in loaded.model.parameters())


def load_in(ctx: BuildContext, role: str, fmt: str) -> LoadedModel:
    """The role's model in this weight format (fp32: the one already loaded, unless released)."""
    loaded = ctx.target if role == "target" else ctx.draft
    if fmt == "fp32" and not released(loaded):
        return loaded
    return load(ctx.models[role]["name"], dtype=parse_dtype(ctx.recipe.dtype), device=ctx.recipe.device,
                quiet=True, weights=fmt)


def _runners(ctx: BuildContext, fmt: str) -> tuple[tuple, StepRunner, StepRunner | None] | FormatMeasurement:
    """The format's (target, draft) LoadedModels and step runners, or its UNSUPPORTED
    measurement."""
    recipe = ctx.recipe
    draft_fmt = recipe.draft_format(fmt) if ctx.draft is not None else None
    try:
        target = load_in(ctx, "target", fmt)
        draft = load_in(ctx, "draft", draft_fmt) if draft_fmt else None
    except YggdrasilError as exc:
        if recipe.weights != "auto":
            raise FormatError(f"{recipe.source}: weights {fmt} cannot be used here: {exc}") from None
        return FormatMeasurement(fmt, UNSUPPORTED, str(exc).split("\n")[0][:200], draft_fmt)
    runtime = assemble_runtime(target.model, draft.model if draft else None, recipe.max_context,
                               chunk_sizes=recipe.buckets.prefill_chunks)
    return (target, draft), runtime.runner, runtime.draft_runner


class _Stopwatch:
    """Wall seconds of the named parts of one measurement, in order (where compile's time goes)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = round(now - self._last, 2)
        self._last = now


def dominates(faster: LatencyProfile, slower: LatencyProfile) -> bool:
    """Every measured step of `faster` (the target's T(n), the draft's) takes at most as long as
    `slower`'s, and one takes less. Then, with the same acceptance (formats above the quality floor generate the
    same tokens nearly always), every bucket costs `slower` at least as much, and the latency
    objective cannot prefer it."""
    pairs = ((faster.t_verify, slower.verify), (faster.t_draft, slower.draft))
    times = [(time_of(n), t) for time_of, points in pairs for n, t in points]
    # identical times tie, and a tie the objective breaks by the recipe's order: not dominated
    return all(a <= b for a, b in times) and any(a < b for a, b in times)


def time_format(ctx: BuildContext, fmt: str, keep: dict | None = None, beaten_by: tuple = ()
                ) -> tuple[FormatMeasurement, StepRunner] | FormatMeasurement:
    """The format loaded and its step times measured: the measurement so far (quality not yet
    judged; verdict reference for fp32, passes otherwise) and its target's runner, or the
    format's UNSUPPORTED measurement, or its DOMINATED one when a probe shows a format in
    beaten_by faster at every step. keep: given, it gets {fmt: (target, draft)}, the
    LoadedModels, so that deploying the chosen format need not load and convert them again."""
    started = time.perf_counter()
    loaded = _runners(ctx, fmt)
    if isinstance(loaded, FormatMeasurement):
        return loaded
    models, target_runner, draft_runner = loaded
    if keep is not None:
        keep[fmt] = models
    load_seconds = round(time.perf_counter() - started, 2)
    timed = _timed(ctx, fmt, models, target_runner, draft_runner, beaten_by)
    timed = replace(timed, seconds={"load": load_seconds, **timed.seconds})
    return timed if timed.verdict == DOMINATED else (timed, target_runner)


def _timed(ctx: BuildContext, fmt: str, models: tuple, target_runner: StepRunner,
           draft_runner: StepRunner | None, beaten_by: tuple = ()) -> FormatMeasurement:
    """The format's step times (quality not yet judged; verdict reference for fp32, passes
    otherwise), or, probed, its DOMINATED measurement (format_pricing.py)."""
    watch = _Stopwatch()
    draft_fmt = ctx.recipe.draft_format(fmt) if ctx.draft is not None else None
    winner = fastest_usable(list(beaten_by))
    if winner is not None and not ctx.recipe.quality.time_every_format:
        same_draft = draft_runner is None or winner.draft_format == draft_fmt
        drafter = None if same_draft else grid_drafter(ctx.grid(), draft_runner)
        probed = probe_checked(winner.latency(), target_runner, drafter, target_runner.device, ctx.log)
        watch.lap("probe")
        if probed is not None:
            shown = ", ".join(str(n) for n, _ in probed.verify)
            return FormatMeasurement(fmt, DOMINATED, f"slower than {winner.format}, which passes quality, at every "
                                     f"step (probed at {shown} row(s); wider steps take longer): not timed in full, "
                                     "its quality not measured (quality.time_every_format times it)", draft_fmt,
                                     probed.as_dict(), weight_bytes=weight_bytes(models[0].model),
                                     seconds=watch.parts, probed=True)
    profile = step_profile(ctx, target_runner, draft_runner, fmt)
    watch.lap("step_times")
    return FormatMeasurement(fmt, REFERENCE if fmt == "fp32" else PASSES, "", draft_fmt, profile.as_dict(),
                             weight_bytes=weight_bytes(models[0].model), seconds=watch.parts)


def judge_format(ctx: BuildContext, timed: FormatMeasurement, runner: StepRunner,
                 reference: Reference) -> FormatMeasurement:
    """A timed format's quality: agreement with fp32 (refused below the floor), held-out
    perplexity and the batch invariance of its eager steps."""
    watch = _Stopwatch()
    agreed, positions = agreement(runner, reference)
    low, high = wilson(round(agreed * positions), positions)
    watch.lap("agreement")
    floor = ctx.recipe.quality.min_agreement
    verdict, note = timed.verdict, ""
    if timed.format != "fp32" and agreed < floor:
        verdict, note = REFUSED, (f"agreement {agreed:.4f} (95 % {low:.3f}-{high:.3f} over {positions} positions) "
                                  f"< quality.min_agreement {floor:g}")
    held_out = perplexity(runner, reference)
    watch.lap("perplexity")
    invariance = measure_invariance(runner, probe_ids(ctx.target.tokenizer), measure_sizes(ctx))
    watch.lap("invariance")
    activation = None
    if timed.format == "q4":  # int8 activations measured apart (activation_cost.py)
        activation = activation_cost.measure(runner.model, runner, reference, _fp32_target(ctx))
        watch.lap("activation_cost")
    return replace(timed, verdict=verdict, note=note, agreement=round(agreed, 6), positions=positions,
                   agreement_interval=(round(low, 4), round(high, 4)),
                   perplexity=_round(held_out), invariance=invariance.as_dict(),
                   seconds={**(timed.seconds or {}), **watch.parts}, activation_cost=activation)


def _fp32_target(ctx: BuildContext):
    """The fp32 target (the reference's model) on demand: compile's own, or loaded again where
    compile has let it go (activation_cost.measure drops it once measured)."""
    return lambda: load_in(ctx, "target", "fp32").model


def dominator(measured, timed: FormatMeasurement) -> FormatMeasurement | None:
    """A format measured already that passes quality and dominates this one's step times."""
    return next((m for m in measured if m.usable and m.format != timed.format
                 and dominates(m.latency(), timed.latency())), None)


def as_dominated(timed: FormatMeasurement, winner: FormatMeasurement) -> FormatMeasurement:
    return replace(timed, verdict=DOMINATED, note=f"no step faster than {winner.format}'s, which passes quality: "
                   "the objective cannot prefer it, so its quality was not measured")


def measure_format(ctx: BuildContext, fmt: str, reference: Reference, keep: dict | None = None,
                   beaten_by: tuple[FormatMeasurement, ...] = ()) -> FormatMeasurement:
    """One format timed and, unless a format in beaten_by (measured already, passing quality)
    dominates its step times (then it is DOMINATED), judged. keep: as time_format's."""
    timed = time_format(ctx, fmt, keep, beaten_by)
    if isinstance(timed, FormatMeasurement):
        return timed
    measurement, runner = timed
    winner = dominator(beaten_by, measurement)
    return as_dominated(measurement, winner) if winner else judge_format(ctx, measurement, runner, reference)


def _cache_key(ctx: BuildContext, candidates: tuple[str, ...]) -> str:
    recipe = ctx.recipe
    return work_key("formats", FORMATS_VERSION, ctx.model_hashes(), candidates, recipe.draft_weights, asdict(recipe.quality),
                    ctx.grid().as_dict(), recipe.calibration.__dict__, recipe.dtype, recipe.max_context,
                    ctx.env.device, ctx.env.torch)


def _cached(path: Path, key: str) -> list[FormatMeasurement] | None:
    try:
        body = yaml.safe_load(path.read_text())
        if body.get("key") != key:
            return None
        return [FormatMeasurement(**m) for m in body["measurements"]]
    except (OSError, AttributeError, KeyError, TypeError, yaml.YAMLError):
        return None


def measure_formats(ctx: BuildContext, reprofile: bool = False, keep: dict | None = None,
                    let_go: bool = False) -> list[FormatMeasurement]:
    """Every candidate measured here (or the cached measurements of the same candidates,
    models, prompts and machine, unless reprofile). keep: given, it ends up holding the loaded
    models of the provisional choice (gate's: the fastest usable T(1)) when they were loaded
    here; the others are let go as soon as a faster one passes. let_go: free ctx's fp32 models
    once the reference and fp32's step times are measured (release(); choose_format's caller gets
    the chosen format's context back), so one other format's models are loaded at a time."""
    candidates = ctx.recipe.candidate_formats(WEIGHT_FORMATS)
    path, key = ctx.work.root / FORMATS_FILE, _cache_key(ctx, candidates)
    cached = _cached(path, key)
    if cached is not None and not reprofile:
        ctx.log(f"reusing the weight-format measurements in {path}")
        return cached
    if cached is not None:
        return _save(path, key, retime_formats(ctx, cached, let_go))
    ctx.log(f"measuring weight formats {', '.join(candidates)}: step times, agreement with fp32, held-out "
            "perplexity and batch invariance")
    bar = Progress("measuring weight formats", len(candidates) + 1)
    started = time.perf_counter()
    reference = build_reference(ctx, StepRunner(ctx.target.model, ctx.recipe.max_context,
                                                chunk_sizes=ctx.recipe.buckets.prefill_chunks))
    ctx.log(f"fp32 reference continuations: {time.perf_counter() - started:.1f} s")
    bar.update()
    measured = _measure_in_order(ctx, candidates, reference, keep, let_go, bar)
    measured.sort(key=lambda m: candidates.index(m.format))  # shown in the recipe's order
    bar.close(", ".join(f"{m.format} {m.verdict}" for m in measured))
    return _save(path, key, measured)


def _measure_in_order(ctx: BuildContext, candidates: tuple[str, ...], reference: Reference, keep: dict | None,
                      let_go: bool, bar: Progress) -> list[FormatMeasurement]:
    """After the reference, fp32's models are let go; the others follow smallest first, each
    priced or dominated where a passing one beats it; fp32 comes last, reloaded only if neither
    settles it."""
    # while the fp32 models they are counted on are loaded
    floors = {} if released(ctx.target) else step_floors(ctx, candidates)
    if floors:
        ctx.log("weight bytes a decode step reads at least, over this machine's bandwidth ("
                f"{ctx.bandwidth / 1e9:.1f} GB/s): " + ", ".join(f"{f} {1e3 * t:.1f} ms" for f, (t, _) in floors.items()))
    measured: list[FormatMeasurement] = []
    for fmt in sorted(candidates, key=_measure_rank):
        if let_go and fmt != "fp32" and not released(ctx.target):
            _let_go_of_fp32(ctx, keep)
        measured.append(_price_or_measure(ctx, fmt, reference, keep, measured, floors.get(fmt)))
        if keep is not None:
            _keep_fastest(keep, measured)
        bar.update()
    return measured


def _price_or_measure(ctx: BuildContext, fmt: str, reference: Reference, keep: dict | None,
                      measured: list[FormatMeasurement], floor: tuple[float, float] | None) -> FormatMeasurement:
    """One format priced by its weight bytes, or timed (fp32 reloaded if let go) and judged."""
    draft_fmt = ctx.recipe.draft_format(fmt) if ctx.draft is not None else None
    if floor is not None:
        stand_in = floor_profile(floor, [m.latency() for m in measured if m.profile])
        winner = dominator(measured, FormatMeasurement(fmt, PASSES, "", draft_fmt, stand_in.as_dict()))
        if winner is not None:
            return FormatMeasurement(fmt, PRICED, f"its linear weights take at least {1e3 * floor[0]:.1f} ms a step to "
                                     f"read at {ctx.bandwidth / 1e9:.1f} GB/s, longer than every step of {winner.format}, "
                                     "which passes quality: not timed (quality.time_every_format times it)", draft_fmt)
    if fmt == "fp32" and released(ctx.target):
        started = time.perf_counter()
        models, runner, draft_runner = _runners(ctx, "fp32")
        reload = round(time.perf_counter() - started, 2)
        if keep is not None:
            keep["fp32"] = models
        timed = _timed(ctx, fmt, models, runner, draft_runner, tuple(measured))
        timed = replace(timed, seconds={"reload": reload, **timed.seconds})
        if timed.verdict == DOMINATED:
            return timed
        winner = dominator(measured, timed)
        return as_dominated(timed, winner) if winner else judge_format(ctx, timed, runner, reference)
    return measure_format(ctx, fmt, reference, keep, tuple(measured))


def _let_go_of_fp32(ctx: BuildContext, keep: dict | None) -> None:
    if keep is not None:
        keep.pop("fp32", None)
    release(ctx.target)
    release(ctx.draft)


def _measure_rank(fmt: str) -> int:
    return MEASURE_ORDER.index(fmt) if fmt in MEASURE_ORDER else len(MEASURE_ORDER)


def fastest_usable(measured: list[FormatMeasurement]) -> FormatMeasurement | None:
    """The provisional choice among formats passing quality: the fastest plain decode step."""
    usable = [m for m in measured if m.usable]
    return min(usable, key=lambda m: m.t_ms(1)) if usable else None


def _keep_fastest(keep: dict, measured: list[FormatMeasurement]) -> None:
    fastest = fastest_usable(measured)
    for fmt in list(keep):
        if fastest is None or fmt != fastest.format:
            del keep[fmt]


def _save(path: Path, key: str, measured: list[FormatMeasurement]) -> list[FormatMeasurement]:
    path.write_text(yaml.safe_dump({"key": key, "measurements": [asdict(m) for m in measured]}, sort_keys=False))
    return measured


def retime_formats(ctx: BuildContext, cached: list[FormatMeasurement], let_go: bool = False) -> list[FormatMeasurement]:
    """--reprofile: the step times measured again; agreement and perplexity (which a busy
    machine does not change) kept from the cached measurements of the same models and prompts.
    One format's models at a time: fp32 first, on compile's own models, which are then let go
    (let_go) as measure_formats lets them go; every other format's once it is timed (holding them
    all beside fp32 ran a 24 GB machine out of memory on the Qwen pair)."""
    ctx.log(f"--reprofile: measuring the step times of weight formats {', '.join(m.format for m in cached)} "
            "again; keeping their measured agreement and perplexity")
    bar = Progress("timing weight formats", len(cached))
    measured = []
    for old in sorted(cached, key=lambda m: m.format != "fp32"):
        # unsupported or priced by its bytes: nothing to time (a priced format's loading alone is the waste)
        loaded = old if old.verdict in (UNSUPPORTED, PRICED) else _runners(ctx, old.format)
        if isinstance(loaded, FormatMeasurement):  # still unsupported here
            measured.append(loaded)
        else:
            models, target_runner, draft_runner = loaded
            profile = step_profile(ctx, target_runner, draft_runner, old.format)
            measured.append(replace(old, profile=profile.as_dict(), objective_speedup=None, expected_tpot_ms=None))
            for model in models:
                if model is not ctx.target and model is not ctx.draft:
                    release(model)
        del loaded
        if let_go and not released(ctx.target):
            _let_go_of_fp32(ctx, None)
        bar.update()
    measured.sort(key=lambda m: [c.format for c in cached].index(m.format))
    bar.close(", ".join(f"{m.format} {m.verdict}" for m in measured))
    return measured
