"""From calibration data to what the runtime uses: the trained depth predictor, its held-out
report (objective with predicted depths vs the best constant bucket vs an oracle), Sequoia trees
per verify budget, a plot; and `AutoPolicy`, which picks each iteration's bucket at run time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from yggdrasil.buckets import NO_SPEC, Bucket, Grid
from yggdrasil.drafters import LookupDrafter, ModelDrafter
from yggdrasil.errors import InvalidRequestError
from yggdrasil.latency import LatencyProfile

from . import depth as depth_mod
from .calibrate import CalibrationRun
from .calibration_data import aal_table, depth_acceptance, load_run, mean_capped, rank_acceptance
from .select import Selector, bucket_index, oracle_choices, realised_speedup, record_costs
from .sequoia import best_tree


@dataclass(frozen=True)
class PolicyReport:
    """Objective 3.1 realised on held-out calibration iterations (plain decoding = 1.0)."""

    held_out_records: int
    constant_shape: str
    constant_speedup: float
    predicted_speedup: float
    oracle_speedup: float
    predicted_shapes: dict  # bucket -> times chosen


def run_costs(run: CalibrationRun, latency: LatencyProfile) -> torch.Tensor:
    return record_costs(run.grid, latency, run.tree_size, run.accepted.shape[0])


def selector_for(run: CalibrationRun, rows: torch.Tensor, latency: LatencyProfile) -> Selector:
    return Selector(run.grid, latency, run.accepted[rows].double().mean(0), mean_capped(run, rows),
                    run_costs(run, latency)[rows].mean(0))


def judge_policies(run: CalibrationRun, model: depth_mod.DepthMLP | None, train_mask: torch.Tensor,
                   held_mask: torch.Tensor, latency: LatencyProfile) -> PolicyReport:
    selector = selector_for(run, train_mask, latency)
    accepted = run.accepted[held_mask]
    costs, t1 = run_costs(run, latency)[held_mask], latency.t_verify(1)
    constant, _ = selector.constant()
    constant_pick = [bucket_index(run.grid, constant)] * accepted.shape[0]
    if model is not None:
        with torch.inference_mode():
            tails = model.tail(run.hidden[held_mask].float())
        shapes = [selector.for_tail(t)[0] for t in tails]
    else:
        shapes = [constant] * accepted.shape[0]
    counts: dict[str, int] = {}
    for s in shapes:
        counts[str(s)] = counts.get(str(s), 0) + 1
    return PolicyReport(
        int(accepted.shape[0]), str(constant),
        realised_speedup(accepted, costs, t1, constant_pick),
        realised_speedup(accepted, costs, t1, [bucket_index(run.grid, s) for s in shapes]),
        realised_speedup(accepted, costs, t1, oracle_choices(accepted, costs, t1)),
        dict(sorted(counts.items(), key=lambda kv: -kv[1])))


def sequoia_trees(run: CalibrationRun, directory: Path) -> dict[int, str]:
    """Sequoia's best static tree for each verify budget > 1, from the measured rank acceptance."""
    written = {}
    acceptance = rank_acceptance(run)
    if not run.rank_trials or not any(acceptance):
        return written
    for budget in run.grid.verifies:
        if budget < 2:
            continue
        shape, value = best_tree(acceptance, budget - 1, run.grid.max_depth)
        path = directory / f"sequoia-v{budget}.json"
        path.write_text(json.dumps([list(p) for p in shape]))
        written[budget] = f"{path.name} (expected accepted {value:.2f})"
    return written


def train_and_report(directory: Path, meta_extra: dict | None = None) -> dict:
    """Train the predictor on a saved calibration directory and write everything next to it.

    Raises PredictorError on too little data. A predictor that does not beat the constant on
    held-out data is still saved but marked useful: false, and the runtime ignores it.
    """
    directory = Path(directory)
    run, meta, latency = load_run(directory)
    depth_mod.check_enough(run.prompt_index)
    train_mask, held_mask = depth_mod.split_by_prompt(run.prompt_index)
    max_depth = run.grid.max_depth
    model = depth_mod.train(run.hidden, run.accepted_max, train_mask, max_depth)
    report = depth_mod.evaluate(model, run.hidden, run.accepted_max, train_mask, held_mask, max_depth)
    policy = judge_policies(run, model, train_mask, held_mask, latency)
    summary = {
        "target_sha256": meta.get("target_sha256"),
        "held_out": {**{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(report).items()},
                     "useful": report.useful},
        "objective": {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(policy).items()},
        "sequoia": {f"v{k}": v for k, v in sequoia_trees(run, directory).items()},
        **(meta_extra or {}),
    }
    # the runtime uses the predictor trained on all iterations; the report above is held-out
    final = depth_mod.train(run.hidden, run.accepted_max, torch.ones_like(train_mask), max_depth)
    depth_mod.save(final, directory, summary)
    plot_calibration(run, latency, directory / "calibration.png")
    return summary


