"""Sampling parameters and the target distribution they define (temperature, top-k, top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from yggdrasil.errors import InvalidRequestError
from yggdrasil.host_reads import HostReads, staged


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 means no top-k cut."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, over the last dim of logits (fp32).

    Greedy is the one-hot of the argmax, so verification code can treat both modes alike.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep a token while the mass before it is still below top_p (the first is always kept)
        keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of logits [..., V]. On the host, torch.multinomial; on a device, the
    randoms come from the (host) generator and the draw is made where the logits are
    (draw_from), so nothing is read back: the caller's one packed read takes the token."""
    if params.greedy:
        return logits.argmax(-1)
    probs = target_probs(logits, params)
    if probs.device.type != "cpu":
        flat = probs.reshape(-1, probs.shape[-1])
        return draw_from(flat, host_uniforms(flat.shape[0], generator, flat.device)).reshape(probs.shape[:-1])
    flat = probs.reshape(-1, probs.shape[-1])
    drawn = torch.multinomial(flat, 1, generator=generator)
    return drawn.reshape(probs.shape[:-1])


def argmax(logits: torch.Tensor, reads: HostReads, rows: int | None = None) -> torch.Tensor:
    """logits.argmax(-1), the first maximum of each row (a NaN counting as the maximum, as torch
    does); rows: of the first `rows` rows of a forward's logits [1, N, vocab] only. On the host
    numpy's vectorised scan (and numpy's slicing): torch's CPU argmax over a 152k vocabulary is
    a scalar loop (0.5 ms for 4 rows on a Zen 4 core, numpy's 0.04 ms)."""
    if reads.on_host and logits.dtype in (torch.float32, torch.float64):
        values = reads.numpy(logits)
        return torch.from_numpy((values if rows is None else values[0, :rows]).argmax(-1))
    return (logits if rows is None else logits[0, :rows]).argmax(-1)


def host_uniforms(rows: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """[rows, 1] uniforms in [0, 1) drawn in one call of the (host) generator, moved to `device`
    in one staged, non-blocking copy (a seed gives the same draws on every device)."""
    uniforms = torch.rand(rows, 1, generator=generator)
    return staged((uniforms,), device)[0]


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [N, V] by inverse CDF with uniforms [N, 1], on their device."""
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, uniforms * cdf[:, -1:]).squeeze(-1).clamp(max=probs.shape[-1] - 1)
