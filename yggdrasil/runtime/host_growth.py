"""Equal-Growth drafting on the host (issue 51, item 5): ModelDrafter's tree and candidate pool
as Python lists, where the draft model runs on the CPU.

The device path (drafters._CandidatePool and TokenTree.add) grows the tree with fixed-shape
tensor ops so that nothing is read back from an accelerator. On the CPU nothing needs reading
back, and those ops (a few dozen per build, on a handful of nodes each) cost more than the
build's real work: right after a model forward every op runs with cold caches, 5-10 us apiece
for a torch or numpy call on a few elements. Here only the vocabulary-wide ops stay in torch
(log_softmax and the top-k of each fed row); the pool and the tree are lists of a few nodes.
The candidates, their order, the float32 scores and so the tree are the device path's, bit for
bit (tests/test_host_growth.py):

- a score is parent + child log-probability in float32: the sum is formed in double and rounded
  to float32 (array "f"), which is the float32 sum (double rounding is exact for a sum when the
  wider format has at least 2p + 1 bits: 53 >= 49);
- candidates are taken best first as torch.topk takes them; where two candidates' scores tie
  (or one is NaN), torch.topk itself picks, since its order among equal values is its own.
"""

from __future__ import annotations

from array import array

import numpy as np
import torch

from yggdrasil.runtime.tree import HostNodes, TokenTree

NEG_INF = float("-inf")


class HostCandidatePool:
    """_CandidatePool on the host: every expanded node's top-`width` children, scored by path
    log-probability, in the same order as the device pool."""

    def __init__(self, width: int, token_ids: list[int] | None = None) -> None:
        self.width, self.token_ids = width, token_ids
        self._parents: list[int] = []
        self._tokens: list[int] = []
        self._scores: list[float] = []  # float32 values; taken candidates -inf

    @property
    def used(self) -> int:
        return len(self._scores)

    @property
    def parents(self) -> np.ndarray:
        """The expanded node of each candidate (calibration reads the pool's arrays)."""
        return np.asarray(self._parents, dtype=np.int64)

    def extend(self, parents: list[int], parent_logp: list[float], logits: torch.Tensor) -> None:
        """Offer each parent's top children; logits: a row per parent, [len(parents), vocab] or a
        forward's [1, len(parents), vocab] as it comes (no torch op to slice it), or [vocab] for
        a single parent."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        top = torch.log_softmax(logits, dim=-1).topk(self.width, dim=-1)
        values, columns = top.values.tolist(), top.indices.tolist()
        dims = logits.dim()
        if dims != 2:
            values, columns = ([values], [columns]) if dims == 1 else (values[0], columns[0])
        sums = []
        for parent, base, values, columns in zip(parents, parent_logp, values, columns):
            self._parents += [parent] * self.width
            self._tokens += columns if self.token_ids is None else [self.token_ids[c] for c in columns]
            sums += [base + v for v in values]
        self._scores += array("f", sums).tolist()

    def children_of(self, node: int) -> list[int]:
        """The tokens proposed under an expanded node, best first (calibration's bookkeeping)."""
        return [token for parent, token in zip(self._parents, self._tokens) if parent == node]

    def take(self, count: int) -> list[tuple[int, int, float]]:
        """The `count` best candidates (parent, token, score), best first; they never come back."""
        scores = self._scores
        order = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
        ranked = [scores[i] for i in order[:count + 1]]
        if any(a <= b for a, b in zip(ranked, ranked[1:])) or any(s != s for s in scores):
            # a tie at or above the cut (or a NaN): torch.topk's own pick and order
            order = torch.tensor(scores, dtype=torch.float32).topk(count).indices.tolist()
        picked = [(self._parents[i], self._tokens[i], scores[i]) for i in order[:count]]
        for i in order[:count]:
            scores[i] = NEG_INF
        return picked


class HostGrowth:
    """One Equal-Growth build on the host: the tree's per-node lists and its candidate pool."""

    def __init__(self, capacity: int, root_token: int, width: int, token_ids: list[int] | None = None) -> None:
        self.capacity = capacity
        self.tokens, self.parents, self.depth, self.logp = [root_token], [-1], [0], [0.0]
        self.ancestors = [[True] + [False] * (capacity - 1)]  # a row of the ancestor relation per node
        self.pool = HostCandidatePool(width, token_ids)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def expand(self, nodes: list[int], logits: torch.Tensor) -> None:
        """Offer each node's top children (logits: [len(nodes), vocab], one row per node)."""
        self.pool.extend(nodes, [self.logp[n] for n in nodes], logits)

    def grow(self, count: int) -> list[int]:
        """Add the pool's `count` best candidates as nodes (TokenTree.add); their indices."""
        first = self.size
        for parent, token, logp in self.pool.take(count):
            row = list(self.ancestors[parent])
            row[self.size] = True  # the new node is its own ancestor
            self.ancestors.append(row)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.logp.append(logp)
        return list(range(first, self.size))

    def step_inputs(self, nodes: list[int], base: int, span: int) -> tuple[list[int], list[int], list[int], np.ndarray]:
        """A draft step's tokens, positions and slots over these nodes, and its mask [1, len(nodes),
        span] (ModelDrafter._feed's: node i at slot base + i, attending the prefix and its ancestors)."""
        size = self.size
        mask = np.zeros((1, len(nodes), span), dtype=np.bool_)
        mask[0, :, :base] = True
        mask[0, :, base:base + size] = [self.ancestors[n][:size] for n in nodes]
        return ([self.tokens[n] for n in nodes], [base + self.depth[n] for n in nodes], [base + n for n in nodes],
                mask)

    def tree(self) -> TokenTree:
        """The grown tree as a host TokenTree over these lists (its tensors made on first use)."""
        n = self.size
        return TokenTree.from_nodes(HostNodes(self.tokens, self.parents, self.depth, self.logp,
                                              [row[:n] for row in self.ancestors]))
