"""Autoregressive generation: chunked prefill, then one token per decode step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from yggdrasil.errors import InvalidRequestError
from yggdrasil.runtime.logits import LogitsControl
from yggdrasil.sampling import SamplingParams, sample
from yggdrasil.runtime.steps import StepRunner

TokenCallback = Callable[[Sequence[int]], None]


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    first_token_seconds: float  # prefill + first sample
    decode_seconds: float  # everything after the first token
    prefilled_tokens: int  # prompt tokens actually prefilled (fewer when a cached prefix was reused)

    @property
    def time_per_output_token(self) -> float:
        """Seconds between output tokens after the first (the decode rate)."""
        steps = self.new_tokens - 1
        return self.decode_seconds / steps if steps > 0 else float("nan")

    def summary(self) -> str:
        tpot = self.time_per_output_token
        rate = f"{1 / tpot:.1f} tok/s" if tpot == tpot and tpot > 0 else "n/a"
        return (f"prompt {self.prompt_tokens} tok | new {self.new_tokens} tok | "
                f"prefill {self.prefill_seconds:.3f} s{self._reused()} | first token {self.first_token_seconds:.3f} s | "
                f"TPOT {tpot * 1e3:.1f} ms ({rate})")

    def _reused(self) -> str:
        reused = self.prompt_tokens - self.prefilled_tokens
        return f" ({reused} cached)" if reused > 0 else ""


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    stop_reason: str  # "stop" (a stop token), "length" (max_new_tokens), "context" (cache full)
    stats: GenerationStats
    cached_ids: list[int]  # the tokens whose K/V the cache now holds, in order (reusable next call)


def reusable_prefix(reuse: int, prompt_ids: Sequence[int]) -> int:
    """How many leading prompt tokens to take from the cache: at most all but the last, whose
    logits the prefill must produce."""
    if reuse < 0:
        raise InvalidRequestError(f"reuse must be >= 0, got {reuse}")
    return min(reuse, len(prompt_ids) - 1)


def generate(runner: StepRunner, prompt_ids: Sequence[int], max_new_tokens: int,
             sampling: SamplingParams, stop_ids: frozenset[int] = frozenset(),
             on_tokens: TokenCallback | None = None, reuse: int = 0,
             control: LogitsControl | None = None) -> GenerationResult:
    """Generate up to max_new_tokens after prompt_ids; stop tokens end the reply (not emitted).

    reuse: leading prompt tokens whose K/V the cache already holds from an earlier call (its
    cached_ids' common prefix with this prompt); only the rest is prefilled.
    control: penalties and a grammar applied to every step's logits (runtime/logits.py); a
    completed grammar ends the reply ("stop")."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty; give at least one token of text")
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    runner.check_fits(len(prompt_ids))
    generator = sampling.generator()
    reuse = reusable_prefix(reuse, prompt_ids)
    started = time.perf_counter()
    if control is not None:  # its mask for the first token is computed while the prefill runs
        control.start([prompt_ids[-1]], [-1])
    logits = runner.prefill(list(prompt_ids[reuse:]), start=reuse)
    prefill_done = time.perf_counter()
    budget = min(max_new_tokens, runner.max_context - len(prompt_ids))
    out: list[int] = []
    stop_reason = "length" if budget == max_new_tokens else "context"
    first_token_at = prefill_done
    position = len(prompt_ids)
    while True:
        if control is None:
            token = int(runner.reads.item(sample(logits, sampling, generator)))  # the step's one read
        else:
            token = control.choose(logits[None], lambda rows, nodes: runner.reads.tolist(sample(rows, sampling, generator)),
                                   sampling.greedy)[0][0]
        if not out:
            first_token_at = time.perf_counter()
        if token in stop_ids:
            stop_reason = "stop"
            break
        out.append(token)
        if on_tokens is not None:
            on_tokens([token])
        if control is not None and (control.commit([token]) and control.finished):
            stop_reason = "stop"
            break
        if len(out) >= budget:
            break
        if control is not None:
            control.start([token], [-1])
        logits = runner.decode(token, position)
        position += 1
    finished = time.perf_counter()
    stats = GenerationStats(
        prompt_tokens=len(prompt_ids), new_tokens=len(out),
        prefill_seconds=prefill_done - started, first_token_seconds=first_token_at - started,
        decode_seconds=finished - first_token_at, prefilled_tokens=len(prompt_ids) - reuse,
    )
    return GenerationResult(out, stop_reason, stats, (list(prompt_ids) + out)[:position])


def greedy_tokens(runner: StepRunner, prompt_ids: Sequence[int], n: int) -> list[int]:
    """Plain greedy continuation, ignoring stop tokens (the reference for exactness tests)."""
    with torch.inference_mode():
        return generate(runner, prompt_ids, n, SamplingParams()).tokens
