"""Phase "calibrate": profile the eager steps, run the deepest, widest tree over the recipe's
calibration prompts, train and judge the depth predictor; cached in the work directory under a
key of exactly what it depends on.

Calibration is checkpointed per prompt in the work cache (calibration.checkpoint/), so a
compile killed while calibrating resumes where it stopped (issue 24). The step times are
measured with checks for a busy machine (yggdrasil/runtime/latency.py measure_checked) and their quality
is recorded with the calibration. `compile --reprofile` measures them again and redoes what
depends on them (the predictor's judgement here; bucket selection, the bundle's profile and the
stage plans in build.py) but keeps the recorded acceptance; a --reprofile that was interrupted
is finished by the next compile.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
import yaml

from yggdrasil.runtime import latency
from yggdrasil.runtime.latency import MeasurementQuality
from yggdrasil.predictor import prompts as prompt_sets
from yggdrasil.predictor.calibrate import Calibrator
from yggdrasil.policy.calibration import drafted_mask
from yggdrasil.predictor.calibration_data import save_run
from yggdrasil.policy.calibration import load_run
from yggdrasil.predictor.checkpoint import CalibrationCheckpoint
from yggdrasil.predictor.confidence import record_confidence
from yggdrasil.policy.files import PredictorError
from yggdrasil.predictor.pipeline import train_and_report
from yggdrasil.policy.auto import shipped_policy
from yggdrasil.predictor.rejudge import rejudge
from yggdrasil.predictor.stopping import CalibrationStopper, StoppingRule

from .context import BuildContext, work_key
from yggdrasil.runtime.assembly import grid_drafter

PROFILE_REPEATS = 5  # eager timings per step: enough to see their spread
CHECKPOINT = "calibration.checkpoint"  # per-prompt parts of an unfinished calibration
REPROFILING = "calibration.reprofiling"  # a --reprofile under way: holds the calibration's key
JUDGED = "calibration.judged"  # the calibration as the bundle ships it: policies judged on its graphs


def reprofile_command(recipe, out: Path) -> str:
    return f"`yggdrasil compile {recipe.source or recipe.name} --out {out} --reprofile`"


def _key_file(ctx: BuildContext) -> Path:
    """Written last: the calibration under it is finished and was made for this key."""
    return ctx.work.root / "calibration.key"


def _key(ctx: BuildContext) -> str:
    recipe = ctx.recipe
    return work_key(ctx.model_hashes(), ctx.grid().as_dict(), _tree_depth(ctx), recipe.calibration.__dict__,
                    recipe.dtype, recipe.max_context, ctx.env.device, ctx.env.torch,
                    *ctx.weight_key("target"), *ctx.weight_key("draft"))  # calibrated in the deployed format


def _tree_depth(ctx: BuildContext) -> int:
    """How deep calibration builds widths above 1: the recipe's own deepest depth (the grid's
    deeper depths are the chains' only)."""
    return ctx.recipe.buckets.tree_depth or ctx.recipe.buckets.depths[-1]


def calibrate(ctx: BuildContext, reprofile: bool = False) -> Path:
    """Profile (eager) and calibrate into work/calibration, unless it holds a calibration of
    the same models, grid, prompts and machine (then, with reprofile, only measure the step
    times again); train and judge the predictor."""
    directory, key = ctx.work.calibration, _key(ctx)
    key_file, marker = _key_file(ctx), ctx.work.root / REPROFILING
    saved = (directory / "calibration.yaml").is_file()
    finished = saved and key_file.is_file() and key_file.read_text() == key
    interrupted = saved and not finished and marker.is_file() and marker.read_text() == key
    if not (finished or interrupted):
        return _calibrate(ctx, key)
    shutil.rmtree(ctx.work.root / CHECKPOINT, ignore_errors=True)  # left by a kill just after it finished
    if reprofile or interrupted:
        return _reprofile(ctx, key, interrupted)
    ctx.log(f"reusing calibration in {directory}")
    quality = recorded_quality(directory)
    if quality is not None and quality.verdict == "noisy":
        ctx.log(f"WARNING: the cached eager step times (bucket selection) were measured on a busy machine "
                f"({quality.summary()}); re-run {reprofile_command(ctx.recipe, ctx.out)} on a quiet machine")
    return directory


