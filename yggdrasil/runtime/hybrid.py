"""Hybrid drafting (issue 51): prompt lookup where the context has a match, the draft model
elsewhere, in the same fixed-shape verify buckets.

Each iteration the objective (docs/design.md §3.1) prices the two ways to draft:

    lookup alone   (1 + E_lookup) · T_verify(1) / T_verify(V_lookup)     no draft step at all
    the model      the speedup calibration measured for the policy's constant bucket

E_lookup = Σ_i c^i over the best continuation's tokens, with c the per-token acceptance of a
lookup match of that n-gram length: a prior (LookupDrafter.MATCH_CONFIDENCE) updated with what
this generation's lookup iterations actually accepted, so a context whose matches keep failing
stops being trusted. When lookup wins, the tree is the lookup trie alone (the draft model's
cache falls behind and catches up at its next head step); otherwise the draft model grows its
Equal-Growth tree and the lookup continuations are merged into it as extra branches, whose path
scores (log c per token) compete with the model's nodes when the tree is pruned to the verify
width. Either tree is verified on the bundle's compiled verify widths.

Lookup nodes come after the model's nodes, so the draft model's bookkeeping (which nodes it fed)
is untouched; a lookup node it never fed is a pending token at its next head step.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.tree import TokenTree

PRIOR_WEIGHT = 4.0  # the prior confidence counts as this many observed tokens


class HybridDrafter:
    kind = "hybrid"

    def __init__(self, model: ModelDrafter | None, lookup_depth: int, lookup_width: int = 1,
                 profile: LatencyProfile | None = None, verifies: Sequence[int] = (),
                 model_speedup: float | None = None) -> None:
        """profile, verifies: the step times and compiled verify widths the lookup-only price
        uses; model_speedup: the objective's value of drafting with the model (None: never draft
        by lookup alone, only merge its branches into the model's tree). model None: no draft
        model (a lookup bundle): where lookup does not pay, the tree is the root alone, a plain
        decode step, and model_speedup is plain decoding's, 1."""
        self.model = model
        self.lookup = LookupDrafter(lookup_depth, lookup_width)
        self.profile, self.verifies, self.model_speedup = profile, sorted(verifies), model_speedup
        self.width, self.widths = (model.width, model.widths) if model is not None else (1, (1,))
        self.depth = max(model.depth if model is not None else 0, lookup_depth)  # the longest acceptable path
        n = len(LookupDrafter.MATCH_CONFIDENCE)
        self._accepted = [c * PRIOR_WEIGHT for c in LookupDrafter.MATCH_CONFIDENCE]
        self._offered = [PRIOR_WEIGHT] * n
        self._lookup_only: list[int] | None = None  # this build's lookup path's n-gram tiers
        self.lookup_iterations = self.model_iterations = 0

    @property
    def runner(self):
        """The draft model's step runner (traces and benchmarks look for it), if any."""
        return None if self.model is None else self.model.runner

    @property
    def capacity(self) -> int:
        return (1 if self.model is None else self.model.capacity) + self.lookup.depth * self.lookup.width

    def confidence(self, ngram: int) -> float:
        """Per-token acceptance of a lookup match of this n-gram length, as observed so far."""
        tier = min(ngram, len(self._offered)) - 1
        return self._accepted[tier] / self._offered[tier]

    # -- the drafter protocol, delegated to the model where it keeps state -------------------
    def start(self, prompt_ids: list[int], reuse: int = 0) -> None:
        if self.model is not None:
            self.model.start(prompt_ids, reuse)

    def truncate(self, valid: int) -> None:
        if self.model is not None:
            self.model.truncate(valid)

    def rewind(self, history: list[int]) -> None:
        if self.model is not None:
            self.model.rewind(history)

    def warm_up(self) -> None:
        if self.model is not None:
            self.model.warm_up()

    def build(self, history: list[int]) -> TokenTree:
        if self.model is None:
            return self.build_shaped(history, self.lookup.depth, 1)
        return self.build_shaped(history, self.model.depth, self.model.width)

    def build_shaped(self, history: list[int], depth: int, width: int) -> TokenTree:
        found = self._continuations(history)
        if found and self._lookup_pays(found[0]):
            self.lookup_iterations += 1
            self._lookup_only = [found[0][2]] * len(found[0][0])
            return _trie([], [], [], found, history[-1])
        self._lookup_only = None
        self.model_iterations += 1
        if self.model is None:  # nothing worth verifying: the root alone, a plain decode step
            return TokenTree.from_lists([history[-1]], [-1], [0.0])
        tree = self.model.build_shaped(history, depth, width)
        if not found:
            return tree
        n = tree.size
        return _trie(tree.tokens[:n].tolist(), tree.parents[:n].tolist(), tree.logp[:n].tolist(), found, history[-1])

    def commit(self, accepted_nodes: list[int]) -> None:
        if self._lookup_only is None:
            if self.model is not None:
                self.model.commit(accepted_nodes)
            return
        # a lookup-only tree is one path (node i at depth i): its first len(accepted) tokens held
        tiers = self._lookup_only
        for depth, tier in enumerate(tiers):
            if depth > len(accepted_nodes):
                break
            self._offered[tier - 1] += 1
            self._accepted[tier - 1] += depth < len(accepted_nodes)

    # -- pricing ---------------------------------------------------------------------------
    def _continuations(self, history: list[int]) -> list[tuple[list[int], float, int]]:
        """(tokens, log confidence per token, n-gram length) of each continuation, best first."""
        found, tiers = [], LookupDrafter.MATCH_CONFIDENCE
        for follow, logp in self.lookup.continuations(history):
            # the n-gram length the lookup matched, from the prior confidence it gave the match
            ngram = 1 + min(range(len(tiers)), key=lambda i: abs(tiers[i] - math.exp(logp)))
            found.append((follow, math.log(self.confidence(ngram)), ngram))
        return found

    def _lookup_pays(self, best: tuple[list[int], float, int]) -> bool:
        if self.model_speedup is None or self.profile is None or not self.verifies:
            return False
        follow, logp, _ = best
        c = math.exp(logp)
        expected = sum(c ** i for i in range(1, len(follow) + 1))
        fits = [v for v in self.verifies if v >= 1 + len(follow)]
        if not fits:
            return False
        t_verify = min(self.profile.t_verify(v) for v in fits)
        return (1 + expected) * self.profile.t_verify(1) / t_verify > self.model_speedup


