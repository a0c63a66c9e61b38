"""Acceptance bookkeeping of speculative decoding across iterations (per-depth acceptance,
the buckets and verify widths chosen, the depth predictor's estimates against what happened)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Acceptance bookkeeping across iterations."""

    iterations: int = 0
    committed: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)  # iterations accepting >= d tokens
    offered_at_depth: list[int] = field(default_factory=list)  # iterations that reached depth d - 1
    host_seconds: float = 0.0  # tree bookkeeping outside the model forwards
    shapes: dict[str, int] = field(default_factory=dict)  # auto mode: buckets chosen, with counts
    verifies: dict[str, int] = field(default_factory=dict)  # draft confidence: verify widths it chose
    predicted_iterations: int = 0  # auto mode with a predictor: iterations it predicted
    predicted_accepted: float = 0.0  # sum of its expected accepted lengths E[min(a, D max)]
    chosen_depth: int = 0  # sum of the depths chosen on those iterations
    accepted_when_predicted: int = 0  # sum of the tokens then actually accepted

    def record(self, accepted: int, tree_depth: int) -> None:
        """One iteration's walk: `accepted` draft tokens and the bonus committed (generate takes
        back what it does not deliver: `undelivered`)."""
        self.iterations += 1
        self.committed += accepted + 1
        while len(self.accepted_at_depth) < tree_depth:
            self.accepted_at_depth.append(0)
            self.offered_at_depth.append(0)
        for d in range(min(accepted + 1, tree_depth)):
            self.offered_at_depth[d] += 1
        for d in range(accepted):
            self.accepted_at_depth[d] += 1

    def undelivered(self, tokens: int) -> None:
        """The last iteration committed `tokens` past the length limit or the stop token: never
        delivered, so not counted in AAL (which would otherwise flatter the run's last iteration)."""
        self.committed -= tokens

    @property
    def aal(self) -> float:
        """Mean tokens delivered per target forward, bonus included."""
        return self.committed / self.iterations if self.iterations else float("nan")

    def depth_acceptance(self) -> list[float]:
        """P(token at depth d accepted | the walk reached depth d - 1), d = 1..depth."""
        return [a / o if o else float("nan") for a, o in zip(self.accepted_at_depth, self.offered_at_depth)]

    def note_choice(self, shape, tail: list[float] | None) -> None:
        self.shapes[str(shape)] = self.shapes.get(str(shape), 0) + 1
        if tail is not None:
            self.predicted_iterations += 1
            self.predicted_accepted += sum(tail)
            self.chosen_depth += shape.depth

    def note_verify(self, verify: int) -> None:
        """A verify width draft confidence chose (counted as shapes are)."""
        self.verifies[f"V{verify}"] = self.verifies.get(f"V{verify}", 0) + 1

    def merge(self, other: "SpecStats") -> None:
        """Add another call's counts (a chat session's running totals)."""
        self.iterations += other.iterations
        self.committed += other.committed
        for mine, theirs in ((self.accepted_at_depth, other.accepted_at_depth),
                             (self.offered_at_depth, other.offered_at_depth)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for d, count in enumerate(theirs):
                mine[d] += count
        self.host_seconds += other.host_seconds
        for mine, theirs in ((self.shapes, other.shapes), (self.verifies, other.verifies)):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
        self.predicted_iterations += other.predicted_iterations
        self.predicted_accepted += other.predicted_accepted
        self.chosen_depth += other.chosen_depth
        self.accepted_when_predicted += other.accepted_when_predicted

    def prediction_summary(self) -> str:
        """Predicted vs chosen depth vs what was accepted, per predicted iteration."""
        n = self.predicted_iterations
        if not n:
            return "no depth predictions (no useful predictor in this bundle)"
        return (f"predicted accepted {self.predicted_accepted / n:.2f} | chosen depth "
                f"{self.chosen_depth / n:.2f} | accepted {self.accepted_when_predicted / n:.2f} "
                f"(means over {n} iterations)")

    def summary(self) -> str:
        rates = " ".join("-" if r != r else f"{r:.2f}" for r in self.depth_acceptance())  # "-": never offered
        text = f"AAL {self.aal:.2f} over {self.iterations} iterations | per-depth acceptance [{rates}]"
        for label, counts in (("buckets", self.shapes), ("confidence chose", self.verifies)):
            if counts:
                top = sorted(counts.items(), key=lambda kv: -kv[1])[:4]
                text += f" | {label} " + ", ".join(f"{k} x{v}" for k, v in top)
        return text
