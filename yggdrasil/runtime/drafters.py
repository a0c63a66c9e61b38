"""Drafters: build a speculation tree behind one interface (docs/design.md §3.2).

- ModelDrafter: a small model with the target's tokenizer grows an Equal-Growth Tree: the first
  step expands the root, then every step feeds exactly `width` nodes in one fixed-shape forward and
  adds the `width` best candidates from the whole frontier by path log-probability. With width 1
  this is a chain (gpt-fast style).
- LookupDrafter: model-free prompt lookup; continuations of earlier occurrences of the current
  suffix n-gram, merged into a trie. Costs almost nothing, so any single model can speculate.

Both return a TokenTree whose root is the last committed token; `commit` tells the drafter which
nodes the target accepted so it can keep its cache in sync.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from yggdrasil.runtime.dispatcher import head_sizes, padded, padding_table
from yggdrasil.errors import InvalidRequestError
from yggdrasil.host_reads import staged
from yggdrasil.models.vocab import head_token_ids
from yggdrasil.runtime.host_growth import HostGrowth
from yggdrasil.runtime.steps import StepInputs, StepRunner
from yggdrasil.runtime.tree import TokenTree


class ModelDrafter:
    """Equal-Growth drafting with a draft model (its own StepRunner and KV cache)."""

    kind = "model"

    def __init__(self, runner: StepRunner, depth: int, width: int,
                 widths: tuple[int, ...] = ()) -> None:
        """depth, width: the largest tree; widths: every draft width a build may ask for (each
        is one fixed-shape draft step; default just `width`)."""
        if depth < 1 or width < 1 or any(w < 1 or w > width for w in widths):
            raise InvalidRequestError(f"depth and width must be >= 1 and widths within 1..width, got "
                                      f"depth={depth} width={width} widths={list(widths)}")
        self.runner, self.depth, self.width = runner, depth, width
        self.widths = tuple(sorted(set(widths) | {width}))
        # head steps carry the pending committed tokens + the root: usually one accepted token the
        # draft never fed plus the root, more after iterations that drafted nothing. The
        # head table (one shape per draft width, as compile builds them) pads each to the smallest
        # that fits
        self.head_widths = head_sizes(self.widths)
        self.head_table = padding_table(self.head_widths)
        self.last_pool: _CandidatePool | None = None  # the last build's candidates (calibration)
        # a trimmed draft vocabulary (yggdrasil/models/vocab.py): logit column -> token id
        self.token_ids = head_token_ids(runner.model)
        self._token_id_list: list[int] | None = None  # the same as a list (host builds), made once
        self.cached = 0  # committed tokens whose K/V the draft cache holds
        self._base = 0
        self._fed: set[int] = set()  # tree nodes whose K/V the last build wrote to the cache
        # an ahead-of-time head (stage plan aot_head): the root's logits for the history length
        # they belong to, and the slot holding the root's K/V until commit moves it into place
        self._ready: tuple[int, torch.Tensor] | None = None
        self._ahead_slot: int | None = None

    @property
    def capacity(self) -> int:
        return 1 + self.depth * self.width

    def start(self, prompt_ids: list[int], reuse: int = 0) -> None:
        """Prefill the prompt, keeping the first `reuse` tokens' K/V where the draft cache holds
        them from the last generation (whose history shares that prefix)."""
        keep = min(reuse, self.cached, len(prompt_ids) - 1)
        self.runner.prefill(prompt_ids[keep:], start=keep)
        self.cached = len(prompt_ids)
        self._ready = None

    def truncate(self, valid: int) -> None:
        """Only the first `valid` committed tokens' K/V can be trusted (an interrupted call)."""
        self.cached = min(self.cached, valid)
        self._ready = None

    def _head_inputs(self, pending: list[int], base: int) -> StepInputs:
        """Pending committed tokens + the root at their own slots, padded to a head width (built
        in numpy on the host, staged in one copy)."""
        n, runner = len(pending), self.runner
        size = padded(self.head_table, n, "draft_head", "draft_widths")
        first = base - n + 1  # the first pending token's position (and slot)
        pad = size - n
        mask = np.zeros((1, size, runner.span(base + self.capacity)), dtype=np.bool_)
        mask[0, :n, :first] = True  # real rows: the prefix, and causally each other
        mask[0, :n, first:first + n] = [[k <= row for k in range(n)] for row in range(n)]
        if pad:
            mask[0, n:, first] = True  # padding rows attend the first real slot only, so they stay finite
        return runner.stage_rows(pending + [0] * pad, list(range(first, first + n)) + [0] * pad,
                                 list(range(first, first + n)) + [runner.scratch_slot] * pad, mask)

    def rewind(self, history: list[int]) -> None:
        """Build again from the root of `history` (the root's K/V is simply rewritten)."""
        self.truncate(len(history) - 1)

    def _catch_up(self, history: list[int]) -> list[int]:
        """Prefill committed tokens the cache lacks beyond what fits in the head step."""
        pending = history[self.cached:]
        widest = self.head_widths[-1]
        if len(pending) > widest:
            extra = pending[:-widest]
            self.runner.prefill(extra, start=self.cached)
            self.cached += len(extra)
            pending = pending[len(extra):]
        return pending

    def _root_logits(self, history: list[int]) -> torch.Tensor:
        """Head step: feed pending committed tokens and the root; the root's next-token logits."""
        self._base = len(history) - 1
        self._fed = set()
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == len(history) == self.cached:
            return ready[1]  # drafted ahead of time, and the root's K/V is in place
        pending = self._catch_up(history)  # ends with the root
        logits = self.runner.run(self._head_inputs(pending, self._base), key="draft_head")
        self.cached = len(history)
        return logits[0, len(pending) - 1]

    def build(self, history: list[int]) -> TokenTree:
        return self.build_shaped(history, self.depth, self.width)

    def build_shaped(self, history: list[int], depth: int, width: int) -> TokenTree:
        """An Equal-Growth Tree of `depth` steps of `width` nodes (within the drafter's maximum).

        Its first d steps are exactly the tree a depth-d build would make, which calibration uses.
        The tree grows on the draft's device with fixed-shape ops (candidates picked by a device
        top-k) and comes to the host in one packed read at the end.
        """
        if not (1 <= depth <= self.depth and width in self.widths):
            raise InvalidRequestError(f"no draft shape for depth {depth} width {width}: this drafter "
                                      f"has depths 1..{self.depth} and widths {list(self.widths)}")
        root_logits = self._root_logits(history)
        if self.runner.reads.on_host:
            return self._build_on_host(history[-1], root_logits, depth, width)
        dev = self.runner.device
        tree = TokenTree.with_root(1 + depth * width, history[-1], dev)
        pool = _CandidatePool(width, depth, dev, self.token_ids)
        pool.extend(torch.zeros(1, dtype=torch.long, device=dev), tree.logp[:1], root_logits[None])
        for step in range(1, depth + 1):
            parents, tokens, scores = pool.take(width)
            added = tree.add(parents, tokens, scores)
            if step < depth:
                first = tree.size - width  # the nodes just added: known on the host
                pool.extend(added, tree.logp[added], self._feed(tree, list(range(first, tree.size))))
        self.last_pool = pool
        return tree.to_host(self.runner.reads)

    def _build_on_host(self, root: int, root_logits: torch.Tensor, depth: int, width: int) -> TokenTree:
        """build_shaped's tree grown in Python lists (the draft runs on the host: host_growth.py),
        the same tree as the device path's."""
        if self._token_id_list is None and self.token_ids is not None:
            self._token_id_list = self.token_ids.tolist()  # a trimmed head's column -> token id, once
        growth = HostGrowth(1 + depth * width, root, width, self._token_id_list)
        growth.expand([0], root_logits)
        span = self.runner.span(self._base + self.capacity)
        for step in range(1, depth + 1):
            added = growth.grow(width)
            if step < depth:
                inputs = self.runner.stage_rows(*growth.step_inputs(added, self._base, span))
                self._fed.update(added)
                growth.expand(added, self.runner.run(inputs, key="draft_step"))
        self.last_pool = growth.pool
        return growth.tree()

    def _feed(self, tree: TokenTree, nodes: list[int], key: str = "draft_step") -> torch.Tensor:
        """One fixed-shape draft forward over nodes of a tree on the draft's device (no reads);
        their logits [len(nodes), vocab]."""
        base = self._base
        span = self.runner.span(base + self.capacity)
        index = self._node_index(nodes, tree.device)
        columns = torch.arange(tree.size, device=tree.device)
        values = (tree.tokens[index][None], tree.positions(index, base)[None],
                  (base + index)[None], tree.mask_for(index, columns, base, span)[None])
        # a host tree (the AOT tail feeds the built tree) is staged like any host input
        inputs = StepInputs(*values) if tree.device == self.runner.device else self.runner.stage(*values)
        self._fed.update(nodes)
        return self.runner.run(inputs, key=key)[0]

    def _node_index(self, nodes: list[int], device: torch.device) -> torch.Tensor:
        """nodes as an index tensor on `device`, with no pageable host→device copy: a run of
        consecutive nodes (every draft step's) is an arange made there, any other list is staged."""
        if nodes == list(range(nodes[0], nodes[0] + len(nodes))):
            return torch.arange(nodes[0], nodes[0] + len(nodes), device=device)
        index = torch.tensor(nodes, dtype=torch.long)
        return staged((index,), device)[0]

    def warm_up(self) -> None:
        """Run every draft shape once (compiles them when the runner compiles)."""
        self._base = self.head_widths[-1]  # room for the widest head's pending tokens
        for width in self.head_widths:
            self.runner.run(self._head_inputs([0] * width, self._base), key="draft_head")
        dev = self.runner.device
        for width in self.widths:
            tree = TokenTree.with_root(1 + width, 0, dev)
            tree.add(torch.zeros(width, dtype=torch.long, device=dev),
                     torch.zeros(width, dtype=torch.long, device=dev), torch.zeros(width, device=dev))
            self._feed(tree, list(range(1, 1 + width)))

    def commit(self, accepted_nodes: list[int]) -> None:
        """The target accepted these tree nodes (in depth order): keep their draft K/V.

        Nodes fed to the draft (all but the last step's, unless fed ahead of time) have K/V at
        base + index; they move to base + 1, base + 2, ...; the first unfed accepted node stays
        pending for the next head step. A root drafted ahead of time moves in behind them.
        """
        fed = []
        for node in accepted_nodes:
            if node not in self._fed:
                break
            fed.append(node)
        src, dst = [self._base + n for n in fed], [self._base + 1 + k for k in range(len(fed))]
        if self._ahead_slot is not None:
            src.append(self._ahead_slot)
            dst.append(self._base + 1 + len(fed))
            self._ahead_slot = None
        move_slots(self.runner, src, dst, self.depth + 1)
        self.cached = self._base + 1 + len(dst)

    # -- ahead-of-time drafting (stage plans, yggdrasil/runtime/stage_plan.py) -------------------------
    def _unfed(self, tree: TokenTree) -> list[int]:
        return [n for n in range(1, tree.size) if n not in self._fed]

    def feed_last_level(self, tree: TokenTree) -> None:
        """AOT tail: feed the nodes the build left unfed (its last level), so that whichever the
        target accepts, the next head has only the root to read."""
        nodes = self._unfed(tree)
        if nodes:
            self._feed(tree, nodes)

    def draft_ahead(self, tree: TokenTree, kept: torch.Tensor, choices: torch.Tensor,
                    verify_rows: int) -> torch.Tensor:
        """AOT head: the next head for every verified node's bonus candidate (its choice, one
        position deeper), plus the unfed last level if any; returns the candidates' logits
        [verify_rows, vocab]. Candidate j's K/V goes to slot base + capacity + j, outside the
        tree, until adopt_ahead picks one."""
        base, runner = self._base, self.runner
        unfed = self._unfed(tree)
        self._fed.update(unfed)
        tail = torch.tensor(unfed, dtype=torch.long)
        n_tail, n_kept = len(unfed), kept.numel()
        rows = n_tail + verify_rows
        span = runner.span(base + self.capacity + verify_rows)
        columns = torch.arange(tree.size)
        first = base + self.capacity
        # a host tree: everything but the candidates' tokens is built on the host and staged
        tokens = torch.zeros(rows, dtype=torch.long)
        positions = torch.zeros(rows, dtype=torch.long)
        slots = torch.full((rows,), runner.scratch_slot)
        mask = torch.zeros(rows, span, dtype=torch.bool)
        mask[:, base] = True  # padding rows attend the root only, so they stay finite
        tokens[:n_tail], positions[:n_tail] = tree.tokens[tail], tree.positions(tail, base)
        slots[:n_tail] = base + tail
        mask[:n_tail] = tree.mask_for(tail, columns, base, span)
        real = slice(n_tail, n_tail + n_kept)
        candidate_slots = first + torch.arange(n_kept)
        positions[real] = tree.positions(kept, base) + 1
        slots[real] = candidate_slots
        mask[real] = tree.mask_for(kept, columns, base, span)
        mask[torch.arange(n_tail, n_tail + n_kept), candidate_slots] = True  # ...and itself
        inputs = runner.stage(tokens[None], positions[None], slots[None], mask[None])
        inputs.tokens[0, real] = choices[:n_kept]  # the target's choices stay on the device
        return runner.run(inputs, key="draft_ahead")[0, n_tail:]

    def adopt_ahead(self, logits: torch.Tensor, kept_index: int, history_length: int) -> None:
        """Acceptance ended at verified node `kept_index`: its candidate is the next root (the
        history then has `history_length` tokens); commit moves its K/V into place."""
        self._ready = (history_length, logits[kept_index])
        self._ahead_slot = self._base + self.capacity + kept_index

    def warm_up_ahead(self, rows: set[int]) -> None:
        """Run each ahead-of-time head shape once (compiles them when the runner compiles)."""
        dev = self.runner.device
        for n in sorted(rows):
            span = self.runner.span(self.capacity + n + 1)
            mask = torch.zeros(1, n, span, dtype=torch.bool, device=dev)
            mask[..., 0] = True
            slots = torch.full((1, n), self.runner.scratch_slot, device=dev)
            zeros = torch.zeros(1, n, dtype=torch.long, device=dev)
            self.runner.run(StepInputs(zeros, zeros, slots, mask), key="draft_ahead")


