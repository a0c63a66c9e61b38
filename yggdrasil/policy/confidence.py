"""Draft confidence choosing the verify width at run time (issue 25; EAGLE-2's confidence-based
expansion applied to V): the calibrated map from a drafted node's depth, rank and path
log-probability to P(accepted), and the policy that reads it for each drafted tree. Fitting and
judging it live in predictor/confidence.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from yggdrasil.policy.files import PredictorError
from yggdrasil.yaml_files import parse_yaml


SCHEMA = "yggdrasil-confidence/1"


# a node's rank among the tree's nodes at its depth, by path probability, capped: the best node at
# a depth is accepted far more often than a runner-up of about the same probability (a flat draft
# distribution gives siblings nearly equal probabilities, so the probability alone cannot tell them)
RANKS = 3


def rank_class(rank: torch.Tensor) -> torch.Tensor:
    return rank.clamp(min=0, max=RANKS - 1)


@dataclass(frozen=True)
class AcceptanceMap:
    """P(a drafted node is accepted | its depth, its rank at that depth, its path log-probability):
    per depth 1..max and rank class, a non-decreasing step function of the log-probability
    (isotonic regression, shrunk a little toward the group's mean so a block of a few nodes never
    says 0 or 1). Depths beyond the fitted ones use the deepest."""

    lower: tuple[tuple[float, ...], ...]  # per group (depth - 1) * RANKS + rank class: block lower bounds
    value: tuple[tuple[float, ...], ...]  # per group: each block's acceptance probability

    @property
    def depths(self) -> int:
        return len(self.lower) // RANKS

    def probabilities(self, depth: torch.Tensor, rank: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """Acceptance probability per node (depth >= 1)."""
        out = torch.zeros(logp.shape, dtype=torch.float64)
        group = (depth.clamp(min=1, max=self.depths) - 1) * RANKS + rank_class(rank)
        for g in range(len(self.lower)):
            at = group == g
            if not bool(at.any()):
                continue
            lower = torch.tensor(self.lower[g], dtype=torch.float64)
            block = (torch.searchsorted(lower, logp[at].double().contiguous(), right=True) - 1).clamp(min=0)
            out[at] = torch.tensor(self.value[g], dtype=torch.float64)[block]
        return out

    def as_dict(self) -> dict:
        return {"ranks": RANKS, "lower": [list(x) for x in self.lower], "value": [list(x) for x in self.value]}

    @classmethod
    def from_dict(cls, raw: dict) -> AcceptanceMap:
        if raw.get("ranks") != RANKS:
            raise PredictorError(f"an acceptance map of {raw.get('ranks')} rank classes, this yggdrasil has "
                                 f"{RANKS}; re-run calibration")
        return cls(tuple(tuple(float(v) for v in x) for x in raw["lower"]),
                   tuple(tuple(float(v) for v in x) for x in raw["value"]))


@dataclass(frozen=True)
class DraftConfidence:
    """The run-time confidence policy: draft one depth x width tree every iteration and let its
    nodes' calibrated acceptance probabilities pick V (speculative.choose_verify_width)."""

    depth: int
    width: int
    acceptance: AcceptanceMap

    def node_acceptance(self, tree) -> torch.Tensor:
        """[tree.size] calibrated P(accepted) per node of a TokenTree (the root's is 1): each
        node's rank at its depth counted in pruning's order, as calibration ranked them."""
        size = tree.size
        score = tree.rank_scores().cpu()
        order = score.argsort(descending=True)
        depth = tree.depth[:size].cpu()
        rank = torch.empty(size, dtype=torch.long)
        rank[order] = level_ranks(depth[order][None])[0]
        p = self.acceptance.probabilities(depth.clamp(min=1), rank, tree.logp[:size].cpu().double())
        p[0] = 1.0
        return p


def load_confidence(directory: Path, widths: tuple[int, ...] | None = None) -> tuple[DraftConfidence | None, dict | None]:
    """(the policy, confidence.yaml's report) of a calibration directory: the policy only when the
    held-out judgement shipped it and its draft width is among `widths` (a bundle's compiled
    ones; None: any)."""
    path = Path(directory) / "confidence.yaml"
    if not path.is_file():
        return None, None
    body = parse_yaml(path.read_text())
    if not isinstance(body, dict) or body.get("schema") != SCHEMA:
        raise PredictorError(f"{path} is not a {SCHEMA} file; re-run calibration (compile) to rewrite it")
    report, raw = body.get("report", {}), body.get("policy", {})
    if report.get("shipped") != "confidence" or (widths is not None and raw.get("width") not in widths):
        return None, report
    return DraftConfidence(int(raw["depth"]), int(raw["width"]), AcceptanceMap.from_dict(raw["acceptance"])), report


def level_ranks(depth: torch.Tensor) -> torch.Tensor:
    """[N, M] for nodes sorted by score: how many nodes of the same depth come before each."""
    rank = torch.zeros_like(depth)
    for d in depth.unique().tolist():
        at = depth == d
        rank = torch.where(at, at.long().cumsum(1) - 1, rank)
    return rank