def _measure(ctx: BuildContext, target, drafter, draft):
    """The eager step times bucket selection works from, checked for a busy machine."""

    grid = ctx.grid()
    ctx.log("profiling step times (eager) for bucket selection")
    return latency.measure_checked(
        lambda: latency.measure_profile(target, drafter, grid.verifies, repeats=PROFILE_REPEATS,
                                        draft_widths=() if draft is None else grid.widths),
        target.device, ctx.log, what="eager step times (bucket selection)",
        hint=f"; re-run {reprofile_command(ctx.recipe, ctx.out)} on a quiet machine")


def _train(ctx: BuildContext, directory: Path) -> None:
    (directory / "predictor.skipped").unlink(missing_ok=True)
    summary = None
    try:
        summary = train_and_report(directory)
    except PredictorError as exc:
        ctx.log(f"no depth predictor: {exc}; the bundle uses the best constant bucket")
        (directory / "predictor.skipped").write_text(str(exc))
    _judge_confidence(ctx, directory, summary)


def _judge_confidence(ctx: BuildContext, directory: Path, predictor_summary: dict | None) -> None:
    """Whether draft confidence choosing the verify width beats the best constant bucket held
    out (predictor/confidence.py); recorded in confidence.yaml, which the bundle's policy reads
    (bundle.policy_from_calibration) and bucket selection then follows. The log names what
    ships as shipped_policy decides it (the depth predictor may have gained more)."""
    (directory / "confidence.yaml").unlink(missing_ok=True)
    try:
        report = record_confidence(directory)["report"]
    except PredictorError as exc:
        ctx.log(f"draft-confidence verify width not judged: {exc}")
        return
    runs = shipped_policy(predictor_summary, report)
    if runs == "confidence":
        verdict = "ships: the bundle drafts it and lets the calibrated confidence pick V"
    elif report["shipped"] == "confidence":
        verdict = "beat the constant but does not ship: the depth predictor gained more held out"
    else:
        verdict = "not shipped: the bundle keeps " + ("the depth predictor" if runs == "predictor" else
                                                      "the best constant bucket")
    ctx.log(f"draft confidence choosing V on {report['confidence_shape']}: {report['reason']}; {verdict}")


