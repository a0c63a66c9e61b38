"""Which graphs a bundle compiles: the buckets the objective picks on calibration data, and the
(stage, rows) graphs those buckets and prefill need for each model (DESIGN §3.6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yggdrasil.graphs.registry import SERVE_STAGE, GraphSpec

from .recipe import Recipe


@dataclass(frozen=True)
class BucketPlan:
    """What survives selection: draft widths and verify widths to compile (depths cost no graph
    of their own), with how often each bucket was picked and what was dropped."""

    widths: tuple[int, ...]  # empty: speculation never paid, the bundle decodes plainly
    verifies: tuple[int, ...]
    picked: dict  # bucket -> iterations that chose it
    dropped_widths: tuple[int, ...]
    dropped_verifies: tuple[int, ...]

    @property
    def speculates(self) -> bool:
        return bool(self.widths)

    def as_dict(self) -> dict:
        return {"draft_widths": list(self.widths), "verify_widths": list(self.verifies),
                "picked": self.picked, "dropped_draft_widths": list(self.dropped_widths),
                "dropped_verify_widths": list(self.dropped_verifies)}


def select_buckets(policy, hidden: torch.Tensor, grid) -> BucketPlan:
    """Run the policy on every calibration iteration; keep the draft widths it ever picks and
    the verify widths up to the widest it picks (smaller keeps verify with those)."""
    picked: dict[str, int] = {}
    widths, widest = set(), 1
    for row in hidden:
        shape = policy.choose(row)
        picked[str(shape)] = picked.get(str(shape), 0) + 1
        if shape.depth:
            widths.add(shape.width)
            widest = max(widest, shape.verify)
    verifies = tuple(v for v in grid.verifies if v <= widest) if widths else (1,)
    return BucketPlan(tuple(sorted(widths)), verifies, dict(sorted(picked.items(), key=lambda kv: -kv[1])),
                      tuple(w for w in grid.widths if w not in widths),
                      tuple(v for v in grid.verifies if v not in verifies))


def graph_specs(recipe: Recipe, plan: BucketPlan, needs_hidden: bool) -> list[GraphSpec]:
    """Every graph the runtime can ask for with this plan, largest first."""
    chunks = recipe.buckets.prefill_chunks
    specs = {GraphSpec("target", "prefill", c) for c in chunks} | {GraphSpec("target", "decode", 1)}
    if needs_hidden:  # a prompt's last chunk also returns the hidden state the predictor reads
        specs |= {GraphSpec("target", "prefill", c, True) for c in chunks}
    if plan.speculates:
        specs |= {GraphSpec("target", "verify", v, needs_hidden) for v in plan.verifies}
        if recipe.draft != "lookup":
            specs |= {GraphSpec("draft", "prefill", c) for c in chunks}
            specs |= {GraphSpec("draft", "draft_head", max(w, 2)) for w in plan.widths}
            specs |= {GraphSpec("draft", "draft_step", w) for w in plan.widths}
    specs |= set(serve_specs(recipe, plan))
    return sorted(specs, key=lambda s: (-s.rows, s.role, s.stage, s.hidden))


def serve_specs(recipe: Recipe, plan: BucketPlan) -> list[GraphSpec]:
    """`yggdrasil serve`'s graphs: one per model that serving runs (the draft only when the
    bundle speculates with it), each taking any number of rows over the server's KV pool."""
    specs = [GraphSpec("target", SERVE_STAGE, 0)]
    if plan.speculates and recipe.draft != "lookup":
        specs.append(GraphSpec("draft", SERVE_STAGE, 0))
    return specs
