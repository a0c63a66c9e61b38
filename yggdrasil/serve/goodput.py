"""Goodput-based speculation for a batch (SmartSpec, docs/design.md §3.8).

Each engine step picks one speculation length k for every decoding request in it (0 = plain
decoding). With a per-request acceptance rate a, k proposals yield l(a, k) = (1 - a^(k+1)) / (1 - a)
tokens in expectation (the bonus token included), and the step costs the target forward over
every request's k + 1 rows plus the prefill chunk riding along, plus k draft forwards. The chosen
k maximises goodput = sum of l(a_i, k) / step time. At batch 1 this is the single-user objective
for a chain; as the batch grows the verify rows cost more, speculation shrinks and switches off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from yggdrasil.errors import InvalidRequestError
from yggdrasil.policy.costs import LinearStepModel, StepCurve

MODES = ("goodput", "fixed", "off")


@dataclass(frozen=True)
class StepCostModel:
    """Predicted seconds of one engine step; draft None means drafting costs nothing (lookup)."""

    # a line (fitted, e.g. synthetic or from the bundle's profile) or a measured curve over rows
    target: LinearStepModel | StepCurve
    draft: LinearStepModel | StepCurve | None = None

    def step_seconds(self, k: int, batch: int, prefill_rows: int = 0, context: int = 0) -> float:
        seconds = _forward_seconds(self.target, prefill_rows + batch * (k + 1), context)
        if k > 0 and self.draft is not None:
            seconds += k * _forward_seconds(self.draft, batch, context)
        return seconds

    @classmethod
    def from_latency(cls, latency, has_draft_model: bool) -> "StepCostModel":
        """From a bundle's LatencyProfile: its verify curve is T(rows) of the target, its draft
        points the time of one draft step."""
        draft = LinearStepModel.fit_rows(latency.draft) if has_draft_model else None
        return cls(LinearStepModel.fit_rows(latency.verify), draft)


def _forward_seconds(cost: LinearStepModel | StepCurve, rows: int, context: int) -> float:
    return cost(rows) if isinstance(cost, StepCurve) else cost.seconds(rows, context)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify of k chained proposals yields on average, the bonus token included."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


class AcceptanceRate:
    """A request's moving acceptance rate per proposed token: each verify adds its accepted
    proposals as successes and the first rejected one (if any) as a failure; old evidence decays
    so the rate follows the text (code vs prose)."""

    def __init__(self, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.9) -> None:
        self.successes = prior * prior_weight
        self.trials = prior_weight
        self.decay = decay

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < proposed else 0)

    @property
    def value(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0


@dataclass(frozen=True)
class SpeculationLength:
    """How the engine picks k: 'goodput' (per step, above), 'fixed' (always fixed_k) or 'off'."""

    mode: str
    max_k: int
    cost: StepCostModel | None = None
    fixed_k: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidRequestError(f"speculation mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_k < 0 or not 0 <= self.fixed_k <= max(self.max_k, 0):
            raise InvalidRequestError(f"speculation length must be within 0..{self.max_k}, got {self.fixed_k}")
        if self.mode == "goodput" and self.cost is None:
            raise InvalidRequestError("goodput speculation needs a step cost model (the bundle's profile)")

    def choose(self, acceptances: Sequence[float], prefill_rows: int = 0, context: int = 0,
               correction: "Correction | None" = None) -> int:
        if not acceptances or self.mode == "off":
            return 0
        if self.mode == "fixed":
            return self.fixed_k
        return max(range(self.max_k + 1),
                   key=lambda k: (self.goodput(k, acceptances, prefill_rows, context, correction), -k))

    def goodput(self, k: int, acceptances: Sequence[float], prefill_rows: int = 0, context: int = 0,
                correction: "Correction | None" = None) -> float:
        tokens = sum(expected_tokens(a, k) for a in acceptances)
        seconds = self.cost.step_seconds(k, len(acceptances), prefill_rows, context)
        if correction is not None:
            tokens, seconds = tokens * correction.tokens[k], seconds * correction.seconds[k]
        return tokens / seconds


class Correction:
    """What the model above missed, learnt from the steps the engine takes, per k: the EMA of
    measured / predicted step seconds (host work per request, the draft's real cost) and of
    committed / expected tokens (prompt lookup finds chains shorter than k, and its hits come in
    runs, not independently). Both start at 1, so a k not yet tried is judged by the model alone
    and tried if it looks best; once tried, its correction decides."""

    def __init__(self, max_k: int, decay: float = 0.8) -> None:
        self.seconds = [1.0] * (max_k + 1)
        self.tokens = [1.0] * (max_k + 1)
        self.steps = [0] * (max_k + 1)
        self.decay = decay

    def observe(self, k: int, predicted_seconds: float, seconds: float, expected: float, tokens: int) -> None:
        if predicted_seconds <= 0 or expected <= 0:
            return
        self.seconds[k] = ema_ratio(self.seconds[k], self.steps[k], seconds, predicted_seconds, self.decay)
        self.tokens[k] = ema_ratio(self.tokens[k], self.steps[k], tokens, expected, self.decay)
        self.steps[k] += 1


def ema_ratio(current: float, observations: int, measured: float, modelled: float, decay: float) -> float:
    """A running measured / modelled ratio that starts at 1: the first observation replaces it,
    later ones move it by (1 - decay)."""
    keep = decay if observations else 0.0
    return keep * current + (1 - keep) * measured / modelled
