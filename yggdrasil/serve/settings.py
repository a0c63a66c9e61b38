"""The engine's settings, its step records and the errors submit raises."""

from __future__ import annotations

from dataclasses import dataclass

from yggdrasil.errors import InvalidRequestError, YggdrasilError
from .memory import PREEMPTION_MODES


class QueueFullError(YggdrasilError):
    """The waiting queue is full; the client should retry after retry_after seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(YggdrasilError):
    """The server is shutting down (drain()) and takes no new requests."""


@dataclass(frozen=True)
class EngineSettings:
    max_context: int
    max_batch: int = 4
    max_queue: int = 16
    chunk_size: int = 64  # prompt tokens per step
    block_size: int = 16
    kv_blocks: int | None = None  # the pool's size; None: max_batch full contexts (never short)
    swap_bytes: int = 2**30  # host memory for swapped-out KV
    preemption: str = "auto"  # auto (cheaper of swap and recompute) | swap | recompute

    def __post_init__(self) -> None:
        for name in ("max_context", "max_batch", "max_queue", "chunk_size", "block_size"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_blocks is not None and self.kv_blocks < 2:
            raise InvalidRequestError(f"the KV pool needs at least 2 blocks of {self.block_size} tokens, "
                                      f"got {self.kv_blocks}; give a larger --kv-budget")
        if self.swap_bytes < 0:
            raise InvalidRequestError(f"swap_bytes must be >= 0, got {self.swap_bytes}")
        if self.preemption not in PREEMPTION_MODES:
            raise InvalidRequestError(f"--preemption must be one of {', '.join(PREEMPTION_MODES)}, "
                                      f"got {self.preemption!r}")

    @property
    def full_blocks(self) -> int:
        """Blocks for max_batch requests at the full context each: more is never used."""
        return self.max_batch * -(-self.max_context // self.block_size)


@dataclass(frozen=True)
class StepRecord:
    """What one step did (the engine keeps the last few hundred; tests and metrics read them)."""

    index: int
    prefill: tuple[int, int] | None  # (request id, prompt tokens in the chunk), recompute chunks too
    decoding: tuple[int, ...]  # request ids that got tokens from the verify rows
    k: int  # speculation length chosen for the step
    rows: int  # target rows in the forward
    new_tokens: dict[int, int]  # request id -> tokens committed this step
    seconds: float
