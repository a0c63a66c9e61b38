"""TokenTree: one speculation tree in fixed-capacity tensors (docs/design.md §3.2).

Node 0 is the root: the last committed token, whose K/V is not yet in the caches. Every other node
is a candidate continuation. All per-node state lives in tensors of the tree's capacity, and the
attention masks, positions and slots are derived with tensor ops (no Python loop over nodes):

    tokens [N]  parents [N] (-1 for the root)  depth [N]  logp [N] (path log-probability)
    ancestors [N, N] bool: ancestors[i, j] is True when j is i or one of i's ancestors

Where it lives: a draft model grows its tree on the model's device (fixed-shape ops, no reads);
`to_host` then brings the whole tree to the host in one packed read. Pruning, the verify's inputs
and the walk work on host trees only; the target's choices come to the host in one read too.

Cache layout while a tree is in flight, with `base` = slot of the root = committed length - 1:
the draft cache holds node i at slot base + i (nodes accumulate over draft steps); a verify forward
over kept nodes K (ascending) puts K[j] at slot base + j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yggdrasil.host_reads import HostReads

NEG_INF = float("-inf")


class TokenTree:
    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = capacity
        self.device = torch.device(device)
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.parents = torch.full((capacity,), -1, dtype=torch.long, device=self.device)
        self.depth = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.logp = torch.full((capacity,), NEG_INF, device=self.device)
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=self.device)
        self.size = 0
        self._nodes: HostNodes | None = None  # nodes(), made once per host tree

    @classmethod
    def with_root(cls, capacity: int, root_token: int, device: torch.device | str = "cpu") -> "TokenTree":
        tree = cls(capacity, device)
        tree.tokens[0] = root_token
        tree.logp[0] = 0.0
        tree.ancestors[0, 0] = True
        tree.size = 1
        return tree

    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int], logp: list[float]) -> "TokenTree":
        """A host tree from plain lists (node 0 the root, parents before children): a few
        tensor ops in all, where adding node by node costs a handful per node."""
        n = len(tokens)
        depth, ancestors = [0] * n, [[False] * n for _ in range(n)]
        ancestors[0][0] = True
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            ancestors[i] = list(ancestors[parents[i]])
            ancestors[i][i] = True
        tree = cls.__new__(cls)
        tree.capacity, tree.size, tree.device = n, n, torch.device("cpu")
        tree.tokens, tree.parents = torch.tensor(tokens), torch.tensor([-1] + list(parents[1:]))
        tree.depth, tree.logp = torch.tensor(depth), torch.tensor(logp, dtype=torch.float32)
        tree.ancestors = torch.tensor(ancestors)
        return tree

    @classmethod
    def from_nodes(cls, nodes: "HostNodes") -> "TokenTree":
        """A host tree over lists (node 0 the root, parents before children, ancestors [n, n]):
        the decode loop's host paths read only the lists, so its tensors are made on first use."""
        tree = cls.__new__(cls)
        tree.capacity = tree.size = len(nodes.tokens)
        tree.device, tree._nodes = torch.device("cpu"), nodes
        return tree

    def __getattr__(self, name: str):
        """The tensors of a tree made from_nodes, made when first asked for."""
        nodes = self.__dict__.get("_nodes")
        if name not in ("tokens", "parents", "depth", "logp", "ancestors") or nodes is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.tokens, self.parents, self.depth = (torch.tensor(v, dtype=torch.long)
                                                 for v in (nodes.tokens, nodes.parents, nodes.depth))
        self.logp = torch.tensor(nodes.logp, dtype=torch.float32)
        self.ancestors = torch.tensor(nodes.ancestors, dtype=torch.bool).reshape(self.size, self.size)
        return self.__dict__[name]

    def add(self, parents: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """Append nodes (parents must already exist); returns their indices."""
        n = parents.numel()
        if self.size + n > self.capacity:
            raise ValueError(f"tree capacity {self.capacity} exceeded")
        new = slice(self.size, self.size + n)  # slices, not index tensors: no host/device mixing
        self.tokens[new] = tokens
        self.parents[new] = parents
        self.depth[new] = self.depth[parents] + 1
        self.logp[new] = logp
        self.ancestors[new] = self.ancestors[parents]
        self.ancestors[new, new].diagonal().fill_(True)
        self.size += n
        self._nodes = None
        return torch.arange(new.start, new.stop, device=self.device)

    def to_host(self, reads: HostReads) -> "TokenTree":
        """This tree's nodes on the host, in one packed read (its capacity is its size)."""
        n = self.size
        host = TokenTree.__new__(TokenTree)
        host.tokens, host.parents, host.depth, host.logp, host.ancestors = reads.packed(
            self.tokens[:n], self.parents[:n], self.depth[:n], self.logp[:n], self.ancestors[:n, :n])
        host.capacity, host.size, host.device = n, n, torch.device("cpu")
        return host

    # ---- derived views -------------------------------------------------------------------

    def nodes(self) -> "HostNodes":
        """A host tree's nodes as Python lists, made once: an iteration's prune, verify inputs and
        walk read a few dozen nodes, where each tensor op costs microseconds and a list lookup
        nanoseconds."""
        nodes = getattr(self, "_nodes", None)  # trees made by __new__ (to_host) have none yet
        if nodes is None:
            n = self.size
            nodes = self._nodes = HostNodes(self.tokens[:n].tolist(), self.parents[:n].tolist(),
                                            self.depth[:n].tolist(), self.logp[:n].tolist(),
                                            self.ancestors[:n, :n].tolist())
        return nodes

    def top_list(self, count: int) -> list[int]:
        """top_nodes(count) as a list, computed in Python with the same double arithmetic (so
        the same nodes); where two scores tie exactly (or one is NaN) torch.topk's own pick
        among them decides, so top_nodes answers."""
        nodes, n = self.nodes(), self.size
        scores = [(logp - 1e-9 * depth) - 1e-12 * i for i, (logp, depth) in enumerate(zip(nodes.logp, nodes.depth))]
        scores[0] = float("inf")
        if len(set(scores)) < n or any(s != s for s in scores):
            return self.top_nodes(count).tolist()
        return sorted(sorted(range(n), key=scores.__getitem__, reverse=True)[:min(count, n)])

    def top_nodes(self, count: int) -> torch.Tensor:
        """Indices of the `count` most probable nodes, ascending (the root first).

        A child's path probability never exceeds its parent's; ties are broken toward shallower
        nodes, then lower indices (parents come before children), so the set is a connected subtree.
        """
        count = min(count, self.size)
        return self.rank_scores().topk(count).indices.sort().values

    def rank_scores(self) -> torch.Tensor:
        """[size] the order top_nodes keeps nodes in: path log-probability, ties toward shallower
        nodes then lower indices; the root always first."""
        score = self.logp[:self.size].double() - 1e-9 * self.depth[:self.size].double()
        score = score - 1e-12 * torch.arange(self.size, device=self.device, dtype=torch.double)
        score[0] = float("inf")
        return score

    def positions(self, nodes: torch.Tensor, base: int) -> torch.Tensor:
        return base + self.depth[nodes]

    def mask_for(self, rows: torch.Tensor, columns: torch.Tensor, base: int, span: int) -> torch.Tensor:
        """[len(rows), span] bool: rows attend the committed prefix (< base) and their ancestors
        among `columns`, which sit at slots base + position-in-columns."""
        mask = torch.zeros(rows.numel(), span, dtype=torch.bool, device=self.device)
        mask[:, :base] = True
        mask[:, base:base + columns.numel()] = self.ancestors[rows][:, columns]
        return mask

    def check_slot_order(self, kept: torch.Tensor) -> None:
        """Assert what the verify's slot layout relies on: kept[j] goes to slot base + j, so each
        kept node's ancestors must come before it in `kept` (the root first). Then the keys a row
        attends sit in slot order exactly as its path runs, the order a decode step meets them in,
        and the fixed-order attention sums its denominator over the same sequence in a verify as in
        a decode (yggdrasil/kernels/README.md). top_nodes' ascending indices give this, because a
        node's parent always has a lower index (add: parents must already exist)."""
        kept = kept.tolist() if isinstance(kept, torch.Tensor) else list(kept)
        parents = self.local_parent_list(kept)
        if not kept or kept[0] != 0 or any(not 0 <= p < j for j, p in enumerate(parents[1:], 1)):
            raise AssertionError(f"verify rows out of path order: kept nodes {kept} with local parents "
                                 f"{parents}; each node's parent must be kept before it, the root first")

    def local_parent_list(self, nodes: list[int]) -> list[int]:
        """local_parents of a host tree's nodes, as a list."""
        where, parents = {node: j for j, node in enumerate(nodes)}, self.nodes().parents
        return [where.get(parents[node], -1) for node in nodes]

    def local_parents(self, nodes: torch.Tensor) -> torch.Tensor:
        """Parent of each of `nodes` as a position within `nodes` (-1 for the root)."""
        where = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)
        where[nodes] = torch.arange(nodes.numel(), device=self.device)
        parents = self.parents[nodes]
        return torch.where(parents >= 0, where[parents.clamp(min=0)], -1)


