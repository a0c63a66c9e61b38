"""Dispatcher table: every request maps to the smallest bucket that holds it, or to a clear
"not compiled" error, never to a wrong-shaped graph."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yggdrasil.buckets import STAGE_NAMES, Bucket, GraphKey, Grid
from yggdrasil.runtime.dispatcher import Dispatcher, GraphCall, NotCompiledError, head_sizes, prefill_pieces

GRID = dict(depths=(1, 2, 4, 6), draft_widths=(1, 2, 4), verify_widths=(1, 4, 8, 16, 32),
            prefill_chunks=(32, 64, 128), batch_sizes=(1, 2, 4, 8))
DISPATCH = Dispatcher(Grid(GRID["depths"], GRID["draft_widths"], GRID["verify_widths"], GRID["prefill_chunks"],
                           GRID["batch_sizes"]), recipe_hint="recipes/x.yaml")


def _smallest(sizes, n):
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else None


@settings(max_examples=400, deadline=None)
@given(depth=st.integers(0, 8), width=st.integers(1, 6), verify=st.integers(1, 40), batch=st.integers(1, 10))
def test_every_request_gets_the_smallest_fitting_bucket_or_a_clear_error(depth, width, verify, batch):
    request = Bucket(depth, width, verify)
    want_verify = _smallest(GRID["verify_widths"], verify)
    want_batch = _smallest(GRID["batch_sizes"], batch)
    want_width = _smallest(GRID["draft_widths"], width)
    impossible = (want_verify is None or want_batch is None
                  or (depth > 0 and (want_width is None or depth > max(GRID["depths"]))))
    if impossible:
        with pytest.raises(NotCompiledError, match="not compiled.*recipes/x.yaml and recompile"):
            DISPATCH.graphs(request, batch)
        return
    plan = DISPATCH.graphs(request, batch)
    assert plan.verify == GraphKey("verify", want_verify, want_batch)
    if depth == 0:
        assert plan.draft_step is None and plan.draft_head is None
    else:
        assert plan.draft_step == GraphKey("draft_step", want_width, want_batch)
        assert plan.draft_head.rows >= 2 and plan.depth == depth
    sizes = {"draft_head": head_sizes(GRID["draft_widths"]), "draft_step": GRID["draft_widths"],
             "verify": GRID["verify_widths"]}
    for key in filter(None, (plan.draft_head, plan.draft_step, plan.verify)):
        assert key.rows in sizes[key.stage] and key.batch in GRID["batch_sizes"]  # only shapes that exist


@given(n=st.integers(1, 400))
def test_prefill_pieces_fill_the_largest_chunk_then_pad_the_rest_up(n):
    chunks = GRID["prefill_chunks"]
    pieces = prefill_pieces(chunks, n)
    assert [offset for offset, _ in pieces] == [i * max(chunks) for i in range(len(pieces))]
    assert all(size == max(chunks) for _, size in pieces[:-1])
    offset, size = pieces[-1]
    assert size == _smallest(chunks, n - offset)


def test_compile_and_capture_order_is_largest_first_and_complete():
    keys = DISPATCH.bundle_keys(draft_model=True, speculates=True, hidden=True)
    sizes = [k.rows for k in keys if k.rows]
    assert sizes == sorted(sizes, reverse=True)
    chunks, widths, verifies = GRID["prefill_chunks"], GRID["draft_widths"], GRID["verify_widths"]
    expected = {GraphKey("decode", 1), GraphKey("serve", 0), GraphKey("serve", 0, role="draft")}
    expected |= {GraphKey("prefill", c, hidden=h) for c in chunks for h in (False, True)}
    expected |= {GraphKey("verify", v, hidden=True) for v in verifies}  # the predictor reads every verify
    expected |= {GraphKey("prefill", c, role="draft") for c in chunks}
    expected |= {GraphKey("draft_head", n, role="draft") for n in head_sizes(widths)}
    expected |= {GraphKey("draft_step", w, role="draft") for w in widths}
    assert len(keys) == len(set(keys)) and set(keys) == expected


@settings(max_examples=200, deadline=None)
@given(stage=st.sampled_from(STAGE_NAMES), rows=st.integers(0, 300), batch=st.integers(1, 9), hidden=st.booleans(),
       role=st.sampled_from(("target", "draft")))
def test_a_graph_name_parses_back_to_its_key(stage, rows, batch, hidden, role):
    key = GraphKey(stage, rows, batch, hidden, role)
    assert GraphKey.parse(key.name, role) == key


COMPILED = [GraphKey("decode", 1), GraphKey("verify", 4), GraphKey("verify", 8, hidden=True),
            GraphKey("draft_step", 2, role="draft")]


@pytest.mark.parametrize("stage, rows, hidden, role, runs", [
    ("verify", 4, False, "target", GraphKey("verify", 4)),  # its own graph
    ("verify", 8, False, "target", GraphKey("verify", 8, hidden=True)),  # a superset: hidden states dropped
    ("verify", 8, True, "target", GraphKey("verify", 8, hidden=True)),
    ("verify", 1, False, "target", GraphKey("decode", 1)),  # a one-row verify is a decode step
    ("draft_step", 2, False, "draft", GraphKey("draft_step", 2, role="draft")),
])
def test_dispatch_picks_the_compiled_graph_a_step_runs(stage, rows, hidden, role, runs):
    dispatcher = Dispatcher.of_compiled(COMPILED, "recipes/x.yaml")
    asked = GraphKey(stage, rows, hidden=hidden, role=role)
    call = dispatcher.dispatch(stage, rows, hidden, role)
    assert call == GraphCall(asked, runs)
    # the substitution rules the runner applies: the decode graph's one row is the logits' row,
    # a superset graph's hidden states are dropped
    assert call.first_row_logits == (runs.stage == "decode")
    assert call.output(("logits", "hidden")) == ("logits" if runs.hidden and not hidden else ("logits", "hidden"))
    # without compiled graphs (eager or torch.compile steps) every step runs its own shape
    assert Dispatcher(DISPATCH.grid).dispatch(stage, rows, hidden, role) == GraphCall(asked, asked)


class _Graphs:
    """A graph set's face to the dispatcher: its role, its names, its keys."""

    role, hint, graphs = "target", "recipes/x.yaml", {"decode_w1": None}

    def has(self, key):
        return key.role == self.role and key.name in self.graphs

    @property
    def keys(self):
        return frozenset(GraphKey.parse(n, self.role) for n in self.graphs)


