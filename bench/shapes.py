"""Which tree shapes the suites run, chosen from the bundle's calibration by the latency-aware
objective (docs/design.md §3.1) so that no baseline is handicapped by an arbitrary shape:

    speedup(D, W, V) = (1 + mean accepted) · T_verify(1) / (D · T_draft(W) + T_verify(V))

with the mean accepted tokens measured per bucket on calibration prompts and the bundle's
profiled step times."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from yggdrasil.buckets import Bucket
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.policy.calibration import load_run
from yggdrasil.policy.auto import selector_for
from yggdrasil.policy.select import Selector


def full_selector(runtime) -> Selector:
    """The objective over the whole calibration grid (every draft width the recipe had, not only
    the ones the bundle compiled), with the bundle's profiled step times."""

    run, _, _ = load_run(BundleLayout(runtime.path).calibration)
    return selector_for(run, torch.ones(run.accepted.shape[0], dtype=torch.bool), runtime.latency)


def objective(selector: Selector, shape: Bucket) -> float:
    grid = selector.grid
    i, j, k = grid.depths.index(shape.depth), grid.widths.index(shape.width), grid.verifies.index(shape.verify)
    return float((1.0 + selector.mean_accepted[i, j, k]) * selector.t1 / selector.costs[i, j, k])


def best(selector: Selector, allowed: Callable[[Bucket], bool]) -> tuple[Bucket, float] | None:
    """The allowed bucket with the highest objective (None if none is allowed)."""
    grid = selector.grid
    shapes = [Bucket(d, w, v) for d in grid.depths for w in grid.widths for v in grid.verifies if allowed(Bucket(d, w, v))]
    if not shapes:
        return None
    scored = [(objective(selector, s), s) for s in shapes]
    value, shape = max(scored, key=lambda vs: vs[0])
    return shape, value


def whole_tree(shape: Bucket) -> bool:
    """The bucket verifies every drafted node (no pruning)."""
    return shape.verify >= 1 + shape.depth * shape.width


def best_chain(selector: Selector) -> Bucket:
    """gpt-fast style: a chain (width 1) verified whole, the depth the objective likes best."""
    found = best(selector, lambda s: s.width == 1 and whole_tree(s))
    if found is None:  # the calibration grid had no width 1: a chain as deep as the smallest verify holds
        depth = min(selector.grid.depths)
        return Bucket(depth, 1, depth + 1)
    shape, _ = found
    return Bucket(shape.depth, 1, shape.depth + 1)


def best_whole_tree(selector: Selector) -> Bucket:
    """The best bucket among those that verify the whole tree: the ablation's fixed EGT shape."""
    found = best(selector, whole_tree)
    return found[0] if found else Bucket(1, 1, 2)


def sequoia_file(runtime, selector: Selector) -> tuple[Path, int] | None:
    """Sequoia's best static tree for the verify budget the objective picks (the calibration
    wrote one per budget), or None without any."""
    files = sequoia_files(runtime)
    if not files:
        return None
    found = best(selector, lambda s: s.verify in files and s.verify > 1)
    budget = found[0].verify if found else max(files)
    return files[budget], budget


def sequoia_files(runtime) -> dict[int, Path]:
    return {int(p.stem.split("-v")[1]): p for p in BundleLayout(runtime.path).calibration.glob("sequoia-v*.json")}
