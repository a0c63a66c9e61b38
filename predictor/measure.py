"""Measuring step times for a profile: n new tokens over a context, prefill chunks, copy bandwidth."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

from yggdrasil.runtime.latency import device_timed_runs
from yggdrasil.runtime.steps import StepInputs, StepRunner

from yggdrasil.policy.device_profile import ModelProfile, Point, median_time

Progress = Callable[[str], None]


def step_inputs(runner: StepRunner, n: int, context: int) -> StepInputs:
    """n new tokens at positions context.., attending the cached prefix and each other causally."""
    dev = runner.device
    positions = torch.arange(context, context + n, device=dev)
    span = runner.span(context + n)
    mask = torch.arange(span, device=dev)[None, :] <= positions[:, None]
    tokens = torch.zeros(n, dtype=torch.long, device=dev)
    return StepInputs(tokens[None], positions[None], positions[None], mask[None])


def _point(runner: StepRunner, n: int, context: int, repeats: int, mode: str) -> Point:
    inputs = step_inputs(runner, n, context)
    # on CUDA between events around each run (a call returns once its kernels are queued)
    times = device_timed_runs(lambda: runner.run(inputs, key="profile"), repeats, 1, runner.device)
    return Point(n, context, statistics.median(times), min(times), max(times), mode)


def profile_model(name: str, sha256: str | None, runner: StepRunner, sizes: Sequence[int],
                  contexts: Sequence[int], chunk_sizes: Sequence[int], repeats: int,
                  tick: Progress = lambda _: None) -> ModelProfile:
    """Step times for every (n, context) point and every prefill chunk size on one runner."""
    mode = "compiled" if runner.compiled else "eager"
    # compiled steps attend over the whole cache, so context does not change their cost
    points_contexts = [max(contexts)] if runner.compiled else list(contexts)
    steps = []
    for context in points_contexts:
        for n in sizes:
            tick(f"{name} {mode} n={n} context={context}")
            steps.append(_point(runner, n, context, repeats, mode))
    chunks = []
    for chunk in chunk_sizes:  # a prefill chunk is `chunk` new tokens over an empty cache
        tick(f"{name} {mode} prefill chunk {chunk}")
        chunks.append(_point(runner, chunk, 0, repeats, mode))
    params = sum(p.numel() for p in runner.model.parameters())
    return ModelProfile(name, sha256, params, tuple(steps), tuple(chunks))


def merge(a: ModelProfile, b: ModelProfile) -> ModelProfile:
    """One model's compiled and eager measurements in one profile."""
    return ModelProfile(a.name, a.sha256, a.params, a.steps + b.steps, a.prefill_chunks + b.prefill_chunks)


def copy_bandwidth(device: str, megabytes: int = 256, repeats: int = 5) -> dict:
    """Host↔device copy bandwidth in bytes/s (what swapping KV costs); not applicable on CPU."""
    if not device.startswith("cuda"):
        return {"d2h_bytes_per_s": None, "h2d_bytes_per_s": None,
                "note": "not applicable: on CPU the KV cache already lives in host memory"}
    n = megabytes * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize
    h2d, *_ = median_time(lambda: dev.copy_(host, non_blocking=True), repeats, sync=sync)
    d2h, *_ = median_time(lambda: host.copy_(dev, non_blocking=True), repeats, sync=sync)
    return {"d2h_bytes_per_s": n / d2h, "h2d_bytes_per_s": n / h2d, "note": f"{megabytes} MiB pinned copies"}
