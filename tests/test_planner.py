"""Stage planner: the DAG, the ahead-of-time moves, the schedule estimate and the plan search."""

from __future__ import annotations

from itertools import product

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from yggdrasil.planner.dag import (SEQUENTIAL, Bucket, Plan, StageCosts, critical_path,
                                   extra_tokens, iteration_graph)
from yggdrasil.planner.schedule import best_plan, iteration_time, simulate
from yggdrasil.runtime.stage_plan import all_plans

COSTS = StageCosts(draft=((1, 1.0), (2, 1.1), (4, 1.3), (8, 1.6)), verify=((1, 5.0), (4, 5.5), (8, 6.5)),
                   prune=0.4, accept_host=2.0, accept_device=0.5, compact=0.3, contention=1.2)
BUCKET = Bucket(depth=3, width=2, verify=4)


def test_sequential_plan_is_the_stage_chain():
    one = iteration_graph(BUCKET, COSTS)
    # a 2-row head (root + the accepted leaf the last step never fed), D - 1 steps of W rows,
    # prune, verify of V rows, the host walk, compaction
    chain = 1.1 + 2 * 1.1 + 0.4 + 5.5 + 2.0 + 0.3
    assert abs(critical_path(one) - chain) < 1e-9
    assert nx.is_simple_path(one, [("head", 0), ("draft_1", 0), ("draft_2", 0), ("prune", 0), ("verify", 0),
                                   ("accept", 0), ("compact", 0)])
    # every device stage on one stream, the next head after this compaction: nothing overlaps
    assert abs(iteration_time(BUCKET, COSTS, SEQUENTIAL) - chain) < 1e-9


def _edges(plan: Plan) -> set:
    return set(iteration_graph(BUCKET, COSTS, plan, iterations=2).edges)


def test_aot_tail_feeds_the_last_level_before_acceptance():
    plain, moved = _edges(SEQUENTIAL), _edges(Plan(aot_tail=True))
    assert plain - moved == set()
    assert moved - plain == {(("draft_2", 0), ("tail", 0)), (("draft_2", 1), ("tail", 1)),
                             (("tail", 0), ("head", 1))}
    graph = iteration_graph(BUCKET, COSTS, Plan(aot_tail=True), 2)
    assert ("tail", 0) not in nx.descendants(graph, ("accept", 0))
    # the accepted leaf no longer rides in the next head, which reads the root alone, but in
    # our runtime's smallest head graph (2 rows): the move only adds work unless it overlaps
    assert graph.nodes[("head", 1)]["cost"] == COSTS.t_draft(2)
    assert iteration_graph(BUCKET, COSTS, SEQUENTIAL, 2).nodes[("head", 1)]["cost"] == COSTS.t_draft(2)
    assert extra_tokens(Plan(aot_tail=True), BUCKET) == BUCKET.width


def test_aot_head_removes_exactly_accept_to_next_head():
    for base in (SEQUENTIAL, Plan(aot_tail=True)):
        plain = _edges(base)
        moved = _edges(Plan(aot_tail=base.aot_tail, aot_head=True))
        assert plain - moved == {(("accept", 0), ("head", 1)), (("compact", 0), ("head", 1))}
        assert moved - plain == {(("verify", 0), ("head", 1)), (("head", 1), ("compact", 0)),
                                 (("accept", 0), ("prune", 1)), (("compact", 0), ("prune", 1))}
        graph = iteration_graph(BUCKET, COSTS, Plan(aot_tail=base.aot_tail, aot_head=True), 2)
        assert ("head", 1) not in nx.descendants(graph, ("accept", 0))
    # the superset of work it pays for: the next head reads V rows (V + W when it also feeds
    # the last-level candidates the AOT tail would have)
    both = iteration_graph(BUCKET, COSTS, Plan(aot_tail=True, aot_head=True), 2)
    assert both.nodes[("head", 1)]["cost"] == COSTS.t_draft(BUCKET.verify)
    head_only = iteration_graph(BUCKET, COSTS, Plan(aot_head=True), 2)
    assert head_only.nodes[("head", 1)]["cost"] == COSTS.t_draft(BUCKET.verify + BUCKET.width)
    assert extra_tokens(Plan(aot_tail=True, aot_head=True), BUCKET) == 2 + 4 - 2
    assert extra_tokens(Plan(aot_head=True), BUCKET) == 4 + 2 - 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.05, 5.0), min_size=7, max_size=7), st.floats(1.0, 2.0),
       st.sampled_from(all_plans()), st.integers(1, 4), st.sampled_from([1, 2, 4]), st.sampled_from([1, 4, 8]))
