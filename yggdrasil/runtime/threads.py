"""Serial host work, parallel model steps (issue 51, part 5).

A speculative iteration does a few hundred small tensor ops on the host between its model
forwards: masks, positions, the draft's log-softmax and top-k over its vocabulary, the target's
argmax over each verified row. With torch's intra-op threads at 2, each of those ops that ATen
parallelises opens an OpenMP region and waits for the second thread; when that thread is late
(the other core busy, or still spinning out a kernel's own parallel_for), a 0.5 ms reduction takes
8-30 ms (measured on a 2-core Zen 4: `argmax` of [4, 151936] 0.5 ms on one thread, 8 ms on two
while another process ran). So an iteration's host work runs on one thread, and each model
forward (compiled graph or eager step, whose kernels split work with at::parallel_for) gets the
threads back for its duration.

`HostThreads` is the switch: the speculator enters `host()` for its iteration, and every step
runner sharing the object enters `model()` around its forward. Outside `host()` both do nothing,
so plain decoding and everything else run as before.
"""

from __future__ import annotations

import contextlib

import torch


class HostThreads:
    def __init__(self) -> None:
        self.model_threads: int | None = None  # while inside host(): the count the model steps run with
        self._model = _ModelThreads(self)

    @contextlib.contextmanager
    def host(self):
        """Host work on one intra-op thread (nested calls are no-ops)."""
        threads = torch.get_num_threads()
        if self.model_threads is not None or threads == 1:
            yield
            return
        self.model_threads = threads
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            self.model_threads = None

    def model(self) -> "_ModelThreads":
        """A model forward inside host(): with the threads host() found (one reused context
        object: it is entered on every forward)."""
        return self._model


class _ModelThreads:
    def __init__(self, owner: HostThreads) -> None:
        self._owner = owner

    def __enter__(self) -> None:
        if self._owner.model_threads is not None:
            torch.set_num_threads(self._owner.model_threads)

    def __exit__(self, *exc) -> None:
        if self._owner.model_threads is not None:
            torch.set_num_threads(1)