def _calibrate(ctx: BuildContext, key: str) -> Path:
    recipe, grid, directory = ctx.recipe, ctx.grid(), ctx.work.calibration
    shutil.rmtree(directory, ignore_errors=True)
    (ctx.work.root / REPROFILING).unlink(missing_ok=True)
    started = time.perf_counter()
    target, draft = ctx.runners()
    drafter = grid_drafter(grid, draft)
    profile = _measure(ctx, target, drafter, draft)
    names = [recipe.resolve(p) if p.endswith(".jsonl") else p for p in recipe.calibration.prompts]
    texts = prompt_sets.select(names, "calibration", recipe.calibration.num_prompts)
    ids = [prompt_sets.encode(p, ctx.target.tokenizer) for p in texts]
    stop_ids = ctx.target.tokenizer.stop_ids
    checkpoint = CalibrationCheckpoint(ctx.work.root / CHECKPOINT,
                                       work_key(key, ids, recipe.calibration.max_new_tokens, sorted(stop_ids)),
                                       ctx.log)
    done = checkpoint.saved()
    if done:
        ctx.log(f"resuming calibration: {done} of {len(ids)} prompts were done before the last compile "
                f"stopped (checkpoint in {checkpoint.directory})")
    calibrator = Calibrator(target, drafter, grid, _tree_depth(ctx))
    stopper = stopper_for(recipe, grid, profile, calibrator.depths, ctx.env.cpu)
    run = calibrator.run(ids, recipe.calibration.max_new_tokens, stop_ids, checkpoint=checkpoint, stopper=stopper)
    used = calibrator.stopped.prompts if calibrator.stopped is not None else len(ids)
    ctx.log(f"calibration used {run.accepted_max.numel()} iterations from {used} of {len(ids)} prompts"
            + (f": settled early, {calibrator.stopped.summary()} (calibration.stop_early)"
               if calibrator.stopped is not None else ""))
    meta = {"device": ctx.env.device, **_cpu(ctx), "dtype": recipe.dtype, "target": ctx.models["target"]["name"],
            "target_sha256": ctx.models["target"]["sha256"],
            "draft": ctx.models.get("draft", {}).get("name", "lookup"),
            "draft_sha256": ctx.models.get("draft", {}).get("sha256"),
            "prompt_sets": list(recipe.calibration.prompts), "split": "calibration",
            "prompt_ids": [p.id for p in texts], "max_new_tokens": recipe.calibration.max_new_tokens,
            "latency_source": "measured eagerly by yggdrasil compile",
            "profile_quality": profile.quality.as_dict(),
            "stopped_early": None if calibrator.stopped is None else calibrator.stopped.summary(),
            "prompts_used": used, "prompts_available": len(ids)}
    save_run(run, directory, meta, profile)
    _train(ctx, directory)
    (ctx.work.root / "calibration.seconds").write_text(f"{time.perf_counter() - started:.1f}")
    _key_file(ctx).write_text(key)
    checkpoint.remove()
    return directory