def test_simulated_schedules_respect_dependencies_and_lanes(values, contention, plan, depth, width, verify):
    d1, d8, v1, v8, prune, accept, compact = values
    costs = StageCosts(draft=((1, d1), (8, d1 + d8)), verify=((1, v1), (8, v1 + v8)), prune=prune,
                       accept_host=accept, accept_device=accept / 2, compact=compact, contention=contention)
    graph = iteration_graph(Bucket(depth, width, verify), costs, plan, iterations=3)
    slots = {(s.stage, s.iteration): s for s in simulate(graph, contention)}
    assert set(slots) == set(graph.nodes)
    for before, after in graph.edges:
        assert slots[after].start >= slots[before].end - 1e-9
    by_lane: dict = {}
    for slot in slots.values():
        by_lane.setdefault(slot.lane, []).append(slot)
    for lane in by_lane.values():
        lane.sort(key=lambda s: s.start)
        for a, b in zip(lane, lane[1:]):
            assert b.start >= a.end - 1e-9
    # a stage never runs faster than its cost, and slower only by the contention
    for node, slot in slots.items():
        cost = graph.nodes[node]["cost"]
        assert cost - 1e-9 <= slot.end - slot.start <= cost * contention + 1e-9


def _brute_force(bucket: Bucket, costs: StageCosts) -> tuple[Plan, float]:
    """Every combination of the four switches, side stream without a move included."""
    best = (SEQUENTIAL, iteration_time(bucket, costs, SEQUENTIAL))
    for flags in product((False, True), repeat=4):
        plan = Plan(*flags)
        seconds = iteration_time(bucket, costs, plan)
        if seconds < best[1] * (1 - 1e-9):
            best = (plan, seconds)
    return best


def test_search_finds_the_known_optimum():
    # GPU-like: drafting is cheap, overlap is nearly free, the host walk is slow -> move both
    # drafts ahead of time onto a side stream; walking on the device is cheaper still
    gpu = StageCosts(draft=((1, 0.3), (8, 0.35)), verify=((1, 4.0), (8, 4.1)), prune=0.3,
                     accept_host=1.5, accept_device=0.2, compact=0.1, contention=1.05)
    choice = best_plan(BUCKET, gpu)
    assert choice.plan.aot_head and choice.plan.side_stream and choice.plan.accept_on_device
    assert choice.seconds < choice.sequential_seconds and choice.gain > 1.0
    # CPU-like: every row costs, and two stages at once just share the cores -> stay sequential
    cpu = StageCosts(draft=((1, 1.0), (2, 2.0), (4, 4.0), (8, 8.0)), verify=((1, 5.0), (4, 20.0), (8, 40.0)),
                     prune=0.3, accept_host=0.3, accept_device=0.6, compact=0.2, contention=2.0)
    assert best_plan(BUCKET, cpu).plan == SEQUENTIAL
    for costs in (gpu, cpu, COSTS):
        for bucket in (BUCKET, Bucket(1, 1, 2), Bucket(4, 4, 8)):
            plan, seconds = _brute_force(bucket, costs)
            found = best_plan(bucket, costs, min_gain=0.0)
            assert abs(found.seconds - seconds) < 1e-9, (bucket, plan, found.plan)
            # with the default margin, a plan is taken only for a real predicted gain
            chosen = best_plan(bucket, costs)
            assert chosen.plan == SEQUENTIAL or chosen.gain >= 1.01
