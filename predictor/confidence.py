"""Draft confidence chooses how much of the drafted tree to verify (issue 25, item 2; EAGLE-2's
confidence-based expansion, applied to the verify width).

After drafting and before verifying, each drafted node's path log-probability under the draft is
known. Calibration data records it per node with whether the node lay on the target's greedy
path (predictor/calibrate.py node arrays), so compile can fit a map from (depth, path
log-probability) to P(node accepted). At run time the policy drafts one fixed (D, W) tree, ranks
its nodes by path probability as the runtime's pruning does (TokenTree.top_nodes), and keeps the
top V of the grid's verify widths that minimise the expected time per token

    (D · T_draft(W) + T_verify(V)) / (1 + Σ calibrated P(accepted) of the V - 1 kept non-root nodes).

The kept nodes are a connected subtree holding the root (a child's path probability never
exceeds its parent's), so the accepted tokens are the target path's nodes among them and
verifying them is exactly as lossless as any pruning the runtime already does.

judge_confidence evaluates the policy on a held-out split by prompt against the best constant
(D, W, V) bucket, from the recorded hindsight (realised accepted tokens and step times from the
latency profile, as pipeline.judge_policies does for the depth predictor), and decides which one
ships: the confidence policy only if it wins held out by CONFIDENCE_MARGIN.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from yggdrasil.buckets import Bucket, Grid
from yggdrasil.runtime.latency import LatencyProfile

from yggdrasil.policy.calibration import CalibrationRun, drafted_mask
from yggdrasil.policy.calibration import load_run, mean_capped
from yggdrasil.predictor.depth import check_enough, split_by_prompt
from yggdrasil.policy.files import PredictorError, atomic_write
from yggdrasil.policy.select import Selector, cheapest_verify, record_costs
from yggdrasil.policy.confidence import RANKS, SCHEMA, AcceptanceMap, level_ranks, rank_class

# the confidence policy ships only if it beats the best constant bucket held out by this share
# (issue 25's target for any adaptive policy that is kept: a >= 5 % TPOT gain)
CONFIDENCE_MARGIN = 0.05
MIN_NODES = 40  # nodes a (depth, rank) group needs for a map of its own (else its depth's, or deeper, pooled)
PRIOR = 2.0  # pseudo-nodes at the group's mean acceptance added to each isotonic block


def isotonic(x: torch.Tensor, y: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(block lower bounds, block means) of the non-decreasing least-squares fit of y on x
    (pool adjacent violators), each mean shrunk by PRIOR pseudo-points at y's mean."""
    order = torch.argsort(x.double(), stable=True)
    xs, ys = x.double()[order].tolist(), y.double()[order].tolist()
    mean = sum(ys) / len(ys)
    blocks: list[list[float]] = []  # [lower x, sum y, count]
    for xi, yi in zip(xs, ys):
        if blocks and blocks[-1][0] == xi:  # equal x: one block (a step function of x)
            blocks[-1][1] += yi
            blocks[-1][2] += 1
        else:
            blocks.append([xi, yi, 1.0])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] >= blocks[-1][1] / blocks[-1][2]:
            top = blocks.pop()
            blocks[-1][1] += top[1]
            blocks[-1][2] += top[2]
    values, running = [], 0.0
    for _, total, count in blocks:  # shrinking can break the order slightly: keep it non-decreasing
        running = max(running, (total + PRIOR * mean) / (count + PRIOR))
        values.append(running)
    return tuple(b[0] for b in blocks), tuple(values)


def fit_acceptance_map(depth: torch.Tensor, rank: torch.Tensor, logp: torch.Tensor, accepted: torch.Tensor,
                       max_depth: int) -> AcceptanceMap:
    """Fit on drafted nodes (depth >= 1), per depth and rank class; a group with fewer than
    MIN_NODES nodes uses its depth's nodes of every rank, and a depth with fewer uses every node
    at least that deep. Depths past the deepest drafted node are left out."""
    deepest = min(max_depth, int(depth.max())) if depth.numel() else 0
    if deepest < 1:
        raise PredictorError("calibration recorded no drafted nodes to fit the draft confidence on")
    classes, lower, value = rank_class(rank), [], []
    for d in range(1, deepest + 1):
        for r in range(RANKS):
            for at in (depth == d) & (classes == r), depth == d, depth >= d:
                if int(at.sum()) >= MIN_NODES:
                    break
            bounds, means = isotonic(logp[at], accepted[at].double())
            lower.append(bounds)
            value.append(means)
    return AcceptanceMap(tuple(lower), tuple(value))


