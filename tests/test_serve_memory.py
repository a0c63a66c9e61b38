"""KV memory pressure in the serve engine (issue 9): a small pool, swap and recompute
preemption, fairness, and replies that never change under pressure."""

from __future__ import annotations

import pytest
import torch
import test_serve as base

from yggdrasil.errors import InvalidRequestError
from yggdrasil.sampling import SamplingParams
from yggdrasil.policy.costs import LinearStepModel, PreemptionCosts
from yggdrasil.serve.memory import parse_bytes
from yggdrasil.serve.requests import GenerationRequest
from yggdrasil.serve.scheduler import priority
from yggdrasil.serve.setup import kv_blocks

pair = base.pair  # the module-scoped tiny target and draft (a fixture)
Sink, _engine, _reference = base.Sink, base._engine, base._reference

# a pool of 12 blocks (192 tokens) holds about two of these requests at their longest (8-78
# prompt tokens + GEN)
PRESSURE = {"kv_blocks": 12, "max_batch": 4}
GEN = 60
# synthetic costs: swap has a fixed 48 ms, recompute 1 ms per token, so recompute wins below 48 tokens
CROSSOVER = PreemptionCosts(swap=LinearStepModel(0.0, 0.0, 0.048), prefill=LinearStepModel(0.0, 1e-3, 0.0))


def _prompts(count=8):
    return [[(i * 5 + j % (4 + i)) % 200 + 5 for j in range(8 + 10 * i)] for i in range(count)]


def _pressured(pair, preemption, costs=CROSSOVER, swap_bytes=2**30, **options):
    engine = _engine(pair, **{**PRESSURE, **options, "preemption": preemption, "swap_bytes": swap_bytes})
    engine.costs = costs
    return engine


def _run_all(engine, requests):
    sinks = [Sink() for _ in requests]
    for request, sink in zip(requests, sinks):
        engine.submit(request, sink)
    while engine.step() is not None:
        assert engine.pool.used_blocks <= engine.pool.n_blocks
    return sinks


def _modes(engine) -> set[str]:
    return {p.mode for p in engine.scheduler.preemptions}


@pytest.mark.parametrize("preemption,mode,k,proposer", [
    ("swap", "fixed", 3, "model"), ("recompute", "fixed", 3, "model"), ("auto", "fixed", 3, "model"),
    ("auto", "goodput", 0, "lookup"), ("recompute", "off", 0, "model")])
def test_eight_requests_under_pressure_equal_their_unpressured_replies(pair, preemption, mode, k, proposer):
    engine = _pressured(pair, preemption, mode=mode, k=k, proposer=proposer)
    prompts = _prompts()
    sinks = _run_all(engine, [GenerationRequest(tuple(p), GEN) for p in prompts])
    for prompt, sink in zip(prompts, sinks):
        assert sink.error is None and sink.ids == _reference(pair, prompt, GEN)
    preemptions = list(engine.scheduler.preemptions)
    assert preemptions, "the pool never ran short: the test lost its point"
    expected = {"swap": {"swap"}, "recompute": {"recompute"}, "auto": {"swap", "recompute"}}[preemption]
    if mode == "goodput":  # its k (so who is preempted when, at which length) follows step timings
        assert _modes(engine) <= expected
    else:
        assert _modes(engine) == expected
    for p in preemptions:  # auto picks the cheaper by the (synthetic) predicted cost
        if preemption == "auto":
            assert p.mode == ("swap" if p.swap_seconds < p.recompute_seconds else "recompute")
    assert engine.pool.used_blocks == 0 and engine.store.swapped_bytes == 0 and not engine.scheduler.swapped
    text = engine.metrics.render()
    for m in _modes(engine):
        assert f'yggdrasil_preemptions_total{{mode="{m}"}} {sum(p.mode == m for p in preemptions)}' in text
    if "swap" in _modes(engine):
        assert f"yggdrasil_swap_out_bytes_total {sum(p.n_bytes for p in preemptions if p.mode == 'swap')}" in text


def test_seeded_sampling_survives_preemption(pair):
    prompts = _prompts()
    requests = [GenerationRequest(tuple(p), GEN, SamplingParams(1.0, 0.95, seed=10 + i)) for i, p in enumerate(prompts)]
    calm = _run_all(_engine(pair, "fixed", 3, max_batch=4), requests)
    for preemption in ("swap", "recompute"):
        engine = _pressured(pair, preemption, mode="fixed", k=3)
        pressed = _run_all(engine, requests)
        assert engine.scheduler.preemptions
        assert [s.ids for s in pressed] == [s.ids for s in calm]


