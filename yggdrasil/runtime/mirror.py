"""Rank 0's mirror of a tensor-parallel target's steps (issue 55; docs/tensor-parallel.md).

Every operation of rank 0's shard that runs a collective or touches K/V is first broadcast to the
other ranks: a fixed int64 header, then the operation's tensors, over torch.distributed. The
operations are the forward, and on a KV cache: its setup, a new cache beside the model's own (a
server's pool), a move of slots, a swap of slots out to host memory and back in, and dropping a
swapped copy. The other ranks (`follow`) run the same operation on their own shard and caches in
the same order, so they join the same collectives and their caches hold the same positions at the
same slots (only their own K/V heads); they run nothing else. Block tables, scheduling and
sampling stay on rank 0: the others see only slot indices.

A waiting rank's broadcast ends at the process group's timeout, so rank 0 sends a keep-alive when
it has sent nothing for a quarter of it (a server between requests, a chat waiting for input).
A failed broadcast or collective, or a spawned rank that exited, becomes one TensorParallelError
naming the rank; after it, every mirrored operation raises it again at once (never a hang).
"""

from __future__ import annotations

import itertools
import threading
import time

from typing import Callable

import torch
import torch.distributed as dist

from yggdrasil.models.tensor_parallel import TensorParallelError

FORWARD, MOVE, SETUP, STOP, NEW_CACHE, SWAP_OUT, SWAP_IN, DROP, PING, GRAPH = range(1, 11)
HEADER = 8  # op, cache (0: the model's own), then the op's sizes (see Leader's methods)
OWN_CACHE = 0
STACKED = {None: 0, False: 1, True: 2}  # setup_cache's layout argument, as a header int


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def exited(processes: list) -> list[str]:
    """The spawned ranks (1..N-1, in order) that have exited, named with their exit codes."""
    return [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(processes)
            if p is not None and p.exitcode is not None]


def _indices(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).to(torch.int64).cpu().contiguous()