@dataclass(frozen=True)
class HostNodes:
    """TokenTree.nodes(): a host tree's per-node values as lists; ancestors[i][j] is True where
    j is i or one of i's ancestors."""

    tokens: list[int]
    parents: list[int]
    depth: list[int]
    logp: list[float]
    ancestors: list[list[bool]]


@dataclass(frozen=True)
class WalkResult:
    """Outcome of verifying one tree: path[0] is the root; the new tokens are path[1:] + bonus."""

    path: list[int]  # indices into the verified node list (0 = root)
    accepted_tokens: list[int]  # tokens of path[1:]
    bonus: int

    @property
    def committed(self) -> list[int]:
        return self.accepted_tokens + [self.bonus]


def walk(tokens: torch.Tensor | list[int], parents: torch.Tensor | list[int],
         choices: torch.Tensor | list[int]) -> WalkResult:
    """Follow the target from the root over the verified nodes (index 0 = root), on the host.

    tokens, parents (local, -1 for the root) and choices are [V] host tensors or lists; choices[j] is the
    target's token at node j (its argmax, or a draw made with that node's pre-drawn uniform). From
    each node the walk descends into the first child holding the target's token; where there is
    none, that token is the bonus. A few dozen nodes: plain Python beats tensor ops here.
    """
    token_list, parent_list, choice_list = (v.tolist() if isinstance(v, torch.Tensor) else v
                                            for v in (tokens, parents, choices))
    child: dict[tuple[int, int], int] = {}
    for j in range(1, len(token_list)):
        child.setdefault((parent_list[j], token_list[j]), j)
    node, path = 0, [0]
    while (nxt := child.get((node, choice_list[node]))) is not None:
        node = nxt
        path.append(node)
    return WalkResult(path, [token_list[j] for j in path[1:]], int(choice_list[node]))


