"""Equal-Growth drafting on the host (issue 51, item 5): ModelDrafter's tree and candidate pool
as numpy arrays, where the draft model runs on the CPU.

The device path (drafters._CandidatePool and TokenTree.add) grows the tree with fixed-shape
tensor ops so that nothing is read back from an accelerator. On the CPU nothing needs reading
back, and those ops (a few dozen per build, on a handful of nodes each) cost more than the
build's real work: right after a model forward each torch op runs with cold caches, several
microseconds apiece. Here only the vocabulary-wide ops stay in torch (log_softmax, the top-k of
each fed row, and the top-k that takes candidates, whose choice among equal scores is torch's);
the bookkeeping is numpy. The candidates, their order, the float32 scores and so the tree are
those of the device path, bit for bit (tests/test_host_growth.py).
"""

from __future__ import annotations

import numpy as np
import torch

from yggdrasil.runtime.tree import TokenTree


class HostCandidatePool:
    """_CandidatePool on the host: every expanded node's top-`width` children, scored by path
    log-probability, in the same slots and order as the device pool."""

    def __init__(self, width: int, depth: int, token_ids: np.ndarray | None = None) -> None:
        self.width, self.token_ids = width, token_ids
        size = width + (depth - 1) * width * width
        self.parents = np.zeros(size, dtype=np.int64)
        self.tokens = np.zeros(size, dtype=np.int64)
        self.scores = np.full(size, -np.inf, dtype=np.float32)
        self.used = 0

    def extend(self, parents: np.ndarray, parent_logp: np.ndarray, logits: torch.Tensor) -> None:
        top = torch.log_softmax(logits.float(), dim=-1).topk(self.width, dim=-1)
        values, indices = top.values.numpy(), top.indices.numpy()
        n = len(parents) * self.width
        span = slice(self.used, self.used + n)
        self.parents[span] = np.repeat(parents, self.width)
        tokens = indices.reshape(-1)
        self.tokens[span] = tokens if self.token_ids is None else self.token_ids[tokens]
        self.scores[span] = (parent_logp[:, None] + values).reshape(-1)
        self.used += n

    def children_of(self, node: int) -> list[int]:
        """The tokens proposed under an expanded node, best first (calibration's bookkeeping)."""
        return self.tokens[:self.used][self.parents[:self.used] == node].tolist()

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        best = torch.from_numpy(self.scores[:self.used]).topk(count).indices.numpy()
        picked = self.parents[best], self.tokens[best], self.scores[best].copy()
        self.scores[best] = -np.inf  # taken candidates never come back
        return picked


class HostGrowth:
    """One Equal-Growth build on the host: the tree's arrays (TokenTree's layout) and its pool."""

    def __init__(self, capacity: int, root_token: int, width: int, depth: int,
                 token_ids: np.ndarray | None = None) -> None:
        self.tokens = np.zeros(capacity, dtype=np.int64)
        self.parents = np.full(capacity, -1, dtype=np.int64)
        self.depth = np.zeros(capacity, dtype=np.int64)
        self.logp = np.full(capacity, -np.inf, dtype=np.float32)
        self.ancestors = np.zeros((capacity, capacity), dtype=np.bool_)
        self.tokens[0], self.logp[0], self.ancestors[0, 0] = root_token, 0.0, True
        self.size = 1
        self.pool = HostCandidatePool(width, depth, token_ids)

    def expand(self, nodes: np.ndarray, logits: torch.Tensor) -> None:
        """Offer each node's top children (logits: [len(nodes), vocab], one row per node)."""
        self.pool.extend(nodes, self.logp[nodes], logits)

    def grow(self, count: int) -> np.ndarray:
        """Add the pool's `count` best candidates as nodes (TokenTree.add); their indices."""
        parents, tokens, logp = self.pool.take(count)
        new = slice(self.size, self.size + count)
        self.tokens[new], self.parents[new], self.logp[new] = tokens, parents, logp
        self.depth[new] = self.depth[parents] + 1
        self.ancestors[new] = self.ancestors[parents]
        self.ancestors[new, new] |= np.eye(count, dtype=np.bool_)
        self.size += count
        return np.arange(new.start, new.stop)

    def step_inputs(self, nodes: np.ndarray, base: int, span: int) -> tuple[np.ndarray, ...]:
        """A draft step's tokens, positions, slots and mask [1, len(nodes), ...] over these nodes
        (ModelDrafter._feed's: node i at slot base + i, attending the prefix and its ancestors)."""
        mask = np.zeros((1, len(nodes), span), dtype=np.bool_)
        mask[0, :, :base] = True
        mask[0, :, base:base + self.size] = self.ancestors[nodes, :self.size]
        return self.tokens[nodes][None], (base + self.depth[nodes])[None], (base + nodes)[None], mask

    def tree(self) -> TokenTree:
        """The grown tree as a host TokenTree (views of these arrays: no copy)."""
        n = self.size
        tree = TokenTree.__new__(TokenTree)
        tree.tokens, tree.parents, tree.depth, tree.logp = (torch.from_numpy(a[:n]) for a in
                                                             (self.tokens, self.parents, self.depth, self.logp))
        tree.ancestors = torch.from_numpy(np.ascontiguousarray(self.ancestors[:n, :n]))
        tree.capacity, tree.size, tree.device = n, n, torch.device("cpu")
        return tree
