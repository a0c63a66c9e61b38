"""Sequoia's dynamic program: the best static tree for a node budget from acceptance statistics.

Under Sequoia's positional assumption, the draft's rank-r child of any node is accepted (given its
parent was) with probability p[r], independent of the rest. A tree's expected number of accepted
tokens is then the sum over its nodes of the product of p along the path from the root. For a
budget of n nodes (and at most `max_depth` levels) the DP below finds the tree maximising it:

    F(d, n)    best value of n nodes hanging under one node, at most d levels deep
    G(d, r, m) best value of m nodes spread over that node's children of rank r, r+1, ...
    G(d, r, m) = max( G(d, r + 1, m),                                   skip rank r
                      max_s p[r] * (1 + F(d - 1, s - 1)) + G(d, r + 1, m - s) )   child r, size s

Children of higher rank can only help if a lower rank is also present (p is non-increasing), so
the optimum always uses ranks 0, 1, 2, ... in order. The result is a shape for StaticTreeDrafter.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence


def best_tree(acceptance: Sequence[float], budget: int, max_depth: int) -> tuple[tuple[tuple[int, ...], ...], float]:
    """(rank-path shape, expected accepted tokens excluding the bonus) for `budget` nodes."""
    p = [float(x) for x in acceptance]
    if not p or budget < 1 or max_depth < 1:
        raise ValueError("need a non-empty acceptance vector, budget >= 1 and max_depth >= 1")
    if any(not 0.0 <= x <= 1.0 for x in p):
        raise ValueError(f"acceptance probabilities must be in [0, 1], got {p}")
    k = len(p)

    @lru_cache(maxsize=None)
    def f(depth: int, n: int) -> float:
        return g(depth, 0, n)[0] if depth > 0 and n > 0 else 0.0

    @lru_cache(maxsize=None)
    def g(depth: int, rank: int, m: int) -> tuple[float, int]:
        """(value, size given to child `rank`; 0 = skip it)."""
        if m == 0 or rank >= k:
            return 0.0, 0
        best, best_size = g(depth, rank + 1, m)[0], 0
        for size in range(1, m + 1):
            value = p[rank] * (1.0 + f(depth - 1, size - 1)) + g(depth, rank + 1, m - size)[0]
            if value > best + 1e-15:
                best, best_size = value, size
        return best, best_size

    def build(depth: int, n: int, prefix: tuple[int, ...], out: list) -> None:
        rank, remaining = 0, n
        while remaining > 0 and rank < k and depth > 0:
            size = g(depth, rank, remaining)[1]
            if size:
                node = prefix + (rank,)
                out.append(node)
                build(depth - 1, size - 1, node, out)
                remaining -= size
            rank += 1

    shape: list[tuple[int, ...]] = []
    build(max_depth, budget, (), shape)
    return tuple(sorted(shape, key=lambda path: (len(path), path))), f(max_depth, budget)


def tree_value(shape: Sequence[tuple[int, ...]], acceptance: Sequence[float]) -> float:
    """Expected accepted tokens of a shape under the positional acceptance model."""
    total = 0.0
    for path in shape:
        prob = 1.0
        for rank in path:
            prob *= acceptance[rank] if rank < len(acceptance) else 0.0
        total += prob
    return total
