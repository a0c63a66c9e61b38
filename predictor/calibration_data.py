"""Saved calibration data and the statistics read from it.

A calibration directory holds calibration.safetensors (per-iteration arrays) and calibration.yaml
(schema, grid, models, latency table, summary statistics). Writing goes through temporary names
and renames, so an interrupted run never leaves a half-written file under the real name.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from yggdrasil.buckets import NO_SPEC
from yggdrasil.runtime.latency import LatencyProfile

from yggdrasil.policy.calibration import CalibrationRun, drafted_mask
from yggdrasil.policy.files import atomic_write
from yggdrasil.policy.select import oracle_choices, record_costs, shape_at
from yggdrasil.policy.calibration import NODE_ARRAYS, SCHEMA, TOKEN_ARRAYS


def aal_table(run: CalibrationRun) -> torch.Tensor:
    """[depths, widths, verifies] mean tokens per iteration, bonus included."""
    return 1.0 + run.accepted.double().mean(0)


def depth_acceptance(run: CalibrationRun) -> list[float]:
    """P(the depth-d token is accepted | depth d - 1 was), d = 1..max depth, for a as in mean_capped."""
    a = run.accepted_max
    out = []
    for d in range(1, run.grid.max_depth + 1):
        reached = int((a >= d - 1).sum())
        out.append(float((a >= d).sum()) / reached if reached else float("nan"))
    return out


def rank_acceptance(run: CalibrationRun) -> list[float]:
    """Sequoia's positional acceptance: P(the target's token is the draft's rank-r proposal)."""
    return [h / run.rank_trials if run.rank_trials else 0.0 for h in run.rank_hits]


def hindsight_best(run: CalibrationRun, latency: LatencyProfile) -> list[str]:
    """Per iteration, the bucket that would have been best in hindsight ("no-spec" when none
    beats a plain decode step), by objective 3.1 with this latency profile."""

    costs = record_costs(run.grid, latency, run.tree_size, run.accepted.shape[0],
                         drafted_mask(run.grid, run.drafted_depths))
    picks = oracle_choices(run.accepted, costs, latency.t_verify(1))
    return [str(NO_SPEC if index is None else shape_at(run.grid, index)) for index in picks]


def save_run(run: CalibrationRun, directory: Path, meta: dict, latency: LatencyProfile) -> None:
    """Write the arrays and calibration.yaml: the caller's metadata plus the statistics computed
    here, which replace any keys of the same name in `meta` (so a loaded meta can be passed back)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"hidden": run.hidden.contiguous(), "accepted_max": run.accepted_max.contiguous(),
              "accepted": run.accepted.contiguous(), "prompt_index": run.prompt_index.contiguous()}
    if run.tree_size is not None:
        arrays["tree_size"] = run.tree_size.contiguous()
    for name in NODE_ARRAYS + TOKEN_ARRAYS:  # absent from data calibrated before they were recorded
        if getattr(run, name) is not None:
            arrays[name] = getattr(run, name).contiguous()
    atomic_write(directory / "calibration.safetensors", lambda p: save_file(arrays, str(p)))
    table = aal_table(run)
    drafted = drafted_mask(run.grid, run.drafted_depths)
    best = hindsight_best(run, latency)
    counts: dict[str, int] = {}
    for name in best:
        counts[name] = counts.get(name, 0) + 1
    body = {
        "schema": SCHEMA,
        **meta,
        "grid": run.grid.as_dict(),
        "latency": {"draft": [list(p) for p in latency.draft], "verify": [list(p) for p in latency.verify]},
        "iterations": int(run.accepted_max.numel()),
        "prompts": len(set(run.prompt_index.tolist())),
        "skipped_prompts": run.skipped_prompts,
        "generated_tokens": run.generated_tokens,
        "rank_hits": list(run.rank_hits),
        "rank_trials": run.rank_trials,
        "depth_acceptance": [round(x, 4) for x in depth_acceptance(run)],
        "rank_acceptance": [round(x, 4) for x in rank_acceptance(run)],
        "hindsight_best_counts": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
        "hindsight_best": best,  # per iteration, in the order of calibration.safetensors
        # null: that tree was not drafted (wider widths stop at the recipe's own deepest depth)
        "aal_table": {f"D{d}": {f"W{w}": ([round(float(x), 3) for x in table[i, j]] if drafted[i, j] else None)
                                for j, w in enumerate(run.grid.widths)}
                      for i, d in enumerate(run.grid.depths)},
    }
    if run.drafted_depths is not None:
        body["drafted_depths"] = {f"W{w}": d for w, d in zip(run.grid.widths, run.drafted_depths)}
    atomic_write(directory / "calibration.yaml", lambda p: p.write_text(yaml.safe_dump(body, sort_keys=False)))