def test_a_runner_dispatcher_is_built_once_and_sees_graphs_added_later():
    """compile's stage check adds graphs to a loaded set: the runner's one dispatcher sees them
    without being remade."""
    graphs = _Graphs()
    graphs.graphs = dict(graphs.graphs)
    dispatcher = Dispatcher.for_runner(graphs, (16,))
    with pytest.raises(NotCompiledError, match="verify_w4.*it has decode_w1"):
        dispatcher.dispatch("verify", 4)
    graphs.graphs["verify_w4"] = None
    assert dispatcher.dispatch("verify", 4).runs == GraphKey("verify", 4)
    assert dispatcher.dispatch("verify", 1).runs == GraphKey("decode", 1)
    with pytest.raises(NotCompiledError):
        dispatcher.dispatch("verify", 4, role="draft")


@pytest.mark.parametrize("stage, rows, hidden, role", [
    ("verify", 4, True, "target"),  # hidden states asked of a graph that has none
    ("verify", 1, True, "target"),  # the decode graph returns no hidden states
    ("verify", 16, False, "target"),
    ("draft_step", 2, False, "target"),  # the draft's graph is not the target's
])
def test_dispatch_never_runs_a_graph_that_was_not_compiled(stage, rows, hidden, role):
    dispatcher = Dispatcher.of_compiled(COMPILED, "recipes/x.yaml")
    with pytest.raises(NotCompiledError, match="not compiled.*recipes/x.yaml and recompile"):
        dispatcher.dispatch(stage, rows, hidden, role)


def test_the_draft_ahead_graphs_are_named_by_the_dispatcher_largest_first():
    assert Dispatcher.draft_ahead_keys([3, 9, 3, 5]) == tuple(GraphKey("draft_ahead", r, role="draft") for r in (9, 5, 3))


def test_nonsense_sizes_are_refused():
    with pytest.raises(NotCompiledError, match="not a valid request"):
        DISPATCH.graphs(Bucket(1, 0, 4))


@given(verify=st.integers(1, 32))
def test_with_measured_costs_the_verify_table_pads_to_the_cheapest_fitting_width(verify):
    # measured on a CPU: a 32-row verify is cheaper than an 8- or 16-row one
    cost = {1: 0.10, 4: 0.20, 8: 0.40, 16: 0.45, 32: 0.30}
    dispatch = Dispatcher(DISPATCH.grid, verify_cost=cost.__getitem__)
    fits = [v for v in GRID["verify_widths"] if v >= verify]
    got = dispatch.graphs(Bucket(1, 1, verify)).verify.rows
    assert got in fits and cost[got] == min(cost[v] for v in fits)


def test_chunk_pieces_use_the_largest_chunk_then_the_smallest_that_holds_the_rest(tiny_runner_chunks):
    runner = tiny_runner_chunks

    def chunks(n: int) -> list[tuple[int, int]]:  # (offset, chunk size) of a runner without recorded times
        return [(piece.offset, piece.key.rows) for piece in runner.pieces(n)]

    assert chunks(5) == [(0, 16)]
    assert chunks(64) == [(0, 64)]
    assert chunks(70) == [(0, 64), (64, 16)]
    assert chunks(100) == [(0, 64), (64, 64)]


