"""Phase "formats": which weight format the bundle deploys (issue 22, part 3).

For each candidate format (the recipe's `weights`, or with `auto` every format this device
supports, int4 only when `quality.allow_int4`), the target (and draft) are loaded in that
format and measured here, on this device:

- step times T(n) over the recipe's verify widths (and 1 and 16 rows), and the draft's, with
  the checks for a busy machine compile measures everything with (yggdrasil/latency.py);
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
fp32 is the reference and always passes. The measurements are cached in the work directory.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import yaml

from yggdrasil import latency
from yggdrasil.drafters import LookupDrafter, ModelDrafter
from yggdrasil.errors import YggdrasilError
from yggdrasil.latency import LatencyProfile
from yggdrasil.loader import LoadedModel, load, parse_dtype
from yggdrasil.predictor import prompts as prompt_sets
from yggdrasil.predictor.calibration_data import load_run
from yggdrasil.predictor.pipeline import selector_for
from yggdrasil.progress import Progress
from yggdrasil.quant import WEIGHT_FORMATS, weight_bytes
from yggdrasil.steps import StepRunner

from .context import BuildContext, work_key
from .greedy_path import greedy_paths
from .invariance import Invariance, measure_invariance, probe_ids

FORMATS_FILE = "formats.yaml"  # in the work cache: the measurements, under their key
FORMATS_VERSION = 3  # 2: each format's batch invariance measured too; 3: the time each part took
REPEATS = 5
AGREEMENT_METHOD = ("teacher-forced on the fp32 model's greedy continuations of the calibration prompts: "
                    "the format's argmax vs fp32's at each continuation position")
REFERENCE, PASSES, REFUSED, UNSUPPORTED = "reference", "passes", "refused", "unsupported"


class FormatError(YggdrasilError):
    """A weight format the recipe names cannot be deployed (below the quality floor, unsupported)."""


@dataclass(frozen=True)
class FormatMeasurement:
    """One candidate format as measured here. verdict: reference (fp32), passes, refused
    (below the floor) or unsupported (this device or build cannot run it); note says why."""

    format: str
    verdict: str
    note: str = ""
    draft_format: str | None = None
    profile: dict | None = None  # LatencyProfile.as_dict() of the eager steps in this format
    agreement: float | None = None
    positions: int = 0  # how many positions agreement was measured over
    perplexity: float | None = None
    weight_bytes: int | None = None
    objective_speedup: float | None = None  # the objective's best constant bucket, vs plain decoding
    expected_tpot_ms: float | None = None  # T(1) / that speedup
    invariance: dict | None = None  # Invariance.as_dict() of the format's eager steps
    seconds: dict | None = None  # wall seconds of each part of measuring it (load, steps, agreement, ...)

    @property
    def usable(self) -> bool:
        return self.verdict in (REFERENCE, PASSES)

    def latency(self) -> LatencyProfile:
        return LatencyProfile.from_dict(self.profile)

    def t_ms(self, n: int) -> float | None:
        return None if self.profile is None else self.latency().t_verify(n) * 1e3

    def invariance_verdict(self) -> str | None:
        """"bitwise" or "up to ties (max gap ...)" for the format's eager steps; None: not measured."""
        return None if self.invariance is None else Invariance(**self.invariance).verdict()

    def as_dict(self) -> dict:
        """What the manifest records (and `inspect` prints)."""
        body = {"format": self.format, "draft_format": self.draft_format, "verdict": self.verdict,
                "note": self.note, "agreement": self.agreement, "positions": self.positions,
                "perplexity": self.perplexity, "weight_bytes": self.weight_bytes,
                "t1_ms": _round(self.t_ms(1)), "t16_ms": _round(self.t_ms(16)),
                "t_ms": None if self.profile is None else
                {int(n): round(t * 1e3, 4) for n, t in self.latency().verify},
                "objective_speedup": _round(self.objective_speedup), "expected_tpot_ms": _round(self.expected_tpot_ms),
                "batch_invariance": self.invariance_verdict(), "batch_invariance_measured": self.invariance,
                "seconds": self.seconds}
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
@dataclass(frozen=True)
class Reference:
    """What every format is compared with: fp32's argmax along its own greedy continuations,
    and the held-out token sequences perplexity is measured on."""

    sequences: tuple[tuple[int, ...], ...]  # prompt + fp32 greedy continuation
    starts: tuple[int, ...]  # where each continuation's predictions begin (last prompt position)
    heldout: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def argmax(self) -> tuple[tuple[int, ...], ...]:
        """fp32's argmax at each of those positions: the continuation's own next tokens (a
        teacher-forced recomputation in prefill chunks differed at 0 of 512 positions on SmolLM2
        and 0 of 256 on the Qwen 1.5B target, and cost 80 s there)."""
        return tuple(sequence[start + 1:] for sequence, start in zip(self.sequences, self.starts))


