"""Per-iteration bucket selection by the latency-aware objective (docs/design.md §3.1):

    speedup(D, W, V) = AAL(D, W, V) · T_verify(1) / (D · T_draft(W) + T_verify(V))

AAL comes from calibration: the mean tokens each bucket accepted (plus the bonus), optionally
conditioned on the depth predictor's output for this iteration. Depth 0 is "do not speculate":
one plain decode step, speedup exactly 1. Only buckets in the grid are ever returned.
"""

from __future__ import annotations

import math

import torch

from yggdrasil.buckets import NO_SPEC, Bucket, Grid
from yggdrasil.runtime.latency import LatencyProfile


def shape_costs(grid: Grid, profile: LatencyProfile) -> torch.Tensor:
    """[depths, widths, verifies] seconds of one iteration: D draft steps plus one verify."""
    draft = torch.tensor([[d * profile.t_draft(w) for w in grid.widths] for d in grid.depths],
                         dtype=torch.double)
    verify = torch.tensor([profile.t_verify(v) for v in grid.verifies], dtype=torch.double)
    return draft[:, :, None] + verify[None, None, :]


def cheapest_verify(grid: Grid, profile: LatencyProfile) -> list[tuple[int, float]]:
    """For k = 0..max V kept nodes: (grid verify width, seconds) of the cheapest width >= k.

    Measured step times need not grow with n (on CPU a 32-row GEMM can beat an 8-row one), so
    the width that holds k nodes most cheaply is not always the smallest.
    """
    out = []
    for k in range(grid.verifies[-1] + 1):
        out.append(min(((v, profile.t_verify(v)) for v in grid.verifies if v >= k), key=lambda x: x[1]))
    return out


def record_costs(grid: Grid, profile: LatencyProfile, tree_size: torch.Tensor | None,
                 n_records: int, drafted: torch.Tensor | None = None) -> torch.Tensor:
    """[N, depths, widths, verifies] seconds each record's iteration costs per bucket.

    A bucket keeps k = min(V, tree nodes) nodes and the runtime verifies them with the cheapest
    grid width that holds k (a lookup that found nothing costs one plain decode step). Without
    recorded tree sizes, trees are taken as full (1 + D·W nodes), as a draft model's always are.
    drafted [depths, widths]: where False, calibration did not draft that tree, so nothing is
    known of it: it costs infinite time and no objective ever picks it.
    """
    if tree_size is None:
        full = torch.tensor([[1 + d * w for w in grid.widths] for d in grid.depths])
        tree_size = full.expand(n_records, *full.shape)
    cheapest = torch.tensor([t for _, t in cheapest_verify(grid, profile)], dtype=torch.double)
    verifies = torch.tensor(grid.verifies)
    kept = torch.minimum(tree_size.long()[..., None], verifies[None, None, None, :])  # [N, D, W, V]
    draft = torch.tensor([[d * profile.t_draft(w) for w in grid.widths] for d in grid.depths],
                         dtype=torch.double)
    costs = draft[None, :, :, None] + cheapest[kept]
    if drafted is not None:
        costs = costs.masked_fill(~drafted[None, :, :, None], float("inf"))
    return costs


def shape_at(grid: Grid, index: tuple[int, int, int]) -> Bucket:
    i, j, k = index
    return Bucket(grid.depths[i], grid.widths[j], grid.verifies[k])


def shape_at_flat(grid: Grid, flat: int) -> Bucket:
    """The bucket at a flat index of a [depths, widths, verifies] table (plain divmod: torch's
    unravel_index imports sympy, 0.7 s that a bundle's first speculative step would pay)."""
    rest, k = divmod(flat, len(grid.verifies))
    i, j = divmod(rest, len(grid.widths))
    return shape_at(grid, (i, j, k))


