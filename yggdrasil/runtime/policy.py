"""What the runtime asks of a bucket policy: the one typed interface between the speculative loop
and whatever picks each iteration's (D, W, V) bucket (yggdrasil.policy.auto.AutoPolicy at run
time; tests and bench pass their own)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from yggdrasil.buckets import Bucket, Grid
from yggdrasil.runtime.latency import LatencyProfile

if TYPE_CHECKING:  # (types only: the drafters import nothing from here)
    from yggdrasil.runtime.speculative import Drafter
    from yggdrasil.runtime.steps import StepRunner
    from yggdrasil.runtime.tree import TokenTree


@runtime_checkable
class BucketPolicy(Protocol):
    """Picks each iteration's bucket from the grid the bundle compiled."""

    @property
    def grid(self) -> Grid:
        """The buckets it may pick (the bundle's compiled grid)."""
        ...

    @property
    def profile(self) -> LatencyProfile:
        """The step times its choices were made for (the verify-width objective reads them)."""
        ...

    @property
    def needs_hidden(self) -> bool:
        """Whether select() reads the target's last hidden state (through predict())."""
        ...

    def predict(self, hidden: torch.Tensor | None) -> list[float] | None:
        """What the policy reads from the hidden state (P(accepted >= d) tails), or None."""
        ...

    def select(self, tail: list[float] | None) -> Bucket:
        """This iteration's bucket, from predict()'s output."""
        ...

    def node_acceptance(self, tree: TokenTree) -> torch.Tensor | None:
        """Calibrated P(accepted) per node of the drafted tree, to choose V; None: the bucket's V."""
        ...

    def drafter(self, draft_runner: StepRunner | None = None) -> Drafter:
        """A drafter that can build every bucket of the grid."""
        ...
