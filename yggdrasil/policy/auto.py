"""The bucket policy a bundle runs (`AutoPolicy`, a runtime.policy.BucketPolicy) built from a
calibration directory: the best constant bucket, or the depth predictor or draft confidence where
calibration judged on held-out prompts that it ships (shipped_policy, the one rule)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from yggdrasil.buckets import Bucket, Grid
from yggdrasil.errors import InvalidRequestError
from yggdrasil.policy.calibration import CalibrationRun, drafted_mask, load_run, mean_capped, restrict
from yggdrasil.policy.confidence import DraftConfidence, load_confidence
from yggdrasil.policy.depth_model import DepthMLP
from yggdrasil.policy.depth_model import load as load_depth_model
from yggdrasil.policy.select import Selector, record_costs
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.runtime.assembly import grid_drafter


# the depth predictor ships only if, on prompts it never trained on, its realised objective 3.1
# beats the best constant bucket's by at least this share; otherwise the constant policy ships
# (issue 25: a predictor that merely ties costs its per-iteration work and its estimates' bias)
PREDICTOR_MARGIN = 0.05


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


@dataclass
class AutoPolicy:
    """Per-iteration bucket choice: the predictor's tails (if it is useful) through the Selector,
    or, when draft confidence ships, its one (D, W) tree with V chosen per tree from the nodes'
    calibrated acceptance (node_acceptance)."""

    selector: Selector
    model: DepthMLP | None
    confidence: DraftConfidence | None = None

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

    @property
    def profile(self) -> LatencyProfile:
        return self.selector.profile

    def drafter(self, draft_runner=None):
        """A drafter that can build every bucket of the grid: EGT with the draft model's runner,
        or prompt lookup without one."""
        return grid_drafter(self.grid, draft_runner)


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
        model, meta = load_depth_model(directory, dim, target_sha256)
    confidence, report = load_confidence(directory, widths)
    choice = shipped_policy(meta, report if confidence is not None else None)
    notes = {"predictor": "depth predictor on",
             "confidence": f"draft confidence choosing V on D{confidence.depth}xW{confidence.width}"
             if confidence is not None else "",
             "constant": f"neither the depth predictor nor draft confidence beat the best constant bucket by "
                         f"{PREDICTOR_MARGIN:.0%} on held-out prompts: using the best constant bucket"}
    return AutoPolicy(selector, model if choice == "predictor" else None,
                      confidence if choice == "confidence" else None), notes[choice]


def policy_from_calibration(directory: Path, widths: tuple[int, ...] | None, verifies: tuple[int, ...] | None,
                            latency, dim: int, target_sha256: str | None):
    """The AutoPolicy over the compiled buckets: calibration statistics restricted to the kept
    widths (None: the whole calibrated grid), the given step times (default: the
    calibration's), and the depth predictor or draft confidence where shipped_policy ships it."""

    run, meta, calibrated = load_run(directory)
    if widths:
        run = restrict(run, widths, verifies)
    return load_policy(directory, (run, meta, calibrated), latency, dim, target_sha256, widths or None)[0]