JUDGED_ON = "judged_on"  # a verdict's record of whose step times judged it (predictor/rejudge.py)


def judged_lines(judged_on: str | None, eager: dict | None) -> list[str]:
    """inspect's note that a verdict was judged again on a bundle's graphs (predictor/rejudge.py),
    with what the calibration's eager step times had said."""
    if not judged_on:
        return []
    eager = eager or {}
    gain, won = eager.get("gain"), eager.get("shipped") in ("predictor", "confidence")
    said = ("was not judged" if gain is None else
            f"gained {gain:+.1%} ({'enough to ship' if won else 'not enough to ship'})")
    return [(f"{'':<10} judged on {judged_on} over the compiled buckets; on the calibration's eager step "
             f"times it {said}")]


def describe_confidence(report: dict | None, runs: str | None = None) -> list[str]:
    """What `yggdrasil inspect` prints about draft confidence choosing V. runs: the pipeline's
    shipped_policy choice (None: this verdict's own)."""
    if report is None:
        return [f"{'confidence':<10} draft confidence choosing V not judged (too few calibration prompts to hold "
                "some out, or a calibration without per-node draft confidence)"]
    won = report.get("shipped") == "confidence"
    verb = ("ships" if won and runs in (None, "confidence") else
            "beat the constant but does not ship (the depth predictor gained more held out)" if won else
            "not shipped")
    held = report.get("confidence", {})
    return [f"{'confidence':<10} draft confidence choosing V on {report.get('confidence_shape', '?')} {verb}: "
            f"{report.get('reason', '?')}", *judged_lines(report.get(JUDGED_ON), report.get("eager")),
            f"{'':<10} its AAL predicted {held.get('aal_estimate', float('nan')):.3f}, realised "
            f"{held.get('aal_realised', float('nan')):.3f} ({report.get('held_out_records', '?')} held-out "
            "iterations)"]


@dataclass(frozen=True)
class TreeView:
    """One (D, W) tree per record from the node arrays, its nodes ranked as top_nodes keeps them."""

    score: torch.Tensor  # [N, M] rank score, descending; -inf past the tree
    depth: torch.Tensor  # [N, M] node depth (root 0; -1 past the tree)
    on_path: torch.Tensor  # [N, M] bool
    size: torch.Tensor  # [N] nodes in the tree, root included
    rank: torch.Tensor  # [N, M] rank among the tree's nodes at the same depth (0: most probable)


def tree_view(run: CalibrationRun, depth: int, width: int, rows: torch.Tensor | None = None) -> TreeView:
    """The depth-`depth` part of each record's width-`width` build (the first D Equal-Growth
    steps, or a lookup trie's nodes at depth <= D: calibration's node_step), nodes sorted by rank
    score."""
    if run.node_score is None:
        raise PredictorError("this calibration has no per-node draft confidence (calibrated by an older "
                             "yggdrasil); re-run calibration to judge the confidence policy")
    j = run.grid.widths.index(width)
    score, node_depth, on_path = run.node_score[:, j], run.node_depth[:, j].long(), run.node_on_path[:, j]
    step = run.node_step[:, j].long()
    if rows is not None:
        score, node_depth, on_path, step = score[rows], node_depth[rows], on_path[rows], step[rows]
    inside = (step >= 0) & (step <= depth)
    score = score.masked_fill(~inside, float("-inf"))
    order = score.argsort(dim=1, descending=True, stable=True)
    sorted_depth = node_depth.masked_fill(~inside, -1).gather(1, order)
    return TreeView(score.gather(1, order), sorted_depth, (on_path & inside).gather(1, order), inside.sum(1),
                    level_ranks(sorted_depth))


def accepted_at(view: TreeView, keep: torch.Tensor) -> torch.Tensor:
    """[N] tokens accepted when each record verifies its top keep[i] nodes (root included)."""
    positions = torch.arange(view.score.shape[1])[None, :]
    return (view.on_path & (positions < keep[:, None])).sum(1)