def sequence_logits(runner: StepRunner, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logits of every position, teacher-forced, in prefill chunks."""
    out, size = [], runner.chunk_size
    with torch.inference_mode():
        for offset in range(0, len(ids), size):
            piece = ids[offset:offset + size]
            inputs = replace(runner.prefill_inputs(piece, offset, size), logit_index=None)
            out.append(runner.run(inputs)[0, :len(piece)].float())
    return torch.cat(out)


def _prompt_ids(ctx: BuildContext, part: str) -> list[list[int]]:
    recipe = ctx.recipe
    names = [recipe.resolve(p) if p.endswith(".jsonl") else p for p in recipe.calibration.prompts]
    texts = prompt_sets.select(names, part, recipe.calibration.num_prompts)
    return [prompt_sets.encode(p, ctx.target.tokenizer) for p in texts]


def build_reference(ctx: BuildContext, runner: StepRunner) -> Reference:
    """fp32 greedy continuations of the calibration prompts (quality.agreement_tokens positions
    in all; decoded together, greedy_path.py), which are fp32's argmax along them; the held-out
    token sequences."""
    recipe, quality = ctx.recipe, ctx.recipe.quality
    limit = recipe.max_context - 1
    prompts = _prompt_ids(ctx, "calibration")
    # the positions are shared out over the prompts: a short calibration (few prompts, short
    # replies) still measures agreement_tokens positions, and a 0.97-0.98 floor needs them
    per_prompt = -(-quality.agreement_tokens // max(len(prompts), 1))
    jobs, budget = [], quality.agreement_tokens
    for prompt in prompts:
        if budget <= 0:
            break
        prompt = prompt[-(limit // 2):]
        n = min(per_prompt, budget, limit - len(prompt))
        jobs.append((prompt, n))
        budget -= n
    continuations = greedy_paths(runner.model, [p for p, _ in jobs], [n for _, n in jobs], runner.chunk_size)
    sequences = tuple(tuple(prompt + continuation) for (prompt, _), continuation in zip(jobs, continuations))
    starts = tuple(len(prompt) - 1 for prompt, _ in jobs)
    heldout, budget = [], quality.heldout_tokens
    for ids in _prompt_ids(ctx, "held-out"):
        if budget <= 0:
            break
        ids = ids[:min(limit, budget + 1)]
        if len(ids) >= 2:
            heldout.append(tuple(ids))
            budget -= len(ids) - 1
    return Reference(sequences, starts, tuple(heldout))


def agreement(runner: StepRunner, reference: Reference) -> tuple[float, int]:
    """(share of positions where the model's argmax is fp32's, positions)."""
    agreed = total = 0
    for sequence, start, expected in zip(reference.sequences, reference.starts, reference.argmax):
        picked = sequence_logits(runner, list(sequence[:-1]))[start:].argmax(-1)
        agreed += int((picked == torch.tensor(expected)).sum())
        total += len(expected)
    return (agreed / total if total else 1.0), total


def perplexity(runner: StepRunner, reference: Reference) -> float | None:
    """exp(mean negative log-likelihood) of the held-out tokens (None: no held-out text)."""
    nll = count = 0.0
    for ids in reference.heldout:
        logits = sequence_logits(runner, list(ids[:-1]))
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count) if count else None


def measure_sizes(ctx: BuildContext) -> tuple[int, ...]:
    """The verify widths each format's T(n) is measured at: the recipe's, and 1 and 16 rows."""
    return tuple(sorted(n for n in {1, 16, *ctx.recipe.buckets.verify_widths} if n < ctx.recipe.max_context))


def step_profile(ctx: BuildContext, target: StepRunner, draft: StepRunner | None, what: str) -> LatencyProfile:
    """The eager step times in one format, as compile's calibration measures them."""
    grid = ctx.grid()
    drafter = (LookupDrafter(grid.max_depth, grid.max_width) if draft is None else
               ModelDrafter(draft, grid.max_depth, grid.max_width, grid.widths))
    return latency.measure_checked(
        lambda: latency.measure_profile(target, drafter, measure_sizes(ctx), repeats=REPEATS,
                                        draft_widths=() if draft is None else grid.widths),
        target.device, ctx.log, what=f"step times in {what}")


def load_in(ctx: BuildContext, role: str, fmt: str) -> LoadedModel:
    """The role's model in this weight format (fp32: the one already loaded)."""
    loaded = ctx.target if role == "target" else ctx.draft
    if fmt == "fp32":
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
    chunks = recipe.buckets.prefill_chunks
    target_runner = StepRunner(target.model, recipe.max_context, chunk_sizes=chunks)
    draft_runner = StepRunner(draft.model, recipe.max_context, chunk_sizes=chunks) if draft else None
    return (target, draft), target_runner, draft_runner


class _Stopwatch:
    """Wall seconds of the named parts of one measurement, in order (where compile's time goes)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = round(now - self._last, 2)
        self._last = now


def measure_format(ctx: BuildContext, fmt: str, reference: Reference, keep: dict | None = None) -> FormatMeasurement:
    """keep: given, it gets {fmt: (target, draft)}, the LoadedModels measured, so that deploying
    the chosen format need not load and convert the models again."""
    recipe = ctx.recipe
    watch = _Stopwatch()
    loaded = _runners(ctx, fmt)
    if isinstance(loaded, FormatMeasurement):
        return loaded
    watch.lap("load")
    models, target_runner, draft_runner = loaded
    target = models[0]
    if keep is not None:
        keep[fmt] = models
    draft_fmt = recipe.draft_format(fmt) if ctx.draft is not None else None
    profile = step_profile(ctx, target_runner, draft_runner, fmt)
    watch.lap("step_times")
    agreed, positions = agreement(target_runner, reference)
    watch.lap("agreement")
    floor = recipe.quality.min_agreement
    verdict, note = (REFERENCE, "") if fmt == "fp32" else (PASSES, "")
    if fmt != "fp32" and agreed < floor:
        verdict = REFUSED
        note = f"agreement {agreed:.4f} < quality.min_agreement {floor:g}"
    held_out = perplexity(target_runner, reference)
    watch.lap("perplexity")
    invariance = measure_invariance(target_runner, probe_ids(ctx.target.tokenizer), measure_sizes(ctx))
    watch.lap("invariance")
    return FormatMeasurement(fmt, verdict, note, draft_fmt, profile.as_dict(), round(agreed, 6), positions,
                             _round(held_out), weight_bytes(target.model),
                             invariance=invariance.as_dict(), seconds=watch.parts)


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


def measure_formats(ctx: BuildContext, reprofile: bool = False, keep: dict | None = None) -> list[FormatMeasurement]:
    """Every candidate measured here (or the cached measurements of the same candidates,
    models, prompts and machine, unless reprofile). keep: given, it ends up holding the loaded
    models of the provisional choice (gate's: the fastest usable T(1)) when they were loaded
    here; the others are let go as soon as a faster one passes (one format's models at a time
    beside fp32's)."""
    candidates = ctx.recipe.candidate_formats(WEIGHT_FORMATS)
    path, key = ctx.work.root / FORMATS_FILE, _cache_key(ctx, candidates)
    cached = _cached(path, key)
    if cached is not None and not reprofile:
        ctx.log(f"reusing the weight-format measurements in {path}")
        return cached
    if cached is not None:
        return _save(path, key, retime_formats(ctx, cached))
    ctx.log(f"measuring weight formats {', '.join(candidates)}: step times, agreement with fp32, held-out "
            "perplexity and batch invariance")
    bar = Progress("measuring weight formats", len(candidates) + 1)
    started = time.perf_counter()
    reference = build_reference(ctx, StepRunner(ctx.target.model, ctx.recipe.max_context,
                                                chunk_sizes=ctx.recipe.buckets.prefill_chunks))
    ctx.log(f"fp32 reference continuations: {time.perf_counter() - started:.1f} s")
    bar.update()
    measured = []
    for fmt in candidates:
        measured.append(measure_format(ctx, fmt, reference, keep))
        if keep is not None:
            _keep_fastest(keep, measured)
        bar.update()
    bar.close(", ".join(f"{m.format} {m.verdict}" for m in measured))
    return _save(path, key, measured)


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


def retime_formats(ctx: BuildContext, cached: list[FormatMeasurement]) -> list[FormatMeasurement]:
    """--reprofile: the step times measured again; agreement and perplexity (which a busy
    machine does not change) kept from the cached measurements of the same models and prompts."""
    ctx.log(f"--reprofile: measuring the step times of weight formats {', '.join(m.format for m in cached)} "
            "again; keeping their measured agreement and perplexity")
    bar = Progress("timing weight formats", len(cached))
    measured = []
    for old in cached:
        loaded = old if old.verdict == UNSUPPORTED else _runners(ctx, old.format)
        if isinstance(loaded, FormatMeasurement):  # still unsupported here
            measured.append(loaded)
        else:
            _, target_runner, draft_runner = loaded
            profile = step_profile(ctx, target_runner, draft_runner, old.format)
            measured.append(replace(old, profile=profile.as_dict(), objective_speedup=None, expected_tpot_ms=None))
        bar.update()
    bar.close(", ".join(f"{m.format} {m.verdict}" for m in measured))
    return measured


# -- choosing --------------------------------------------------------------------------------
def gate(ctx: BuildContext, measured: list[FormatMeasurement]) -> FormatChoice:
    """Refuse what is below the floor; a named format that is refused stops compile. Among
    several usable formats the provisional choice is the fastest plain decode step (T(1)),
    which prefer_by_objective revisits once calibration has measured acceptance."""
    recipe = ctx.recipe
    if recipe.weights != "auto":
        only = measured[0]
        if not only.usable:
            raise FormatError(f"{recipe.source}: weights {only.format} is below the quality floor: greedy "
                              f"next-token agreement with fp32 {only.agreement:.4f} over {only.positions} "
                              f"positions < quality.min_agreement {recipe.quality.min_agreement:g}; use "
                              "weights: auto (or a wider format), or lower quality.min_agreement")
        return FormatChoice(only.format, "named by the recipe; passes the quality floor", tuple(measured))
    best = fastest_usable(measured)
    return FormatChoice(best.format, f"fastest plain decode step, T(1) {best.t_ms(1):.2f} ms, among formats "
                        "passing quality", tuple(measured))


def prefer_by_objective(choice: FormatChoice, calibration: Path) -> FormatChoice:
    """Each usable format's expected seconds per token under the latency objective: its step
    times with the calibration's acceptance (the best constant bucket; formats above the floor
    generate the same tokens nearly always, so acceptance carries over); the lowest wins."""
    run = load_run(calibration)[0]
    rows = torch.ones(run.accepted.shape[0], dtype=torch.bool)
    scored = []
    for c in choice.candidates:
        if not c.usable:
            scored.append(c)
            continue
        profile = c.latency()
        _, speedup = selector_for(run, rows, profile).constant()
        scored.append(replace(c, objective_speedup=speedup, expected_tpot_ms=profile.t_verify(1) * 1e3 / speedup))
    usable = [c for c in scored if c.usable]
    best = min(usable, key=lambda c: c.expected_tpot_ms)
    if len(usable) == 1:
        reason = choice.reason
    else:
        reason = (f"lowest expected time per token under the latency objective, {best.expected_tpot_ms:.2f} ms "
                  f"(speedup {best.objective_speedup:.2f}x over its own plain decoding), among formats passing "
                  "quality")
    return FormatChoice(best.format, reason, tuple(scored))


def deploy(ctx: BuildContext, fmt: str, loaded: tuple | None = None) -> BuildContext:
    """The context with its models in this format (what calibration, the graphs and the
    eager reference of the compile check then use). loaded: (target, draft) already in it."""
    draft_fmt = ctx.recipe.draft_format(fmt)
    if fmt == ctx.weights.get("target") and (ctx.draft is None or draft_fmt == ctx.weights.get("draft")):
        return ctx
    if loaded is not None:
        ctx.log(f"deploying weight format {fmt}: the models measured in it")
        target, draft = loaded
    else:
        ctx.log(f"loading the models in weight format {fmt}" + (f" (draft {draft_fmt})" if ctx.draft else ""))
        target = load_in(ctx, "target", fmt)
        draft = load_in(ctx, "draft", draft_fmt) if ctx.draft is not None else None
    weights = {"target": fmt, **({"draft": draft_fmt} if draft is not None else {})}
    return replace(ctx, target=target, draft=draft, weights=weights)


def choose_format(ctx: BuildContext, reprofile: bool = False) -> tuple[BuildContext, FormatChoice]:
    """Measure and gate the candidates; returns the context in the provisional choice."""
    recipe = ctx.recipe
    if recipe.weights == "fp32" and recipe.draft_format("fp32") == "fp32":
        return ctx, FormatChoice("fp32", "named by the recipe", measured=False)
    keep: dict = {}
    choice = gate(ctx, measure_formats(ctx, reprofile, keep))
    for c in choice.candidates:
        ctx.log(f"  {c.format:<5} T(1) {_ms(c.t_ms(1))}  T(16) {_ms(c.t_ms(16))}  agreement "
                f"{'-' if c.agreement is None else f'{c.agreement:.4f}'}  steps {c.invariance_verdict() or '-'}  "
                f"{c.verdict}{': ' + c.note if c.note else ''}"
                + (f"  ({', '.join(f'{k} {v:.0f} s' for k, v in c.seconds.items())})" if c.seconds else ""))
    ctx.log(f"weight format: {choice.chosen} ({choice.reason})")
    return deploy(ctx, choice.chosen, keep.get(choice.chosen)), choice


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"