def _trie(tokens: list[int], parents: list[int], logp: list[float],
          found: list[tuple[list[int], float, int]], root: int) -> TokenTree:
    """The tree (lists of a host tree, or empty for a root alone) with each continuation merged
    in after its nodes: a continuation's token under a node that already has it follows that
    node, any other becomes a new node scored by the continuation's log confidence per token."""
    if not tokens:
        tokens, parents, logp = [root], [-1], [0.0]
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}
    for follow, step_logp, _ in found:
        node = 0
        for token in follow:
            nxt = child.get((node, token))
            if nxt is None:
                nxt = child[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                logp.append(float(_f32(logp[node] + step_logp)))
            node = nxt
    return TokenTree.from_lists(tokens, parents, logp)


def _f32(x: float) -> float:
    """Rounded to float32, as trees store path scores (ranks and ties stay the same)."""
    return float(np.float32(x))


def hybrid_drafter(policy, draft_runner, lookup_depth: int | None = None) -> HybridDrafter:
    """The hybrid over a bundle's policy (yggdrasil.policy.auto.AutoPolicy): its grid's model
    drafter (none for a lookup bundle), lookup continuations as deep as the widest compiled
    verify allows, priced against the policy's constant bucket (plain decoding's 1 where that
    is no speculation or there is no draft model) on the policy's step times."""
    grid = policy.grid
    depth = lookup_depth or max(1, max(grid.verifies) - 1)
    bucket, speedup = policy.selector.constant()
    # where the model's best bucket is no speculation, drafting with it never pays: lookup or nothing
    model = policy.drafter(draft_runner) if draft_runner is not None and bucket.depth else None
    if model is None:
        speedup = 1.0
    return HybridDrafter(model, depth, 1, policy.profile, grid.verifies, speedup)


def hybrid_speculator(runner, draft_runner, policy):
    """A speculator drafting with hybrid_drafter: under the policy's buckets when it speculates;
    where its best constant bucket is no speculation (the policy would never ask a drafter),
    with the objective choosing each tree's verify width among the compiled ones."""
    drafter = hybrid_drafter(policy, draft_runner)
    if drafter.model is None:
        return build_speculator(runner, drafter, verify=policy.grid.verifies, latency=policy.profile)
    return build_speculator(runner, drafter, policy=policy)