def expected_tokens(view: TreeView, probabilities: torch.Tensor, verifies: tuple[int, ...]) -> torch.Tensor:
    """[N, len(verifies)] 1 + Σ acceptance probabilities of the kept non-root nodes per V."""
    p = probabilities.masked_fill(view.depth <= 0, 0.0)
    cumulative = torch.cat([torch.zeros(p.shape[0], 1, dtype=torch.float64), p.cumsum(1)], 1)
    keep = kept_nodes(view, verifies)
    return 1.0 + cumulative.gather(1, keep)


def kept_nodes(view: TreeView, verifies: tuple[int, ...]) -> torch.Tensor:
    """[N, len(verifies)] nodes each verify width keeps: min(V, tree size)."""
    return torch.minimum(view.size[:, None], torch.tensor(verifies)[None, :])


def choose_verify(expected: torch.Tensor, seconds: torch.Tensor) -> torch.Tensor:
    """[N] index of the verify width with the least expected seconds per token (first of equals)."""
    return (seconds / expected).argmin(1)


def _seconds(view: TreeView, grid: Grid, latency: LatencyProfile, depth: int, width: int) -> torch.Tensor:
    """[N, len(verifies)] seconds per record and verify width: D draft steps plus the cheapest
    verify holding the kept nodes (as select.record_costs charges)."""
    cheapest = torch.tensor([t for _, t in cheapest_verify(grid, latency)], dtype=torch.float64)
    return depth * latency.t_draft(width) + cheapest[kept_nodes(view, grid.verifies)]


@dataclass(frozen=True)
class PolicyOutcome:
    """One policy on a set of records: realised objective 3.1 (plain decoding = 1), AAL it
    promised vs realised, and how often it picked each verify width."""

    speedup: float
    aal_estimate: float
    aal_realised: float
    verify_counts: dict


def _outcome(view: TreeView, keep_index: torch.Tensor, expected: torch.Tensor, seconds: torch.Tensor,
             verifies: tuple[int, ...], t1: float) -> PolicyOutcome:
    keep = kept_nodes(view, verifies).gather(1, keep_index[:, None])[:, 0]
    tokens = 1.0 + accepted_at(view, keep).double()
    spent = seconds.gather(1, keep_index[:, None])[:, 0]
    counts: dict[str, int] = {}
    for k in keep_index.tolist():
        counts[f"V{verifies[k]}"] = counts.get(f"V{verifies[k]}", 0) + 1
    return PolicyOutcome(float(tokens.sum() * t1 / spent.sum()),
                         float(expected.gather(1, keep_index[:, None]).mean()), float(tokens.mean()),
                         dict(sorted(counts.items(), key=lambda kv: -kv[1])))


def confidence_outcome(run: CalibrationRun, latency: LatencyProfile, depth: int, width: int,
                       rows: torch.Tensor, acceptance: AcceptanceMap | None) -> PolicyOutcome:
    """The confidence policy drafting (depth, width) on `rows`; acceptance None: the raw draft
    path probabilities (uncalibrated, as choose_verify_width in the runtime uses them)."""
    view = tree_view(run, depth, width, rows)
    p = (view.score.exp() if acceptance is None else
         acceptance.probabilities(view.depth.clamp(min=1), view.rank, view.score))
    p = p.masked_fill(~torch.isfinite(view.score) | (view.depth <= 0), 0.0)
    expected = expected_tokens(view, p, run.grid.verifies)
    seconds = _seconds(view, run.grid, latency, depth, width)
    return _outcome(view, choose_verify(expected, seconds), expected, seconds, run.grid.verifies,
                    latency.t_verify(1))


def oracle_outcome(run: CalibrationRun, latency: LatencyProfile, depth: int, width: int,
                   rows: torch.Tensor) -> PolicyOutcome:
    """The best verify width per record in hindsight for this (D, W): what any V choice can reach."""
    view = tree_view(run, depth, width, rows)
    keep = kept_nodes(view, run.grid.verifies)
    realised = 1.0 + torch.stack([accepted_at(view, keep[:, k]) for k in range(keep.shape[1])], 1).double()
    seconds = _seconds(view, run.grid, latency, depth, width)
    return _outcome(view, choose_verify(realised, seconds), realised, seconds, run.grid.verifies,
                    latency.t_verify(1))


