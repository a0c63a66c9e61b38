"""The server's engine: one loop that batches every running request into each step (docs/design.md §3.7).

A step carries at most one prefill chunk (SARATHI: long prompts are cut into chunks so they
never stall the decodes riding along) plus every decoding request's root and k chained
proposals, k chosen per step for goodput (goodput.py). All of it is one batch-1 forward over
the shared slot pool (pool.py). New requests join between steps, finished and cancelled ones
leave, and a failure in a step fails only the requests in it.

The HTTP layer talks to the engine from other threads only through submit / cancel, which go
through a locked inbox the loop drains at the top of every step.

`yggdrasil serve` runs the loop on the main thread (run) and the HTTP server in a thread: with
the OpenMP build of PyTorch, a second thread's parallel regions run several times slower once the
main thread has used OpenMP (measured 5x on a decode-sized matmul), which made a background
engine decode at half speed. `start` (a background thread) is kept for tests and embedding.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import replace
from typing import Callable

import torch

from yggdrasil.errors import InvalidRequestError
from yggdrasil.storage.cuda_graphs import PoolGraphBuckets
from yggdrasil.models.model import Transformer
from yggdrasil.policy.costs import LinearStepModel, PreemptionCosts
from yggdrasil.models.tokenizer import Tokenizer
from yggdrasil.runtime.logits import mask_worker
from yggdrasil.structured.grammar import GrammarEngine, Matcher
from .calibrate import calibrate_costs, measure_step_costs
from .goodput import AcceptanceRate, Correction, SpeculationLength, expected_tokens
from .memory import KVStore, kv_bytes_per_token
from .metrics import ServerMetrics
from .pool import PoolForward, Segment, SlotPool
from .requests import GenerationRequest, RequestState, Sink
from .scheduler import Scheduler
from .settings import EngineSettings, QueueFullError, ShuttingDownError, StepRecord

__all__ = ["Engine", "EngineSettings", "QueueFullError", "ShuttingDownError", "StepRecord"]

log = logging.getLogger("yggdrasil.serve")


class Engine:
    def __init__(self, target: Transformer, tokenizer: Tokenizer, settings: EngineSettings,
                 speculation: SpeculationLength, make_proposer: Callable[[SlotPool], object] | None = None,
                 metrics: ServerMetrics | None = None, costs: PreemptionCosts | None = None,
                 target_graph=None, health: Callable[[], None] | None = None) -> None:
        """make_proposer: builds the drafting.ModelProposer or LookupProposer over this engine's
        pool (None: no speculation). costs: what preemptions cost (None: measured by calibrate(),
        which build_engine calls when the pool can run short). target_graph: the bundle's
        compiled serve graph for the target (None: eager forwards). health: raises when the
        engine cannot go on (a tensor-parallel target's rank that stopped): asked while idle and
        after a failed step, it ends run() with that one error instead of failing every request."""
        self.target, self.tokenizer, self.settings = target, tokenizer, settings
        self._health = health or (lambda: None)
        self.grammars = GrammarEngine(tokenizer)  # response formats and tool calls, compiled per request
        # full grammar masks of a step's rows are computed here while its forward runs (when a
        # core is free for it; runtime/logits.py)
        self._mask_worker = mask_worker()
        self.pool = self.make_pool(settings)
        self.forward = PoolForward(target, self.pool.new_cache(target), target_graph)
        self.cache = self.forward.cache
        self.proposer = make_proposer(self.pool) if make_proposer is not None else None
        self.speculation = speculation if self.proposer is not None else SpeculationLength("off", 0)
        # a request never holds more than the pool, so one request alone always fits
        self.request_limit = min(settings.max_context, self.pool.n_blocks * self.pool.block_size)
        self.store = KVStore(self.pool, [forward.cache for forward in self._models()], settings.swap_bytes,
                             self.pool.block_size * sum(kv_bytes_per_token(f.model) for f in self._models()))
        self.metrics = metrics or ServerMetrics()
        scratch_k = self.speculation.max_k if self.speculation.mode != "off" else 0
        unmeasured = PreemptionCosts(LinearStepModel(0, 0, 0), LinearStepModel(0, 0, 0))  # ties go to recompute
        self.scheduler = Scheduler(self.store, costs or unmeasured, settings.preemption, settings.chunk_size,
                                   scratch_k, settings.max_batch, self.metrics)
        self.running: list[RequestState] = []
        # server-wide acceptance: a new request's prior, so it starts from what this workload's
        # proposals have been worth, not a constant
        self.acceptance = AcceptanceRate(prior=0.6, prior_weight=2.0, decay=0.98)
        self.correction = Correction(self.speculation.max_k)  # goodput's model against measured steps
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=512)
        self._ids = itertools.count(1)
        self._inbox: list[RequestState] = []
        self._cancels: set[int] = set()
        self._cond = threading.Condition()
        self._held = False
        self._stopping = False
        self._drain_deadline: float | None = None  # set by drain(): when running requests are cut
        self._thread: threading.Thread | None = None
        self._looping = False
        self._steps = 0

    @staticmethod
    def make_pool(settings: EngineSettings) -> SlotPool:
        """kv_blocks blocks, or room for max_batch requests at the full context each."""
        return SlotPool(min(settings.kv_blocks or settings.full_blocks, settings.full_blocks), settings.block_size)

    @property
    def costs(self) -> PreemptionCosts:
        return self.scheduler.costs

    @costs.setter
    def costs(self, costs: PreemptionCosts) -> None:
        self.scheduler.costs = costs

    def _models(self) -> list[PoolForward]:
        """The target, and the draft model if it has one, as the pool runs them."""
        models = [self.forward]
        if hasattr(self.proposer, "forward"):
            models.append(self.proposer.forward)
        return models

    def capture_graphs(self, buckets: tuple[int, ...]) -> int:
        """On CUDA: capture each model's serve graph at these row buckets over its pool cache
        (storage/cuda_graphs.PoolGraphBuckets), so batched steps replay CUDA graphs; returns the
        bytes the captures took."""
        taken = 0
        for owner in (self, self.proposer):
            forward = getattr(owner, "forward", None)
            if forward is None or forward.graph is None:
                continue
            kv = [t for pair in zip(forward.cache.keys, forward.cache.values) for t in pair]
            captured = PoolGraphBuckets(forward.graph, kv, self.pool.capacity, self.pool.scratch_slot, buckets,
                                        forward.model.device)
            owner.forward = replace(forward, graph=captured)
            taken += captured.capture_bytes
        return taken

    @property
    def compiled(self) -> bool:
        """Whether every model runs the bundle's compiled serve graph."""
        return all(forward.graph is not None for forward in self._models())

    @property
    def can_run_short(self) -> bool:
        """Whether the pool is smaller than max_batch full contexts (preemption can happen)."""
        return self.pool.n_blocks < self.settings.full_blocks

    @property
    def limit_text(self) -> str:
        """What caps a request's tokens, for error messages."""
        if self.request_limit < self.settings.max_context:
            return f"the KV budget (--kv-budget) holds {self.request_limit} tokens per request"
        return f"the context holds {self.request_limit}"

    @property
    def needs_calibration(self) -> bool:
        return self.speculation.mode == "goodput" or self.can_run_short

    def calibrate(self, report: Callable[[str], None] = lambda message: None) -> None:
        """Measure, on the empty pool, the step costs goodput speculation weighs and the swap and
        prefill costs preemption weighs (call before serving; calibrate.py)."""
        if self.speculation.mode == "goodput":
            cost = measure_step_costs(self._models(), self.pool,
                                      self.settings.max_batch * (self.speculation.max_k + 1), self.settings.max_batch,
                                      report, prefill_rows=self.settings.chunk_size)
            self.speculation = replace(self.speculation, cost=cost)
        if self.can_run_short:
            self.costs = calibrate_costs(self.store, self._models(), self.settings.chunk_size, report)
            self.scheduler.learning = True  # measured costs get corrected by what resumes cost

    # ---- called from other threads ----------------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink, matcher: Matcher | None = None) -> int:
        """Queue a request; matcher: its grammar's parse state (built from request.grammar by
        the caller, off the event loop; built here when not given)."""
        if len(request.prompt_ids) >= self.request_limit:
            raise InvalidRequestError(f"the prompt has {len(request.prompt_ids)} tokens but {self.limit_text}; "
                                      "shorten the prompt")
        with self._cond:
            if self._drain_deadline is not None:
                raise ShuttingDownError("the server is shutting down and takes no new requests; retry on "
                                        "another server or after it restarts")
            queued = len(self.scheduler.waiting) + len(self._inbox)
            if queued >= self.settings.max_queue:
                self.metrics.rejected()
                raise QueueFullError(f"the server is busy: {queued} requests are waiting "
                                     f"(--max-queue {self.settings.max_queue}); retry later", self._retry_after())
            if request.grammar is not None and matcher is None:
                matcher = self.grammars.matcher(request.grammar)
            state = RequestState(next(self._ids), request, sink, self.tokenizer, self.request_limit,
                                 self.acceptance.value, matcher, self._mask_worker)
            self._inbox.append(state)
            self._cond.notify()
        return state.rid

    def cancel(self, rid: int) -> None:
        """Drop a request (its client went away); its slot frees at the next step."""
        with self._cond:
            self._cancels.add(rid)
            self._cond.notify()

    def _retry_after(self) -> int:
        per_request = self.metrics.mean_request_seconds() or 1.0
        return max(1, round(per_request * (len(self.scheduler.waiting) + 1) / self.settings.max_batch))

    def start(self) -> None:
        """Run the loop in a background thread until stop()."""
        self._thread = threading.Thread(target=self.run, name="yggdrasil-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and cancel whatever is still queued or running."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        if self._mask_worker is not None:
            self._mask_worker.shutdown(wait=False)
        for state in [*self._inbox, *self.scheduler.queued, *self.running]:
            self._finish(state, "cancelled")
            self.scheduler.forget(state)
        self._inbox, self.running = [], []

    def drain(self, timeout: float) -> None:
        """Shut down gracefully: refuse new requests (ShuttingDownError), cancel at the next step
        those not started yet, let the running ones (preempted ones too) finish for timeout
        seconds, then cancel whatever is left. Safe to call from a signal handler."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
            self._cond.notify()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def hold(self, held: bool = True) -> None:
        """Pause stepping (requests still queue): lets tests build a queue deterministically."""
        with self._cond:
            self._held = held
            self._cond.notify()

    def pending(self) -> tuple[int, int]:
        """(requests submitted, cancels asked for) that the loop has not taken in yet."""
        with self._cond:
            return len(self._inbox), len(self._cancels)

    @property
    def alive(self) -> bool:
        return self._looping

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool] = lambda: False, poll_seconds: float = 0.1) -> None:
        """Step on the calling thread until stop() is called or should_stop() (asked at least
        every poll_seconds while idle) turns true."""
        self._looping = True
        try:
            while True:
                with self._cond:
                    while not self._stopping and (self._held or not (self._inbox or self._cancels
                                                                     or self.scheduler.waiting or self.running)):
                        if should_stop():
                            return
                        self._health()
                        self._cond.wait(poll_seconds)
                    if self._stopping or should_stop():
                        return
                self.step()
        finally:
            self._looping = False

    def _drain_inbox(self) -> None:
        with self._cond:
            self.scheduler.waiting.extend(self._inbox)
            self._inbox = []
            cancels, self._cancels = self._cancels, set()
        for state in [*self.scheduler.queued, *self.running]:
            if state.rid in cancels and not state.done:
                self._finish(state, "cancelled")
        if self._drain_deadline is not None:
            self._cancel_for_shutdown(time.monotonic() >= self._drain_deadline)
        self._retire()

    def _cancel_for_shutdown(self, past_deadline: bool) -> None:
        """While draining: cancel what has not started (never admitted), and past the deadline
        everything."""
        for state in [*self.scheduler.queued, *(self.running if past_deadline else ())]:
            if not state.done and (past_deadline or state.scheduled_at is None):
                self._finish(state, "cancelled")

    def _schedule(self) -> None:
        """Preempt until the next step fits the pool; if nothing had to go, admit (scheduler.py)."""
        now = time.perf_counter()
        if not self.scheduler.make_room(self.running, now):
            self.scheduler.admit(self.running, now)
        for state in self.running:
            if state.prefilled == 0 and state.resume_goal is None and not self.pool.held_blocks(state.rid):
                self._reuse_prefix(state)
        self._report_load()

    def _reuse_prefix(self, state: RequestState) -> None:
        """A request about to prefill takes the cached blocks of its prompt's longest cached
        prefix (all but its last token, whose logits the prefill must produce)."""
        matched = self.pool.share_prefix(state.rid, state.history[:state.prompt_length - 1])
        state.prefilled = state.draft_cached = state.cached_tokens = matched
        if matched:
            self.metrics.cached_prompt_tokens(matched)

    def _remember(self, state: RequestState) -> None:
        """Cache the whole blocks of what a leaving request's K/V holds, in every model's cache."""
        if state.finish_reason == "error":
            return
        valid = state.prefilled if state.prefilling else len(state.history) - 1
        if getattr(self.proposer, "kind", None) == "model":
            valid = min(valid, state.draft_cached)
        self.pool.remember(state.rid, state.history[:valid])

    def _report_load(self) -> None:
        self.metrics.set_load(len(self.scheduler.waiting), len(self.running), self.pool.used_blocks / self.pool.n_blocks,
                              len(self.scheduler.swapped), self.store.swapped_bytes)

    def step(self) -> StepRecord | None:
        """Run one step over everything running; None when there was nothing to do."""
        self._drain_inbox()
        self._schedule()
        if not self.running:
            return None
        started = time.perf_counter()
        prefill_state = next((s for s in self.running if s.prefilling), None)
        recomputed = None
        if prefill_state is not None and prefill_state.resume_goal is not None:
            recomputed = (prefill_state.rid, self._recompute_chunk(prefill_state))
            prefill_state = None
        planned = time.perf_counter()  # goodput's forecast covers the step from here, not a recompute
        prefill = self._prefill_segment(prefill_state) if prefill_state else None
        if prefill is not None and prefill.logits == "last":  # its last row gives the first token
            prefill_state.start([prefill.tokens[-1]])
        # a request whose recompute just completed decodes from the next step, as after a prefill
        just_recomputed = recomputed[0] if recomputed else None
        decoding = [s for s in self.running if not s.prefilling and s.rid != just_recomputed]
        try:
            k, ks, proposals, segments, forecast = self._plan(decoding, prefill)
            logits = self.forward.run(self.pool, segments)
        except Exception as exc:  # a failed forward fails the requests in it, not the server
            for state in ([prefill_state] if prefill_state else []) + decoding:
                self._fail(state, f"the engine failed while running this request: {exc}")
            self._retire()
            self._health()  # unless the engine cannot go on: then run() ends with that one error
            log.exception("engine step failed")
            return None
        new_tokens = self._commit(decoding, ks, proposals, logits[:len(decoding)])
        if prefill is not None:
            self._after_prefill(prefill_state, prefill, logits[-1], new_tokens)
        self._retire()
        record = StepRecord(self._steps, (prefill.owner, len(prefill.tokens)) if prefill else recomputed,
                            tuple(s.rid for s in decoding), k, sum(len(s.tokens) for s in segments),
                            new_tokens, time.perf_counter() - started)
        self._steps += 1
        if forecast is not None:
            self.correction.observe(k, forecast[1], time.perf_counter() - planned, forecast[0],
                                    sum(new_tokens.get(s.rid, 0) for s in decoding))
        self.records.append(record)
        self.metrics.step(record)
        return record

    def _prefill_segment(self, state: RequestState) -> Segment:
        chunk = state.history[state.prefilled:min(state.prefilled + self.settings.chunk_size, state.prefill_goal)]
        completes = state.prefilled + len(chunk) == state.prefill_goal
        self.pool.reserve(state.rid, state.prefilled + len(chunk))
        return Segment(state.rid, tuple(chunk), state.prefilled, "last" if completes else "none")

    def _recompute_chunk(self, state: RequestState) -> int:
        """A request preempted by recompute prefills its tokens again, a chunk per step, in
        forwards of its own (target, then draft) so that their cost is measured on its own."""
        segment = replace(self._prefill_segment(state), logits="none")
        started = time.perf_counter()
        try:
            self.forward.run(self.pool, [segment])
            if self.proposer is not None:
                self.proposer.feed(segment)
                self.proposer.prefilled(segment, state)
            if self.cache.k0.device.type == "cuda":
                torch.cuda.synchronize(self.cache.k0.device)
        except Exception as exc:
            self._fail(state, f"the engine failed while running this request: {exc}")
            self._health()
            log.exception("request %d failed", state.rid)
            return len(segment.tokens)
        state.prefilled = segment.end
        if not state.prefilling:
            state.resume_goal = None
        self.scheduler.reprefilled(state, time.perf_counter() - started)
        return len(segment.tokens)

    def _plan(self, decoding: list[RequestState], prefill: Segment | None):
        """Choose k, draft the chains and lay out the target's segments (decodes first); with
        goodput, also the (tokens, seconds) its model forecasts for the step."""
        prefill_rows = len(prefill.tokens) if prefill else 0
        context = sum(len(s.history) for s in decoding)
        acceptances = [s.acceptance.value for s in decoding]
        k = self.speculation.choose(acceptances, prefill_rows, context, self.correction)
        ks = {s.rid: min(k, s.room()) for s in decoding}
        forecast = None  # (tokens, seconds) the goodput model expects of this step, to learn from
        if self.speculation.mode == "goodput" and decoding:
            forecast = (sum(expected_tokens(a, ks[s.rid]) for a, s in zip(acceptances, decoding)),
                        self.speculation.cost.step_seconds(k, len(decoding), prefill_rows, context))
        for s in decoding:  # the draft writes its proposals' K/V at the same slots
            self.pool.reserve(s.rid, len(s.history) + ks[s.rid])
        proposals: dict[int, list[int]] = {s.rid: [] for s in decoding}
        if self.proposer is not None and (any(ks.values()) or (prefill and self.proposer.kind == "model")):
            proposals.update(self.proposer.propose(decoding, ks, prefill))
        segments = []
        for s in decoding:
            chain = proposals[s.rid][:ks[s.rid]]
            proposals[s.rid] = chain
            segments.append(Segment(s.rid, (s.history[-1], *chain), len(s.history) - 1, "all"))
            s.start([s.history[-1], *chain])
        return k, ks, proposals, segments + ([prefill] if prefill else []), forecast

    def _commit(self, decoding: list[RequestState], ks: dict[int, int], proposals: dict[int, list[int]],
                logits: list) -> dict[int, int]:
        """Walk each chain: accept proposals while they equal the target's own choice."""
        new_tokens = {}
        for state, rows in zip(decoding, logits):
            try:
                chain = proposals[state.rid]
                before = len(state.history)
                choices, rows = state.choose(rows, state.generated)
                accepted = next((j for j, token in enumerate(chain) if token != choices[j]), len(chain))
                tokens = chain[:accepted] + [choices[accepted]]
                state.acceptance.update(len(chain), accepted)
                self.acceptance.update(len(chain), accepted)
                if self.proposer is not None:
                    self.proposer.after_verify(state, before, len(chain), accepted)
                state.append(tokens, state.logprobs(rows, tokens))
                new_tokens[state.rid] = len(state.history) - before
                self.metrics.verified(len(chain), accepted)
            except Exception as exc:
                log.exception("request %d failed", state.rid)
                self._fail(state, f"the engine failed while running this request: {exc}")
        return new_tokens

    def _after_prefill(self, state: RequestState, prefill: Segment, logits, new_tokens: dict[int, int]) -> None:
        try:
            state.prefilled = prefill.end
            if self.proposer is not None:
                self.proposer.prefilled(prefill, state)
            if not state.prefilling:  # the prompt is in: its last row gives the first token
                self.pool.remember(state.rid, state.history[:state.prompt_length])
                choices, rows = state.choose(logits, 0)
                first = choices[:1]
                state.append(first, state.logprobs(rows, first))
                new_tokens[state.rid] = 1
                self.metrics.first_token(state)
        except Exception as exc:
            log.exception("request %d failed", state.rid)
            self._fail(state, f"the engine failed while running this request: {exc}")

    # ---- leaving ----------------------------------------------------------------------------
    def _fail(self, state: RequestState, message: str) -> None:
        if state.reported:
            return
        state.finish_reason, state.reported = "error", True
        self.metrics.finished(state)
        try:
            state.sink.fail(message)
        except Exception:
            log.exception("could not report the failure of request %d", state.rid)

    def _finish(self, state: RequestState, reason: str) -> None:
        if state.reported:
            return
        state.finish_reason, state.reported = state.finish_reason or reason, True
        self.metrics.finished(state)
        try:
            state.sink.finish(state.finish_reason, state.usage())
        except Exception:
            log.exception("could not deliver the end of request %d", state.rid)

    def _retire(self) -> None:
        """Report finished requests and free their blocks."""
        for state in [s for s in self.running if s.done]:
            self._finish(state, state.finish_reason)
            self._remember(state)
            self.scheduler.forget(state)
            self.running.remove(state)
        for state in [s for s in self.scheduler.queued if s.done]:
            self.scheduler.forget(state)
        self._report_load()
