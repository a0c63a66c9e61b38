"""Step-time profiles for the latency-aware objective (docs/design.md §3.1).

A LatencyProfile is a small table of measured step times. `measure_profile` takes one quickly at
start-up from the runners that will actually run (a few forwards per verify width); the profiler
writes fuller ones to disk.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

from .device import device_sync, median_time
from .steps import StepRunner, verify_inputs
from .tree import TokenTree


@dataclass(frozen=True)
class LatencyProfile:
    """Step times T(n) in seconds for n new tokens, interpolated linearly between points.

    The default is flat (every size costs the same), under which the objective keeps the widest
    tree; the profiler fills in measured times.
    """

    draft: tuple[tuple[int, float], ...] = ((1, 1.0),)
    verify: tuple[tuple[int, float], ...] = ((1, 1.0),)

    @staticmethod
    def _interpolate(points: tuple[tuple[int, float], ...], n: int) -> float:
        sizes = [p[0] for p in points]
        i = bisect.bisect_left(sizes, n)
        if i < len(points) and sizes[i] == n:
            return points[i][1]
        if i == 0:
            return points[0][1]
        if i == len(points):
            (n0, t0), (n1, t1) = points[-2:] if len(points) > 1 else (points[-1], points[-1])
        else:
            (n0, t0), (n1, t1) = points[i - 1], points[i]
        return t0 if n1 == n0 else t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    def t_draft(self, n: int) -> float:
        return self._interpolate(self.draft, n)

    def t_verify(self, n: int) -> float:
        return self._interpolate(self.verify, n)

    def as_dict(self) -> dict:
        return {"draft": [list(p) for p in self.draft], "verify": [list(p) for p in self.verify]}

    @classmethod
    def from_dict(cls, raw: dict) -> "LatencyProfile":
        return cls(tuple((int(n), float(t)) for n, t in raw["draft"]),
                   tuple((int(n), float(t)) for n, t in raw["verify"]))



def from_device_profile(profile, has_draft_model: bool) -> LatencyProfile:
    """The objective's table from a measured DeviceProfile (compiled numbers when present)."""
    verify = profile.target.curve()
    points = tuple(zip(verify.sizes, verify.seconds))
    if has_draft_model and profile.draft is not None:
        draft = profile.draft.curve()
        return LatencyProfile(draft=tuple(zip(draft.sizes, draft.seconds)), verify=points)
    return LatencyProfile(draft=((1, 0.0),), verify=points)  # lookup drafting costs ~nothing


def measure_profile(target: StepRunner, drafter, verify_widths: Sequence[int],
                    repeats: int = 3, draft_widths: Sequence[int] | None = None,
                    hidden: bool = False, warmup: int = 1) -> LatencyProfile:
    """T_verify(V) for each allowed width and T_draft(W) per draft step, measured in place.

    Verify times use a root-only tree padded to each width, which costs the same as a full one
    (the forward's shape is what matters). The draft time is one whole tree build over a dummy
    history, divided by the depth, so host-side drafting work is counted too: the drafter's own
    shape by default, or a deepest-depth Equal-Growth build per width in `draft_widths`; an
    empty `draft_widths` skips drafting (lookup, which costs ~nothing). hidden: time the verify
    graphs that also return hidden states (what --auto with a predictor runs). warmup: untimed
    runs before each measurement.
    """
    tree = TokenTree.with_root(max(verify_widths), 0, target.device)
    root = torch.zeros(1, dtype=torch.long, device=target.device)
    widths = sorted({1, *verify_widths})
    sync = device_sync(target.device)
    verify = tuple((w, median_time(
        lambda w=w: target.run(verify_inputs(target, tree, root, 1, w), key="verify", hidden=hidden), repeats,
        warmup=warmup, sync=sync)[0]) for w in widths)
    if draft_widths is not None and not draft_widths:
        return LatencyProfile(draft=((1, 0.0),), verify=verify)
    history = [0] * 8  # any valid ids do: only the shapes matter
    drafter.start(history[:-1])

    def per_step(build) -> float:
        def run() -> None:
            drafter.rewind(history)  # as if the same tokens were new each time
            build()
        return median_time(run, repeats, sync=sync)[0] / drafter.depth

    if draft_widths is None:
        draft = ((drafter.width, per_step(lambda: drafter.build(history))),)
    else:
        draft = tuple((w, per_step(lambda w=w: drafter.build_shaped(history, drafter.depth, w)))
                      for w in draft_widths)
    return LatencyProfile(draft=draft, verify=verify)