@dataclass
class AutoPolicy:
    """Per-iteration bucket choice: the predictor's tails (if it is useful) through the Selector."""

    selector: Selector
    model: depth_mod.DepthMLP | None

    @property
    def needs_hidden(self) -> bool:
        return self.model is not None

    def predict(self, hidden: torch.Tensor | None) -> list[float] | None:
        """P(accepted >= d) for d = 1..max depth from the target's last hidden state, or None
        when there is no (useful) predictor."""
        if self.model is None or hidden is None:
            return None
        with torch.inference_mode():
            return self.model.tail(hidden.float().cpu()[None])[0].tolist()

    def select(self, tail: list[float] | None) -> Bucket:
        """The bucket for these tails (the best constant bucket without them)."""
        return self.selector.constant()[0] if tail is None else self.selector.for_tail_fast(tail)

    def choose(self, hidden: torch.Tensor | None) -> Bucket:
        return self.select(self.predict(hidden))

    @property
    def grid(self) -> Grid:
        return self.selector.grid

    def drafter(self, draft_runner=None):
        """A drafter that can build every bucket of the grid: EGT with the draft model's runner,
        or prompt lookup without one."""

        grid = self.grid
        if draft_runner is None:
            return LookupDrafter(grid.max_depth, grid.max_width)
        return ModelDrafter(draft_runner, grid.max_depth, grid.max_width, grid.widths)


def check_draft(directory: Path, meta: dict, draft: str, draft_sha256: str | None = None) -> None:
    """The draft given at run time must be the one calibrated with (lookup or that model file)."""
    calibrated = meta.get("draft")
    if (calibrated == "lookup") != (draft == "lookup"):
        raise InvalidRequestError(f"{directory} was calibrated with draft {calibrated!r} but the draft "
                                  f"is {draft!r}; use the same draft or re-run `yggdrasil calibrate`")
    if meta.get("draft_sha256") and draft_sha256 and meta["draft_sha256"] != draft_sha256:
        raise InvalidRequestError(f"{directory} was calibrated with another draft model file; "
                                  "re-run `yggdrasil calibrate` with this draft")


def predictor_pays(meta: dict) -> bool:
    """Use the predictor only if it beat the constant on held-out data twice over: a lower
    log-loss, and at least the best constant bucket's realised objective 3.1."""
    objective = meta.get("objective", {})
    return bool(meta.get("held_out", {}).get("useful")) and \
        objective.get("predicted_speedup", 0.0) >= objective.get("constant_speedup", float("inf"))


def load_policy(directory: Path, calibration: tuple, latency: LatencyProfile | None, dim: int,
                target_sha256: str | None) -> tuple[AutoPolicy, str]:
    """The run-time policy from a calibration directory, whose load_run() result the caller has
    already read (it checks the drafter against it); latency defaults to the one measured when
    calibrating. Returns it with a one-line description."""
    run, _, calibrated_latency = calibration
    latency = latency or calibrated_latency
    selector = selector_for(run, torch.ones(run.accepted.shape[0], dtype=torch.bool), latency)
    model, pmeta = depth_mod.load(directory, dim, target_sha256)
    useful = predictor_pays(pmeta)
    note = ("depth predictor on" if useful else
            "depth predictor did not beat the constant on held-out data: using the best constant bucket")
    return AutoPolicy(selector, model if useful else None), note


def plot_calibration(run: CalibrationRun, latency: LatencyProfile, path: Path) -> Path:
    # optional and slow to import: loaded only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    depths = list(range(1, run.grid.max_depth + 1))
    left.plot(depths, depth_acceptance(run), marker="o", label="P(depth d accepted | d-1 was)")
    hist = torch.bincount(run.accepted_max.clamp(max=run.grid.max_depth), minlength=run.grid.max_depth + 1)
    left.bar(range(run.grid.max_depth + 1), (hist / hist.sum()).tolist(), alpha=0.3,
             label="share of iterations accepting k")
    left.set_xlabel("depth d / accepted tokens k")
    left.set_title(f"deepest/widest tree, {run.accepted_max.numel()} iterations", fontsize=9)
    left.legend(fontsize=7)
    left.grid(True, alpha=0.3)
    table, costs = aal_table(run), run_costs(run, latency).mean(0)
    speedup = table * latency.t_verify(1) / costs
    speculating = slice(1, None) if len(run.grid.verifies) > 1 else slice(None)  # V=1 drafts nothing
    for j, width in enumerate(run.grid.widths):
        best_v = speedup[:, j, speculating].max(-1).values
        right.plot(run.grid.depths, best_v.tolist(), marker="o", label=f"W={width} (best V > 1)")
    right.axhline(1.0, color="grey", linestyle=":")
    right.set_xlabel("draft depth D")
    right.set_ylabel("objective 3.1 (plain decode = 1)")
    right.set_title("calibrated AAL over measured latency, on average (below 1: only some "
                    "iterations should speculate)", fontsize=8)
    right.legend(fontsize=7)
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def read_summary(directory: Path) -> dict:
    return yaml.safe_load((Path(directory) / "predictor.yaml").read_text())


__all__ = ["AutoPolicy", "predictor_pays", "NO_SPEC", "PolicyReport", "judge_policies", "load_policy",
           "train_and_report", "read_summary", "sequoia_trees"]
