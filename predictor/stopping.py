"""When calibration has seen enough (issues 37, 50): stop once more prompts cannot change what
the objective decides enough to matter.

After each calibrated prompt the best constant bucket under the latency objective (as
`Selector.constant` picks it: speedup = (1 + mean accepted) * T(1) / mean seconds per
iteration, plain decoding when nothing beats 1) is recomputed on bootstrap resamples of the
prompts so far (prompts, not iterations, are resampled: a prompt's iterations are alike). The
decision is settled when

  - the winner (the bucket most resamples pick) is within `regret` of the best bucket of at
    least `agreement` of the resamples: near-ties (D2xW2/V4 against D3xW1/V4 on the Qwen pair,
    1 % apart) swap places from resample to resample, and requiring the very same argmax never
    settled there, although either choice costs under `regret`;
  - either that is plain decoding, or the winner's speedup is known to within `tolerance`
    (half the width of its 5-95 % interval, relative to its value);
  - and at least `min_prompts` prompts were calibrated.

Or calibration confirms `expected`, the choice recorded for this recipe on a similar machine
(its measured_cold_compile): calibration then only has to check that this machine agrees, not
find the choice from nothing, so after `expected_prompts` prompts it settles where the winner is
the record, within `regret` of the best in `confirm_agreement` of the resamples, and (unless
the record is plain decoding) its speedup's 5 % bound is above 1: speculation surely pays. Its
speedup's width is then not waited for (on the Qwen pair, a Zen 4 compile's winner was the
recorded D2xW2/V4 from the second prompt on, with 81-93 % of resamples from the fourth, and the
full rule took 20 prompts).

The resampling is seeded, so a calibration resumed from its checkpoint stops where an
uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yggdrasil.buckets import Grid
from yggdrasil.runtime.latency import LatencyProfile

from yggdrasil.policy.select import record_costs, shape_at_flat


@dataclass(frozen=True)
class StoppingRule:
    min_prompts: int = 8
    resamples: int = 400
    agreement: float = 0.95
    tolerance: float = 0.05
    seed: int = 0
    regret: float = 0.02  # a winner this close to a resample's best counts as that resample's choice
    expected: str | None = None  # the choice recorded on a similar machine (a bucket name, or no-spec)
    expected_prompts: int = 4  # prompts enough when calibration confirms `expected`
    confirm_agreement: float = 0.8  # share of resamples that must pick `expected` (within regret)


@dataclass(frozen=True)
class Verdict:
    """settled: calibration may stop. best: the bucket most resamples pick; share: how many do;
    low/high: the 5-95 % interval of its speedup over the resamples."""

    settled: bool
    best: str
    share: float
    low: float
    high: float
    prompts: int
    confirms_record: bool = False  # settled on fewer prompts because it is the recorded choice

    def summary(self) -> str:
        said = (f"after {self.prompts} prompts the best constant bucket is {self.best} (within the rule's regret of "
                f"the best in {self.share:.0%} of resamples), speedup {self.low:.2f}-{self.high:.2f}x (5-95 %)")
        return said + ("; the choice recorded for this recipe on a similar machine" if self.confirms_record else "")


class CalibrationStopper:
    """Fed each calibrated prompt's part (predictor/calibrate.py), in order; says whether the
    objective's decision is settled."""

    def __init__(self, grid: Grid, profile: LatencyProfile, drafted: torch.Tensor, rule: StoppingRule) -> None:
        self.grid, self.profile, self.drafted, self.rule = grid, profile, drafted, rule
        self.t1 = profile.t_verify(1)
        self._accepted: list[torch.Tensor] = []  # per prompt: summed accepted tokens per bucket
        self._seconds: list[torch.Tensor] = []  # per prompt: summed seconds per bucket
        self._iterations: list[int] = []

    def add(self, part: dict) -> Verdict | None:
        """The verdict after this prompt (None: a prompt with no iterations)."""
        if "accepted" not in part:
            return None
        accepted = part["accepted"]
        costs = record_costs(self.grid, self.profile, part.get("tree_size"), accepted.shape[0], self.drafted)
        self._accepted.append(accepted.double().sum(0).flatten())
        self._seconds.append(costs.sum(0).flatten())
        self._iterations.append(accepted.shape[0])
        return self.verdict()

    def verdict(self) -> Verdict:
        rule, prompts = self.rule, len(self._iterations)
        accepted, seconds = torch.stack(self._accepted), torch.stack(self._seconds)
        iterations = torch.tensor(self._iterations, dtype=torch.double)
        generator = torch.Generator().manual_seed(rule.seed + prompts)
        picks = torch.randint(0, prompts, (rule.resamples, prompts), generator=generator)
        weights = torch.zeros(rule.resamples, prompts, dtype=torch.double).scatter_add_(
            1, picks, torch.ones(rule.resamples, prompts, dtype=torch.double))
        count = weights @ iterations  # [R]
        speedup = (1.0 + (weights @ accepted) / count[:, None]) * self.t1 / ((weights @ seconds) / count[:, None])
        speedup = torch.nan_to_num(speedup, nan=0.0)
        no_spec = speedup.shape[1]  # index of plain decoding (speedup 1)
        best_value, best_index = speedup.max(1)
        best_value = best_value.clamp(min=1.0)  # plain decoding is always there, at 1
        best_index = torch.where(best_value > 1.0, best_index, torch.full_like(best_index, no_spec))
        winner = int(torch.mode(best_index).values)
        values = torch.ones(rule.resamples, dtype=torch.double) if winner == no_spec else speedup[:, winner]
        share = float((values >= (1.0 - rule.regret) * best_value).double().mean())
        low, high = (float(v) for v in torch.quantile(values, torch.tensor([0.05, 0.95], dtype=torch.double)))
        tight = winner == no_spec or (high - low) / 2 <= rule.tolerance * float(values.median())
        name = self._name(winner, no_spec)
        found = share >= rule.agreement and tight and prompts >= rule.min_prompts
        confirms = (name == rule.expected and prompts >= rule.expected_prompts and share >= rule.confirm_agreement
                    and (winner == no_spec or low > 1.0))
        return Verdict(found or confirms, name, share, low, high, prompts, confirms and not found)

    def _name(self, index: int, no_spec: int) -> str:
        return "no-spec" if index == no_spec else str(shape_at_flat(self.grid, index))