def constant_outcome(run: CalibrationRun, latency: LatencyProfile, bucket: Bucket, rows: torch.Tensor,
                     estimate: float) -> PolicyOutcome:
    """A constant bucket on `rows` (estimate: the expected accepted tokens it was chosen with)."""
    if bucket.depth == 0:
        return PolicyOutcome(1.0, 1.0, 1.0, {"no-spec": int(rows.sum())})
    view = tree_view(run, bucket.depth, bucket.width, rows)
    seconds = _seconds(view, run.grid, latency, bucket.depth, bucket.width)
    k = run.grid.verifies.index(bucket.verify)
    index = torch.full((view.size.numel(),), k)
    return _outcome(view, index, torch.full_like(seconds, 1.0 + estimate), seconds, run.grid.verifies,
                    latency.t_verify(1))


def best_constant(run: CalibrationRun, latency: LatencyProfile, rows: torch.Tensor) -> tuple[Bucket, float]:
    """The best constant (D, W, V) on `rows` (as pipeline.selector_for picks it) and its mean
    accepted tokens there."""
    costs = record_costs(run.grid, latency, run.tree_size, run.accepted.shape[0],
                         drafted_mask(run.grid, run.drafted_depths))[rows].mean(0)
    selector = Selector(run.grid, latency, run.accepted[rows].double().mean(0), mean_capped(run, rows), costs)
    bucket, _ = selector.constant()
    if bucket.depth == 0:
        return bucket, 0.0
    index = (run.grid.depths.index(bucket.depth), run.grid.widths.index(bucket.width),
             run.grid.verifies.index(bucket.verify))
    return bucket, float(selector.mean_accepted[index])


def drafted_shapes(run: CalibrationRun) -> list[tuple[int, int]]:
    """(D, W) trees calibration drafted (V is the confidence policy's to choose)."""
    drafted = drafted_mask(run.grid, run.drafted_depths)
    return [(d, w) for i, d in enumerate(run.grid.depths) for j, w in enumerate(run.grid.widths) if drafted[i, j]]


def fit_map(run: CalibrationRun, depth: int, width: int, rows: torch.Tensor) -> AcceptanceMap:
    """The acceptance map of the (depth, width) trees' drafted nodes on `rows` (ranks are
    within those trees, as the runtime sees them)."""
    view = tree_view(run, depth, width, rows)
    drafted = view.depth >= 1
    return fit_acceptance_map(view.depth[drafted], view.rank[drafted], view.score[drafted],
                              view.on_path[drafted], depth)


def best_confidence_shape(run: CalibrationRun, latency: LatencyProfile,
                          rows: torch.Tensor) -> tuple[tuple[int, int], AcceptanceMap, float]:
    """The drafted (D, W) whose confidence policy realises the best objective on `rows`, with
    its map fitted there and that objective."""
    scored = []
    for d, w in drafted_shapes(run):
        acceptance = fit_map(run, d, w, rows)
        scored.append((confidence_outcome(run, latency, d, w, rows, acceptance).speedup, (d, w), acceptance))
    speedup, shape, acceptance = max(scored, key=lambda x: x[0])
    return shape, acceptance, speedup


@dataclass(frozen=True)
class ConfidenceReport:
    """The confidence policy against the best constant bucket, both chosen on the training split
    and realised on the held-out one; `raw` uses uncalibrated draft probabilities, `oracle` the
    best V per record in hindsight for the confidence policy's (D, W)."""

    held_out_records: int
    constant_shape: str
    confidence_shape: str  # D x W drafted; V chosen per iteration
    constant: PolicyOutcome
    confidence: PolicyOutcome
    raw: PolicyOutcome
    oracle: PolicyOutcome
    node_log_loss: float  # held-out per-node log-loss of the map ...
    node_constant_log_loss: float  # ... and of one acceptance rate per depth
    shipped: str  # "confidence" or "constant"
    reason: str
    gain: float

    def as_dict(self) -> dict:
        body = asdict(self)
        for key in ("constant", "confidence", "raw", "oracle"):
            body[key] = {k: round(v, 4) if isinstance(v, float) else v for k, v in body[key].items()}
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in body.items()}