def stopper_for(recipe, grid, profile, depths, cpu=None) -> CalibrationStopper | None:
    """The stopping rule (predictor/stopping.py), unless the recipe turns it off. It waits for
    half the recipe's prompts at least: the depth predictor and draft confidence train on the same
    records, and their held-out verdicts need prompts to hold out; a quarter where calibration
    confirms the choice the recipe records for a machine of this one's ISA level (cpu: this
    machine's CpuFingerprint)."""
    if not recipe.calibration.stop_early:
        return None
    recorded = recipe.measured_cold_compile
    similar = (recorded is not None and recorded.choice is not None and cpu is not None
               and recorded.isa == cpu.portable_isa())
    rule = StoppingRule(min_prompts=max(StoppingRule.min_prompts, recipe.calibration.num_prompts // 2),
                        expected=recorded.choice if similar else None,
                        expected_prompts=max(StoppingRule.expected_prompts, recipe.calibration.num_prompts // 4))
    return CalibrationStopper(grid, profile, drafted_mask(grid, depths), rule)


def _reprofile(ctx: BuildContext, key: str, interrupted: bool) -> Path:
    """Measure the eager step times again and redo what depends on them here (the statistics
    saved with the calibration, the predictor's training and judgement); the recorded
    iterations are kept. Until it is done the calibration has no key and REPROFILING holds it,
    so a kill meanwhile is finished by the next compile instead of calibrating again."""

    directory = ctx.work.calibration
    try:
        run, meta, _ = load_run(directory)
    except PredictorError as exc:
        ctx.log(f"cannot re-profile the cached calibration ({exc}); calibrating again")
        return _calibrate(ctx, key)
    ctx.log("finishing an interrupted --reprofile" if interrupted else
            f"--reprofile: measuring step times again; keeping the {run.accepted_max.numel()} calibrated iterations")
    key_file, marker = _key_file(ctx), ctx.work.root / REPROFILING
    marker.write_text(key)
    key_file.unlink(missing_ok=True)
    target, draft = ctx.runners()
    profile = _measure(ctx, target, grid_drafter(ctx.grid(), draft), draft)
    meta.update(latency_source="measured eagerly by yggdrasil compile --reprofile", device=ctx.env.device,
                **_cpu(ctx), profile_quality=profile.quality.as_dict())
    save_run(run, directory, meta, profile)
    _train(ctx, directory)
    key_file.write_text(key)
    marker.unlink()
    return directory


def _cpu(ctx: BuildContext) -> dict:
    """The CPU fingerprint a profile records (yggdrasil/cpu.py)."""
    return {"cpu": ctx.env.cpu.as_dict()} if ctx.env.cpu is not None else {}


def adopt_calibration(ctx: BuildContext, source: Path) -> bool:
    """Take a bundle's calibration as the work cache's finished one when the cache holds none
    under this key (compile/adopt.py: --reprofile of a copied bundle measures its step times
    again and keeps its recorded iterations); False when there was one already."""
    directory, key, key_file = ctx.work.calibration, _key(ctx), _key_file(ctx)
    if (directory / "calibration.yaml").is_file() and key_file.is_file() and key_file.read_text() == key:
        return False
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(source, directory)
    (ctx.work.root / REPROFILING).unlink(missing_ok=True)
    shutil.rmtree(ctx.work.root / CHECKPOINT, ignore_errors=True)
    key_file.write_text(key)
    return True


def judge_on_graphs(ctx: BuildContext, selection, latency) -> Path:
    """The calibration the bundle ships: a copy whose depth predictor and draft confidence are
    judged again against the best constant bucket on the compiled graphs' step times, over the
    compiled buckets (predictor/rejudge.py): the eager verdict above chose which graphs to
    compile, this one chooses what runs on them. Redone every build (seconds: one small
    training run); a calibration that cannot be judged again ships as calibrated."""
    out = ctx.work.root / JUDGED
    try:
        judged = rejudge(ctx.work.calibration, out, latency, selection.widths, selection.verifies,
                         "the compiled graphs' step times (the bundle's profile)")
    except PredictorError as exc:
        ctx.log(f"policies not judged on the compiled graphs ({exc}); the bundle keeps the eager verdict")
        return ctx.work.calibration
    names = {"predictor": "the depth predictor", "confidence": "draft confidence choosing V",
             "constant": "the best constant bucket"}
    ctx.log(f"on the compiled graphs' step times: {judged.describe()}; the bundle runs {names[judged.runs]}")
    return out


def recorded_quality(directory: Path):
    """The MeasurementQuality saved with a calibration's eager step times (None: not recorded)."""

    try:
        meta = yaml.safe_load((Path(directory) / "calibration.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return MeasurementQuality.from_dict(meta.get("profile_quality")) if isinstance(meta, dict) else None


def measurement_stats(calibration: Path, compiled) -> dict:
    """The manifest's record of how the bundle's step times were measured: the eager ones
    (bucket selection) and the compiled ones (the bundle's profile, None when it does not
    speculate); measurement_quality is the worse of the two (noisy, unchecked, good)."""

    measured = {"selection (eager)": recorded_quality(calibration),
                "bundle (graphs)": getattr(compiled, "quality", None) if compiled is not None else None}
    if compiled is None:
        measured.pop("bundle (graphs)")
    verdicts = {q.verdict if q is not None else "unchecked" for q in measured.values()}
    verdict = next(v for v in ("noisy", "unchecked", "good") if v in verdicts)
    described = "; ".join(f"{what}: {q.summary() if q is not None else 'not recorded'}" for what, q in measured.items())
    return {"measurement_quality": verdict, "measurement": described, "threads": torch.get_num_threads()}


def noisy_warning(stats: dict, recipe, out: Path) -> str | None:
    """The warning a bundle whose step times were measured on a busy machine gets (None: it
    was measured quietly)."""
    if stats.get("measurement_quality") != "noisy":
        return None
    return (f"WARNING: this bundle's step times were measured on a busy machine, so its bucket selection may "
            f"be wrong (a loaded machine makes speculation look costly): {stats.get('measurement')}. "
            f"Re-run {reprofile_command(recipe, out)} on a quiet machine")
