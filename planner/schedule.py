"""Estimating a plan's iteration time on its stage DAG, and the offline plan search.

The estimate is an event simulation with resources: one host thread runs host stages one at a
time; each device stream runs its stages in order; stages on different streams share the device
(two at once each progress at 1 / contention of full speed). Ready stages start in
(iteration, topological) order. The steady-state iteration time is the makespan growth per
iteration over a few consecutive iterations, so overlap across the iteration boundary counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from yggdrasil.runtime.stage_plan import all_plans

from .dag import DEVICE, SEQUENTIAL, Bucket, Plan, StageCosts, extra_tokens, iteration_graph

WINDOW = 4  # iterations simulated for the steady state
MIN_GAIN = 0.01  # a plan must predict at least this much over the sequential one


@dataclass(frozen=True)
class Slot:
    """When a stage ran in the simulated schedule."""

    stage: str
    iteration: int
    start: float
    end: float
    lane: str  # "host", "main" or "side"


def simulate(graph: nx.DiGraph, contention: float) -> list[Slot]:
    """The schedule of every stage (see module docstring)."""
    order = {node: k for k, node in enumerate(nx.lexicographical_topological_sort(
        graph, key=lambda n: (n[1], n[0])))}
    waiting = {node: graph.in_degree(node) for node in graph}
    ready = sorted((n for n, d in waiting.items() if d == 0), key=order.get)
    running: dict = {}  # node -> remaining work (seconds at full speed)
    started: dict = {}
    busy: set[str] = set()  # lanes in use
    slots, now = [], 0.0
    while ready or running:
        for node in list(ready):
            lane = graph.nodes[node]["stream"]
            if lane not in busy:
                busy.add(lane)
                ready.remove(node)
                running[node], started[node] = graph.nodes[node]["cost"], now
        on_device = [n for n in running if graph.nodes[n]["resource"] == DEVICE]
        shared = contention if len(on_device) > 1 else 1.0

        def rate(node) -> float:
            return 1.0 / shared if node in on_device else 1.0

        step = min(running[n] / rate(n) for n in running)
        now += step
        for node in list(running):
            running[node] -= step * rate(node)
            if running[node] <= 1e-15:
                del running[node]
                lane = graph.nodes[node]["stream"]
                busy.discard(lane)
                slots.append(Slot(node[0], node[1], started[node], now, lane))
                for nxt in graph.successors(node):
                    waiting[nxt] -= 1
                    if waiting[nxt] == 0:
                        ready.append(nxt)
        ready.sort(key=order.get)
    return slots


def makespan(slots: list[Slot]) -> float:
    return max((s.end for s in slots), default=0.0)


def iteration_time(bucket: Bucket, costs: StageCosts, plan: Plan) -> float:
    """Steady-state seconds per iteration of this plan."""
    one = makespan(simulate(iteration_graph(bucket, costs, plan, 1), costs.contention))
    many = makespan(simulate(iteration_graph(bucket, costs, plan, WINDOW), costs.contention))
    return (many - one) / (WINDOW - 1)


@dataclass(frozen=True)
class PlanChoice:
    bucket: Bucket
    plan: Plan
    seconds: float  # predicted per iteration
    sequential_seconds: float
    extra_tokens: int  # rows of AOT work per iteration

    @property
    def gain(self) -> float:
        """Predicted sequential time / chosen time (1 = no gain)."""
        return self.sequential_seconds / self.seconds if self.seconds > 0 else 1.0


def best_plan(bucket: Bucket, costs: StageCosts, plans: list[Plan] | None = None,
              min_gain: float = MIN_GAIN) -> PlanChoice:
    """Grid search over the plans (the space is small): the fastest predicted, unless it beats
    the sequential plan by less than `min_gain` (the estimate's own error is about that, and a
    move costs extra rows and complexity for nothing less)."""
    sequential = iteration_time(bucket, costs, SEQUENTIAL)
    best, best_seconds = SEQUENTIAL, sequential
    for plan in plans or all_plans(costs.streams):
        seconds = iteration_time(bucket, costs, plan)
        if seconds < best_seconds * (1 - 1e-9):
            best, best_seconds = plan, seconds
    if sequential < best_seconds * (1 + min_gain):
        best, best_seconds = SEQUENTIAL, sequential
    return PlanChoice(bucket, best, best_seconds, sequential, extra_tokens(best, bucket))