def test_a_full_swap_space_falls_back_to_recompute(pair):
    engine = _pressured(pair, "swap", swap_bytes=0)
    prompts = _prompts()
    sinks = _run_all(engine, [GenerationRequest(tuple(p), GEN) for p in prompts])
    assert _modes(engine) == {"recompute"}
    assert all(s.ids == _reference(pair, p, GEN) for p, s in zip(prompts, sinks))
    # room for one request's blocks: the first swaps, the ones that find it taken recompute
    engine = _pressured(pair, "swap", swap_bytes=6 * _engine(pair, **PRESSURE).store.block_bytes)
    sinks = _run_all(engine, [GenerationRequest(tuple(p), GEN) for p in prompts])
    assert _modes(engine) == {"swap", "recompute"}
    assert all(s.ids == _reference(pair, p, GEN) for p, s in zip(prompts, sinks))


def test_the_lowest_priority_request_is_preempted_and_the_oldest_never(pair):
    engine = _pressured(pair, "recompute", kv_blocks=8, max_batch=3)
    prompts = [_prompts()[1], _prompts()[3], _prompts()[2]]  # 18, 38 and 28 tokens, +40 each
    sinks = [Sink() for _ in prompts]
    rids = [engine.submit(GenerationRequest(tuple(p), 40), s) for p, s in zip(prompts, sinks)]
    while engine.scheduler.waiting or engine._inbox or any(s.prefilling for s in engine.running):
        engine.step()
    states = {s.rid: s for s in engine.running}
    assert not engine.scheduler.preemptions and len(states) == 3
    now = states[rids[0]].arrived
    # the first arrived long ago; the other two at once, so the longer one ranks lowest
    states[rids[0]].arrived, states[rids[1]].arrived, states[rids[2]].arrived = now - 100, now, now
    while not engine.scheduler.preemptions:
        assert engine.step() is not None
    assert engine.scheduler.preemptions[0].rid == rids[1]
    assert priority(states[rids[1]], now + 1) < priority(states[rids[2]], now + 1)
    while engine.step() is not None:
        assert all(p.rid != rids[0] for p in engine.scheduler.preemptions)
    assert all(s.ids == _reference(pair, p, 40) for p, s in zip(prompts, sinks))


@pytest.mark.parametrize("behind", [0, 3])
def test_a_long_request_finishes_under_a_stream_of_short_ones(pair, behind):
    """Submitted first, or behind a full batch of short ones: either way the long request is
    admitted and finishes while short requests keep arriving."""
    engine = _pressured(pair, "auto", kv_blocks=10, max_batch=3)
    short = [Sink() for _ in range(300)]
    submitted = 0

    def submit_short() -> None:
        nonlocal submitted
        engine.submit(GenerationRequest((7 + submitted % 50, 9, 11), 6), short[submitted])
        submitted += 1

    for _ in range(behind):
        submit_short()
    engine.step()
    long_prompt, long_sink = _prompts()[6], Sink()  # 68 tokens
    engine.submit(GenerationRequest(tuple(long_prompt), 40), long_sink)
    while long_sink.reason is None:
        if submitted < len(short) and len(engine.scheduler.waiting) < 4:
            submit_short()
        assert engine.step() is not None
    assert submitted < len(short), "the long request only finished once the stream had ended"
    assert long_sink.ids == _reference(pair, long_prompt, 40)
    while engine.step() is not None:
        pass
    assert all(s.reason is not None and s.error is None for s in short[:submitted])


def test_a_request_larger_than_the_budget_is_refused_with_the_reason(pair):
    engine = _pressured(pair, "auto", kv_blocks=4)  # 64 tokens
    assert engine.request_limit == 64 < base.CONTEXT
    with pytest.raises(InvalidRequestError, match="KV budget .* holds 64 tokens per request"):
        engine.submit(GenerationRequest(tuple(range(5, 75)), 4), Sink())
    sink = Sink()  # one that fits but would grow past the pool stops at the limit, never hangs
    engine.submit(GenerationRequest(tuple(range(5, 55)), 40), sink)
    while engine.step() is not None:
        pass
    assert sink.reason in ("length", "stop") and 50 + len(sink.ids) <= 64


