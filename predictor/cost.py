"""Latency cost models built from a device profile (DESIGN §3.1, §3.8, §3.9).

- StepCurve: T(n) for n new tokens, linear interpolation between measured points (monotone
  wherever the measurements are), linear extrapolation past the ends.
- LinearStepModel: SmartSpec's T_fwd = alpha * N_context + gamma * N_batched + delta, fitted by
  least squares, with its error on held-out points.
- swap_seconds / recompute_seconds: AdaptiveLLM's preemption costs.
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


def swap_seconds(kv_bytes: int, d2h_bytes_per_s: float, h2d_bytes_per_s: float) -> float:
    """Swapping a request's KV out and back in: bytes / bandwidth, each way."""
    return kv_bytes / d2h_bytes_per_s + kv_bytes / h2d_bytes_per_s


def recompute_seconds(prefill_curve: StepCurve, chunk: int, length: int) -> float:
    """Re-prefilling `length` tokens in chunks of `chunk` with profiled chunk times."""
    full, rest = divmod(length, chunk)
    return full * prefill_curve(chunk) + (prefill_curve(chunk) if rest else 0.0)
