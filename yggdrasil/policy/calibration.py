"""A calibration run as the runtime reads it: what calibration collected per iteration
(CalibrationRun), loaded from a calibration directory (calibration.safetensors + calibration.yaml,
written by predictor/calibration_data.py) and seen through a bundle's smaller grid."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from yggdrasil.buckets import Grid
from yggdrasil.policy.files import PredictorError, read_pair
from yggdrasil.runtime.latency import LatencyProfile


@dataclass(frozen=True)
class CalibrationRun:
    """What calibrate() collected; CalibrationData (data.py) is its saved form."""

    grid: Grid
    hidden: torch.Tensor  # [N, dim] float16: target hidden state before each iteration
    accepted_max: torch.Tensor  # [N] most tokens any width's whole build would have accepted
    accepted: torch.Tensor  # [N, depths, widths, verifies] tokens each drafted bucket would have accepted
    prompt_index: torch.Tensor  # [N] which prompt each iteration came from
    rank_hits: tuple[int, ...]  # times the target's token was the draft's rank-r proposal
    rank_trials: int  # expanded nodes on the target's path (the denominator)
    generated_tokens: int
    skipped_prompts: int
    tree_size: torch.Tensor | None = None  # [N, depths, widths] nodes (root included) each tree had
    drafted_depths: tuple[int, ...] | None = None  # per width, the depth its build reached (None: all)
    # each width's whole build, node by node in build order (padded with depth -1), for the draft
    # confidence policy (predictor/confidence.py); None: calibrated before they were recorded
    node_score: torch.Tensor | None = None  # [N, widths, M] float64 rank score (path log-prob; root inf)
    node_depth: torch.Tensor | None = None  # [N, widths, M] int8 depth, -1 past the tree's end
    node_step: torch.Tensor | None = None  # [N, widths, M] int8 least D whose depth-D tree holds it, -1 past
    node_on_path: torch.Tensor | None = None  # [N, widths, M] bool: on the target's greedy path
    # the target's tokens (issue 51: what a trimmed draft vocabulary is chosen from); None:
    # calibrated before they were recorded
    continuation: torch.Tensor | None = None  # [N, max depth] int32: its next tokens after each root
    sequence_tokens: torch.Tensor | None = None  # [T] int32: every prompt and its generation, joined


def drafted_mask(grid: Grid, drafted_depths: tuple[int, ...] | None) -> torch.Tensor:
    """[depths, widths] True where calibration drafted the (D, W) tree (so its hindsight holds)."""
    reach = torch.tensor(drafted_depths if drafted_depths is not None else [grid.max_depth] * len(grid.widths))
    return torch.tensor(grid.depths)[:, None] <= reach[None, :]


SCHEMA = "yggdrasil-calibration/1"


# per-node arrays of each width's build (draft confidence, predictor/confidence.py): optional, so
# calibration directories written before them still load (without a confidence policy)
NODE_ARRAYS = ("node_score", "node_depth", "node_on_path", "node_step")
TOKEN_ARRAYS = ("continuation", "sequence_tokens")  # optional too


def mean_capped(run: CalibrationRun, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[depths] mean min(a, D) of a, the most tokens any width's whole build accepted."""
    a = run.accepted_max if rows is None else run.accepted_max[rows]
    return torch.stack([a.clamp(max=d).double().mean() for d in run.grid.depths])


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
                             **{name: arrays.get(name) for name in NODE_ARRAYS + TOKEN_ARRAYS})
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
