"""The serve engine on the eager tiny pair: batching, chunked prefill, chain speculation and
goodput choice never change a reply; cancels free slots; failures stay with their requests."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import EIGHT_LAYER_PAIR, save_tiny_pair

from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.models.loader import load
from yggdrasil.sampling import SamplingParams, target_probs
from yggdrasil.serve import engine as engine_mod
from yggdrasil.serve.drafting import LookupProposer, ModelProposer
from yggdrasil.serve.engine import Engine, EngineSettings, QueueFullError, ShuttingDownError
from yggdrasil.policy.costs import LinearStepModel
from yggdrasil.serve.goodput import (AcceptanceRate, Correction, SpeculationLength, StepCostModel,
                                     expected_tokens)
from yggdrasil.serve.pool import PoolFullError, Segment, SlotPool, batch_inputs
from yggdrasil.serve.requests import GenerationRequest, StopText
from yggdrasil.runtime.steps import StepRunner

CONTEXT = 256
COST = StepCostModel(LinearStepModel(0.0, 2e-4, 2e-3), LinearStepModel(0.0, 2e-5, 3e-4))


class Sink:
    def __init__(self) -> None:
        self.ids, self.text, self.reason, self.error = [], "", None, None

    def tokens(self, ids, text) -> None:
        self.ids += ids
        self.text += text

    def finish(self, reason, usage) -> None:
        self.reason, self.usage = reason, usage

    def fail(self, message) -> None:
        self.error = message


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-pair")
    save_tiny_pair(root, **EIGHT_LAYER_PAIR)
    target = load(str(root / "tiny-random"), dtype=torch.float32, quiet=True)
    draft = load(str(root / "tiny-draft"), dtype=torch.float32, quiet=True)
    return target, draft, StepRunner(target.model, CONTEXT, 16)


def _engine(pair, mode="off", k=0, proposer="model", **settings) -> Engine:
    target, draft, _ = pair
    settings = EngineSettings(**{"max_context": CONTEXT, "max_batch": 3, "chunk_size": 16, **settings})
    make_proposer = ((lambda pool: ModelProposer(draft.model, pool)) if proposer == "model"
                     else (lambda pool: LookupProposer()))
    return Engine(target.model, target.tokenizer, settings, SpeculationLength(mode, 4, COST, k), make_proposer)


def _reference(pair, prompt, n) -> list[int]:
    target, _, runner = pair
    out = greedy_tokens(runner, prompt, n)
    stop = next((i for i, t in enumerate(out) if t in target.tokenizer.stop_ids), len(out))
    return out[:stop]


def _prompts(count=8):
    # different lengths, several longer than a chunk; repeats give prompt lookup something to find
    return [[(i * 7 + j % (3 + i)) % 200 + 5 for j in range(3 + 11 * i)] for i in range(count)]


def _run(engine, requests):
    sinks = [Sink() for _ in requests]
    for request, sink in zip(requests, sinks):
        engine.submit(request, sink)
    while engine.step() is not None:
        pass
    return sinks


@pytest.mark.parametrize("mode,k,proposer", [("off", 0, "model"), ("fixed", 3, "model"),
                                             ("goodput", 0, "model"), ("fixed", 2, "lookup"),
                                             ("goodput", 0, "lookup")])
def test_batched_replies_equal_single_request_greedy(pair, mode, k, proposer):
    engine = _engine(pair, mode, k, proposer)
    prompts = _prompts()
    sinks = _run(engine, [GenerationRequest(tuple(p), 24) for p in prompts])
    for prompt, sink in zip(prompts, sinks):
        expected = _reference(pair, prompt, 24)
        assert sink.ids == expected and sink.error is None
        assert sink.reason == ("length" if len(expected) == 24 else "stop")
    assert max(len(r.decoding) + (r.prefill is not None) for r in engine.records) > 1  # really batched
    assert engine.pool.used_blocks == 0 and not engine.running
    if mode != "off":
        assert any(r.k > 0 for r in engine.records)
    if mode == "fixed" and proposer == "model":
        assert engine.metrics.aal() > 1.5  # the tiny draft agrees with its target


def test_seeded_sampling_does_not_depend_on_speculation_or_batch(pair):
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    prompt = tuple(_prompts()[3])
    alone = _run(_engine(pair), [GenerationRequest(prompt, 20, sampling)])[0]
    others = [GenerationRequest(tuple(p), 20) for p in _prompts(4)]
    crowded = _run(_engine(pair, "fixed", 3), [*others[:2], GenerationRequest(prompt, 20, sampling), *others[2:]])[2]
    assert alone.ids == crowded.ids and len(alone.ids) > 0


def test_sampled_first_token_follows_the_target_distribution(pair):
    """Chi-square over 600 seeds: the first sampled token is drawn from target_probs."""
    target, _, runner = pair
    prompt = tuple(_prompts()[1])
    params = SamplingParams(temperature=1.5, top_p=1.0)
    engine = _engine(pair, max_batch=8, max_queue=700)
    requests = [GenerationRequest(prompt, 1, SamplingParams(1.5, 1.0, seed=s)) for s in range(600)]
    firsts = [s.ids[0] if s.ids else -1 for s in _run(engine, requests)]
    probs = target_probs(runner.prefill(list(prompt)), params)
    likely = probs.topk(6).indices.tolist()
    observed = [sum(f == t for f in firsts) for t in likely] + [sum(f not in likely for f in firsts)]
    expected = [600 * float(probs[t]) for t in likely] + [600 * (1 - float(probs[likely].sum()))]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    assert chi2 < 22.5  # 6 degrees of freedom, p = 0.001


def test_long_prompt_is_chunked_and_never_stalls_running_decodes(pair):
    engine = _engine(pair, "fixed", 2, chunk_size=16)
    short = [GenerationRequest(tuple(p), 60) for p in _prompts(2)]
    sinks = [Sink(), Sink()]
    for request, sink in zip(short, sinks):
        engine.submit(request, sink)
    while any(s.rid not in {r.rid for r in engine.running} or s.prefilling for s in engine.running) \
            or len(engine.running) < 2:
        engine.step()
    long_prompt = tuple((j * 13) % 200 + 5 for j in range(150))
    engine.submit(GenerationRequest(long_prompt, 4), Sink())
    prefill_steps = []
    while engine.step() is not None:
        record = engine.records[-1]
        if record.prefill is not None and record.prefill[0] == 3:
            prefill_steps.append(record)
    assert len(prefill_steps) == math.ceil(150 / 16)
    for record in prefill_steps:
        assert record.prefill[1] <= 16
        running = [rid for rid in (1, 2) if rid in record.new_tokens]
        if running:  # every still-running decode got at least one token in the same step
            assert set(running) <= set(record.decoding) and all(record.new_tokens[r] >= 1 for r in running)
    assert sum(1 for r in prefill_steps if 1 in r.decoding) >= 5


def test_cancel_frees_the_slot_for_the_next_request(pair):
    engine = _engine(pair, max_batch=1)
    first, second = Sink(), Sink()
    a = engine.submit(GenerationRequest(tuple(_prompts()[2]), 100), first)
    engine.step()  # a is admitted before the second arrives (admission goes by priority, not order)
    engine.submit(GenerationRequest(tuple(_prompts()[1]), 5), second)
    for _ in range(2):
        engine.step()
    assert [s.rid for s in engine.running] == [a] and engine.pool.used_blocks > 0
    engine.cancel(a)
    while engine.step() is not None:
        pass
    assert first.reason == "cancelled" and len(first.ids) < 100
    assert second.ids == _reference(pair, _prompts()[1], 5)
    assert engine.pool.used_blocks == 0


def test_drain_refuses_new_requests_cancels_queued_ones_and_lets_running_ones_finish(pair):
    """What SIGTERM does: a request that never started is cancelled with nothing generated, a
    running one goes on to its full reply, and new requests are refused."""
    engine = _engine(pair, max_batch=1)
    running, queued = Sink(), Sink()
    engine.submit(GenerationRequest(tuple(_prompts()[2]), 30), running)
    engine.step()
    engine.submit(GenerationRequest(tuple(_prompts()[1]), 5), queued)
    engine.step()
    assert len(engine.scheduler.waiting) == 1 and len(running.ids) > 0
    engine.drain(60)
    with pytest.raises(ShuttingDownError, match="shutting down"):
        engine.submit(GenerationRequest((5, 6, 7), 4), Sink())
    while engine.step() is not None:
        pass
    assert queued.reason == "cancelled" and queued.ids == [] and queued.usage.completion_tokens == 0
    assert running.ids == _reference(pair, _prompts()[2], 30) and running.reason in ("length", "stop")
    assert engine.pool.used_blocks == 0 and not engine.scheduler.waiting and engine.draining


def test_drain_cuts_what_still_runs_at_its_deadline(pair):
    engine = _engine(pair, max_batch=2)
    sinks = [Sink(), Sink()]
    for prompt, sink in zip(_prompts(2), sinks):
        engine.submit(GenerationRequest(tuple(prompt), 100), sink)
    for _ in range(3):
        engine.step()
    engine.drain(0)
    assert engine.step() is None  # everything was cut before the step ran
    for sink in sinks:
        assert sink.reason == "cancelled" and 0 < len(sink.ids) < 100
    assert engine.pool.used_blocks == 0 and not engine.running


def test_full_queue_refuses_with_retry_after(pair):
    engine = _engine(pair, max_batch=1, max_queue=2)
    for _ in range(2):
        engine.submit(GenerationRequest((5, 6, 7), 4), Sink())
    with pytest.raises(QueueFullError, match="--max-queue 2") as info:
        engine.submit(GenerationRequest((5, 6, 7), 4), Sink())
    assert info.value.retry_after >= 1
    assert engine.metrics.requests["rejected"] == 1


def test_a_failing_request_fails_alone(pair, monkeypatch):
    engine = _engine(pair, "fixed", 2)
    prompts = _prompts(4)
    real_choose = engine_mod.RequestState.choose

    def choose(self, logits, first_index):
        if self.rid == 2 and first_index >= 3:
            raise RuntimeError("injected fault")
        return real_choose(self, logits, first_index)

    monkeypatch.setattr(engine_mod.RequestState, "choose", choose)
    sinks = _run(engine, [GenerationRequest(tuple(p), 12) for p in prompts])
    assert "injected fault" in sinks[1].error and sinks[1].reason is None
    for i in (0, 2, 3):
        assert sinks[i].error is None and sinks[i].ids == _reference(pair, prompts[i], 12)


def test_a_failing_forward_fails_its_step_and_the_engine_goes_on(pair, monkeypatch):
    engine = _engine(pair)
    broken = Sink()
    engine.submit(GenerationRequest((5, 6, 7, 8), 6), broken)
    real = engine.forward

    class LostDevice:
        def run(self, pool, segments):
            raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "forward", LostDevice())
    assert engine.step() is None
    assert "device lost" in broken.error and engine.pool.used_blocks == 0
    monkeypatch.setattr(engine, "forward", real)
    later = _run(engine, [GenerationRequest((9, 10, 11), 6)])[0]
    assert later.ids == _reference(pair, [9, 10, 11], 6)


def test_prompt_longer_than_the_context_is_refused(pair):
    engine = _engine(pair)
    with pytest.raises(Exception, match=f"context holds {CONTEXT}"):
        engine.submit(GenerationRequest(tuple([5] * CONTEXT), 4), Sink())


def test_reply_stops_at_the_context_end(pair):
    engine = _engine(pair, "fixed", 3)
    prompt = (tuple(_prompts()[5][:40]) * 7)[:CONTEXT - 10]
    sink = _run(engine, [GenerationRequest(prompt, 50)])[0]
    assert sink.ids == _reference(pair, list(prompt), 10)
    assert len(sink.ids) == 10 or sink.reason == "stop"


# ---- pieces ---------------------------------------------------------------------------------
def test_pool_hands_out_lowest_blocks_and_keeps_requests_apart():
    pool = SlotPool(n_blocks=6, block_size=4)
    pool.reserve(1, 5)
    pool.reserve(2, 3)
    assert pool.slots(1, 5).tolist() == [0, 1, 2, 3, 4] and pool.slots(2, 3).tolist() == [8, 9, 10]
    pool.release(1)
    pool.reserve(3, 9)  # blocks 0, 1 (freed) and 3
    assert pool.slots(3, 9).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12]
    with pytest.raises(PoolFullError):
        pool.reserve(4, 9)
    inputs = batch_inputs(pool, [Segment(3, (1, 2), 7, "all"), Segment(2, (5,), 2, "last")], torch.device("cpu"))
    mask = inputs.mask[0]
    assert inputs.slots[0].tolist() == [7, 12, 10]
    assert mask[0].nonzero().flatten().tolist() == list(range(8))
    assert mask[1].nonzero().flatten().tolist() == list(range(8)) + [12]
    assert mask[2].nonzero().flatten().tolist() == [8, 9, 10]  # request 2 sees only its own slots
    assert inputs.logit_index[0].tolist() == [0, 1, 2]


def test_goodput_speculation_shrinks_with_the_batch_and_switches_off():
    policy = SpeculationLength("goodput", 6, StepCostModel(LinearStepModel(0.0, 1e-3, 10e-3), LinearStepModel(0.0, 0, 1e-3)))
    chosen = [policy.choose([0.8] * batch) for batch in (1, 2, 4, 8, 16, 32, 64)]
    assert chosen[0] >= 3 and chosen[-1] == 0
    assert all(a >= b for a, b in zip(chosen, chosen[1:]))
    # break-even: beyond the first batch where k = 0 wins, it keeps winning
    first_off = chosen.index(0)
    assert all(k == 0 for k in chosen[first_off:])
    assert policy.choose([0.05]) == 0  # a draft that is never right is not worth running
    assert SpeculationLength("fixed", 6, None, 3).choose([0.1] * 50) == 3
    assert SpeculationLength("off", 6).choose([0.99]) == 0


def test_expected_tokens_and_acceptance_rate():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    rate = AcceptanceRate(prior=0.5, prior_weight=2)
    for _ in range(30):
        rate.update(proposed=4, accepted=4)
    assert rate.value > 0.95
    for _ in range(30):
        rate.update(proposed=4, accepted=0)
    assert rate.value < 0.2  # the old evidence has decayed


def test_stop_text_holds_back_partial_matches():
    stop = StopText(("END", "\n\n"))
    assert stop.push("hello E") == ("hello ", False)
    assert stop.push("N") == ("", False)
    assert stop.push("x and \n") == ("ENx and ", False)
    assert stop.push("\nmore") == ("", True)
    assert StopText(()).push("abc") == ("abc", False)


def test_calibrate_measures_the_step_costs_goodput_weighs(pair):
    """The bundle's profile times compiled graphs; serve measures its own eager forwards."""
    engine = _engine(pair, "goodput", proposer="model", max_batch=2)
    profiled = engine.speculation.cost
    lines = []
    engine.calibrate(lines.append)
    cost = engine.speculation.cost
    assert cost is not profiled and cost.draft is not None and len(lines) == 1
    assert cost.target(10) > 0 and cost.target(1) > 0 and cost.draft(2) > 0
    # a step with k=2 for 2 requests: the target over 6 rows, and 2 draft steps over 2 rows
    assert cost.step_seconds(2, 2) == pytest.approx(cost.target(6) + 2 * cost.draft(2))
    assert engine.pool.used_blocks == 0 and not engine.can_run_short  # no preemption costs needed
    prompts = _prompts(4)  # serving afterwards is unaffected
    sinks = _run(engine, [GenerationRequest(tuple(p), 16) for p in prompts])
    assert [s.ids for s in sinks] == [_reference(pair, p, 16) for p in prompts]


