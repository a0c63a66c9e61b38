"""Run from a bundle: validate it, load the models and its graphs, and assemble the generator
with the bundle's predictor and bucket selection (issue 5, DESIGN §4). Nothing compiles here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from yggdrasil.errors import YggdrasilError
from yggdrasil.stage_plan import PlanTable

from .manifest import BundleError, Environment, Manifest, check_bundle, read_manifest
from .models import model_digest
from yggdrasil.buckets import SERVE_STAGE, SPAN_UNIT

from .registry import GraphSet, load_graph_set


class RecompileError(YggdrasilError):
    """Something compiled at run time, which a bundle must never need."""


@dataclass(frozen=True)
class CompiledBuckets:
    """The draft and verify widths a bundle compiled (its plan.yaml)."""

    widths: tuple[int, ...]
    verifies: tuple[int, ...]

    @property
    def speculates(self) -> bool:
        return bool(self.widths)


def policy_from_calibration(directory: Path, plan, latency, dim: int, target_sha256: str | None):
    """The AutoPolicy over the compiled buckets: calibration statistics restricted to the plan's
    widths, the given step times (default: the calibration's), and the depth predictor when it
    was trained and beat the constant."""
    from yggdrasil.predictor import depth as depth_mod
    from yggdrasil.predictor.calibration_data import load_run, restrict
    from yggdrasil.predictor.pipeline import AutoPolicy, predictor_pays, selector_for

    run, _, calibrated = load_run(directory)
    if plan is not None and plan.speculates:
        run = restrict(run, plan.widths, plan.verifies)
    selector = selector_for(run, torch.ones(run.accepted.shape[0], dtype=torch.bool), latency or calibrated)
    model = None
    if (Path(directory) / "predictor.yaml").is_file():
        model, meta = depth_mod.load(directory, dim, target_sha256)
        model = model if predictor_pays(meta) else None
    return AutoPolicy(selector, model)


def build_generators(target, draft, policy, plans=None):
    """A greedy `generate(prompt_ids, n) -> tokens` over these runners (plain decoding when
    there is no policy), under these stage plans (default sequential): what the warm-load
    check compares, compiled against eager."""
    from yggdrasil.generate import greedy_tokens
    from yggdrasil.sampling import SamplingParams
    from yggdrasil.speculative import SpeculativeGenerator

    if policy is None:
        return lambda ids, n: greedy_tokens(target, ids, n)
    generator = SpeculativeGenerator(target, policy.drafter(draft), policy=policy,
                                     **({"plans": plans} if plans is not None else {}))
    return lambda ids, n: generator.generate(ids, n, SamplingParams(temperature=0.0)).tokens


@dataclass
class BundleRuntime:
    path: Path
    manifest: Manifest
    target: object  # LoadedModel
    draft: object | None
    runner: object  # target StepRunner
    draft_runner: object | None
    policy: object | None
    graph_sets: dict[str, GraphSet]
    load_seconds: float
    capture_bytes: int = 0  # CUDA graph pool (0 on CPU)
    plans: PlanTable = field(default_factory=PlanTable)  # each bucket's stage plan
    latency: object = None  # LatencyProfile: the bundle's profiled step times (profile.yaml)

    def speculator(self):
        from yggdrasil.speculative import SpeculativeGenerator

        if self.policy is None:
            return None
        return SpeculativeGenerator(self.runner, self.policy.drafter(self.draft_runner), policy=self.policy,
                                    plans=self.plans)

    def graph_seconds(self) -> float:
        return sum(s.seconds for s in self.graph_sets.values())


def rebuild_hint(manifest_raw: dict, bundle: Path) -> str:
    source = (manifest_raw.get("recipe") or {}).get("source") or "RECIPE"
    return f"`yggdrasil compile {source} --out {bundle}`"


GRAPH_MODES = ("steps", "serve", "none")


def open_bundle(bundle: Path, quiet: bool = False, graphs: str = "steps") -> BundleRuntime:
    """graphs: which compiled graphs to load: "steps" (single-request generation: every step
    graph, bound to each model's own max_context cache, and on CUDA captured), "serve" (only the
    serve graphs, which run over the server's KV pool) or "none" (eager forwards)."""
    from yggdrasil.loader import load, parse_dtype
    from yggdrasil.steps import StepRunner

    if graphs not in GRAPH_MODES:
        raise ValueError(f"graphs must be one of {GRAPH_MODES}, got {graphs!r}")
    started = time.perf_counter()
    bundle = Path(bundle)
    _, raw = read_manifest(bundle, "`yggdrasil compile RECIPE --out BUNDLE`")
    rebuild = rebuild_hint(raw, bundle)
    recipe = raw["recipe"]
    device = recipe["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BundleError(f"{bundle} was compiled for {device} but this machine has no CUDA device; "
                          f"compile a CPU recipe instead (e.g. recipes/{recipe['name'].replace('cuda', 'cpu')}.yaml)")
    environment = Environment.current(device)
    manifest = check_bundle(bundle, environment, {}, rebuild)
    dtype = parse_dtype(manifest.dtype)
    target = load(manifest.models["target"]["name"], dtype=dtype, device=device, quiet=quiet)
    draft = None
    if "draft" in manifest.models:
        draft = load(manifest.models["draft"]["name"], dtype=dtype, device=device, quiet=quiet)
    hashes = {"target": model_digest(target.source)}
    if draft is not None:
        hashes["draft"] = model_digest(draft.source)
    check_bundle(bundle, environment, hashes, rebuild, verify_artifacts=False)
    plan_raw = yaml.safe_load((bundle / "plan.yaml").read_text())
    chunks = tuple(manifest.chunk_sizes)
    max_context = int(recipe["max_context"])
    hint = f"buckets in {recipe.get('source') or 'the recipe'}"
    sets, capture_bytes = {}, 0
    for role, model in (("target", target.model), ("draft", draft.model if draft else None)):
        names = [g.split("/", 1)[1] for g in manifest.buckets if g.startswith(f"{role}/")]
        serving = [n for n in names if n == SERVE_STAGE]
        if serving and graphs == "serve":
            sets[role] = load_graph_set(bundle, role, model, serving, rebuild, hint)
        names = [n for n in names if n != SERVE_STAGE]
        if names and graphs == "steps":
            cache = model.setup_cache(1, max_context)
            sets[role] = load_graph_set(bundle, role, model, names, rebuild, hint)
            if device.startswith("cuda"):
                from .cuda_graphs import capture

                capture_bytes += capture(sets[role], max_context // SPAN_UNIT * SPAN_UNIT,
                                         cache.scratch_slot, model.device)
    steps = sets if graphs == "steps" else {}
    runner = StepRunner(target.model, max_context, chunk_sizes=chunks, graphs=steps.get("target"))
    draft_runner = (StepRunner(draft.model, max_context, chunk_sizes=chunks, graphs=steps.get("draft"))
                    if "draft" in steps or (draft is not None and graphs != "steps") else None)
    policy = None
    widths, verifies = tuple(plan_raw["draft_widths"]), tuple(plan_raw["verify_widths"])
    from yggdrasil.latency import LatencyProfile

    latency = LatencyProfile.from_dict(yaml.safe_load((bundle / "profile.yaml").read_text())["latency"])
    if widths:
        policy = policy_from_calibration(bundle / "calibration", CompiledBuckets(widths, verifies), latency,
                                         target.model.config.dim, manifest.models["target"]["sha256"])
    plans = PlanTable.load(bundle) if draft is not None else PlanTable()
    return BundleRuntime(bundle, manifest, target, draft, runner, draft_runner, policy, sets,
                         time.perf_counter() - started, capture_bytes, plans, latency)