def test_calibrated_costs_are_measured_and_leave_the_pool_empty(pair):
    engine = _engine(pair, "fixed", 3, **PRESSURE)
    assert engine.can_run_short
    lines = []
    engine.calibrate(lines.append)
    costs = engine.costs
    assert costs.swap_seconds(engine.store.block_bytes * 4) > 0
    assert costs.recompute_seconds(64, 16) > costs.recompute_seconds(16, 16) > 0
    assert engine.pool.used_blocks == 0 and engine.store.swapped_bytes == 0 and len(lines) == 2
    prompts = _prompts()  # and serving afterwards is unaffected
    sinks = _run_all(engine, [GenerationRequest(tuple(p), 20) for p in prompts])
    assert all(s.ids == _reference(pair, p, 20) for p, s in zip(prompts, sinks))
    for mode in ("swap", "recompute"):
        count, predicted, actual, _ = engine.metrics.preemption_costs[mode]
        if count:
            assert predicted > 0 and actual > 0 and engine.metrics.preemption_error(mode) is not None


def test_prefill_fit_recovers_a_known_line():
    true = LinearStepModel(alpha=2e-6, gamma=3e-4, delta=5e-3)
    points = [(rows, ctx, true.seconds(rows, ctx)) for rows in (4, 16, 64) for ctx in (0, 100, 400)]
    fitted = LinearStepModel.fit_nonnegative(points)
    assert fitted.alpha == pytest.approx(true.alpha, rel=1e-6)
    assert fitted.gamma == pytest.approx(true.gamma, rel=1e-6)
    assert fitted.delta == pytest.approx(true.delta, rel=1e-6)


@pytest.mark.parametrize("text,expected", [("auto", None), ("1024", 1024), ("512MiB", 512 * 2**20),
                                           ("2G", 2 * 2**30), ("1.5GB", 1_500_000_000), ("64 kib", 65536)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "--kv-budget") == expected


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "-5", ""])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(InvalidRequestError, match="--kv-budget must be 'auto' or a size"):
        parse_bytes(text, "--kv-budget")


def test_a_budget_below_two_blocks_names_the_minimum(pair):
    target, draft, _ = pair
    with pytest.raises(InvalidRequestError, match=r"holds 1 blocks .* needs 2; give --kv-budget \S+ \(\d+ bytes\)"):
        per_token = sum(2 * m.config.n_layers * m.config.n_kv_heads * m.config.head_dim * 4
                        for m in (target.model, draft.model))
        kv_blocks(str(16 * per_token * 3 // 2), [target.model, draft.model], 16)
    assert kv_blocks("1MiB", [target.model], 16) >= 2
    assert torch.finfo(target.model.dtype).bits == 32


def test_drain_under_pressure_finishes_preempted_requests_and_cancels_unstarted_ones(pair):
    """A request preempted (swapped or to recompute) has started: a graceful shutdown lets it
    resume and finish, and cancels only the requests that never ran."""
    engine = _pressured(pair, "auto", mode="fixed", k=3)
    for prompt in _prompts():
        engine.submit(GenerationRequest(tuple(prompt), GEN), Sink())
    while not engine.scheduler.preemptions:
        assert engine.step() is not None
    states = [*engine.running, *engine.scheduler.queued]
    started = [s for s in states if s.scheduled_at is not None]
    preempted = [s for s in engine.scheduler.queued if s.scheduled_at is not None]
    assert preempted and len(started) < len(states), "the test needs preempted and unstarted requests"
    engine.drain(600)
    while engine.step() is not None:
        pass
    for state in states:
        if state in started:
            assert state.sink.ids == _reference(pair, list(state.request.prompt_ids), GEN), state.rid
        else:
            assert state.sink.reason == "cancelled" and state.sink.ids == []
    assert engine.pool.used_blocks == 0 and engine.store.swapped_bytes == 0


def test_measured_costs_are_corrected_by_what_resumes_cost(pair):
    """A start-up measurement that says swap takes 48 ms, when it takes well under that here, is
    corrected after the first resumes, and swap wins from then on."""
    engine = _pressured(pair, "auto", mode="fixed", k=3)
    engine.scheduler.learning = True  # as after calibrate()
    prompts = _prompts()
    sinks = _run_all(engine, [GenerationRequest(tuple(p), GEN) for p in prompts])
    assert all(s.ids == _reference(pair, p, GEN) for p, s in zip(prompts, sinks))
    scheduler = engine.scheduler
    assert scheduler._resumes["swap"] >= 1 and scheduler.learnt["swap"] < 0.5
    # the first swap is judged by the model's 48 ms; once one has resumed, by what it cost
    assert scheduler.preemptions[0].swap_seconds == pytest.approx(0.048)
    assert min(p.swap_seconds for p in scheduler.preemptions) < 0.024
    assert engine.metrics.preemption_error("swap") is not None
