"""Goodput-based speculation for a batch (SmartSpec, DESIGN §3.8).

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

from ..errors import InvalidRequestError

MODES = ("goodput", "fixed", "off")


@dataclass(frozen=True)
class LinearCost:
    """Forward time T = alpha * context tokens + gamma * rows + delta (seconds)."""

    alpha: float
    gamma: float
    delta: float

    def seconds(self, rows: int, context: int = 0) -> float:
        return self.alpha * context + self.gamma * rows + self.delta

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> "LinearCost":
        """Least squares of time over rows (the profiles hold no context dimension, so alpha=0)."""
        if not points:
            raise ValueError("no points to fit a step cost to")
        if len(points) == 1:
            return cls(0.0, 0.0, float(points[0][1]))
        n = len(points)
        mean_x = sum(p[0] for p in points) / n
        mean_y = sum(p[1] for p in points) / n
        var = sum((p[0] - mean_x) ** 2 for p in points)
        gamma = sum((p[0] - mean_x) * (p[1] - mean_y) for p in points) / var if var else 0.0
        gamma = max(gamma, 0.0)  # timing noise must not make rows free or negative
        return cls(0.0, gamma, max(mean_y - gamma * mean_x, 0.0))


@dataclass(frozen=True)
class StepCostModel:
    """Predicted seconds of one engine step; draft None means drafting costs nothing (lookup)."""

    target: LinearCost
    draft: LinearCost | None = None

    def step_seconds(self, k: int, batch: int, prefill_rows: int = 0, context: int = 0) -> float:
        seconds = self.target.seconds(prefill_rows + batch * (k + 1), context)
        if k > 0 and self.draft is not None:
            seconds += k * self.draft.seconds(batch, context)
        return seconds

    @classmethod
    def from_latency(cls, latency, has_draft_model: bool) -> "StepCostModel":
        """From a bundle's LatencyProfile: its verify curve is T(rows) of the target, its draft
        points the time of one draft step."""
        draft = LinearCost.fit(latency.draft) if has_draft_model else None
        return cls(LinearCost.fit(latency.verify), draft)


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
class SpeculationPolicy:
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

    def choose(self, acceptances: Sequence[float], prefill_rows: int = 0, context: int = 0) -> int:
        if not acceptances or self.mode == "off":
            return 0
        if self.mode == "fixed":
            return self.fixed_k
        return max(range(self.max_k + 1),
                   key=lambda k: (self.goodput(k, acceptances, prefill_rows, context), -k))

    def goodput(self, k: int, acceptances: Sequence[float], prefill_rows: int = 0, context: int = 0) -> float:
        tokens = sum(expected_tokens(a, k) for a in acceptances)
        return tokens / self.cost.step_seconds(k, len(acceptances), prefill_rows, context)
