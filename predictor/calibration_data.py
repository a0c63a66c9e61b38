"""Saved calibration data and the statistics read from it.

A calibration directory holds calibration.safetensors (per-iteration arrays) and calibration.yaml
(schema, grid, models, latency table, summary statistics). Writing goes through temporary names
and renames, so an interrupted run never leaves a half-written file under the real name.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from yggdrasil.buckets import NO_SPEC, Grid
from yggdrasil.runtime.latency import LatencyProfile

from .calibrate import CalibrationRun, drafted_mask
from .files import PredictorError, atomic_write, read_pair
from .select import oracle_choices, record_costs, shape_at

SCHEMA = "yggdrasil-calibration/1"
# per-node arrays of each width's build (draft confidence, predictor/confidence.py): optional, so
# calibration directories written before them still load (without a confidence policy)
NODE_ARRAYS = ("node_score", "node_depth", "node_on_path", "node_step")


def aal_table(run: CalibrationRun) -> torch.Tensor:
    """[depths, widths, verifies] mean tokens per iteration, bonus included."""
    return 1.0 + run.accepted.double().mean(0)


def mean_capped(run: CalibrationRun, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[depths] mean min(a, D) of a, the most tokens any width's whole build accepted."""
    a = run.accepted_max if rows is None else run.accepted_max[rows]
    return torch.stack([a.clamp(max=d).double().mean() for d in run.grid.depths])


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
    for name in NODE_ARRAYS:  # absent from data calibrated before they were recorded
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


def load_run(directory: Path) -> tuple[CalibrationRun, dict, LatencyProfile]:
    directory = Path(directory)
    rebuild = "re-run `yggdrasil calibrate`"
    meta, arrays = read_pair(directory, "calibration", SCHEMA, f"{directory} is not a calibration directory",
                             f"calibration data in {directory} is unreadable", rebuild)
    try:
        grid = Grid(tuple(meta["grid"]["depths"]), tuple(meta["grid"]["widths"]), tuple(meta["grid"]["verifies"]))
        drafted = meta.get("drafted_depths")  # absent: calibrated before widths stopped early
        run = CalibrationRun(grid, arrays["hidden"], arrays["accepted_max"], arrays["accepted"],
                             arrays["prompt_index"], tuple(meta["rank_hits"]), int(meta["rank_trials"]),
                             int(meta["generated_tokens"]), int(meta["skipped_prompts"]),
                             arrays.get("tree_size"),
                             drafted if drafted is None else tuple(int(drafted[f"W{w}"]) for w in grid.widths),
                             **{name: arrays.get(name) for name in NODE_ARRAYS})
        latency = LatencyProfile(tuple(tuple(p) for p in meta["latency"]["draft"]),
                                 tuple(tuple(p) for p in meta["latency"]["verify"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise PredictorError(f"{directory}/calibration.yaml is malformed ({type(exc).__name__}: {exc}); {rebuild}") from None
    expected = (run.hidden.shape[0], len(grid.depths), len(grid.widths), len(grid.verifies))
    if tuple(run.accepted.shape) != expected:
        raise PredictorError(f"calibration arrays in {directory} do not match its grid "
                             f"({list(run.accepted.shape)} vs {list(expected)}); {rebuild}")
    for name in NODE_ARRAYS:
        array = getattr(run, name)
        if array is not None and (array.dim() != 3 or tuple(array.shape[:2]) != expected[:1] + expected[2:3]):
            raise PredictorError(f"calibration array {name} in {directory} does not match its grid "
                                 f"({list(array.shape)}); {rebuild}")
    return run, meta, latency


def restrict(run: CalibrationRun, widths: tuple[int, ...], verifies: tuple[int, ...]) -> CalibrationRun:
    """The same iterations seen through a smaller grid (the buckets a bundle compiled): every
    depth, only these draft widths and verify widths."""
    grid = run.grid
    w_index = [grid.widths.index(w) for w in widths]
    v_index = [grid.verifies.index(v) for v in sorted({1, *verifies})]
    small = Grid(grid.depths, tuple(widths), tuple(sorted({1, *verifies})))
    accepted = run.accepted[:, :, w_index][..., v_index]
    tree_size = run.tree_size[:, :, w_index] if run.tree_size is not None else None
    drafted = None if run.drafted_depths is None else tuple(run.drafted_depths[j] for j in w_index)
    nodes = {name: getattr(run, name)[:, w_index].contiguous() for name in NODE_ARRAYS
             if getattr(run, name) is not None}
    return replace(run, grid=small, accepted=accepted.contiguous(), tree_size=tree_size, drafted_depths=drafted,
                   **nodes)
