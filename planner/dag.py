"""The stage DAG of speculative iterations and the ahead-of-time moves (docs/design.md §3.5).

One iteration of a (D, W, V) bucket is a chain of stages:

    head -> draft_1 .. draft_{D-1} -> prune -> verify -> accept -> compact -> next head

- head: the draft model reads the root (the last committed token) and proposes its children. As
  our runtime does it, the head also feeds the accepted leaf if the last draft step never fed it
  (the "tail" of the paper's naive pipeline, merged into one 2-row step);
- draft_k: one Equal-Growth step over W frontier nodes;
- prune (host): pick the V nodes to verify and build the verify inputs;
- verify: one target forward over V rows under the tree mask;
- accept (host, or device): walk the tree with the target's choices; the accepted path and the
  bonus token are known after it;
- compact: move the accepted K/V into place (target and draft caches).

Two moves break dependencies by doing a superset of the work ahead of time:

- AOT tail draft: feed every last-level candidate (W rows) to the draft right after the last
  draft step, in the verify's shadow, and keep the accepted one. The accepted leaf's feed no
  longer waits for acceptance, and the next head reads the root alone (still a 2-row graph
  here: our smallest compiled head).
- AOT head draft: run the next head on the bonus token of every verified node (V rows, the
  target's choice at each node is known once verify ends), and keep the accepted one. Removes
  accept -> next head: the next iteration's drafting overlaps acceptance. Without the AOT tail
  the head also feeds the last-level candidates itself (V + W rows).

Graphs are built over several consecutive iterations so that moves across the iteration
boundary are visible; every node is (stage, iteration) with its cost, resource and stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from yggdrasil.buckets import Bucket  # noqa: F401 (the planner's buckets are the runtime's)
from yggdrasil.runtime.stage_plan import SEQUENTIAL, StagePlan as Plan

HOST, DEVICE = "host", "device"
MAIN, SIDE = "main", "side"  # device streams: the main one and an optional side stream for AOT drafts


@dataclass(frozen=True)
class StageCosts:
    """Seconds per stage, from the bundle's profile (draft and verify steps by rows) and the
    measured host work; `contention` says how much two device stages running at once slow
    each other (1 = free overlap, 2 = none: each gets half the device)."""

    draft: tuple[tuple[int, float], ...]  # (rows, seconds) of one draft step
    verify: tuple[tuple[int, float], ...]  # (rows, seconds) of one verify step
    prune: float  # host: select V nodes, build the verify inputs
    accept_host: float  # host: the walk, including reading the target's choices
    accept_device: float  # the walk as a device stage (no host sync)
    compact: float  # device: K/V moves
    contention: float = 2.0
    streams: int = 2  # device streams the runtime can use (1 on a CPU: no side-stream plans)

    def t_draft(self, rows: int) -> float:
        return _at(self.draft, rows)

    def t_verify(self, rows: int) -> float:
        return _at(self.verify, rows)


def _at(points: tuple[tuple[int, float], ...], rows: int) -> float:
    """Seconds at `rows`: the smallest measured size that holds them (graphs are padded up)."""
    for size, seconds in sorted(points):
        if size >= rows:
            return seconds
    size, seconds = max(points)
    return seconds * rows / size  # beyond the profile: linear in rows


def _head_rows(plan: Plan, bucket: Bucket, later: bool) -> int:
    if plan.aot_head and later:  # every possible bonus (and the last level, without the AOT tail)
        return bucket.verify + (0 if plan.aot_tail else bucket.width)
    # the root, plus the unfed accepted leaf without the AOT tail; our smallest head graph has
    # 2 rows either way (a head is one of the compiled draft widths, at least 2)
    return 2


def extra_tokens(plan: Plan, bucket: Bucket) -> int:
    """Draft rows the plan's AOT moves process per iteration beyond the sequential plan's
    2-row head."""
    tail = bucket.width if plan.aot_tail else 0
    return tail + _head_rows(plan, bucket, later=True) - 2


def iteration_graph(bucket: Bucket, costs: StageCosts, plan: Plan = SEQUENTIAL,
                    iterations: int = 1) -> nx.DiGraph:
    """Stages of `iterations` consecutive iterations as a DAG: nodes (stage, i) with attributes
    cost (seconds), resource (host/device) and stream; edges are data dependencies."""
    graph = nx.DiGraph()
    side = SIDE if plan.side_stream else MAIN

    def add(name: str, i: int, cost: float, resource: str, stream: str = MAIN) -> tuple[str, int]:
        graph.add_node((name, i), cost=cost, resource=resource, stream=stream if resource == DEVICE else HOST)
        return (name, i)

    for i in range(iterations):
        later_aot_head = plan.aot_head and i > 0
        head = add("head", i, costs.t_draft(_head_rows(plan, bucket, i > 0)), DEVICE,
                   side if later_aot_head else MAIN)
        previous = head
        for k in range(1, bucket.depth):
            step = add(f"draft_{k}", i, costs.t_draft(bucket.width), DEVICE)
            graph.add_edge(previous, step)
            previous = step
        prune = add("prune", i, costs.prune, HOST)
        graph.add_edge(previous, prune)
        verify = add("verify", i, costs.t_verify(bucket.verify), DEVICE)
        graph.add_edge(prune, verify)
        if plan.accept_on_device:
            accept = add("accept", i, costs.accept_device, DEVICE)
        else:
            accept = add("accept", i, costs.accept_host, HOST)
        graph.add_edge(verify, accept)
        compact = add("compact", i, costs.compact, DEVICE)
        graph.add_edge(accept, compact)
        if plan.aot_tail:  # every last-level candidate, as soon as the last level exists
            tail = add("tail", i, costs.t_draft(bucket.width), DEVICE, side)
            graph.add_edge(previous, tail)
        if i > 0:
            _link(graph, i, plan)
    return graph


def _link(graph: nx.DiGraph, i: int, plan: Plan) -> None:
    """Edges from iteration i - 1 into iteration i's head."""
    head = ("head", i)
    if ("tail", i - 1) in graph:
        graph.add_edge(("tail", i - 1), head)  # the draft cache must hold the accepted path
    graph.add_edge(("compact", i - 1), head)  # and its K/V must be in place
    if plan.aot_head:
        graph.add_edge(("verify", i - 1), head)  # the bonus candidates are the verify's choices
        # the head's result is picked by acceptance before the next prune reads it
        graph.add_edge(("accept", i - 1), ("prune", i))
    else:
        graph.add_edge(("accept", i - 1), head)  # the root is the bonus token accept picked
    if plan.aot_head:
        # the head reads the tree's K/V under the tree mask, so it need not wait for compaction;
        # compaction then waits for it (it rewrites those slots) and the next prune for both
        graph.remove_edge(("compact", i - 1), head)
        graph.add_edge(head, ("compact", i - 1))
        graph.add_edge(("compact", i - 1), ("prune", i))


def critical_path(graph: nx.DiGraph) -> float:
    """Longest path by stage cost, ignoring resources (the dependency-only lower bound)."""
    best: dict = {}
    for node in nx.topological_sort(graph):
        start = max((best[p] for p in graph.predecessors(node)), default=0.0)
        best[node] = start + graph.nodes[node]["cost"]
    return max(best.values(), default=0.0)