class _CandidatePool:
    """Every expanded node's top-`width` children, scored by path log-probability."""

    def __init__(self, width: int, depth: int, device: torch.device | str = "cpu",
                 token_ids: torch.Tensor | None = None) -> None:
        """On the draft's device: extend and take are fixed-shape ops that never read it.
        token_ids: a trimmed head's token id per logit column (None: the column is the id)."""
        self.width, self.token_ids = width, token_ids
        size = width + (depth - 1) * width * width
        self.parents = torch.zeros(size, dtype=torch.long, device=device)
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.scores = torch.full((size,), float("-inf"), device=device)
        self.used = 0

    def extend(self, parents: torch.Tensor, parent_logp: torch.Tensor, logits: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = logp.topk(self.width, dim=-1)
        n = parents.numel() * self.width
        span = slice(self.used, self.used + n)
        self.parents[span] = parents.repeat_interleave(self.width)
        tokens = top.indices.reshape(-1)
        self.tokens[span] = tokens if self.token_ids is None else self.token_ids[tokens]
        self.scores[span] = (parent_logp[:, None] + top.values).reshape(-1)
        self.used += n

    def children_of(self, node: int) -> list[int]:
        """The tokens proposed under an expanded node, best first (empty if never expanded).
        Calibration's bookkeeping, outside the decode loop: it reads the pool directly."""
        hits = (self.parents[:self.used] == node).nonzero().flatten()
        return self.tokens[hits].tolist()

    def take(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        best = self.scores[:self.used].topk(count).indices
        picked = self.parents[best], self.tokens[best], self.scores[best].clone()
        self.scores[best] = float("-inf")  # taken candidates never come back
        return picked


def move_slots(runner: StepRunner, src: list[int], dst: list[int], width: int) -> None:
    """Copy K/V from src slots to dst slots in one fixed-shape move of `width` (StepRunner.move_slots)."""
    runner.move_slots(src, dst, width)


class LookupDrafter:
    """Prompt lookup: continuations of earlier occurrences of the current suffix, as a trie."""

    kind = "lookup"
    # pseudo acceptance probability per drafted token by matched n-gram length (1, 2, 3+)
    MATCH_CONFIDENCE = (0.35, 0.55, 0.7)

    def __init__(self, depth: int, width: int, max_ngram: int = 3) -> None:
        if depth < 1 or width < 1:
            raise InvalidRequestError(f"depth and width must be >= 1, got depth={depth} width={width}")
        self.depth, self.width, self.max_ngram = depth, width, max_ngram

    @property
    def capacity(self) -> int:
        return 1 + self.depth * self.width

    def start(self, prompt_ids: list[int], reuse: int = 0) -> None:
        pass

    def truncate(self, valid: int) -> None:
        pass  # no cache

    def commit(self, accepted_nodes: list[int]) -> None:
        pass

    def rewind(self, history: list[int]) -> None:
        pass  # stateless: every build starts from the history

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(range(1, self.width + 1))

    def continuations(self, history: list[int], depth: int | None = None,
                      width: int | None = None) -> list[tuple[list[int], float]]:
        """Up to `width` distinct continuations, most specific match and most recent first."""
        depth, width = depth or self.depth, width or self.width
        seq = np.asarray(history, dtype=np.int64)
        found: list[tuple[list[int], float]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))[::-1]
            confidence = self.MATCH_CONFIDENCE[min(n, len(self.MATCH_CONFIDENCE)) - 1]
            for start in starts:
                follow = seq[start + n:start + n + depth].tolist()
                key = tuple(follow)
                if follow and key not in seen:
                    seen.add(key)
                    found.append((follow, math.log(confidence)))
                    if len(found) == width:
                        return found
        return found

    def build(self, history: list[int]) -> TokenTree:
        return self.build_shaped(history, self.depth, self.width)

    def build_shaped(self, history: list[int], depth: int, width: int) -> TokenTree:
        """The continuations merged into a trie, built as lists and made a host tree at once."""
        tokens, parents, logp = [history[-1]], [-1], [0.0]
        index: dict[tuple[int, int], int] = {}
        for follow, step_logp in self.continuations(history, depth, width):
            node = 0
            for token in follow:
                child = index.get((node, token))
                if child is None:
                    child = index[(node, token)] = len(tokens)
                    # rounded to float32 as the tree stores it (ranks and ties stay the same)
                    logp.append(float(np.float32(logp[node] + step_logp)))
                    tokens.append(token)
                    parents.append(node)
                node = child
        return TokenTree.from_lists(tokens, parents, logp)


def choose_drafter(draft: StepRunner | None, depth: int, width: int,
                   widths: tuple[int, ...] = ()) -> ModelDrafter | LookupDrafter:
    """The one choice between the two ways to draft a tree of this depth and width: the draft
    model's runner growing Equal-Growth trees (over these draft widths), or prompt lookup
    without a draft model."""
    if draft is None:
        return LookupDrafter(depth, width)
    return ModelDrafter(draft, depth, width, widths)
