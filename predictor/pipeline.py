"""From calibration data to what the runtime uses: the trained depth predictor, its held-out
report (objective with predicted depths vs the best constant bucket vs an oracle), Sequoia trees
per verify budget, a plot; and `AutoPolicy`, which picks each iteration's bucket at run time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from yggdrasil.plotting import pyplot, save
from yggdrasil.buckets import NO_SPEC, Bucket, Grid
from yggdrasil.runtime.latency import LatencyProfile

from yggdrasil.policy.depth_model import DepthMLP
from yggdrasil.predictor import depth as depth_mod
from yggdrasil.policy.calibration import CalibrationRun
from yggdrasil.predictor.calibration_data import aal_table, depth_acceptance, rank_acceptance
from yggdrasil.policy.calibration import load_run
from yggdrasil.predictor.confidence import JUDGED_ON, judged_lines
from yggdrasil.policy.select import bucket_index, oracle_choices, realised_speedup
from yggdrasil.predictor.sequoia import best_tree
from yggdrasil.policy.auto import decide_policy, predictor_decision, run_costs, selector_for


@dataclass(frozen=True)
class PolicyReport:
    """Objective 3.1 realised on held-out calibration iterations (plain decoding = 1.0), and the
    tokens per iteration (AAL, bonus included) each policy's estimate promised against what the
    held-out iterations accepted: the estimate is made from the training split."""

    held_out_records: int
    constant_shape: str
    constant_speedup: float  # realised, held out
    predicted_speedup: float  # the predictor policy's, realised, held out
    oracle_speedup: float
    predicted_shapes: dict  # bucket -> times chosen
    constant_speedup_estimate: float = 0.0  # what the objective promised for the constant bucket
    predictor_speedup_estimate: float = 0.0  # and for the predictor's picks
    constant_aal_estimate: float = 0.0
    constant_aal_realised: float = 0.0
    predictor_aal_estimate: float = 0.0
    predictor_aal_realised: float = 0.0
    # per policy ("constant", "predictor") and bucket it picked held out: times picked, AAL and
    # seconds per iteration as estimated from the training split vs realised on the held-out
    # iterations it was picked for (seconds from the profile judged on, eager at calibration or a
    # bundle's graphs (rejudge.py), and each tree's real size)
    buckets: dict = field(default_factory=dict)


def _policy_tokens(accepted: torch.Tensor, chosen: list[tuple[int, int, int] | None]) -> float:
    """Mean tokens per iteration (bonus included) the picks accepted; no-spec commits one."""
    if not chosen:
        return 0.0
    return sum(1.0 + (0.0 if index is None else float(accepted[(i, *index)]))
               for i, index in enumerate(chosen)) / len(chosen)


def bucket_breakdown(accepted: torch.Tensor, costs: torch.Tensor, t1: float,
                     picks: list[tuple[int, int, int] | None], expected: list[float],
                     estimated_cost: list[float], grid: Grid) -> dict:
    """Per bucket picked: how often, AAL (bonus included) and seconds per iteration the estimate
    promised vs what the iterations it was picked for realised (no-spec: one token, one step)."""
    rows: dict[str, list] = {}
    for i, index in enumerate(picks):
        name = str(NO_SPEC if index is None else Bucket(grid.depths[index[0]], grid.widths[index[1]],
                                                        grid.verifies[index[2]]))
        realised = (0.0, t1) if index is None else (float(accepted[(i, *index)]), float(costs[(i, *index)]))
        rows.setdefault(name, []).append((expected[i], realised[0], estimated_cost[i], realised[1]))
    out = {}
    for name, entries in sorted(rows.items(), key=lambda kv: -len(kv[1])):
        n = len(entries)
        mean = [sum(e[k] for e in entries) / n for k in range(4)]
        out[name] = {"picked": n, "aal_estimate": round(1.0 + mean[0], 4), "aal_realised": round(1.0 + mean[1], 4),
                     "seconds_estimate": round(mean[2], 6), "seconds_realised": round(mean[3], 6)}
    return out


def _estimate(expected: list[float], costs: list[float], t1: float) -> tuple[float, float]:
    """(objective 3.1, AAL) a policy's estimates promise: expected tokens over expected seconds."""
    tokens = sum(1.0 + e for e in expected)
    return tokens * t1 / sum(costs), tokens / len(expected)


def judge_policies(run: CalibrationRun, model: DepthMLP | None, train_mask: torch.Tensor,
                   held_mask: torch.Tensor, latency: LatencyProfile) -> PolicyReport:
    """Both policies estimated from the training split and realised on the held-out one."""
    selector = selector_for(run, train_mask, latency)
    accepted = run.accepted[held_mask]
    costs, t1 = run_costs(run, latency)[held_mask], latency.t_verify(1)
    n = accepted.shape[0]
    constant, _ = selector.constant()
    constant_index = bucket_index(run.grid, constant)
    constant_pick = [constant_index] * n
    if constant_index is None:
        constant_expected, constant_cost = [0.0] * n, [t1] * n
    else:
        constant_expected = [float(selector.mean_accepted[constant_index])] * n
        constant_cost = [float(selector.costs[constant_index])] * n
    if model is not None:
        with torch.inference_mode():
            tails = model.tail(run.hidden[held_mask].float())
        shapes, expected, cost = [], [], []
        for tail in tails:
            shape, _ = selector.for_tail(tail)
            index = bucket_index(run.grid, shape)
            shapes.append(shape)
            expected.append(0.0 if index is None else float(selector.expected_for_tail(tail)[index]))
            cost.append(t1 if index is None else float(selector.costs[index]))
    else:
        shapes, expected, cost = [constant] * n, constant_expected, constant_cost
    picks = [bucket_index(run.grid, s) for s in shapes]
    counts: dict[str, int] = {}
    for s in shapes:
        counts[str(s)] = counts.get(str(s), 0) + 1
    constant_estimate = _estimate(constant_expected, constant_cost, t1)
    predictor_estimate = _estimate(expected, cost, t1)
    breakdown = {"constant": bucket_breakdown(accepted, costs, t1, constant_pick, constant_expected,
                                              constant_cost, run.grid),
                 "predictor": bucket_breakdown(accepted, costs, t1, picks, expected, cost, run.grid)}
    return PolicyReport(
        int(n), str(constant),
        realised_speedup(accepted, costs, t1, constant_pick),
        realised_speedup(accepted, costs, t1, picks),
        realised_speedup(accepted, costs, t1, oracle_choices(accepted, costs, t1)),
        dict(sorted(counts.items(), key=lambda kv: -kv[1])),
        constant_estimate[0], predictor_estimate[0],
        constant_estimate[1], _policy_tokens(accepted, constant_pick),
        predictor_estimate[1], _policy_tokens(accepted, picks), breakdown)