def _log_loss(p: torch.Tensor, y: torch.Tensor) -> float:
    p = p.clamp(1e-6, 1 - 1e-6)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def node_log_losses(run: CalibrationRun, shape: tuple[int, int], acceptance: AcceptanceMap, train: torch.Tensor,
                    held: torch.Tensor) -> tuple[float, float]:
    """Held-out per-node log-loss of the map and of the training split's acceptance rate per
    depth, over the (D, W) trees' drafted nodes."""
    view = tree_view(run, *shape, held)
    drafted = view.depth >= 1
    depth, y = view.depth[drafted], view.on_path[drafted].double()
    fitted = acceptance.probabilities(depth, view.rank[drafted], view.score[drafted])
    base = tree_view(run, *shape, train)
    base_depth, base_y = base.depth[base.depth >= 1], base.on_path[base.depth >= 1].double()
    overall = float(base_y.mean()) if base_y.numel() else 0.5
    rate = torch.tensor([float(base_y[base_depth == d].mean()) if bool((base_depth == d).any()) else overall
                         for d in range(run.grid.max_depth + 1)], dtype=torch.float64)
    return _log_loss(fitted, y), _log_loss(rate[depth], y)


def judge_confidence(run: CalibrationRun, latency: LatencyProfile, train: torch.Tensor, held: torch.Tensor,
                     margin: float = CONFIDENCE_MARGIN) -> ConfidenceReport:
    """Fit and choose on `train`, realise on `held`, and decide which policy ships."""
    constant_bucket, constant_estimate = best_constant(run, latency, train)
    (depth, width), acceptance, _ = best_confidence_shape(run, latency, train)
    constant = constant_outcome(run, latency, constant_bucket, held, constant_estimate)
    confidence = confidence_outcome(run, latency, depth, width, held, acceptance)
    raw = confidence_outcome(run, latency, depth, width, held, None)
    oracle = oracle_outcome(run, latency, depth, width, held)
    loss, constant_loss = node_log_losses(run, (depth, width), acceptance, train, held)
    gain = confidence.speedup / constant.speedup - 1.0
    versus = (f"held-out objective {confidence.speedup:.3f} with draft confidence choosing V on D{depth}xW{width} "
              f"vs {constant.speedup:.3f} with the best constant bucket {constant_bucket} ({gain:+.1%}; "
              f"it must win by {margin:.0%})")
    shipped = "confidence" if gain >= margin and math.isfinite(gain) else "constant"
    return ConfidenceReport(int(held.sum()), str(constant_bucket), f"D{depth}xW{width}", constant, confidence,
                            raw, oracle, loss, constant_loss, shipped, versus, gain)


def record_confidence(directory: Path, latency: LatencyProfile | None = None) -> dict:
    """Judge the confidence policy on a saved calibration directory and write confidence.yaml
    next to it (confidence_body). latency defaults to the calibration's."""
    directory = Path(directory)
    run, _, calibrated = load_run(directory)
    return write_confidence(directory, confidence_body(run, latency or calibrated))


def confidence_body(run: CalibrationRun, latency: LatencyProfile) -> dict:
    """confidence.yaml's body for this run and these step times: the held-out report and
    verdict, and the (D, W) and acceptance map fitted on every iteration (what a runtime policy
    would use). Raises PredictorError without per-node arrays or with too little data to hold
    prompts out."""
    check_enough(run.prompt_index)
    train, held = split_by_prompt(run.prompt_index)
    report = judge_confidence(run, latency, train, held)
    everything = torch.ones_like(train)
    (depth, width), acceptance, _ = best_confidence_shape(run, latency, everything)
    return {"schema": SCHEMA, "report": report.as_dict(),
            "policy": {"depth": depth, "width": width, "verifies": list(run.grid.verifies),
                       "acceptance": acceptance.as_dict()}}


def write_confidence(directory: Path, body: dict) -> dict:
    atomic_write(Path(directory) / "confidence.yaml", lambda p: p.write_text(yaml.safe_dump(body, sort_keys=False)))
    return body
