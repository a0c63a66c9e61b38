"""Who runs in the next step when KV memory is short (docs/design.md §3.9; AdaptiveLLM's Algorithms 1
and 2).

Three queues: waiting (new requests, and requests preempted by recompute), running (the
engine's batch) and swapped (requests whose blocks sit in host memory). Before each step:

1. Make room: while the running requests' next step needs more blocks than are free, preempt the
   lowest-priority running request, by swap or recompute, whichever is predicted cheaper (swap
   only while the host swap space has room). Priority = seconds since arrival / tokens held:
   short requests and long-waiting ones first.
2. Otherwise admit: take the requests that fit from the waiting queue and from the swapped queue,
   each in priority order and stopping at the first that does not fit (so nothing overtakes a
   large request forever), and admit the group with the higher mean priority, never both.

No starvation: the oldest running request is never preempted, and one request alone always fits
(the engine caps a request's tokens at what the pool holds), so the oldest always finishes; and
a waiting request's priority grows with its wait until it heads its queue.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from yggdrasil.policy.costs import PreemptionCosts
from .goodput import ema_ratio
from .memory import PREEMPTION_MODES, KVStore, SwappedKV
from .metrics import ServerMetrics
from .requests import RequestState


@dataclass(frozen=True)
class Preemption:
    """One preemption, as decided (tests and the bench read these)."""

    rid: int
    mode: str  # "swap" | "recompute"
    n_bytes: int  # of its blocks, target and draft
    tokens: int  # that a recompute prefills again
    swap_seconds: float  # predicted round trip
    recompute_seconds: float  # predicted


def priority(state: RequestState, now: float) -> float:
    return (now - state.arrived) / max(len(state.history), 1)


class Scheduler:
    def __init__(self, store: KVStore, costs: PreemptionCosts, mode: str, chunk_size: int, scratch_k: int,
                 max_batch: int, metrics: ServerMetrics) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.store, self.pool, self.costs, self.mode = store, store.pool, costs, mode
        self.chunk_size, self.scratch_k, self.max_batch, self.metrics = chunk_size, scratch_k, max_batch, metrics
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.swapped: dict[int, tuple[RequestState, SwappedKV]] = {}
        self.preemptions: collections.deque[Preemption] = collections.deque(maxlen=512)
        self._recomputing: dict[int, float] = {}  # rid -> seconds its recompute has taken so far
        self._forecasts: dict[int, tuple[str, float, float]] = {}  # rid -> (mode, predicted, modelled)
        # per mode, the running ratio of measured to modelled cost: start-up measurements can be
        # off (a busy machine, caches), so the decisions follow what resumes actually cost. Only
        # measured costs are corrected (the engine's calibrate turns it on); costs given outright
        # (a synthetic model) are taken as they are
        self.learning = False
        self.learnt = {"swap": 1.0, "recompute": 1.0}
        self._resumes = {"swap": 0, "recompute": 0}

    # ---- blocks -------------------------------------------------------------------------------
    def _k_bound(self, state: RequestState) -> int:
        return min(self.scratch_k, state.room())

    def _missing(self, state: RequestState, positions: int) -> int:
        return max(self.pool.blocks_for(positions) - self.pool.held_blocks(state.rid), 0)

    def running_need(self, running: list[RequestState]) -> int:
        """Blocks the running requests' next step adds: the first prefilling request's chunk,
        every decoding request's root and deepest chain."""
        first = next((s for s in running if s.prefilling), None)
        need = 0
        for state in running:
            if not state.prefilling:
                need += self._missing(state, len(state.history) + self._k_bound(state))
            elif state is first:
                need += self._missing(state, min(state.prefilled + self.chunk_size, state.prefill_goal))
        return need

    def _admission_need(self, state: RequestState) -> int:
        """Blocks a request needs to finish its prefill and take one decode step."""
        if state.rid in self.swapped:
            held = self.swapped[state.rid][1].blocks
            return max(self.pool.blocks_for(len(state.history) + self._k_bound(state)), held)
        return self.pool.blocks_for(state.prefill_goal + 1 + self._k_bound(state))

    # ---- 1. make room -------------------------------------------------------------------------
    def make_room(self, running: list[RequestState], now: float) -> bool:
        """Preempt until the next step fits; whether anything was preempted."""
        preempted = False
        while self.running_need(running) > self.pool.free_blocks and len(running) > 1:
            oldest = min(running, key=lambda s: s.arrived)
            victim = min((s for s in running if s is not oldest), key=lambda s: priority(s, now))
            running.remove(victim)
            self._preempt(victim)
            preempted = True
        return preempted

    def _preempt(self, state: RequestState) -> None:
        n_bytes = self.store.request_bytes(state.rid)
        if n_bytes == 0:  # admitted but never ran: nothing to save
            self.waiting.appendleft(state)
            return
        tokens = state.prefilled if state.prefilling else len(state.history) - 1
        modelled = {"swap": self.costs.swap_seconds(n_bytes),
                    "recompute": self.costs.recompute_seconds(tokens, self.chunk_size,
                                                              self.pool.reach(exclude=state.rid))}
        swap_cost, recompute_cost = (modelled[m] * self.learnt[m] for m in ("swap", "recompute"))
        mode = self.choose_mode(n_bytes, swap_cost, recompute_cost)
        if mode == "swap" or state.generated > 0:  # a resume it can measure
            self._forecasts[state.rid] = (mode, swap_cost if mode == "swap" else recompute_cost, modelled[mode])
        if mode == "swap":
            self.swapped[state.rid] = (state, self.store.swap_out(state.rid))
        else:
            self.pool.release(state.rid)
            state.prefilled = state.draft_cached = 0
            if state.generated > 0:  # its tokens so far are prefilled again on its own
                state.resume_goal = len(state.history) - 1
                self._recomputing[state.rid] = 0.0
            self.waiting.append(state)
        self.preemptions.append(Preemption(state.rid, mode, n_bytes, tokens, swap_cost, recompute_cost))
        self.metrics.preempted(mode, n_bytes if mode == "swap" else 0, tokens if mode == "recompute" else 0)

    def choose_mode(self, n_bytes: int, swap_cost: float, recompute_cost: float) -> str:
        if self.mode == "recompute" or not self.store.swap_fits(n_bytes):
            return "recompute"  # also when the host swap space is full
        if self.mode == "swap":
            return "swap"
        return "swap" if swap_cost < recompute_cost else "recompute"

    # ---- 2. admit -----------------------------------------------------------------------------
    def admit(self, running: list[RequestState], now: float) -> None:
        room = self.max_batch - len(running)
        if room <= 0 or not (self.waiting or self.swapped):
            return
        free = self.pool.free_blocks - self.running_need(running)
        by_priority = lambda states: sorted(states, key=lambda s: -priority(s, now))  # noqa: E731
        from_waiting = self._fitting(by_priority(self.waiting), free, room)
        from_swapped = self._fitting(by_priority(s for s, _ in self.swapped.values()), free, room)
        mean = lambda states: sum(priority(s, now) for s in states) / len(states)  # noqa: E731
        if from_swapped and (not from_waiting or mean(from_swapped) >= mean(from_waiting)):
            for state in from_swapped:
                _, swapped = self.swapped.pop(state.rid)
                self._resumed(state.rid, swapped.out_seconds + self.store.swap_in(state.rid, swapped))
                running.append(state)
        else:
            for state in from_waiting:
                self.waiting.remove(state)
                running.append(state)
                if state.scheduled_at is None:
                    state.scheduled_at = now

    def _fitting(self, candidates: list[RequestState], free: int, room: int) -> list[RequestState]:
        chosen = []
        for state in candidates[:room]:
            need = self._admission_need(state)
            if need > free:
                break
            chosen.append(state)
            free -= need
        return chosen

    # ---- recompute progress and leaving ---------------------------------------------------------
    def reprefilled(self, state: RequestState, seconds: float) -> None:
        """A chunk of a recomputed request's tokens went in, in seconds."""
        if state.rid not in self._recomputing:
            return
        self._recomputing[state.rid] += seconds
        if not state.prefilling:
            self._resumed(state.rid, self._recomputing.pop(state.rid))

    def _resumed(self, rid: int, seconds: float) -> None:
        """A preempted request is back: report predicted vs actual cost, and learn from it."""
        forecast = self._forecasts.pop(rid, None)
        if forecast is None:
            return
        mode, predicted, modelled = forecast
        self.metrics.preemption_cost(mode, predicted, seconds)
        if self.learning and modelled > 0:
            self.learnt[mode] = ema_ratio(self.learnt[mode], self._resumes[mode], seconds, modelled, decay=0.8)
            self._resumes[mode] += 1

    def forget(self, state: RequestState) -> None:
        """A request left (finished, cancelled, failed): free whatever it holds here."""
        self.pool.release(state.rid)
        self._recomputing.pop(state.rid, None)
        self._forecasts.pop(state.rid, None)
        held = self.swapped.pop(state.rid, None)
        if held is not None:
            self.store.discard(held[1])
        if state in self.waiting:
            self.waiting.remove(state)

    @property
    def queued(self) -> list[RequestState]:
        return [*self.waiting, *(s for s, _ in self.swapped.values())]