def test_new_requests_start_from_the_servers_acceptance(pair):
    engine = _engine(pair, "fixed", 3, proposer="lookup")
    assert engine.acceptance.value == pytest.approx(0.6)
    _run(engine, [GenerationRequest(tuple(p), 24) for p in _prompts(4)])
    learned = engine.acceptance.value
    assert learned != pytest.approx(0.6)
    engine.submit(GenerationRequest(tuple(_prompts()[5]), 4), Sink())
    engine.step()
    assert engine.running[0].acceptance.value == pytest.approx(learned)


def test_goodput_learns_what_its_model_misses():
    """The model says k=3 pays; steps taken at k=3 turn out slower and give fewer tokens than it
    expected (lookup chains come up short), so the correction moves the choice down."""
    policy = SpeculationLength("goodput", 3, COST)
    correction = Correction(3)
    acceptances = [0.8, 0.8]
    assert policy.choose(acceptances, correction=correction) == 3
    for _ in range(5):
        k = policy.choose(acceptances, correction=correction)
        predicted = COST.step_seconds(k, 2)
        expected = sum(expected_tokens(a, k) for a in acceptances)
        # the truth: every k > 0 costs twice the model's time and yields only the bonus token
        correction.observe(k, predicted, predicted * (2 if k else 1), expected, 2 if k else 2)
    assert policy.choose(acceptances, correction=correction) == 0
    assert correction.steps[0] >= 1 and correction.seconds[3] == pytest.approx(2.0)