class Selector:
    """Maximises the objective over the grid from an expected-accepted-tokens table."""

    def __init__(self, grid: Grid, profile: LatencyProfile, mean_accepted: torch.Tensor,
                 mean_accepted_capped: torch.Tensor, costs: torch.Tensor | None = None) -> None:
        """mean_accepted [D, W, V]: mean tokens each bucket accepted on calibration data;
        mean_accepted_capped [D]: mean min(a, D) of a, the most any width's whole build accepted.
        Their ratio is the share of the full tree's acceptance a smaller bucket keeps.
        costs [D, W, V]: expected seconds per bucket (default: the nominal shape costs)."""
        self.grid, self.profile = grid, profile
        self.costs = shape_costs(grid, profile) if costs is None else costs.double()
        self.t1 = profile.t_verify(1)
        self.mean_accepted = mean_accepted.double()
        self.keep_share = self.mean_accepted / mean_accepted_capped.double().clamp(min=1e-9)[:, None, None]
        self._depth_rows = torch.tensor([d - 1 for d in grid.depths])  # tail entries of the grid depths
        self._constant: tuple[Bucket, float] | None = None  # constant(), once
        # the same tables as Python floats: choosing per iteration in plain Python costs ~40 us
        # where a dozen tiny torch ops cost ~1 ms on CPU right after a model forward has
        # evicted the caches (every op's code and data is cold again)
        self._rows = [(d - 1, [(shape_at(grid, (i, j, k)), keep, cost)
                               for j, (keeps, costs_w) in enumerate(zip(self.keep_share[i].tolist(),
                                                                        self.costs[i].tolist()))
                               for k, (keep, cost) in enumerate(zip(keeps, costs_w))])
                      for i, d in enumerate(grid.depths)]

    def _best(self, expected_accepted: torch.Tensor) -> tuple[Bucket, float]:
        speedup = (1.0 + expected_accepted) * self.t1 / self.costs
        flat = int(speedup.argmax())
        best = float(speedup.flatten()[flat])
        if best <= 1.0:  # speculating costs more than it returns: one plain decode step
            return NO_SPEC, 1.0
        return shape_at_flat(self.grid, flat), best

    def constant(self) -> tuple[Bucket, float]:
        """The single best bucket on average (the best constant (D, W, V)): computed once, as
        its tables never change (a constant policy asks every iteration)."""
        if self._constant is None:
            self._constant = self._best(self.mean_accepted)
        return self._constant

    def expected_for_tail(self, tail: torch.Tensor) -> torch.Tensor:
        """[D, W, V] tokens each bucket is expected to accept given P(accepted >= d) for
        d = 1..max depth for this iteration (the estimate the objective acts on)."""
        capped = tail.double().cumsum(0)  # E[min(a, d)] = Σ_{k <= d} P(a >= k)
        return capped[self._depth_rows][:, None, None] * self.keep_share

    def for_tail(self, tail: torch.Tensor) -> tuple[Bucket, float]:
        """The best bucket given P(accepted >= d) for d = 1..max depth for this iteration."""
        return self._best(self.expected_for_tail(tail))

    def objective(self, shape: Bucket) -> float:
        """Objective 3.1 of one grid bucket on the calibration averages (no-spec: 1)."""
        index = bucket_index(self.grid, shape)
        if index is None:
            return 1.0
        return float((1.0 + self.mean_accepted[index]) * self.t1 / self.costs[index])

    def best_at_verify(self, verify: int) -> Bucket | None:
        """The tree shape for verify width V: the objective's best (D, W) among those whose
        calibrated acceptance is at least the plain chain's at V (depth V - 1, width 1, when the
        grid has it), so the shape chosen at V never accepts fewer tokens than the chain and the
        chain itself is always a candidate (issue 25). None: V is not a grid verify width > 1."""
        grid = self.grid
        if verify <= 1 or verify not in grid.verifies:
            return None
        k = grid.verifies.index(verify)
        chain = Bucket(verify - 1, 1, verify)
        floor = (float(self.mean_accepted[bucket_index(grid, chain)])
                 if chain.depth in grid.depths and 1 in grid.widths else float("-inf"))
        candidates = [Bucket(d, w, verify) for i, d in enumerate(grid.depths) for j, w in enumerate(grid.widths)
                      if float(self.mean_accepted[i, j, k]) >= floor and math.isfinite(float(self.costs[i, j, k]))]
        return max(candidates, key=self.objective)  # max keeps the first of equals (shallow, narrow)

    def for_tail_fast(self, tail: list[float]) -> Bucket:
        """for_tail's bucket, computed in plain Python with the same double arithmetic in the
        same order (so the same choice, ties included); the runtime's per-iteration path."""
        capped, running = [], 0.0
        for p in tail:
            running += p
            capped.append(running)
        best, best_shape = -1.0, NO_SPEC
        for row, buckets in self._rows:
            at_depth = capped[row]
            for shape, keep, cost in buckets:
                speedup = (1.0 + at_depth * keep) * self.t1 / cost
                if speedup > best:  # strict: the first maximum wins, as argmax does
                    best, best_shape = speedup, shape
        return best_shape if best > 1.0 else NO_SPEC


def realised_speedup(accepted: torch.Tensor, costs: torch.Tensor, t1: float,
                     chosen: list[tuple[int, int, int] | None]) -> float:
    """Tokens per second of a policy on calibration records, in units of plain decoding.

    accepted, costs [N, D, W, V]; chosen[i] is the bucket picked for record i (None = no-spec).
    """
    tokens, seconds = 0.0, 0.0
    for i, index in enumerate(chosen):
        if index is None:
            tokens, seconds = tokens + 1.0, seconds + t1
        else:
            tokens += 1.0 + float(accepted[(i, *index)])
            seconds += float(costs[(i, *index)])
    return tokens * t1 / seconds


def bucket_index(grid: Grid, shape: Bucket) -> tuple[int, int, int] | None:
    if shape.depth == 0:
        return None
    return grid.depths.index(shape.depth), grid.widths.index(shape.width), grid.verifies.index(shape.verify)


def oracle_choices(accepted: torch.Tensor, costs: torch.Tensor, t1: float) -> list[tuple[int, int, int] | None]:
    """Per record, the bucket that would have been best in hindsight."""
    speedup = (1.0 + accepted.double()) * t1 / costs
    flat = speedup.flatten(1)
    best = flat.argmax(1)
    out = []
    for i, b in enumerate(best.tolist()):
        if float(flat[i, b]) <= 1.0:
            out.append(None)
        else:
            out.append(tuple(int(x) for x in torch.unravel_index(torch.tensor(b), costs.shape[1:])))
    return out