@pytest.fixture
def tiny_runner_chunks():
    from yggdrasil.config import ModelConfig
    from yggdrasil.models.model import Transformer
    from yggdrasil.runtime.steps import StepRunner

    cfg = ModelConfig(arch="llama", vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=8, ffn_dim=32, norm_eps=1e-5, rope_theta=1e4, max_position=256)
    return StepRunner(Transformer(cfg), 256, chunk_sizes=(16, 64))


def test_compile_builds_exactly_the_graphs_the_dispatcher_lists():
    """compile asks the dispatcher over the kept grid which graphs to build: a draft model's
    head and steps per kept width, the target's verify per kept verify width, nothing else."""
    from yggdrasil.compile.recipe import load_recipe
    from yggdrasil.compile.select import BucketSelection, graph_keys, kept_dispatcher
    from pathlib import Path

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "qwen-pair-cpu.yaml")
    kept = BucketSelection((2,), (1, 2, 4), {}, (1, 4), (8, 16))
    names = {f"{k.role}/{k.name}" for k in graph_keys(recipe, kept, needs_hidden=False)}
    assert {"draft/draft_step_w2", "draft/draft_head_w2", "target/verify_w4", "target/decode_w1"} <= names
    assert not any("w16" in n or "draft_step_w1" in n or "draft_step_w4" in n for n in names)
    dispatch = kept_dispatcher(recipe, kept)
    for bucket in (Bucket(3, 2, 3), Bucket(1, 2, 1)):  # everything the runtime asks for exists
        verify = dispatch.graphs(bucket).verify  # a one-row verify runs on the decode graph
        assert f"target/{verify.name}" in names or (verify.rows == 1 and "target/decode_w1" in names)
    assert "target/verify_w1" not in names


def test_draft_heads_pad_over_the_head_shapes_compile_lists():
    """The drafter pads its pending tokens over a padding table of head_sizes(widths) (ModelDrafter's
    head_table); compile lists the same head shapes (one per draft width, at least 2 rows)."""
    from yggdrasil.runtime.dispatcher import padded, padding_table

    table = padding_table(head_sizes((1, 3, 4)))
    assert [padded(table, n, "draft_head", "draft_widths") for n in (1, 2, 3, 4)] == [2, 2, 3, 4]
    with pytest.raises(NotCompiledError, match="draft_head 5.*draft_widths"):
        padded(table, 5, "draft_head", "draft_widths")
    dispatch = Dispatcher(Grid((1, 2), (1, 3, 4), (1, 8), chunks=(64,)))
    heads = {k.rows for k in dispatch.bundle_keys(True, True, False) if k.stage == "draft_head"}
    assert heads == {2, 3, 4}


def test_every_graph_a_bundle_runs_is_chosen_by_dispatch(tiny_bundle, monkeypatch):
    """Replace Dispatcher.dispatch with a counting wrapper: every graph call of a speculative
    generation (prefill, draft head and steps, verify or decode; both models) went through it."""
    from yggdrasil.bundle import open_bundle
    from yggdrasil.policy.auto import policy_from_calibration
    from yggdrasil.runtime.latency import LatencyProfile
    from yggdrasil.runtime.speculator import build_speculator
    from yggdrasil.sampling import SamplingParams

    chosen: list[GraphKey] = []
    dispatch = Dispatcher.dispatch

    def counting(self, *args, **kwargs):
        call = dispatch(self, *args, **kwargs)
        chosen.append(call.runs)
        return call

    monkeypatch.setattr(Dispatcher, "dispatch", counting)
    rt = open_bundle(tiny_bundle[1]).generator()
    grid = rt.policy.grid
    # free drafting: the policy always speculates, so every kind of step runs
    always = policy_from_calibration(rt.path / "calibration", grid.widths, grid.verifies,
                                     LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0),)),
                                     rt.target.model.config.dim, rt.manifest.models["target"]["sha256"])
    speculator = build_speculator(rt.runner, policy=always, draft_runner=rt.draft_runner, plans=rt.plans)
    ids = rt.target.tokenizer.encode("alpha beta gamma tree")
    before, calls_before = len(chosen), sum(s.calls for s in rt.graph_sets.values())
    speculator.generate(ids, 24, SamplingParams(temperature=0.0))
    ran = sum(s.calls for s in rt.graph_sets.values()) - calls_before
    assert ran > 0 and len(chosen) - before == ran
    stages = {(k.role, k.stage) for k in chosen[before:]}
    assert {("target", "prefill"), ("draft", "prefill"), ("draft", "draft_head"), ("draft", "draft_step")} <= stages
    assert ("target", "verify") in stages or ("target", "decode") in stages
