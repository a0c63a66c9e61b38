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

from yggdrasil.buckets import NO_SPEC, Bucket, Grid
from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.errors import InvalidRequestError
from yggdrasil.runtime.latency import LatencyProfile

from . import depth as depth_mod
from .calibrate import CalibrationRun, drafted_mask
from .calibration_data import aal_table, depth_acceptance, load_run, mean_capped, rank_acceptance
from .confidence import JUDGED_ON, ConfidencePolicy, judged_lines, load_confidence
from .select import Selector, bucket_index, oracle_choices, realised_speedup, record_costs
from .sequoia import best_tree


# the depth predictor ships only if, on prompts it never trained on, its realised objective 3.1
# beats the best constant bucket's by at least this share; otherwise the constant policy ships
# (issue 25: a predictor that merely ties costs its per-iteration work and its estimates' bias)
PREDICTOR_MARGIN = 0.05


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


@dataclass(frozen=True)
class PolicyDecision:
    """Which policy ships and why (recorded in the predictor summary; inspect prints it)."""

    shipped: str  # "predictor" or "constant"
    reason: str
    gain: float | None  # held-out objective of the predictor over the best constant's, minus 1
    margin: float = PREDICTOR_MARGIN

    def as_dict(self) -> dict:
        return {"shipped": self.shipped, "reason": self.reason,
                "gain": None if self.gain is None else round(self.gain, 4), "margin": self.margin}


def decide_policy(useful: bool, predictor_speedup: float | None, constant_speedup: float | None,
                  margin: float = PREDICTOR_MARGIN) -> PolicyDecision:
    """The one rule: keep the predictor only if its held-out log-loss beats the constant tails'
    and its realised held-out objective beats the best constant bucket's by `margin`."""
    if not predictor_speedup or not constant_speedup:
        return PolicyDecision("constant", "no held-out objective recorded for the predictor", None, margin)
    gain = predictor_speedup / constant_speedup - 1.0
    versus = (f"held-out objective {predictor_speedup:.3f} with the predictor vs {constant_speedup:.3f} "
              f"with the best constant bucket ({gain:+.1%}; it must win by {margin:.0%})")
    if not useful:
        return PolicyDecision("constant", "the predictor's held-out log-loss is no better than constant "
                                          f"tails'; {versus}", gain, margin)
    if gain < margin:
        return PolicyDecision("constant", versus, gain, margin)
    return PolicyDecision("predictor", versus, gain, margin)


def run_costs(run: CalibrationRun, latency: LatencyProfile) -> torch.Tensor:
    """[N, D, W, V] seconds per record and bucket; buckets calibration did not draft: infinite."""
    return record_costs(run.grid, latency, run.tree_size, run.accepted.shape[0],
                        drafted_mask(run.grid, run.drafted_depths))


def selector_for(run: CalibrationRun, rows: torch.Tensor, latency: LatencyProfile) -> Selector:
    return Selector(run.grid, latency, run.accepted[rows].double().mean(0), mean_capped(run, rows),
                    run_costs(run, latency)[rows].mean(0))


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


def judge_policies(run: CalibrationRun, model: depth_mod.DepthMLP | None, train_mask: torch.Tensor,
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


@dataclass
class AutoPolicy:
    """Per-iteration bucket choice: the predictor's tails (if it is useful) through the Selector,
    or, when draft confidence ships, its one (D, W) tree with V chosen per tree from the nodes'
    calibrated acceptance (node_acceptance)."""

    selector: Selector
    model: depth_mod.DepthMLP | None
    confidence: ConfidencePolicy | None = None

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
        """The bucket for these tails (the best constant bucket without them); with draft
        confidence, its tree at the widest verify width it may pick."""
        if self.confidence is not None:
            return Bucket(self.confidence.depth, self.confidence.width, max(self.grid.verifies))
        return self.selector.constant()[0] if tail is None else self.selector.for_tail_fast(tail)

    def node_acceptance(self, tree) -> torch.Tensor | None:
        """Calibrated P(accepted) per node of this iteration's tree (None: V is the bucket's)."""
        return None if self.confidence is None else self.confidence.node_acceptance(tree)

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


def predictor_decision(meta: dict) -> PolicyDecision:
    """decide_policy's verdict on the held-out numbers a predictor summary recorded (summaries
    written before the rule existed are judged by it too)."""
    objective = meta.get("objective", {})
    return decide_policy(bool(meta.get("held_out", {}).get("useful")), objective.get("predicted_speedup"),
                         objective.get("constant_speedup"))


def predictor_pays(meta: dict) -> bool:
    """Whether the predictor beat the best constant bucket held out by the margin."""
    return predictor_decision(meta).shipped == "predictor"


def shipped_policy(predictor_summary: dict | None, confidence_report: dict | None) -> str:
    """The one choice of what auto mode runs from a calibration: "predictor", "confidence" or
    "constant". Each adaptive policy must have beaten the best constant bucket held out by its
    margin; when both did, the larger held-out gain ships (a tie goes to draft confidence, which
    reads no hidden states). The bundle, `inspect`, the manifest and `generate --calibration` all
    ask this function, so none can say a policy ships that another does not run."""
    gains = {}
    if confidence_report and confidence_report.get("shipped") == "confidence":
        gains["confidence"] = float(confidence_report.get("gain") or 0.0)
    decision = predictor_decision(predictor_summary) if predictor_summary else None
    if decision is not None and decision.shipped == "predictor":
        gains["predictor"] = float(decision.gain or 0.0)
    return max(gains, key=gains.get) if gains else "constant"


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


def load_policy(directory: Path, calibration: tuple, latency: LatencyProfile | None, dim: int,
                target_sha256: str | None, widths: tuple[int, ...] | None = None) -> tuple[AutoPolicy, str]:
    """The run-time policy from a calibration directory, whose load_run() result the caller has
    already read (and may have restricted to a bundle's compiled widths, given as `widths`);
    latency defaults to the one measured when calibrating. The depth predictor or draft
    confidence rides along only where shipped_policy says it ships. Returns it with a one-line
    description."""
    run, _, calibrated_latency = calibration
    selector = selector_for(run, torch.ones(run.accepted.shape[0], dtype=torch.bool), latency or calibrated_latency)
    model, meta = None, None
    if (Path(directory) / "predictor.yaml").is_file():
        model, meta = depth_mod.load(directory, dim, target_sha256)
    confidence, report = load_confidence(directory, widths)
    choice = shipped_policy(meta, report if confidence is not None else None)
    notes = {"predictor": "depth predictor on",
             "confidence": f"draft confidence choosing V on D{confidence.depth}xW{confidence.width}"
             if confidence is not None else "",
             "constant": f"neither the depth predictor nor draft confidence beat the best constant bucket by "
                         f"{PREDICTOR_MARGIN:.0%} on held-out prompts: using the best constant bucket"}
    return AutoPolicy(selector, model if choice == "predictor" else None,
                      confidence if choice == "confidence" else None), notes[choice]


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
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def read_summary(directory: Path) -> dict:
    return yaml.safe_load((Path(directory) / "predictor.yaml").read_text())


__all__ = ["AutoPolicy", "predictor_pays", "NO_SPEC", "PolicyReport", "PolicyDecision", "PREDICTOR_MARGIN",
           "decide_policy", "describe_policy", "judge_policies", "load_policy", "objective_dict", "predictor_decision",
           "shipped_policy",
           "train_and_report", "read_summary", "sequoia_trees"]