def step_message(op: int, cache_id: int, tokens, positions, slots, mask, logit_index,
                 return_hidden: bool = False, graph: int = 0) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A step as rank 0 sends it (receive_step reads it). Header: op (FORWARD: the model's
    forward; GRAPH: graph `graph` of each rank's set), cache, batch, rows, span, logit rows (-1:
    none), return_hidden, graph; then tokens, positions, slots and logit_index in one int64
    tensor, and the mask as uint8."""
    batch, rows = tokens.shape
    ints = [tokens.reshape(-1), positions.reshape(-1), slots.reshape(-1)]
    k = -1 if logit_index is None else logit_index.shape[1]
    if logit_index is not None:
        ints.append(logit_index.reshape(-1))
    return ([op, cache_id, batch, rows, mask.shape[-1], k, int(return_hidden), graph],
            _indices(torch.cat(ints)), mask.to(torch.uint8).contiguous())


def broadcast(header: list[int], tensors, control) -> None:
    """One message from rank 0 over `control`: the header (padded to HEADER ints), then its tensors."""
    dist.broadcast(torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64), 0, control)
    for t in tensors:
        dist.broadcast(t, 0, control)


class Leader:
    """Rank 0's side: mirrors every step and K/V operation of its sharded target to the other
    ranks (model.forward, setup_cache and new_cache, and each cache's move, swap_out, swap_in
    and drop are replaced by mirrored ones)."""

    def __init__(self, model: torch.nn.Module, world: int, processes: list, control) -> None:
        """control: the group the messages go over (ranks.join's; the model's collectives keep
        the default group)."""
        self.model, self.world, self.processes, self.control = model, world, processes, control
        self._forward, self._setup_cache, self._new_cache = model.forward, model.setup_cache, model.new_cache
        self.closed = False
        self.failed: TensorParallelError | None = None
        self._lock = threading.RLock()  # one operation's broadcasts and collectives at a time, in order
        self._cache_ids = itertools.count(OWN_CACHE + 1)
        self._last_sent = time.monotonic()
        self._closing = threading.Event()
        self._keeper: threading.Thread | None = None
        model.forward = self.forward  # instance attributes: nn.Module.__call__ runs this forward
        model.setup_cache, model.new_cache = self.setup_cache, self.new_cache
        if model.cache is not None:
            self._mirror_cache(model.cache, OWN_CACHE)

    # -- sending --------------------------------------------------------------------------------
    def _send(self, header: list[int], *tensors: torch.Tensor) -> None:
        with self._lock:
            if self.failed is not None:  # the group is broken: say so again rather than wait on it
                raise TensorParallelError(str(self.failed))
            try:
                broadcast(header, tensors, self.control)
            except Exception as exc:
                raise self.failure(exc) from None
            self._last_sent = time.monotonic()

    def failure(self, exc: BaseException | None = None) -> TensorParallelError:
        """One clear error for a rank that stopped (a failed collective, or an exited process);
        it is kept, and every later operation raises it too."""
        who = ", ".join(exited(self.processes)) or "another rank"
        cause = f" ({type(exc).__name__}: {first_line(exc)[:200]})" if exc is not None else ""
        error = TensorParallelError(f"tensor parallel: {who} stopped or timed out, so the run ends{cause}; see that "
                                    "rank's own error above, then run again")
        if self.failed is None:
            self.failed = error
        return error

    def check(self) -> None:
        """Raise the kept failure, or one for a spawned rank that has exited (a server asks this
        while it waits for requests, so a rank that dies between them ends it at once)."""
        if self.failed is None and not self.closed and exited(self.processes):
            self.failure()
        if self.failed is not None:
            raise TensorParallelError(str(self.failed))

    # -- the mirrored operations ----------------------------------------------------------------
    def send_step(self, op: int, cache_id: int, tokens, positions, slots, mask, logit_index,
                  return_hidden: bool = False, graph: int = 0) -> None:
        header, *tensors = step_message(op, cache_id, tokens, positions, slots, mask, logit_index, return_hidden, graph)
        self._send(header, *tensors)

    def forward(self, tokens, positions, slots, mask, logit_index=None, return_hidden=False, cache=None):
        cache_id = self._cache_id(cache)
        with self._lock:  # no keep-alive between the header and the step's own collectives
            self.send_step(FORWARD, cache_id, tokens, positions, slots, mask, logit_index, return_hidden)
            try:
                return self._forward(tokens, positions, slots, mask, logit_index=logit_index,
                                     return_hidden=return_hidden, cache=cache)
            except RuntimeError as exc:  # a collective inside the step (gloo: connection closed, timeout)
                raise self.failure(exc) from None

    def mirror_graphs(self, graphs) -> None:
        """Rank 0's graph set (a storage.registry.GraphSet of this rank's packages): each graph's
        calls first go to the other ranks, which run the same graph of their own set."""
        for index, name in enumerate(sorted(graphs.graphs)):
            graphs.graphs[name] = MirroredStep(self, graphs.graphs[name], index)

    def _cache_id(self, cache) -> int:
        if cache is None or cache is self.model.cache:
            return OWN_CACHE
        cache_id = getattr(cache, "mirror_id", None)
        if cache_id is None:
            raise TensorParallelError("tensor parallel: a forward over a KV cache the other ranks do not hold; "
                                      "make it with the target's new_cache(), which makes it on every rank")
        return cache_id

    def setup_cache(self, batch_size: int, max_context: int, stacked: bool | None = None):
        with self._lock:
            self._send([SETUP, OWN_CACHE, batch_size, max_context, STACKED[stacked]])
            cache = self._setup_cache(batch_size, max_context, stacked=stacked)
        self._mirror_cache(cache, OWN_CACHE)
        return cache

    def new_cache(self, batch_size: int, capacity: int):
        with self._lock:
            cache_id = next(self._cache_ids)
            self._send([NEW_CACHE, cache_id, batch_size, capacity])
            cache = self._new_cache(batch_size, capacity)
        self._mirror_cache(cache, cache_id)
        return cache

    def _mirror_cache(self, cache, cache_id: int) -> None:
        """Replace the cache's K/V operations by ones that run on every rank's cache `cache_id`."""
        if getattr(cache, "mirror_id", None) is not None:
            return
        move, swap_out, swap_in, drop = cache.move, cache.swap_out, cache.swap_in, cache.drop

        def mirrored_move(src: torch.Tensor, dst: torch.Tensor) -> None:
            index = torch.stack([_indices(src), _indices(dst)])
            with self._lock:
                self._send([MOVE, cache_id, index.shape[1]], index)
                move(src, dst)

        def mirrored_swap_out(key: int, slots: torch.Tensor) -> None:
            with self._lock:
                self._send([SWAP_OUT, cache_id, key, slots.numel()], _indices(slots))
                swap_out(key, slots)

        def mirrored_swap_in(key: int, slots: torch.Tensor) -> None:
            with self._lock:
                self._send([SWAP_IN, cache_id, key, slots.numel()], _indices(slots))
                swap_in(key, slots)

        def mirrored_drop(key: int) -> None:
            with self._lock:
                self._send([DROP, cache_id, key])
                drop(key)

        cache.move, cache.swap_out, cache.swap_in, cache.drop = (mirrored_move, mirrored_swap_out,
                                                                 mirrored_swap_in, mirrored_drop)
        cache.mirror_id = cache_id

    # -- idle and closing -----------------------------------------------------------------------
    def keep_alive(self, timeout_s: float) -> None:
        """Send a keep-alive whenever nothing was sent for a quarter of the group's timeout."""
        interval = timeout_s / 4
        self._keeper = threading.Thread(target=self._keep_alive, args=(interval,), daemon=True,
                                        name="yggdrasil-tp-keepalive")
        self._keeper.start()

    def _keep_alive(self, interval: float) -> None:
        while not self._closing.wait(interval / 4):
            with self._lock:
                if self.closed or self.failed is not None:
                    return
                if time.monotonic() - self._last_sent < interval:
                    continue
                try:
                    self._send([PING])
                except TensorParallelError:
                    return  # kept in self.failed: the next operation or check() raises it

    def close(self) -> None:
        """Tell the other ranks to stop, wait for them, leave the group (idempotent). After a
        failure the ranks still running are not waited for: they are stopped."""
        if self.closed:
            return
        self._closing.set()
        if self._keeper is not None:
            self._keeper.join()
        with self._lock:
            self.closed = True
            if self.failed is None:
                try:
                    self._send([STOP])
                except TensorParallelError:
                    pass  # a rank already gone: nothing more to tell it
        for p in self.processes:
            if p is not None:
                p.join(timeout=30 if self.failed is None else 1)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()


