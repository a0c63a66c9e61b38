"""Phase "calibrate": profile the eager steps, run the deepest, widest tree over the recipe's
calibration prompts, train and judge the depth predictor; cached in the work directory under a
key of exactly what it depends on."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from .context import BuildContext, work_key


def calibrate(ctx: BuildContext) -> Path:
    """Profile (eager) and calibrate into work/calibration, unless it holds a calibration of
    the same models, grid, prompts and machine; then train and judge the predictor."""
    from yggdrasil.drafters import LookupDrafter, ModelDrafter
    from yggdrasil.latency import measure_profile
    from yggdrasil.predictor import prompts as prompt_sets
    from yggdrasil.predictor.calibrate import Calibrator
    from yggdrasil.predictor.calibration_data import save_run
    from yggdrasil.predictor.files import PredictorError
    from yggdrasil.predictor.pipeline import train_and_report

    recipe, grid = ctx.recipe, ctx.grid()
    directory = ctx.work.calibration
    key = work_key(ctx.model_hashes(), grid.as_dict(), recipe.calibration.__dict__, recipe.dtype,
                   recipe.max_context, ctx.env.device, ctx.env.torch)
    key_file = ctx.work.root / "calibration.key"
    if key_file.is_file() and key_file.read_text() == key and (directory / "calibration.yaml").is_file():
        ctx.log(f"reusing calibration in {directory}")
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    target, draft = ctx.runners()
    drafter = (LookupDrafter(grid.max_depth, grid.max_width) if draft is None else
               ModelDrafter(draft, grid.max_depth, grid.max_width, grid.widths))
    ctx.log("profiling step times (eager) for bucket selection")
    latency = measure_profile(target, drafter, grid.verifies,
                              draft_widths=() if draft is None else grid.widths)
    names = [recipe.resolve(p) if p.endswith(".jsonl") else p for p in recipe.calibration.prompts]
    texts = prompt_sets.select(names, "calibration", recipe.calibration.num_prompts)
    ids = [prompt_sets.encode(p, ctx.target.tokenizer) for p in texts]
    run = Calibrator(target, drafter, grid).run(ids, recipe.calibration.max_new_tokens,
                                                ctx.target.tokenizer.stop_ids)
    meta = {"device": ctx.env.device, "dtype": recipe.dtype, "target": ctx.models["target"]["name"],
            "target_sha256": ctx.models["target"]["sha256"],
            "draft": ctx.models.get("draft", {}).get("name", "lookup"),
            "draft_sha256": ctx.models.get("draft", {}).get("sha256"),
            "prompt_sets": list(recipe.calibration.prompts), "split": "calibration",
            "prompt_ids": [p.id for p in texts], "max_new_tokens": recipe.calibration.max_new_tokens,
            "latency_source": "measured eagerly by yggdrasil compile"}
    save_run(run, directory, meta, latency)
    try:
        train_and_report(directory)
    except PredictorError as exc:
        ctx.log(f"no depth predictor: {exc}; the bundle uses the best constant bucket")
        (directory / "predictor.skipped").write_text(str(exc))
    (ctx.work.root / "calibration.seconds").write_text(f"{time.perf_counter() - started:.1f}")
    key_file.write_text(key)
    return directory
