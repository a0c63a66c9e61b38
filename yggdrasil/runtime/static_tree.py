"""Static speculation trees (Sequoia-style): one fixed shape for every iteration.

A shape is a list of nodes, each written as the ranks of the draft's choices on the path from the
root: (0,) is the draft's best token after the root, (0, 1) that node's second-best child, and so
on. Every prefix of a node must itself be a node. Drafting goes level by level: the nodes of one
level that have children are fed to the draft in one forward (a fixed width per level).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.errors import InvalidRequestError
from yggdrasil.host_reads import staged
from yggdrasil.models.vocab import head_token_ids
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.runtime.tree import TokenTree

TreeShape = tuple[tuple[int, ...], ...]


def branching_shape(branching: list[int]) -> TreeShape:
    """Every node at depth d has branching[d] children: e.g. [3, 2, 1] gives 3 + 6 + 6 nodes."""
    if not branching or any(b < 1 for b in branching):
        raise InvalidRequestError(f"tree branching must be a list of integers >= 1, got {branching}")
    level: list[tuple[int, ...]] = [()]
    nodes: list[tuple[int, ...]] = []
    for b in branching:
        level = [path + (r,) for path in level for r in range(b)]
        nodes.extend(level)
    return tuple(nodes)


def validate_shape(shape: TreeShape) -> TreeShape:
    nodes = set(shape)
    if not shape or len(nodes) != len(shape):
        raise InvalidRequestError("a static tree needs at least one node and no duplicates")
    for path in shape:
        if not path or any((not isinstance(r, int)) or r < 0 for r in path):
            raise InvalidRequestError(f"tree node {list(path)} must be a non-empty list of ranks >= 0")
        if len(path) > 1 and path[:-1] not in nodes:
            raise InvalidRequestError(f"tree node {list(path)} has no parent {list(path[:-1])} in the shape")
    return tuple(sorted(shape, key=lambda p: (len(p), p)))


def load_shape(path: Path) -> TreeShape:
    """A JSON file holding a list of rank paths, e.g. [[0], [1], [0, 0]]."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot read tree shape {path}: {exc}") from None
    if not isinstance(raw, list) or not all(isinstance(p, list) for p in raw):
        raise InvalidRequestError(f"{path}: a tree shape is a JSON list of rank lists, like [[0], [1], [0, 0]]")
    return validate_shape(tuple(tuple(p) for p in raw))


class StaticTreeDrafter(ModelDrafter):
    """Drafts the same tree shape every iteration with a draft model."""

    def __init__(self, runner: StepRunner, shape: TreeShape) -> None:
        shape = validate_shape(shape)
        depth = max(len(p) for p in shape)
        super().__init__(runner, depth, width=1)
        self.shape = shape
        self.index = {path: i + 1 for i, path in enumerate(shape)}  # tree index of each node
        self.parent_of = [0] + [self.index.get(p[:-1], 0) for p in shape]
        self.rank_of = [0] + [p[-1] for p in shape]
        self.levels = [[self.index[p] for p in shape if len(p) == d] for d in range(1, depth + 1)]
        has_children = set(self.parent_of[1:])
        self.fed_levels = [[n for n in level if n in has_children] for level in self.levels]
        self.top = 1 + max(p[-1] for p in shape)
        self._parents: dict[tuple, torch.Tensor] = {}  # _level_parents' staged copies

    @property
    def capacity(self) -> int:
        return 1 + len(self.shape)

    def _add_level(self, tree: TokenTree, level: list[int], logp_by_parent: dict[int, torch.Tensor]) -> None:
        """Add one level on the draft's device: parents are host-known, tokens and scores stay
        on the device (no reads)."""
        parents = self._level_parents(level, tree.device)
        ranks = [self.rank_of[n] for n in level]
        picked = [logp_by_parent[self.parent_of[n]] for n in level]
        tokens = torch.stack([p.indices[r] for p, r in zip(picked, ranks)])
        ids = head_token_ids(self.runner.model)  # a trimmed draft vocabulary: column -> token id
        tokens = tokens if ids is None else ids[tokens]
        logp = torch.stack([tree.logp[self.parent_of[n]] + p.values[r] for n, p, r in zip(level, picked, ranks)])
        tree.add(parents, tokens, logp)

    def _level_parents(self, level: list[int], device: torch.device) -> torch.Tensor:
        """The (fixed) parents of a level's nodes on `device`, staged once per level and kept."""
        key = (tuple(level), str(device))
        if key not in self._parents:
            self._parents[key] = staged((torch.tensor([self.parent_of[n] for n in level]),), device)[0]
        return self._parents[key]

    def build(self, history: list[int]) -> TokenTree:
        root_logits = self._root_logits(history)
        tree = TokenTree.with_root(self.capacity, history[-1], self.runner.device)
        top = {0: torch.log_softmax(root_logits.float(), -1).topk(self.top)}
        for depth, level in enumerate(self.levels):
            self._add_level(tree, level, top)
            fed = self.fed_levels[depth]
            if fed and depth + 1 < len(self.levels):
                logits = self._feed(tree, fed, key=f"static_level{depth + 1}")
                logp = torch.log_softmax(logits.float(), -1).topk(self.top)
                top = {n: type(logp)((logp.values[i], logp.indices[i])) for i, n in enumerate(fed)}
        return tree.to_host(self.runner.reads)

    def warm_up(self) -> None:
        dev = self.runner.device
        tree = TokenTree.with_root(self.capacity, 0, dev)
        for n in range(1, self.capacity):
            tree.add(torch.tensor([self.parent_of[n]], device=dev), torch.tensor([0], device=dev),
                     torch.tensor([0.0], device=dev))
        self._base = 1
        self.runner.run(self._head_inputs([0, 0], 1), key="draft_head")
        for depth, fed in enumerate(self.fed_levels[:-1]):
            if fed:
                self._feed(tree, fed, key=f"static_level{depth + 1}")
