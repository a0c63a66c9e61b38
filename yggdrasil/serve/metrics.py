"""Server metrics in the Prometheus text format (GET /metrics).

The engine thread writes, the HTTP thread reads; one lock guards both. Each server has its own
ServerMetrics (no module-level registry), so tests can run several servers in one process.
"""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return out + [f"{name}_sum {self.sum:.6g}", f"{name}_count {running}"]


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}  # by finish reason, plus "rejected" (429)
        self.prompt_tokens = 0
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache
        self.generation_tokens = 0
        self.steps = 0
        self.proposed = 0
        self.accepted = 0
        self.verifies = 0
        self.tpot = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.step_seconds = Histogram(LATENCY_BUCKETS)
        self.speculation = Histogram(SIZE_BUCKETS)
        self.tokens_per_verify = Histogram(SIZE_BUCKETS)
        self.waiting = self.running = 0
        self.kv_usage = 0.0
        self.swapped = self.swap_bytes_held = 0
        self.preemptions: dict[str, int] = {"swap": 0, "recompute": 0}
        self.swap_bytes = 0
        self.recompute_tokens = 0
        # per mode: [resumes measured, predicted seconds, actual seconds, sum of |error| / actual]
        self.preemption_costs = {"swap": [0, 0.0, 0.0, 0.0], "recompute": [0, 0.0, 0.0, 0.0]}
        self._request_seconds: list[float] = []

    # writers (engine thread) ------------------------------------------------------------------
    def rejected(self) -> None:
        with self._lock:
            self.requests["rejected"] = self.requests.get("rejected", 0) + 1

    def set_load(self, waiting: int, running: int, kv_usage: float, swapped: int = 0,
                 swap_bytes_held: int = 0) -> None:
        with self._lock:
            self.waiting, self.running, self.kv_usage = waiting, running, kv_usage
            self.swapped, self.swap_bytes_held = swapped, swap_bytes_held

    def preempted(self, mode: str, swap_bytes: int, recompute_tokens: int) -> None:
        with self._lock:
            self.preemptions[mode] += 1
            self.swap_bytes += swap_bytes
            self.recompute_tokens += recompute_tokens

    def preemption_cost(self, mode: str, predicted: float, actual: float) -> None:
        """A preempted request resumed: what its preemption was predicted to cost and did cost."""
        with self._lock:
            cost = self.preemption_costs[mode]
            cost[0] += 1
            cost[1] += predicted
            cost[2] += actual
            cost[3] += abs(predicted - actual) / actual if actual > 0 else 0.0

    def preemption_error(self, mode: str) -> float | None:
        """Mean |predicted - actual| / actual over the resumes measured."""
        with self._lock:
            count, _, _, errors = self.preemption_costs[mode]
            return errors / count if count else None

    def step(self, record) -> None:
        with self._lock:
            self.steps += 1
            self.step_seconds.observe(record.seconds)
            if record.decoding:
                self.speculation.observe(record.k)

    def verified(self, proposed: int, accepted: int) -> None:
        with self._lock:
            self.verifies += 1
            self.proposed += proposed
            self.accepted += accepted
            self.tokens_per_verify.observe(accepted + 1)

    def cached_prompt_tokens(self, tokens: int) -> None:
        with self._lock:
            self.cached_tokens += tokens

    def first_token(self, state) -> None:
        with self._lock:
            self.ttft.observe(state.first_token_at - state.arrived)

    def finished(self, state) -> None:
        with self._lock:
            reason = state.finish_reason or "cancelled"
            self.requests[reason] = self.requests.get(reason, 0) + 1
            self.prompt_tokens += state.prompt_length
            self.generation_tokens += state.generated
            if state.generated > 1 and state.first_token_at is not None:
                self.tpot.observe((state.last_token_at - state.first_token_at) / (state.generated - 1))
            if state.last_token_at is not None:
                self._request_seconds = (self._request_seconds + [state.last_token_at - state.arrived])[-50:]

    # readers ----------------------------------------------------------------------------------
    def mean_request_seconds(self) -> float | None:
        with self._lock:
            seconds = self._request_seconds
            return sum(seconds) / len(seconds) if seconds else None

    def aal(self) -> float:
        """Average accepted length: tokens each verify of a request yields (bonus included)."""
        with self._lock:
            return (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0

    def render(self) -> str:
        aal = self.aal()
        errors = {mode: self.preemption_error(mode) for mode in self.preemption_costs}
        with self._lock:
            lines = ["# HELP yggdrasil_requests_total Requests by how they ended (rejected: 429).",
                     "# TYPE yggdrasil_requests_total counter"]
            lines += [f'yggdrasil_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            for name, kind, value, help_text in (
                    ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of finished requests."),
                    ("prompt_tokens_cached_total", "counter", self.cached_tokens,
                     "Prompt tokens whose K/V the prefix cache supplied (not prefilled)."),
                    ("generation_tokens_total", "counter", self.generation_tokens,
                     "Tokens generated for finished requests."),
                    ("steps_total", "counter", self.steps, "Engine steps run."),
                    ("proposed_tokens_total", "counter", self.proposed, "Speculated tokens verified."),
                    ("accepted_tokens_total", "counter", self.accepted, "Speculated tokens accepted."),
                    ("queue_depth", "gauge", self.waiting, "Requests waiting for a batch slot."),
                    ("running_requests", "gauge", self.running, "Requests in the running batch."),
                    ("kv_usage_ratio", "gauge", round(self.kv_usage, 4), "Fraction of the KV pool's blocks in use."),
                    ("accepted_length", "gauge", round(aal, 4), "Average tokens per verify per request (AAL)."),
                    ("swapped_requests", "gauge", self.swapped, "Preempted requests whose KV is in host memory."),
                    ("swap_space_used_bytes", "gauge", self.swap_bytes_held, "Host memory holding swapped KV."),
                    ("swap_out_bytes_total", "counter", self.swap_bytes, "KV bytes swapped out to host memory."),
                    ("recompute_tokens_total", "counter", self.recompute_tokens,
                     "Tokens dropped by recompute preemptions (prefilled again on resume).")):
                lines += [f"# HELP yggdrasil_{name} {help_text}", f"# TYPE yggdrasil_{name} {kind}",
                          f"yggdrasil_{name} {value}"]
            lines += ["# HELP yggdrasil_preemptions_total Requests preempted for KV memory, by mode.",
                      "# TYPE yggdrasil_preemptions_total counter"]
            lines += [f'yggdrasil_preemptions_total{{mode="{m}"}} {n}' for m, n in sorted(self.preemptions.items())]
            lines += ["# HELP yggdrasil_preemption_cost_seconds_total Predicted and measured cost of the "
                      "preemptions that resumed (swap: out and back; recompute: prefilling again).",
                      "# TYPE yggdrasil_preemption_cost_seconds_total counter"]
            for mode, (count, predicted, actual, _) in sorted(self.preemption_costs.items()):
                lines += [f'yggdrasil_preemption_cost_seconds_total{{mode="{mode}",kind="predicted"}} {predicted:.6g}',
                          f'yggdrasil_preemption_cost_seconds_total{{mode="{mode}",kind="actual"}} {actual:.6g}']
            lines += ["# HELP yggdrasil_preemption_cost_error_ratio Mean |predicted - actual| / actual "
                      "preemption cost, by mode (NaN before any resume).",
                      "# TYPE yggdrasil_preemption_cost_error_ratio gauge"]
            lines += [f'yggdrasil_preemption_cost_error_ratio{{mode="{m}"}} '
                      f'{"NaN" if e is None else round(e, 4)}' for m, e in sorted(errors.items())]
            for name, hist, help_text in (
                    ("time_per_output_token_seconds", self.tpot, "Per request: seconds between output tokens."),
                    ("time_to_first_token_seconds", self.ttft, "Per request: arrival to first token."),
                    ("step_seconds", self.step_seconds, "Engine step time."),
                    ("speculation_length", self.speculation, "Speculation length k chosen per decoding step."),
                    ("tokens_per_verify", self.tokens_per_verify, "Tokens one verify gave one request.")):
                lines += [f"# HELP yggdrasil_{name} {help_text}", f"# TYPE yggdrasil_{name} histogram",
                          *hist.lines(f"yggdrasil_{name}")]
        return "\n".join(lines) + "\n"
