"""Compile recipes: what `yggdrasil compile` builds a bundle from (docs/design.md §4, issue 5).

A recipe is YAML naming the target and draft (or lookup), dtype, device, max context, the bucket
grid (draft depths and widths, verify widths, prefill chunks, serving batch sizes), the tile
multiple sizes are padded to, the calibration set and, optionally, the CPU threads to use, the
weight format (fp32, bf16, int8, int4, or auto: compile measures the candidates and chooses,
compile/formats.py), the quality floor a format must clear and the vector ISA the graphs are
compiled for (native, or a portable avx512 / avx2: graphs/isa.py). Loading validates everything and
names the offending key and what to write instead; nothing is guessed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from yggdrasil.buckets import Grid, chain_depths
from yggdrasil.models.catalog import find_entry, model_statuses
from yggdrasil.cpu import ISAS, NATIVE
from yggdrasil.errors import YggdrasilError
from yggdrasil.runtime.stage_plan import StagePlan

SCHEMA = "yggdrasil-recipe/1"
DTYPES = ("float32", "bfloat16", "float16")
# the weight formats a recipe may name (yggdrasil/models/quant.py WEIGHT_FORMATS, plus auto: measure and choose)
FORMATS = ("fp32", "bf16", "int8", "int4", "q4")
FOUR_BIT = ("int4", "q4")  # formats `weights: auto` measures only with quality.allow_int4
WEIGHTS = FORMATS + ("auto",)
SAME = "same"  # draft_weights: whatever format the target gets


class RecipeError(YggdrasilError):
    """A recipe that cannot be used as written."""


@dataclass(frozen=True)
class Buckets:
    depths: tuple[int, ...]
    draft_widths: tuple[int, ...]
    verify_widths: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    # the recipe's own deepest depth: `depths` adds the chains' (V - 1) to the recipe's, which
    # only width 1 is calibrated at (predictor/calibrate.py); 0: the deepest of `depths`
    tree_depth: int = 0

    @property
    def grid(self) -> Grid:
        """The buckets the runtime may pick from, as the runtime holds them (calibration's grid)."""
        return Grid(self.depths, self.draft_widths, self.verify_widths)


PHASES = ("load", "formats", "calibrate", "draft vocab", "select", "graphs", "check", "stage plans")  # compile/build.py's


@dataclass(frozen=True)
class MeasuredCompile:
    """How long a cold compile of this recipe took where it was measured (the recipe's
    `measured_cold_compile`): what compile and a bare `chat` say to expect before they start.
    Provenance, not content: it is no part of the recipe's identity."""

    cpu: str  # the machine it was measured on, in words (model, cores, idle or not)
    seconds: tuple[tuple[str, float], ...]  # (phase, wall seconds), in compile's order
    result: str = ""  # the committed result file it comes from
    bandwidth_gb_s: float | None = None  # that machine's memory bandwidth (device.memory_bandwidth)
    # what calibration chose there (the best constant bucket, or no-spec) and that CPU's portable
    # ISA level (avx512 or avx2): on a machine of the same level, calibration that confirms the
    # choice may stop sooner (predictor/stopping.py)
    choice: str | None = None
    isa: str | None = None

    @property
    def total(self) -> float:
        return sum(s for _, s in self.seconds)


@dataclass(frozen=True)
class CalibrationSpec:
    prompts: tuple[str, ...]
    num_prompts: int
    max_new_tokens: int
    stop_early: bool = True  # stop once more prompts cannot change the objective's choice (predictor/stopping.py)


@dataclass(frozen=True)
class QualitySpec:
    """The floor a weight format must clear against the fp32 model (compile/formats.py).

    min_agreement: greedy next-token agreement with the fp32 model, teacher-forced along the
    fp32 greedy continuations of the calibration prompts; allow_int4: whether `weights: auto`
    tries int4 at all; agreement_tokens: how many continuation positions agreement is measured
    over; heldout_tokens: how many tokens of the held-out prompts perplexity is measured over."""

    min_agreement: float = 0.98
    allow_int4: bool = False
    agreement_tokens: int = 256
    heldout_tokens: int = 512
    # time every candidate format, rather than settling one by its weight bytes where it cannot win
    time_every_format: bool = False


@dataclass(frozen=True)
class Recipe:
    name: str
    target: str
    draft: str  # a model name or path with the target's tokenizer, or "lookup"
    dtype: str
    device: str
    max_context: int
    tile: int
    buckets: Buckets
    calibration: CalibrationSpec
    source: str = ""  # the file it was read from (not part of its identity)
    # "auto": the planner picks each bucket's stage plan; or one plan for every bucket
    # ("sequential", "aot-tail+aot-head", ...: yggdrasil/runtime/stage_plan.py)
    stage_plan: str = "auto"
    # "objective": keep the buckets the latency objective picks on calibration data (default);
    # "all": compile the whole grid and leave every choice to the run-time objective
    selection: str = "objective"
    # CPU threads for torch while compiling (None: torch's default); `compile --threads` overrides
    # it. Not part of the identity: the thread count is in the bundle's device name already.
    threads: int | None = None
    # the weight format of the target (and, with draft_weights "same", of the draft); "auto":
    # compile measures every candidate on this device and keeps the one the objective prefers
    weights: str = "fp32"
    draft_weights: str = SAME
    quality: QualitySpec = QualitySpec()
    # the vector ISA the graphs are compiled for: native (this CPU's, the default) or a portable
    # x86-64 level, avx512 or avx2, that one build may be copied to a fleet with (graphs/isa.py)
    isa: str = NATIVE
    # what runs the buckets: "aoti" (AOTInductor packages), "inductor" (Inductor's compiled code
    # saved as cache artifacts, restored at open: yggdrasil/storage/inductor_steps.py), "eager" (the models'
    # own steps), all captured as CUDA graphs on CUDA; or "auto": aoti, unless on CUDA this torch
    # build cannot load the packages it compiles, then inductor (compile/loader_check.py)
    steps: str = "auto"
    # the draft's LM head (issue 51, compile/draft_vocab.py): "full", "auto" (the objective picks
    # K among draft_vocab.CANDIDATES and the full head) or a number K of tokens to keep
    draft_vocab: str = "full"
    # ranks the target is split over (issue 55, docs/tensor-parallel.md): its heads, MLP columns and
    # LM head sharded Megatron-style; the bundle then holds one graph set per rank (steps: aoti) or
    # runs eager sharded steps (steps: eager); 1: no parallelism
    tensor_parallel: int = 1
    # compile the server's graphs (one per model over the KV pool, the costliest to compile): false
    # for a bundle only `generate` and `chat` run, whose `serve` then runs eager forwards
    serve_graphs: bool = True
    measured_cold_compile: MeasuredCompile | None = None  # what to expect (not part of the identity)

    def candidate_formats(self, supported: tuple[str, ...]) -> tuple[str, ...]:
        """The formats compile measures: the one named, or with auto every supported format
        (the 4-bit ones only when quality.allow_int4 says so), fp32 always first (the reference)."""
        if self.weights != "auto":
            return (self.weights,)
        allowed = [f for f in FORMATS if f in supported and (f not in FOUR_BIT or self.quality.allow_int4)]
        return tuple(dict.fromkeys(["fp32", *allowed]))

    def draft_format(self, target_format: str) -> str:
        return target_format if self.draft_weights == SAME else self.draft_weights

    def resolve(self, name: str) -> str:
        """A model or prompt file named relative to the recipe's own directory, if it is there;
        otherwise the name as written (a catalog name or a path)."""
        if self.source and name != "lookup":
            local = Path(self.source).parent / name
            if local.exists():
                return str(local.resolve())
        return name

    def identity(self) -> str:
        """sha256 of the recipe's content (what a bundle id hashes), independent of formatting."""
        body = asdict(self)
        body.pop("source")
        body.pop("threads")
        body.pop("measured_cold_compile")  # how long it took somewhere: not what is built
        for key, default in LATER_QUALITY.items():  # quality keys added later: absent at their default
            if body["quality"][key] == default:
                body["quality"].pop(key)
        for key, default in (("stage_plan", "auto"), ("selection", "objective"), ("weights", "fp32"),
                             ("draft_weights", SAME), ("quality", _quality_identity(QualitySpec())), ("isa", NATIVE),
                             ("steps", "auto"), ("draft_vocab", "full"), ("tensor_parallel", 1),
                             ("serve_graphs", True)):
            if body[key] == default:  # bundles built before the key existed stay current
                body.pop(key)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


_TOP = {"schema", "name", "target", "draft", "dtype", "device", "max_context", "tile", "buckets",
        "calibration", "stage_plan", "selection", "threads", "weights", "draft_weights", "quality", "isa",
        "steps", "draft_vocab", "tensor_parallel", "serve_graphs", "measured_cold_compile"}
_OPTIONAL = {"draft", "tile", "stage_plan", "selection", "threads", "weights", "draft_weights", "quality", "isa",
             "steps", "draft_vocab", "tensor_parallel", "serve_graphs", "measured_cold_compile"}
STEPS = ("auto", "aoti", "inductor", "eager")
SELECTIONS = ("objective", "all")
_BUCKETS = {"depths", "draft_widths", "verify_widths", "prefill_chunks", "batch_sizes"}
_CALIBRATION = {"prompts", "num_prompts", "max_new_tokens", "stop_early"}
_QUALITY = {"min_agreement", "allow_int4", "agreement_tokens", "heldout_tokens", "time_every_format"}
LATER_QUALITY = {"time_every_format": False}  # quality keys a recipe's identity leaves out at their default


def _quality_identity(quality: QualitySpec) -> dict:
    body = asdict(quality)
    return {k: v for k, v in body.items() if not (k in LATER_QUALITY and v == LATER_QUALITY[k])}


def _check_keys(where: str, raw: dict, allowed: set[str], required: set[str]) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise RecipeError(f"{where}: unknown key {unknown[0]!r}; allowed keys are {', '.join(sorted(allowed))}")
    missing = sorted(required - set(raw))
    if missing:
        raise RecipeError(f"{where}: missing key {missing[0]!r}")


def _int(where: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RecipeError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _int_list(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise RecipeError(f"{where} must be a non-empty list of integers, e.g. [1, 2, 4]")
    values = tuple(_int(f"{where}[{i}]", v) for i, v in enumerate(value))
    if list(values) != sorted(set(values)):
        raise RecipeError(f"{where} must be strictly increasing without repeats, got {list(values)}")
    return values


def _buckets(where: str, raw: Any, max_context: int, tile: int) -> Buckets:
    if not isinstance(raw, dict):
        raise RecipeError(f"{where} must be a mapping with keys {', '.join(sorted(_BUCKETS))}")
    _check_keys(where, raw, _BUCKETS, _BUCKETS - {"batch_sizes"})
    widths, verifies = (_int_list(f"{where}.draft_widths", raw["draft_widths"]),
                        _int_list(f"{where}.verify_widths", raw["verify_widths"]))
    # with width 1, depth V - 1 for each verify width V too: the chain that fills V (buckets.py)
    own = _int_list(f"{where}.depths", raw["depths"])
    b = Buckets(chain_depths(own, widths, verifies), widths, verifies,
                _int_list(f"{where}.prefill_chunks", raw["prefill_chunks"]),
                _int_list(f"{where}.batch_sizes", raw.get("batch_sizes", [1])), tree_depth=own[-1])
    largest_tree = 1 + b.depths[-1] * b.draft_widths[-1]
    for name, sizes in (("verify_widths", b.verify_widths), ("prefill_chunks", b.prefill_chunks)):
        for size in sizes:
            if size > 1 and size % tile:
                raise RecipeError(f"{where}.{name}: {size} is not a multiple of tile {tile}; padding would "
                                  f"make it a {-(-size // tile) * tile}-row graph, so write that instead")
            if size >= max_context:
                raise RecipeError(f"{where}.{name}: {size} does not fit max_context {max_context}")
    if largest_tree + max(b.prefill_chunks) >= max_context:
        raise RecipeError(f"{where}: the largest tree ({largest_tree} nodes) plus a prefill chunk does not "
                          f"fit max_context {max_context}; raise max_context or shrink the grid")
    return b


def _calibration(where: str, raw: Any) -> CalibrationSpec:
    if not isinstance(raw, dict):
        raise RecipeError(f"{where} must be a mapping with keys {', '.join(sorted(_CALIBRATION))}")
    _check_keys(where, raw, _CALIBRATION, {"prompts"})
    prompts = raw["prompts"]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RecipeError(f"{where}.prompts must be a list of prompt sets, e.g. [humaneval, mtbench]")
    stop_early = raw.get("stop_early", True)
    if not isinstance(stop_early, bool):
        raise RecipeError(f"{where}.stop_early must be true or false, got {stop_early!r}")
    return CalibrationSpec(tuple(prompts), _int(f"{where}.num_prompts", raw.get("num_prompts", 24)),
                           _int(f"{where}.max_new_tokens", raw.get("max_new_tokens", 64)), stop_early)


def parse_recipe(raw: Any, source: str = "recipe") -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping (see recipes/ for examples)")
    if raw.get("schema") != SCHEMA:
        raise RecipeError(f"{source}: expected schema {SCHEMA!r}, found {raw.get('schema')!r}")
    _check_keys(source, raw, _TOP, _TOP - _OPTIONAL)
    for key in ("name", "target", "device"):
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise RecipeError(f"{source}: {key} must be a non-empty string")
    if raw["dtype"] not in DTYPES:
        raise RecipeError(f"{source}: dtype must be one of {', '.join(DTYPES)}, got {raw['dtype']!r}")
    device = raw["device"]
    if device != "cpu" and not device.startswith("cuda"):
        raise RecipeError(f"{source}: device must be cpu or cuda[:N], got {device!r}")
    max_context = _int(f"{source}: max_context", raw["max_context"], 64)
    if max_context % 64:
        raise RecipeError(f"{source}: max_context must be a multiple of 64 (attention spans grow in "
                          f"steps of 64), got {max_context}; use {max_context // 64 * 64} or "
                          f"{-(-max_context // 64) * 64}")
    tile = _int(f"{source}: tile", raw.get("tile", 1))
    draft = raw.get("draft", "lookup")
    if not isinstance(draft, str) or not draft.strip():
        raise RecipeError(f"{source}: draft must be a model name or path, or lookup")
    selection = raw.get("selection", "objective")
    if selection not in SELECTIONS:
        raise RecipeError(f"{source}: selection must be objective (keep the buckets calibration picks) or all "
                          f"(compile the whole grid), got {selection!r}")
    threads = raw.get("threads")
    if threads is not None:
        threads = _int(f"{source}: threads", threads)
    weights, draft_weights = _weights(source, raw, draft)
    isa = raw.get("isa", NATIVE)
    if isa not in ISAS:
        raise RecipeError(f"{source}: isa must be one of {', '.join(ISAS)} (native: this CPU's; avx512 or avx2: "
                          f"a portable bundle for every CPU with that ISA), got {isa!r}")
    steps = raw.get("steps", "auto")
    if steps not in STEPS:
        raise RecipeError(f"{source}: steps must be one of {', '.join(STEPS)} (auto: AOTInductor packages where this "
                          f"torch can load them, else Inductor's saved steps), got {steps!r}")
    if steps == "inductor" and isa != NATIVE:
        raise RecipeError(f"{source}: steps: inductor compiles for this CPU only (Inductor picks its vector ISA at "
                          f"run time); use isa: native, or steps: aoti for a portable --isa {isa} bundle")
    tensor_parallel, steps = _tensor_parallel(source, raw.get("tensor_parallel", 1), steps)
    serve_graphs = raw.get("serve_graphs", True)
    if not isinstance(serve_graphs, bool):
        raise RecipeError(f"{source}: serve_graphs must be true (compile the server's graphs) or false (a bundle for "
                          f"generate and chat only, whose serve runs eager forwards), got {serve_graphs!r}")
    return Recipe(raw["name"], raw["target"], draft, raw["dtype"], device, max_context, tile,
                  _buckets(f"{source}: buckets", raw["buckets"], max_context, tile),
                  _calibration(f"{source}: calibration", raw["calibration"]), source,
                  _stage_plan(source, raw.get("stage_plan", "auto"), draft), selection, threads,
                  weights, draft_weights, _quality(f"{source}: quality", raw.get("quality", {})), isa, steps,
                  _draft_vocab(source, raw.get("draft_vocab", "full"), draft), tensor_parallel=tensor_parallel,
                  serve_graphs=serve_graphs,
                  measured_cold_compile=_measured(f"{source}: measured_cold_compile", raw.get("measured_cold_compile")))


def _tensor_parallel(source: str, raw: Any, steps: str) -> tuple[int, str]:
    """(ranks, steps): a tensor-parallel bundle runs AOTInductor packages per rank (auto or aoti) or
    eager sharded steps (docs/tensor-parallel.md)."""
    ranks = _int(f"{source}: tensor_parallel", raw)
    if ranks < 1:
        raise RecipeError(f"{source}: tensor_parallel must be >= 1 (the ranks the target is split over), got {ranks}")
    if ranks > 1 and steps not in ("auto", "aoti", "eager"):
        raise RecipeError(f"{source}: tensor_parallel: {ranks} runs one AOTInductor graph set per rank or eager "
                          f"sharded steps; use steps: aoti (or auto) or eager (not {steps})")
    return ranks, steps


def _draft_vocab(source: str, raw: Any, draft: str) -> str:
    """full, auto, or a positive multiple of 16 (the q4/q8 kernels' column group)."""
    text = str(raw).strip()
    if text in ("full", "auto") or (text.isdigit() and int(text) > 0 and int(text) % 16 == 0):
        if draft == "lookup" and text != "full":
            raise RecipeError(f"{source}: draft_vocab trims a draft model's head; this recipe drafts by prompt lookup, "
                              "so leave draft_vocab out")
        return text
    raise RecipeError(f"{source}: draft_vocab must be full, auto, or a number of tokens to keep that is a multiple of "
                      f"16 (e.g. 32768), got {raw!r}")


def _measured(where: str, raw: Any) -> MeasuredCompile | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RecipeError(f"{where} must be a mapping with keys cpu, seconds (phase: wall seconds) and result")
    _check_keys(where, raw, {"cpu", "seconds", "result", "bandwidth_gb_s", "choice", "isa"}, {"cpu", "seconds"})
    seconds = raw["seconds"]
    if not isinstance(raw["cpu"], str) or not isinstance(seconds, dict) or not seconds:
        raise RecipeError(f"{where}: cpu must name the machine and seconds map compile's phases to seconds")
    for phase, value in seconds.items():
        if phase not in PHASES:
            raise RecipeError(f"{where}.seconds: unknown phase {phase!r}; compile's phases are {', '.join(PHASES)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise RecipeError(f"{where}.seconds.{phase} must be a number of seconds >= 0, got {value!r}")
    ordered = tuple((phase, float(seconds[phase])) for phase in PHASES if phase in seconds)
    bandwidth = raw.get("bandwidth_gb_s")
    if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
                                  or bandwidth <= 0):
        raise RecipeError(f"{where}.bandwidth_gb_s must be a positive number (GB/s), got {bandwidth!r}")
    for key in ("choice", "isa"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise RecipeError(f"{where}.{key} must be a string (e.g. choice: D2xW2/V4, isa: avx512), got {raw[key]!r}")
    return MeasuredCompile(raw["cpu"], ordered, str(raw.get("result", "")),
                           None if bandwidth is None else float(bandwidth), raw.get("choice"), raw.get("isa"))


def _weights(source: str, raw: dict, draft: str) -> tuple[str, str]:
    weights = raw.get("weights", "fp32")
    if weights not in WEIGHTS:
        raise RecipeError(f"{source}: weights must be one of {', '.join(WEIGHTS)} (auto: compile measures each "
                          f"format on this device and keeps the fastest that passes quality), got {weights!r}")
    draft_weights = raw.get("draft_weights", SAME)
    if draft_weights not in (SAME, *FORMATS):
        raise RecipeError(f"{source}: draft_weights must be {SAME} (the target's format) or one of "
                          f"{', '.join(FORMATS)}, got {draft_weights!r}")
    if draft_weights != SAME and draft == "lookup":
        raise RecipeError(f"{source}: draft_weights is set but the recipe drafts by lookup (no draft model); "
                          "remove draft_weights")
    return weights, draft_weights


def _quality(where: str, raw: Any) -> QualitySpec:
    if not isinstance(raw, dict):
        raise RecipeError(f"{where} must be a mapping with keys {', '.join(sorted(_QUALITY))}")
    _check_keys(where, raw, _QUALITY, set())
    default = QualitySpec()
    floor = raw.get("min_agreement", default.min_agreement)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 < floor <= 1.0:
        raise RecipeError(f"{where}.min_agreement must be a number in (0, 1], e.g. 0.98 (the share of "
                          f"greedy next tokens a format must pick as fp32 does), got {floor!r}")
    allow_int4 = raw.get("allow_int4", default.allow_int4)
    if not isinstance(allow_int4, bool):
        raise RecipeError(f"{where}.allow_int4 must be true or false, got {allow_int4!r}")
    every = raw.get("time_every_format", default.time_every_format)
    if not isinstance(every, bool):
        raise RecipeError(f"{where}.time_every_format must be true or false, got {every!r}")
    return QualitySpec(float(floor), allow_int4,
                       _int(f"{where}.agreement_tokens", raw.get("agreement_tokens", default.agreement_tokens), 16),
                       _int(f"{where}.heldout_tokens", raw.get("heldout_tokens", default.heldout_tokens), 16), every)


def _stage_plan(source: str, value: Any, draft: str) -> str:
    if value == "auto":
        return value
    try:
        plan = StagePlan.parse(value) if isinstance(value, str) else None
    except ValueError as exc:
        raise RecipeError(f"{source}: stage_plan: {exc}, or auto") from None
    if plan is None:
        raise RecipeError(f"{source}: stage_plan must be auto or a plan name such as aot-tail+aot-head")
    if plan.moves and draft == "lookup":
        raise RecipeError(f"{source}: stage_plan {value} drafts ahead of time, which needs a draft model; "
                          "a lookup recipe can use auto, sequential or device-accept")
    return str(plan)


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecipeError(f"recipe {path} does not exist (shipped recipes are in recipes/)") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from None
    return parse_recipe(raw, str(path))


def check_models(recipe: Recipe) -> None:
    """Every model the recipe names can be found (catalog name installed, or an existing path)."""

    statuses = {s.name: s for s in model_statuses()}
    for role, name in (("target", recipe.target), ("draft", recipe.draft)):
        if role == "draft" and name == "lookup":
            continue
        name = recipe.resolve(name)
        entry = find_entry(name)
        if entry is not None:
            status = statuses[entry.name]
            if not (status.installed or status.ready):
                raise RecipeError(f"{recipe.source}: {role} {name!r} is not installed; {status.install_command}")
        elif not Path(name).exists():
            raise RecipeError(f"{recipe.source}: {role} {name!r} is neither a catalog model "
                              "(`yggdrasil models` lists them) nor an existing path")
