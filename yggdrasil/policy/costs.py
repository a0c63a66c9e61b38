"""Latency cost models built from a device profile (docs/design.md §3.1, §3.8, §3.9).

- StepCurve: T(n) for n new tokens, linear interpolation between measured points (monotone
  wherever the measurements are), linear extrapolation past the ends.
- LinearStepModel: SmartSpec's T_fwd = alpha * N_context + gamma * N_batched + delta, fitted by
  least squares: with its error on held-out points (profiles), over rows alone (the serve
  engine's step costs), or with non-negative coefficients (the serve engine's prefill chunks).
- PreemptionCosts: AdaptiveLLM's preemption costs, swap (a line over bytes) and recompute (the
  prefill line summed over chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class StepCurve:
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError("a step curve needs one time per size, and at least one point")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"step curve sizes must be strictly increasing, got {self.sizes}")

    def __call__(self, n: float) -> float:
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1:
            return ys[0]
        if n <= xs[0]:
            i = 0
        elif n >= xs[-1]:
            i = len(xs) - 2
        else:
            i = int(np.searchsorted(xs, n)) - 1
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return float(y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def leave_one_out(curve: "StepCurve") -> "FitReport":
    """Interpolation error at each interior point, predicted from its neighbours without it."""
    errors = []
    for i in range(1, len(curve.sizes) - 1):
        rest = StepCurve(curve.sizes[:i] + curve.sizes[i + 1:], curve.seconds[:i] + curve.seconds[i + 1:])
        errors.append(abs(rest(curve.sizes[i]) - curve.seconds[i]) / max(curve.seconds[i], 1e-12) * 100)
    if not errors:
        return FitReport(float("nan"), float("nan"), 0)
    return FitReport(float(np.mean(errors)), float(np.max(errors)), len(errors))


@dataclass(frozen=True)
class FitReport:
    mean_abs_pct_error: float  # on the held-out points
    max_abs_pct_error: float
    held_out: int


@dataclass(frozen=True)
class LinearStepModel:
    """T_fwd(N_context, N_batched) = alpha * N_context + gamma * N_batched + delta (seconds)."""

    alpha: float
    gamma: float
    delta: float

    def __call__(self, n_context: float, n_batched: float) -> float:
        return self.alpha * n_context + self.gamma * n_batched + self.delta

    def seconds(self, rows: float, context: float = 0) -> float:
        return self(context, rows)

    @classmethod
    def fit_rows(cls, points: Sequence[tuple[float, float]]) -> "LinearStepModel":
        """Least squares of (rows, seconds) with no context term (alpha = 0); noise never makes
        a row free or the intercept negative."""
        if not points:
            raise ValueError("no points to fit a step cost to")
        if len(points) == 1:
            return cls(0.0, 0.0, float(points[0][1]))
        rows, seconds = (np.asarray(v, dtype=np.float64) for v in zip(*points))
        var = float(((rows - rows.mean()) ** 2).sum())
        gamma = float(((rows - rows.mean()) * (seconds - seconds.mean())).sum()) / var if var else 0.0
        gamma = max(gamma, 0.0)
        return cls(0.0, gamma, max(float(seconds.mean()) - gamma * float(rows.mean()), 0.0))

    @classmethod
    def fit_nonnegative(cls, points: Sequence[tuple[float, float, float]]) -> "LinearStepModel":
        """Least squares of (rows, context, seconds), coefficients clipped at 0."""
        design = np.asarray([[rows, context, 1.0] for rows, context, _ in points], dtype=np.float64)
        seconds = np.asarray([s for _, _, s in points], dtype=np.float64)
        gamma, alpha, delta = np.linalg.lstsq(design, seconds, rcond=None)[0]
        return cls(max(float(alpha), 0.0), max(float(gamma), 0.0), max(float(delta), 0.0))

    @classmethod
    def fit(cls, context: Sequence[float], batched: Sequence[float], seconds: Sequence[float],
            held_out_every: int = 4) -> tuple["LinearStepModel", FitReport]:
        """Least squares on all points but every `held_out_every`-th, which measure the error."""
        ctx, bat, sec = (np.asarray(v, dtype=np.float64) for v in (context, batched, seconds))
        if not len(ctx) == len(bat) == len(sec) or len(sec) < 4:
            raise ValueError("fitting the step-time model needs at least 4 measured points")
        test = np.zeros(len(sec), dtype=bool)
        test[held_out_every - 1::held_out_every] = True
        train = ~test if test.any() and (~test).sum() >= 3 else np.ones(len(sec), dtype=bool)
        design = np.stack([ctx, bat, np.ones_like(ctx)], axis=1)
        coef, *_ = np.linalg.lstsq(design[train], sec[train], rcond=None)
        model = cls(*(float(c) for c in coef))
        check = test if test.any() else train
        pred = design[check] @ coef
        err = np.abs(pred - sec[check]) / np.maximum(np.abs(sec[check]), 1e-12) * 100
        return model, FitReport(float(err.mean()), float(err.max()), int(check.sum()))


@dataclass(frozen=True)
class PreemptionCosts:
    """Predicted seconds of preempting a request and resuming it (AdaptiveLLM)."""

    swap: LinearStepModel  # over bytes (as rows): copying a request's blocks out and back
    # one prefill chunk, target and draft: gamma * rows + alpha * span + delta, where the span is
    # the cache slots the attention reads
    prefill: LinearStepModel

    def swap_seconds(self, n_bytes: int) -> float:
        return self.swap.seconds(n_bytes)

    def recompute_seconds(self, tokens: int, chunk_size: int, span_floor: int = 0) -> float:
        """Prefilling tokens again in chunks; each chunk's span is at least span_floor (where
        the other requests' blocks reach, since a resumed request's blocks land among them)."""
        total = 0.0
        for start in range(0, tokens, chunk_size):
            rows = min(chunk_size, tokens - start)
            total += self.prefill.seconds(rows, max(start + rows, span_floor))
        return total
