"""Phase "select": which buckets a bundle keeps (the ones the objective picks on calibration
data) and so which graphs it compiles; the dispatcher over the kept grid lists them
(docs/design.md §3.6)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.runtime.dispatcher import Dispatcher

from .recipe import Recipe


@dataclass(frozen=True)
class BucketSelection:
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


def select_buckets(policy, hidden: torch.Tensor, grid) -> BucketSelection:
    """Run the policy on every calibration iteration; keep the draft widths it ever picks and
    the verify widths up to the widest it picks (smaller keeps verify with those)."""
    picked: dict[str, int] = {}
    widths, widest = set(), 1
    for row in hidden:
        bucket = policy.choose(row)
        picked[str(bucket)] = picked.get(str(bucket), 0) + 1
        if bucket.depth:
            widths.add(bucket.width)
            widest = max(widest, bucket.verify)
    verifies = tuple(v for v in grid.verifies if v <= widest) if widths else (1,)
    return BucketSelection(tuple(sorted(widths)), verifies, dict(sorted(picked.items(), key=lambda kv: -kv[1])),
                           tuple(w for w in grid.widths if w not in widths),
                           tuple(v for v in grid.verifies if v not in verifies))


def keep_all(grid, picked: BucketSelection) -> BucketSelection:
    """Recipe `selection: all`: every draft and verify width of the grid, whatever was picked."""
    return BucketSelection(tuple(grid.widths), tuple(grid.verifies), picked.picked, (), ())


def kept_dispatcher(recipe: Recipe, selection: BucketSelection) -> Dispatcher:
    """The dispatcher over what selection kept: the one list of the bundle's shapes."""
    grid = replace(recipe.buckets.grid, widths=selection.widths or (1,), verifies=selection.verifies,
                   chunks=recipe.buckets.prefill_chunks, batches=recipe.buckets.batch_sizes)
    return Dispatcher(grid, recipe.source or recipe.name)


def graph_keys(recipe: Recipe, selection: BucketSelection, needs_hidden: bool) -> list[GraphKey]:
    """Every graph the runtime can ask for with this selection, largest first (the server's
    only where the recipe asks for them: serve_graphs)."""
    keys = kept_dispatcher(recipe, selection).bundle_keys(recipe.draft != "lookup", selection.speculates, needs_hidden)
    return keys if recipe.serve_graphs else [k for k in keys if k.stage != SERVE_STAGE]