def walk_on_device(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                   choices: torch.Tensor, reads: HostReads | None = None,
                   extra: tuple[torch.Tensor, ...] = ()) -> tuple[WalkResult, list[torch.Tensor]]:
    """walk() as one tensor computation on the tensors' device, read back in one transfer
    (with the `extra` tensors, returned on the host).

    ancestors [V, V] is True where column k is row j or one of its ancestors (among the verified
    nodes). A node is accepted when every node on its path holds the target's choice at its
    parent; like walk(), where siblings repeat a token the first one counts. The accepted nodes
    form one path; its deepest node's choice is the bonus.
    """
    v, dev = tokens.numel(), tokens.device
    index = torch.arange(v, device=dev)
    hit = (parents[None, :] == index[:, None]) & (tokens[None, :] == choices[:, None])  # [parent, child]
    first = hit & (hit.cumsum(1) == 1)  # walk() descends into the first matching child
    matched = first.any(0) | (parents < 0)
    accepted = ~(ancestors & ~matched[None, :]).any(1)
    depth = ancestors.sum(1)
    last = torch.where(accepted, depth, 0).argmax()
    # index_select, not ancestors[last]: indexing by a 0-dim device tensor reads it (a sync)
    on_path = ancestors.index_select(0, last.reshape(1))[0]
    packed = torch.stack([on_path.long(), tokens, choices.long(), last.expand(v)])
    packed, *extra = (reads or HostReads()).packed(packed, *extra)
    on_path, token_list, choice_list, (deepest, *_) = packed.tolist()
    path = [j for j in range(v) if on_path[j]]
    return WalkResult(path, [token_list[j] for j in path[1:]], choice_list[deepest]), extra