class MirroredStep:
    """Rank 0's side of one compiled graph: its inputs go to the other ranks, then it runs (its
    collectives meet theirs, from the same graph of each rank's own set)."""

    def __init__(self, leader: Leader, step, index: int) -> None:
        self.leader, self.step, self.index = leader, step, index
        self.name = step.name

    @property
    def seconds(self) -> float:
        return self.step.seconds

    def __call__(self, tokens, positions, slots, mask, logit_index=None, kv=()):
        if kv:
            raise TensorParallelError("tensor parallel: the target's graphs run over its own KV cache; a passed "
                                      "KV pool runs eager sharded forwards (serve)")
        with self.leader._lock:
            self.leader.send_step(GRAPH, OWN_CACHE, tokens, positions, slots, mask, logit_index, graph=self.index)
            try:
                return self.step(tokens, positions, slots, mask, logit_index)
            except RuntimeError as exc:  # a collective inside the graph (gloo: connection closed, timeout)
                raise self.leader.failure(exc) from None


# -- ranks 1..N-1 ---------------------------------------------------------------------------------
def follow(model: torch.nn.Module, control, load_graphs: Callable[[], object] | None = None) -> None:
    """A non-zero rank's whole life after loading: run each operation rank 0 broadcasts over
    `control` (ranks.join's group), on this rank's shard and caches, until STOP. load_graphs: this
    rank's graph set (a GraphSet), loaded at its first graph step (after rank 0 has set up the KV
    cache its graphs bind to)."""
    caches = {}
    graphs = None
    header = torch.empty(HEADER, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0, control)
        op, cache_id, *sizes = header.tolist()
        if op == STOP:
            return
        cache = model.cache if cache_id == OWN_CACHE else caches.get(cache_id)
        if op == PING:
            continue
        if op == SETUP:
            model.setup_cache(sizes[0], sizes[1], stacked={v: k for k, v in STACKED.items()}[sizes[2]])
        elif op == NEW_CACHE:
            caches[cache_id] = model.new_cache(sizes[0], sizes[1])
        elif op == MOVE:
            index = receive((2, sizes[0]), control)
            cache.move(index[0], index[1])
        elif op == SWAP_OUT:
            cache.swap_out(sizes[0], receive((sizes[1],), control))
        elif op == SWAP_IN:
            cache.swap_in(sizes[0], receive((sizes[1],), control))
        elif op == DROP:
            cache.drop(sizes[0])
        elif op == FORWARD:
            inputs = receive_step(*sizes[:4], control)
            with torch.inference_mode():
                model(*inputs[:4], logit_index=inputs[4], return_hidden=bool(sizes[4]), cache=cache)
        elif op == GRAPH:
            if graphs is None:
                if load_graphs is None:
                    raise TensorParallelError("tensor parallel: rank 0 runs compiled graphs but this rank has none")
                graphs = load_graphs()
                names = sorted(graphs.graphs)
            inputs = receive_step(*sizes[:4], control)
            with torch.inference_mode():
                graphs.graphs[names[sizes[5]]](*inputs)
        else:
            raise TensorParallelError(f"tensor parallel: unknown operation {op} from rank 0")


def receive(shape: tuple[int, ...], control, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """One tensor of rank 0's message (broadcast), on a rank that follows."""
    t = torch.empty(shape, dtype=dtype)
    dist.broadcast(t, 0, control)
    return t


def receive_step(batch: int, rows: int, span: int, k: int, control) -> tuple:
    """A step's inputs as step_message made them (the header's batch, rows, span and logit
    rows): tokens, positions, slots, mask, logit index."""
    n = batch * rows
    ints = receive((3 * n + (batch * k if k >= 0 else 0),), control)
    mask = receive((batch, rows, span), control, torch.uint8)
    tokens, positions, slots = (ints[i * n:(i + 1) * n].view(batch, rows) for i in range(3))
    return tokens, positions, slots, mask.bool(), ints[3 * n:].view(batch, k) if k >= 0 else None
