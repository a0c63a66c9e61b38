"""`yggdrasil compile RECIPE`: profile → calibrate → train the predictor → select buckets →
compile one AOTInductor graph per (stage, bucket) → warm-load check → write the bundle (DESIGN §4).

Work that is still valid is reused: a finished bundle for the same recipe, models and machine is
kept as is; otherwise the calibration and every compiled graph are cached in a work directory
next to the bundle, keyed by exactly what they depend on, so changing one bucket recompiles one
graph. The bundle itself is written atomically (graphs/manifest.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from yggdrasil.errors import YggdrasilError
from yggdrasil.graphs.manifest import BundleError, Environment, Manifest, check_bundle, write_bundle
from yggdrasil.graphs.models import model_digest
from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.graphs.registry import load_graph_set
from yggdrasil.progress import Progress
from yggdrasil.stage_plan import PLANS_FILE

from .aoti import export_pool_step, export_step, full_span
from .select import BucketSelection, graph_keys, select_buckets
from .recipe import Recipe, check_models


@dataclass(frozen=True)
class BuildResult:
    bundle: Path
    reused: bool
    manifest: Manifest


def rebuild_command(recipe: Recipe, out: Path) -> str:
    return f"`yggdrasil compile {recipe.source or recipe.name} --out {out}`"


def _key(*parts) -> str:
    return hashlib.sha256(yaml.safe_dump(list(parts), sort_keys=True).encode()).hexdigest()


class Builder:
    def __init__(self, recipe: Recipe, out: Path, log=print) -> None:
        self.recipe, self.out, self.log = recipe, Path(out), log
        if recipe.device.startswith("cuda") and not torch.cuda.is_available():
            raise YggdrasilError(f"{recipe.source}: the recipe is for {recipe.device} but this machine has no "
                                 "CUDA device; compile the matching -cpu recipe here instead")
        self.work = self.out.parent / f".{self.out.name}.work"
        self.env = Environment.current(recipe.device)
        self.rebuild = rebuild_command(recipe, self.out)

    # -- models --------------------------------------------------------------------------
    def load_models(self) -> None:
        from yggdrasil.commands import check_same_vocabulary
        from yggdrasil.loader import load, parse_dtype

        recipe = self.recipe
        check_models(recipe)
        dtype = parse_dtype(recipe.dtype)
        self.target = load(recipe.resolve(recipe.target), dtype=dtype, device=recipe.device)
        self.draft = None
        if recipe.draft != "lookup":
            self.draft = load(recipe.resolve(recipe.draft), dtype=dtype, device=recipe.device)
            check_same_vocabulary(self.target, self.draft)
        self.models = {"target": {"name": recipe.resolve(recipe.target),
                                  "sha256": model_digest(self.target.source)}}
        if self.draft is not None:
            self.models["draft"] = {"name": recipe.resolve(recipe.draft), "sha256": model_digest(self.draft.source)}

    def model(self, role: str):
        """The loaded target or draft model."""
        return (self.target if role == "target" else self.draft).model

    def model_hashes(self) -> dict[str, str]:
        return {role: m["sha256"] for role, m in self.models.items()}

    def up_to_date(self) -> Manifest | None:
        """The existing bundle, if it was built from this very recipe for these models here."""
        if not (self.out / "manifest.yaml").is_file():
            return None
        try:
            manifest = check_bundle(self.out, self.env, self.model_hashes(), self.rebuild)
        except BundleError as exc:
            self.log(f"existing bundle is stale, rebuilding: {exc}")
            return None
        if manifest.recipe_identity != self.recipe.identity():
            self.log("existing bundle was built from another version of the recipe, rebuilding")
            return None
        if f"target/{SERVE_STAGE}" not in manifest.buckets:
            self.log("existing bundle has no serve graphs (built by an older yggdrasil), rebuilding")
            return None
        return manifest

    # -- phases ----------------------------------------------------------------------------
    def _runners(self, graphs: dict | None = None):
        from yggdrasil.steps import StepRunner

        chunks = self.recipe.buckets.prefill_chunks
        target = StepRunner(self.target.model, self.recipe.max_context, chunk_sizes=chunks,
                            graphs=(graphs or {}).get("target"))
        draft = None
        if self.draft is not None:
            draft = StepRunner(self.draft.model, self.recipe.max_context, chunk_sizes=chunks,
                               graphs=(graphs or {}).get("draft"))
        return target, draft

    def grid(self):
        from yggdrasil.buckets import Grid

        b = self.recipe.buckets
        return Grid(b.depths, b.draft_widths, b.verify_widths)

    def calibrate(self) -> Path:
        """Profile (eager) and calibrate into work/calibration, unless it holds a calibration of
        the same models, grid, prompts and machine; then train and judge the predictor."""
        from yggdrasil.drafters import LookupDrafter, ModelDrafter
        from yggdrasil.latency import measure_profile
        from yggdrasil.predictor import prompts as prompt_sets
        from yggdrasil.predictor.calibrate import Calibrator
        from yggdrasil.predictor.calibration_data import save_run
        from yggdrasil.predictor.files import PredictorError
        from yggdrasil.predictor.pipeline import train_and_report

        recipe, grid = self.recipe, self.grid()
        directory = self.work / "calibration"
        key = _key(self.model_hashes(), grid.as_dict(), recipe.calibration.__dict__, recipe.dtype,
                   recipe.max_context, self.env.device, self.env.torch)
        key_file = self.work / "calibration.key"
        if key_file.is_file() and key_file.read_text() == key and (directory / "calibration.yaml").is_file():
            self.log(f"reusing calibration in {directory}")
            return directory
        shutil.rmtree(directory, ignore_errors=True)
        started = time.perf_counter()
        target, draft = self._runners()
        drafter = (LookupDrafter(grid.max_depth, grid.max_width) if draft is None else
                   ModelDrafter(draft, grid.max_depth, grid.max_width, grid.widths))
        self.log("profiling step times (eager) for bucket selection")
        latency = measure_profile(target, drafter, grid.verifies,
                                  draft_widths=() if draft is None else grid.widths)
        names = [recipe.resolve(p) if p.endswith(".jsonl") else p for p in recipe.calibration.prompts]
        texts = prompt_sets.select(names, "calibration", recipe.calibration.num_prompts)
        ids = [prompt_sets.encode(p, self.target.tokenizer) for p in texts]
        run = Calibrator(target, drafter, grid).run(ids, recipe.calibration.max_new_tokens,
                                                    self.target.tokenizer.stop_ids)
        meta = {"device": self.env.device, "dtype": recipe.dtype, "target": self.models["target"]["name"],
                "target_sha256": self.models["target"]["sha256"],
                "draft": self.models.get("draft", {}).get("name", "lookup"),
                "draft_sha256": self.models.get("draft", {}).get("sha256"),
                "prompt_sets": list(recipe.calibration.prompts), "split": "calibration",
                "prompt_ids": [p.id for p in texts], "max_new_tokens": recipe.calibration.max_new_tokens,
                "latency_source": "measured eagerly by yggdrasil compile"}
        save_run(run, directory, meta, latency)
        try:
            train_and_report(directory)
        except PredictorError as exc:
            self.log(f"no depth predictor: {exc}; the bundle uses the best constant bucket")
            (directory / "predictor.skipped").write_text(str(exc))
        (self.work / "calibration.seconds").write_text(f"{time.perf_counter() - started:.1f}")
        key_file.write_text(key)
        return directory

    def policy(self, directory: Path, plan: BucketSelection | None, latency=None):
        from yggdrasil.graphs.runtime import policy_from_calibration

        return policy_from_calibration(directory, plan, latency, self.target.model.config.dim,
                                       self.models["target"]["sha256"])

    def compile_graphs(self, specs: list[GraphKey]) -> int:
        """One AOTInductor package per graph into work/graphs, reusing the ones whose key
        (models, dtype, device, context, torch) is unchanged; returns how many were compiled
        (each one's time is kept next to it, NAME.seconds)."""
        recipe, compiled = self.recipe, 0
        dynamic = not recipe.device.startswith("cuda")
        bar = Progress("compiling graphs", len(specs))
        for spec in specs:
            path = self.work / spec.path
            key = _key(self.models[spec.role]["sha256"], recipe.dtype, recipe.device, recipe.max_context,
                       self.env.torch, self.env.triton, self.env.device, spec.name, dynamic)
            key_file = path.with_suffix(".key")
            if not (path.is_file() and key_file.is_file() and key_file.read_text() == key):
                model = self.model(spec.role)
                if spec.stage == SERVE_STAGE:
                    took = export_pool_step(model, path)
                else:
                    model.setup_cache(1, recipe.max_context)
                    took = export_step(model, spec, recipe.max_context, path, dynamic)
                path.with_suffix(".seconds").write_text(f"{took:.1f}")
                compiled += 1
                key_file.write_text(key)
            bar.update()
        bar.close(f"{compiled} compiled, {len(specs) - compiled} reused")
        return compiled

    def warm_load_check(self, specs: list[GraphKey], plan: BucketSelection):
        """Load the fresh packages as a bundle would, check greedy output against eager on a
        probe prompt, and measure each verify graph's step time (the bundle's profile)."""
        from yggdrasil.latency import measure_profile

        sets = {}
        for role in ("target", "draft"):
            names = [s.name for s in specs if s.role == role and s.stage != SERVE_STAGE]
            if names:
                model = self.model(role)
                model.setup_cache(1, self.recipe.max_context)  # the graphs bind to this cache
                sets[role] = load_graph_set(self.work, role, model, names, self.rebuild,
                                            f"buckets in {self.recipe.source}")
                if self.recipe.device.startswith("cuda"):  # exported over the whole context
                    sets[role].fixed_span = full_span(self.recipe.max_context)
        target, draft = self._runners(sets)
        latency = None
        if plan.speculates:
            probe = self.policy(self.work / "calibration", plan)
            # the run-time selection trusts these numbers: warm up and take the median of 7
            # (a fresh package's first calls are slow)
            latency = measure_profile(target, probe.drafter(draft), plan.verifies, repeats=7, warmup=4,
                                      draft_widths=() if draft is None else plan.widths,
                                      hidden=probe.needs_hidden)
        policy = self.policy(self.work / "calibration", plan, latency) if plan.speculates else None
        self._check_against_eager((target, draft), policy)
        self.log(f"warm-load check: {len(specs)} graphs load in "
                 f"{sum(s.load_seconds for s in sets.values()):.2f} s; greedy output equals eager")
        self.loaded = (target, draft, sets, policy)  # for the stage planner
        return latency

    def check_serve_graphs(self, specs: list[GraphKey]) -> None:
        """Run each serve graph and the eager forward over a small pool, two requests at once (a
        prompt chunk beside another's decode rows), and compare their logits."""
        from yggdrasil.serve.pool import Segment, SlotPool, run_segments

        prompt = (self.target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n") * 16)[:16]
        steps = [[Segment(1, tuple(prompt[:8]), 0, "last"), Segment(2, tuple(prompt[:5]), 0, "all")],
                 [Segment(1, tuple(prompt[8:12]), 8, "all"), Segment(2, tuple(prompt[5:]), 5, "last")]]
        for spec in specs:
            model = self.model(spec.role)
            graph = load_graph_set(self.work, spec.role, model, [spec.name], self.rebuild,
                                   f"buckets in {self.recipe.source}").get(spec.name)
            pool = SlotPool(4, 16)
            for owner in (1, 2):
                pool.reserve(owner, 32)
            caches = [pool.new_cache(model) for _ in range(2)]
            for segments in steps:
                eager = torch.cat(run_segments(model, caches[0], pool, segments))
                compiled = torch.cat(run_segments(model, caches[1], pool, segments, graph))
                scale = eager.abs().max().item() or 1.0
                error = (eager - compiled).abs().max().item() / scale
                if error > (1e-3 if model.dtype == torch.float32 else 5e-2):  # fused kernels round differently
                    raise YggdrasilError(f"warm-load check failed: the {spec.role}'s serve graph differs from "
                                         f"the eager forward over the KV pool (relative error {error:.2g}); "
                                         "please report this with the recipe")
        self.log(f"warm-load check: {len(specs)} serve graph(s) agree with eager over the KV pool")

    def _check_against_eager(self, runners, policy, plans=None) -> None:
        from yggdrasil.graphs.runtime import build_generators

        prompt = self.target.tokenizer.encode("def fibonacci(n):")
        compiled = build_generators(*runners, policy, plans)
        eager = build_generators(*self._runners(), policy)
        outputs = [g(prompt, 24) for g in (compiled, eager)]
        if outputs[0] != outputs[1]:
            raise YggdrasilError(f"warm-load check failed: the compiled graphs' greedy output "
                                 f"{outputs[0][:12]}… differs from eager {outputs[1][:12]}…"
                                 f"{' with stage plans' if plans else ''}; please report this with the recipe")

    def choose_stage_plans(self, plan: BucketSelection):
        """Each picked bucket's stage plan: searched on stage costs measured on the loaded
        graphs (recipe stage_plan: auto), or the recipe's one plan; and the draft_ahead graphs
        the chosen plans need. Returns the stage_plans.yaml record, the PlanTable and those
        graph specs."""
        from yggdrasil.planner.costs import stage_costs
        from yggdrasil.planner.dag import Bucket
        from yggdrasil.planner.schedule import best_plan, iteration_time
        from yggdrasil.buckets import Bucket
        from yggdrasil.speculative import SpeculativeGenerator
        from yggdrasil.stage_plan import SEQUENTIAL, PlanTable, StagePlan, ahead_rows

        target, draft, _, policy = self.loaded
        if draft is None or policy is None:
            return {}, PlanTable(), []
        speculator = SpeculativeGenerator(target, policy.drafter(draft), policy=policy)
        prompt = self.target.tokenizer.encode("def quicksort(items):\n")
        started = time.perf_counter()
        self.log("stage planning: measuring host stages and device contention")
        costs = stage_costs(speculator, policy.selector.profile, max(plan.verifies), prompt)
        forced = None if self.recipe.stage_plan == "auto" else StagePlan.parse(self.recipe.stage_plan)
        buckets, table = {}, {}
        for name in plan.picked:
            shape = Bucket.parse(name)
            if not shape.depth:
                continue
            bucket = Bucket(shape.depth, shape.width, shape.verify)
            sequential = iteration_time(bucket, costs, SEQUENTIAL)
            if forced is None:
                choice = best_plan(bucket, costs)
                chosen, seconds = choice.plan, choice.seconds
            else:
                chosen, seconds = forced, iteration_time(bucket, costs, forced)
            table[name] = chosen
            buckets[name] = {"plan": str(chosen), "predicted_ms": round(seconds * 1e3, 3),
                             "sequential_ms": round(sequential * 1e3, 3)}
        plans = PlanTable(table, forced or SEQUENTIAL)
        rows = ahead_rows(plans, [(w, v) for w in plan.widths for v in plan.verifies])
        extra = [GraphKey("draft_ahead", r, role="draft") for r in sorted(rows, reverse=True)]
        record = {"source": "forced by the recipe" if forced else "searched (yggdrasil.planner)",
                  "default": str(forced or SEQUENTIAL),  # buckets not listed (not picked in calibration)
                  "search_seconds": round(time.perf_counter() - started, 2),
                  "costs": {"prune_ms": costs.prune * 1e3, "accept_host_ms": costs.accept_host * 1e3,
                            "accept_device_ms": costs.accept_device * 1e3, "compact_ms": costs.compact * 1e3,
                            "contention": costs.contention, "streams": costs.streams},
                  "buckets": buckets}
        moved = sum(p != SEQUENTIAL for p in table.values())
        self.log(f"stage plans: {moved} of {len(table)} buckets run a non-sequential plan "
                 f"(device contention {costs.contention:.2f}, {costs.streams} stream(s))")
        return record, plans, extra

    def check_stage_plans(self, extra: list[GraphKey], plans) -> None:
        """Load the ahead-of-time graphs next to the others and check the chosen plans' greedy
        output against eager."""
        from yggdrasil.stage_plan import SEQUENTIAL

        target, draft, sets, policy = self.loaded
        if extra:
            added = load_graph_set(self.work, "draft", self.draft.model, [s.name for s in extra],
                                   self.rebuild, f"buckets in {self.recipe.source}")
            sets["draft"].graphs.update(added.graphs)
        if plans.possible() != {SEQUENTIAL}:
            self._check_against_eager((target, draft), policy, plans)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_bundle(recipe: Recipe, out: Path, force: bool = False, log=print) -> BuildResult:
    """The whole pipeline; returns the bundle (reused when already up to date)."""
    from yggdrasil.predictor.profile import now_iso

    started = time.perf_counter()
    builder = Builder(recipe, out, log)
    builder.load_models()
    if not force:
        existing = builder.up_to_date()
        if existing is not None:
            log(f"bundle {out} is up to date (id {existing.bundle_id}); nothing to do")
            return BuildResult(Path(out), True, existing)
    calibration = builder.calibrate()
    policy = builder.policy(calibration, None)
    from yggdrasil.predictor.calibration_data import load_run

    run = load_run(calibration)[0]
    plan = select_buckets(policy, run.hidden, run.grid)
    log(f"bucket selection on {run.hidden.shape[0]} calibration iterations: picked "
        f"{', '.join(f'{k} x{v}' for k, v in list(plan.picked.items())[:6])}")
    if plan.dropped_widths or plan.dropped_verifies:
        log(f"dropped (never picked): draft widths {list(plan.dropped_widths) or '-'}, "
            f"verify widths {list(plan.dropped_verifies) or '-'}")
    specs = graph_keys(recipe, plan, policy.needs_hidden)
    compile_started = time.perf_counter()
    compiled = builder.compile_graphs(specs)
    compile_seconds = time.perf_counter() - compile_started
    latency = builder.warm_load_check(specs, plan)
    builder.check_serve_graphs([s for s in specs if s.stage == SERVE_STAGE])
    if latency is None:
        from yggdrasil.latency import LatencyProfile

        latency = LatencyProfile()
    stage_record, stage_plans, ahead_specs = builder.choose_stage_plans(plan)
    if ahead_specs:
        compiled += builder.compile_graphs(ahead_specs)
        specs = specs + ahead_specs
    builder.check_stage_plans(ahead_specs, stage_plans)
    predictor = _predictor_stats(calibration)
    stats = {"compile_seconds": round(compile_seconds, 1), "graphs_compiled": compiled,
             "graphs_reused": len(specs) - compiled,
             "cold_graph_compile_seconds": round(sum(_seconds(builder.work / s.path) for s in specs), 1),
             "cold_calibration_seconds": _seconds(builder.work / "calibration"),
             "total_seconds": round(time.perf_counter() - started, 1), **predictor}

    def fill(tmp: Path) -> None:
        for spec in specs:
            _link_or_copy(builder.work / spec.path, tmp / spec.path)
        shutil.copytree(calibration, tmp / "calibration")
        (tmp / "plan.yaml").write_text(yaml.safe_dump(plan.as_dict(), sort_keys=False))
        if stage_record:
            (tmp / PLANS_FILE).write_text(yaml.safe_dump(stage_record, sort_keys=False))
        (tmp / "profile.yaml").write_text(yaml.safe_dump(
            {"device": builder.env.device, "source": "compiled graphs, measured at warm-load check",
             "latency": latency.as_dict(),
             # what each graph took when it was compiled, in this run or an earlier one
             "graph_compile_seconds": {f"{p.role}/{p.name}": _seconds(builder.work / p.path) for p in specs}},
            sort_keys=False))
        (tmp / "recipe.yaml").write_text(Path(recipe.source).read_text() if recipe.source else "")

    import json
    from dataclasses import asdict

    recipe_body = json.loads(json.dumps({**asdict(recipe), "source": str(Path(recipe.source).resolve())}))
    manifest = Manifest(recipe=recipe_body, recipe_identity=recipe.identity(),
                        models=builder.models, environment=builder.env,
                        buckets=tuple(f"{s.role}/{s.name}" for s in specs), dtype=recipe.dtype, tile=recipe.tile,
                        chunk_sizes=recipe.buckets.prefill_chunks, stats=stats, created=now_iso())
    final = write_bundle(Path(out), manifest, fill)
    return BuildResult(Path(out), False, final)


def _seconds(path: Path) -> float:
    """What the cached piece of work at `path` took when it was done (0 if unknown)."""
    record = path.with_suffix(".seconds")
    return float(record.read_text()) if record.is_file() else 0.0


def _predictor_stats(calibration: Path) -> dict:
    summary = calibration / "predictor.yaml"
    if not summary.is_file():
        skipped = calibration / "predictor.skipped"
        return {"predictor": "not trained: " + (skipped.read_text()[:120] if skipped.is_file() else "no data")}
    raw = yaml.safe_load(summary.read_text())
    held, objective = raw.get("held_out", {}), raw.get("objective", {})
    from yggdrasil.predictor.pipeline import predictor_pays

    return {"predictor": "used" if predictor_pays(raw) else "not better than the constant (unused)",
            "predictor_accuracy": held.get("accuracy"),
            "objective_constant": objective.get("constant_speedup"),
            "objective_predicted": objective.get("predicted_speedup"),
            "objective_oracle": objective.get("oracle_speedup")}
