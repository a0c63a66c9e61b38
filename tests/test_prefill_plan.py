"""Prefilling a prompt on the graphs that cost least (yggdrasil/runtime/prefill_plan.py): the
plan is the cheapest cover by the recorded times, the runner's pieces give the chunks' logits and
cache, and a bundle records the times and prefills by them."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import save_random_hf_model
from yggdrasil.buckets import GraphKey
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.prefill_plan import (PieceOption, chunk_pieces, measure_piece_seconds, piece_options, plan_pieces,
                                            plan_seconds)
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.storage.registry import EagerStep, GraphSet


def _options(seconds: dict[str, float]) -> list[PieceOption]:
    return [PieceOption(GraphKey.parse(name), s) for name, s in seconds.items()]


def _brute_force(n: int, options: list[PieceOption], hidden: bool) -> float:
    """The least total seconds over every sequence of pieces that covers n tokens, each piece
    taking any number of real tokens it holds."""
    # the last piece is the one that ends the prompt: enumerate it first, then what precedes it
    return min(o.seconds + (min_cover(n - real, options) if n - real else 0.0)
               for o in options if not hidden or o.key.hidden
               for real in range(1, min(o.key.rows, n) + 1))


def min_cover(n: int, options: list[PieceOption]) -> float:
    """The least seconds to cover n tokens with any pieces (none of them last)."""
    least = [0.0] + [float("inf")] * n
    for k in range(1, n + 1):
        least[k] = min(o.seconds + least[k - real] for o in options for real in range(1, min(o.key.rows, k) + 1))
    return least[n]


def _check_cover(pieces, n: int) -> None:
    offset = 0
    for piece in pieces:
        assert piece.offset == offset and 1 <= piece.real <= piece.key.rows
        offset += piece.real
    assert offset == n


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_the_cheapest_cover(seed):
    rng = random.Random(seed)
    options = _options({"prefill_w8": rng.uniform(0.5, 2.0), "decode_w1": rng.uniform(0.05, 0.5),
                        "verify_w2": rng.uniform(0.1, 0.6), "verify_w4": rng.uniform(0.2, 1.0),
                        "prefill_hidden_w8": rng.uniform(0.5, 2.0), "verify_hidden_w4": rng.uniform(0.2, 1.2)})
    for n in range(1, 40):
        for hidden in (False, True):
            pieces = plan_pieces(n, options, hidden)
            _check_cover(pieces, n)
            assert not hidden or pieces[-1].key.hidden
            assert plan_seconds(pieces, options) == pytest.approx(_brute_force(n, options, hidden))


def test_short_prompts_leave_the_chunk_and_long_ones_keep_it():
    # the Qwen q4 pair's target on a 2-core Cascade Lake: a 64-row chunk costs ~15 two-row steps
    options = _options({"prefill_w64": 1.0, "decode_w1": 0.067, "verify_w2": 0.078})
    assert [p.key.name for p in plan_pieces(6, options)] == ["verify_w2"] * 3
    assert [p.key.name for p in plan_pieces(1, options)] == ["decode_w1"]
    long = plan_pieces(1000, options)
    _check_cover(long, 1000)
    assert sum(p.key.name == "prefill_w64" for p in long) == 16  # the 40-token tail costs more in steps
    # a GPU-like curve, where a chunk costs about one small step: the chunk always
    flat = _options({"prefill_w64": 0.010, "decode_w1": 0.008, "verify_w2": 0.009})
    assert [p.key.name for p in plan_pieces(6, flat)] == ["prefill_w64"]


def test_only_piece_graphs_with_every_chunk_timed_make_options():
    keys = [GraphKey("prefill", 16), GraphKey("decode", 1), GraphKey("verify", 4), GraphKey("serve", 0),
            GraphKey("verify", 4, batch=2), GraphKey("draft_ahead", 2)]
    seconds = {"prefill_w16": 0.02, "decode_w1": 0.003, "verify_w4": 0.006, "serve": 0.001, "draft_ahead_w2": 0.001}
    assert {o.key.name for o in piece_options(keys, seconds)} == {"prefill_w16", "decode_w1", "verify_w4"}
    assert piece_options(keys, {"decode_w1": 0.003}) == ()  # the chunk untimed: chunks as before
    assert piece_options(keys, None) == ()


def test_a_hidden_plan_needs_a_graph_that_returns_them():
    with pytest.raises(ValueError, match="hidden"):
        plan_pieces(3, _options({"prefill_w8": 1.0, "decode_w1": 0.1}), hidden=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_random_hf_model(directory, "llama", seed=3)
    return load_hf_model(directory, torch.float32)


def _runner(model, names, seconds=None) -> StepRunner:
    model.setup_cache(1, 96, stacked=True)
    graphs = GraphSet("target", {name: EagerStep(model, name) for name in names}, None, 0.0, "the test")
    return StepRunner(model, max_context=96, graphs=graphs, chunk_sizes=(16,), piece_seconds=seconds)


@pytest.mark.parametrize("prompt_len", [1, 3, 6, 21, 40])
@pytest.mark.parametrize("hidden", [False, True])
def test_pieces_give_the_chunks_logits_and_cache(tiny_model, prompt_len, hidden):
    names = ["prefill_w16", "prefill_hidden_w16", "decode_w1", "verify_w2", "verify_hidden_w4"]
    ids = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    chunked = _runner(tiny_model, names)
    expected = chunked.prefill(ids, hidden=hidden)
    expected_cache = chunked.cache.storage[:, :, :, :prompt_len].clone()
    expected_next = chunked.decode(7, prompt_len)
    seconds = {"prefill_w16": 1.0, "prefill_hidden_w16": 1.0, "decode_w1": 0.1, "verify_w2": 0.15,
               "verify_hidden_w4": 0.25}
    pieced = _runner(tiny_model, names, seconds)
    plan = pieced.pieces(prompt_len, hidden)
    assert prompt_len > 16 or all(p.key.stage != "prefill" for p in plan)  # short prompts: steps only
    got = pieced.prefill(ids, hidden=hidden)
    for a, b in zip(got if hidden else (got,), expected if hidden else (expected,)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pieced.cache.storage[:, :, :, :prompt_len], expected_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pieced.decode(7, prompt_len), expected_next, rtol=1e-5, atol=1e-5)


def test_measured_piece_seconds_name_every_piece_graph(tiny_model):
    runner = _runner(tiny_model, ["prefill_w16", "decode_w1", "verify_w2"])
    seconds = measure_piece_seconds(runner, repeats=2, warmup=1)
    assert set(seconds) == {"prefill_w16", "decode_w1", "verify_w2"} and all(s > 0 for s in seconds.values())


def test_a_bundle_records_its_graph_times_and_prefills_by_them(tiny_bundle):
    from yggdrasil.bundle import open_bundle

    opened = open_bundle(tiny_bundle[1], quiet=True)
    recorded = opened.piece_seconds()
    assert set(recorded) == {"target", "draft"} and "prefill_w16" in recorded["target"]
    generator = opened.generator()
    runner = generator.runner
    # the fixed tiny times (helpers.tiny_piece_seconds): 5 tokens as a 4-row verify and a decode step
    assert [(p.key.stage, p.key.rows) for p in runner.pieces(5)] == [("verify", 4), ("decode", 1)]
    assert [p.key.stage for p in runner.pieces(40)].count("prefill") == 2
    ids = generator.tokenizer.encode("alpha beta gamma tree")
    planned = runner.prefill(ids)
    chunked = runner.prefill(ids, pieces=chunk_pieces(runner.chunk_sizes, len(ids)))
    if opened.manifest.bitwise:  # the bundle's steps are batch-invariant: the same bits either way
        assert torch.equal(planned, chunked)
    torch.testing.assert_close(planned, chunked, rtol=1e-4, atol=1e-4)