def objective_dict(policy: PolicyReport) -> dict:
    """A PolicyReport as the predictor summary records it."""
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(policy).items()}


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

    Raises PredictorError on too little data. A predictor that does not beat the best constant
    bucket on held-out prompts by PREDICTOR_MARGIN is still saved, but the summary's policy says
    the constant ships and why, and the runtime ignores the predictor.
    """
    directory = Path(directory)
    run, meta, latency = load_run(directory)
    depth_mod.check_enough(run.prompt_index)
    train_mask, held_mask = depth_mod.split_by_prompt(run.prompt_index)
    max_depth = run.grid.max_depth
    model = depth_mod.train(run.hidden, run.accepted_max, train_mask, max_depth)
    report = depth_mod.evaluate(model, run.hidden, run.accepted_max, train_mask, held_mask, max_depth)
    policy = judge_policies(run, model, train_mask, held_mask, latency)
    decision = decide_policy(report.useful, policy.predicted_speedup, policy.constant_speedup)
    summary = {
        "target_sha256": meta.get("target_sha256"),
        "held_out": {**{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(report).items()},
                     "useful": report.useful},
        "objective": objective_dict(policy),
        "policy": decision.as_dict(),
        "sequoia": {f"v{k}": v for k, v in sequoia_trees(run, directory).items()},
        **(meta_extra or {}),
    }
    # the runtime uses the predictor trained on all iterations; the report above is held-out
    final = depth_mod.train(run.hidden, run.accepted_max, torch.ones_like(train_mask), max_depth)
    depth_mod.save(final, directory, summary)
    plot_calibration(run, latency, directory / "calibration.png")
    return summary


def describe_policy(summary: dict | None, skipped: str | None = None, runs: str | None = None) -> list[str]:
    """What `yggdrasil inspect` prints about the depth predictor: whether it ships and why, and
    the AAL (tokens per iteration) and objective each policy's estimate promised against what
    held-out calibration prompts realised. runs: shipped_policy's choice (None: this verdict's)."""
    if summary is None:
        return [f"policy     best constant bucket (no depth predictor: {skipped or 'not trained'})"]
    objective = summary.get("objective", {})
    recorded = summary.get("policy")
    decision = predictor_decision(summary).as_dict() if recorded is None else recorded
    if decision["shipped"] == "predictor" and runs not in (None, "predictor"):
        verdict = "depth predictor beat the constant but does not ship (draft confidence gained more held out)"
    else:
        verdict = ("depth predictor" if decision["shipped"] == "predictor" else "best constant bucket") + " ships"
    lines = [f"policy     {verdict}: {decision['reason']}", *judged_lines(summary.get(JUDGED_ON),
                                                                   summary.get("policy_eager"))]
    held = objective.get("held_out_records", "?")
    for name, key, label in (("constant", "constant", f"constant {objective.get('constant_shape', '?')}"),
                             ("predictor", "predictor", "predictor")):
        aal_estimate, aal_realised = objective.get(f"{key}_aal_estimate"), objective.get(f"{key}_aal_realised")
        speed_key = "constant_speedup" if key == "constant" else "predicted_speedup"
        estimate = objective.get(f"{key}_speedup_estimate")
        if aal_estimate is None:
            lines.append(f"{'':<10} {label}: held-out objective {objective.get(speed_key, '?')} "
                         "(predicted vs realised AAL not recorded: calibrated by an older yggdrasil)")
            continue
        lines.append(f"{'':<10} {label}: AAL predicted {aal_estimate:.3f}, realised {aal_realised:.3f}; "
                     f"objective predicted {estimate:.3f}, realised {objective.get(speed_key, 0.0):.3f} "
                     f"({held} held-out iterations)")
    return lines


def plot_calibration(run: CalibrationRun, latency: LatencyProfile, path: Path) -> Path:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    depths = list(range(1, run.grid.max_depth + 1))
    left.plot(depths, depth_acceptance(run), marker="o", label="P(depth d accepted | d-1 was)")
    hist = torch.bincount(run.accepted_max.clamp(max=run.grid.max_depth), minlength=run.grid.max_depth + 1)
    left.bar(range(run.grid.max_depth + 1), (hist / hist.sum()).tolist(), alpha=0.3,
             label="share of iterations accepting k")
    left.set_xlabel("depth d / accepted tokens k")
    left.set_title(f"best of the builds, {run.accepted_max.numel()} iterations", fontsize=9)
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
    return save(fig, path)


def read_summary(directory: Path) -> dict:
    return yaml.safe_load((Path(directory) / "predictor.yaml").read_text())


__all__ = ["PolicyReport", "describe_policy", "judge_policies", "objective_dict", "train_and_report",
           "read_summary", "sequoia_trees"]