# ---- CUDA graphs for serve steps: fixed row buckets (issue 36) -----------------------------------
class _BucketedEager:
    """What serve/pool.py sees of a captured serve graph (storage/cuda_graphs.PoolGraphBuckets):
    rows_for, span, and a call at a bucket's fixed shapes, here the eager forward over the pool
    (a CPU has no CUDA graphs; the padding is what is under test)."""

    def __init__(self, model, buckets) -> None:
        self.model, self.buckets, self.span, self.calls = model, buckets, None, []

    def rows_for(self, rows):
        return next((b for b in self.buckets if b >= rows), None)

    def __call__(self, tokens, positions, slots, mask, logit_index, kv=()):
        from yggdrasil.graphs.aoti import PassedCache

        assert mask.shape[2] == self.span and tokens.shape[1] in self.buckets
        assert logit_index.shape[1] == tokens.shape[1]
        self.calls.append(tokens.shape[1])
        return self.model(tokens, positions, slots, mask, logit_index=logit_index, cache=PassedCache(kv))


def test_serve_steps_padded_to_row_buckets_give_the_same_replies(pair):
    """Batched steps padded to fixed row buckets and the whole pool's span (the shapes captured
    CUDA graphs replay) give every request its single-request greedy reply: padding rows write
    only the scratch slot and their logits are dropped."""
    from yggdrasil.storage.cuda_graphs import row_buckets

    target, draft, _ = pair
    buckets = row_buckets(16 + 3 * 4)
    assert buckets == (1, 2, 4, 8, 16, 32)
    graphs = {"target": _BucketedEager(target.model, buckets), "draft": _BucketedEager(draft.model, buckets)}
    settings = EngineSettings(max_context=CONTEXT, max_batch=3, chunk_size=16)
    engine = Engine(target.model, target.tokenizer, settings, SpeculationLength("fixed", 4, COST, 3),
                    lambda pool: ModelProposer(draft.model, pool, graphs["draft"]), target_graph=graphs["target"])
    for graph in graphs.values():
        graph.span = engine.pool.capacity
    prompts = _prompts()
    sinks = _run(engine, [GenerationRequest(tuple(p), 24) for p in prompts])
    for prompt, sink in zip(prompts, sinks):
        assert sink.ids == _reference(pair, prompt, 24) and sink.error is None
    assert len(set(graphs["target"].calls)) >= 3 and len(graphs["draft"].calls) > 0  # several buckets ran
    assert max(graphs["target"].calls) <= 32


def test_row_buckets_cover_the_widest_step():
    from yggdrasil.storage.cuda_graphs import row_buckets

    assert row_buckets(1) == (1,) and row_buckets(5) == (1, 2, 4, 8) and row_buckets(64)[-1] == 64
