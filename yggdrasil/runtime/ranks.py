"""The ranks of a tensor-parallel target (issue 55; docs/tensor-parallel.md).

Rank 0 is the ordinary process: it owns tokenization, the drafter, the policy and the server,
and its target is its own shard (models/tensor_parallel.py). Every forward and K/V operation of
that target is mirrored to the other ranks (mirror.py), which run the same operations on their
shards and caches and so join the same collectives; they run nothing else. The step messages go
over a group of their own (join): the model's collectives have the default group to themselves.
A bundle of compiled graphs gives each rank its own graph set (graphs/rank-K/target/, the
collectives inside each graph): rank 0's graph calls are mirrored the same way, naming the
graph, and each other rank runs that graph of its own set. Process groups get a
timeout, so a rank that dies or hangs ends the run with one TensorParallelError naming it,
never a hang.

Launch: `start_ranks` spawns ranks 1..N-1 with torch.multiprocessing on this host; under
`torchrun` (several hosts: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment) every
rank runs the same command and `rank_from_environment` says which one this is.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yggdrasil import kernels
from yggdrasil.models.tensor_parallel import TensorParallelError, plan_shards, shard_model
from yggdrasil.runtime.deployed import DeployedWeights
from yggdrasil.runtime.mirror import Leader, MirroredStep, exited, first_line, follow  # noqa: F401 (MirroredStep: tests, bench)
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.registry import GraphSet, load_graph_set

DEFAULT_TIMEOUT_S = 120.0
ENV_TIMEOUT = "YGGDRASIL_TP_TIMEOUT"


@dataclass(frozen=True)
class RankSpec:
    """How one rank joins: its rank, the world size, the rendezvous and per-rank threads."""

    rank: int
    world: int
    address: str
    port: int
    threads: int | None
    timeout_s: float


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timeout_s() -> float:
    return float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))


def join(spec: RankSpec, device: str = "cpu", alive: Callable[[], str | None] = lambda: None):
    """Join the process group with the collective timeout set. Each rank first checks in at rank
    0's store; rank 0 waits for them there while `alive()` (which names a spawned rank that has
    exited, if any) stays None, so a rank that dies while starting is one error, not a wait.

    Returns the group the step messages (rank 0's broadcasts, the barriers) go over: a second
    gloo group over the same ranks, so that the default group carries only the model's own
    collectives. On one group, a broadcast followed by a compiled graph's functional all-reduce
    timed out now and then (torch 2.13, gloo: 6 runs in 18); on two, never in 12 (SGLang keeps its
    control messages on a CPU group of their own too)."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    try:
        store = dist.TCPStore(spec.address, spec.port, spec.world, is_master=spec.rank == 0, timeout=timeout,
                              wait_for_workers=False)
        store.set(f"joined/{spec.rank}", "1")
        if spec.rank == 0:
            _wait_for_ranks(store, spec, alive)
        dist.init_process_group(backend_for(device), store=store, rank=spec.rank, world_size=spec.world,
                                timeout=timeout)
        return dist.new_group(backend="gloo", timeout=timeout)
    except TensorParallelError:
        raise
    except Exception as exc:  # a rank that never came: the store's wait times out
        raise TensorParallelError(
            f"tensor parallel: rank {spec.rank} of {spec.world} could not join the others at "
            f"{spec.address}:{spec.port} within {spec.timeout_s:.0f} s ({type(exc).__name__}: "
            f"{first_line(exc)}); start all {spec.world} ranks (torchrun --nproc-per-node {spec.world}, same "
            "MASTER_ADDR/MASTER_PORT)") from None


def _wait_for_ranks(store, spec: RankSpec, alive: Callable[[], str | None]) -> None:
    deadline = time.monotonic() + spec.timeout_s
    missing = list(range(1, spec.world))
    while missing:
        dead = alive()
        if dead is not None:
            raise TensorParallelError(f"tensor parallel: {dead} stopped before joining; see its error above")
        if time.monotonic() > deadline:
            raise TensorParallelError(
                f"tensor parallel: rank(s) {', '.join(map(str, missing))} of {spec.world} did not join within "
                f"{spec.timeout_s:.0f} s; start all {spec.world} ranks (torchrun --nproc-per-node {spec.world}, "
                f"same MASTER_ADDR/MASTER_PORT) or raise {ENV_TIMEOUT}")
        missing = [r for r in missing if not store.check([f"joined/{r}"])]
        time.sleep(0.05)


def rank_from_environment() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def shard_loaded(model: torch.nn.Module, rank: int, world: int) -> torch.nn.Module:
    """The loaded whole target cut to this rank's shard over the default group."""
    return shard_model(model, plan_shards(model.config, world)[rank], dist.group.WORLD)


def run_rank(load_target: Callable[[], torch.nn.Module], spec: RankSpec, device: str = "cpu",
             load_graphs: Callable | None = None) -> None:
    """A non-zero rank: join, load and shard the target, say ready, follow rank 0 until STOP.
    load_graphs(model, rank): this rank's graph set over its shard (None: eager steps only)."""
    try:
        control = join(spec, device)
        model = shard_loaded(load_target(), spec.rank, spec.world)
        dist.barrier(control)  # ready: rank 0 waits here for every shard
        follow(model, control, None if load_graphs is None else functools.partial(load_graphs, model, spec.rank))
        dist.destroy_process_group()
    except Exception as exc:
        print(f"yggdrasil: tensor-parallel rank {spec.rank}: {first_line(exc)}", file=sys.stderr, flush=True)
        os._exit(1)
    # the work is done: skip interpreter teardown, whose C++ static destructors (the kernels'
    # thread pool beside gloo's) can abort a process that has nothing left to do
    os._exit(0)


def start_ranks(model: torch.nn.Module, load_target: Callable[[], torch.nn.Module], world: int,
                threads: int | None = None, device: str = "cpu", spec: RankSpec | None = None,
                load_graphs: Callable | None = None) -> Leader:
    """Rank 0: start ranks 1..world-1 (spawned here unless `spec` says torchrun started them),
    join them, cut `model` (the whole target, loaded here) to rank 0's shard and mirror its
    steps. load_target: a picklable callable that loads the whole target in another process;
    load_graphs: one that loads rank r's graph set over its shard, load_graphs(model, r)."""
    plan_shards(model.config, world)  # a world size that does not divide the model: before any spawn
    processes = []
    if spec is None:
        spec = RankSpec(0, world, "127.0.0.1", free_port(), threads, timeout_s())
        context = mp.get_context("spawn")
        for rank in range(1, world):
            process = context.Process(target=run_rank, daemon=True, name=f"yggdrasil-rank{rank}",
                                      args=(load_target, RankSpec(rank, world, spec.address, spec.port, threads,
                                                                  spec.timeout_s), device, load_graphs))
            process.start()
            processes.append(process)
    control = join(spec, device, lambda: next(iter(exited(processes)), None))
    shard_loaded(model, 0, world)
    leader = Leader(model, world, processes, control)
    try:
        dist.barrier(control)
    except Exception as exc:
        leader.closed = True
        raise leader.failure(exc) from None
    leader.keep_alive(spec.timeout_s)
    return leader


# -- a bundle's ranks -----------------------------------------------------------------------------
def bundle_world(recipe: dict) -> int:
    """The ranks a bundle's target is split over (1: none), as its manifest's recipe records it."""
    return int(recipe.get("tensor_parallel", 1) or 1)


def load_bundle_target(bundle: str, device: str) -> torch.nn.Module:
    """The whole target from a bundle's deployed weights (what a non-zero rank loads; picklable)."""
    layout = BundleLayout(Path(bundle))
    if layout.kernel_library.is_file():
        kernels.load(layout.kernel_library)
    return DeployedWeights(layout.weights).load("target", device).model


def load_bundle_graphs(bundle: str, names: tuple[str, ...], rebuild: str, hint: str, model: torch.nn.Module,
                       rank: int) -> GraphSet:
    """Rank `rank`'s graph set of a bundle's split target, bound to its shard and KV cache
    (what each rank loads; picklable as a partial over the first four)."""
    return load_graph_set(Path(bundle), "target", model, list(names), rebuild, hint, "aoti", rank)


def start_bundle_ranks(bundle, recipe: dict, model: torch.nn.Module, device: str,
                       threads: int | None = None, load_graphs: Callable | None = None) -> Leader | None:
    """Split a tensor-parallel bundle's target (None for an ordinary bundle): spawn its other ranks
    here, or under torchrun join those the environment names; a non-zero torchrun rank follows
    rank 0's steps and exits when it says stop, never returning. load_graphs(model, rank): each
    rank's graph set (load_bundle_graphs), for a bundle of compiled per-rank graphs."""
    world = bundle_world(recipe)
    launched = rank_from_environment()
    if world == 1 and launched is None:
        return None
    if launched is not None and launched[1] != world:
        raise TensorParallelError(f"{bundle} splits its target over {world} ranks but this run has WORLD_SIZE="
                                  f"{launched[1]}; start exactly {world} (torchrun --nproc-per-node {world})")
    if device.startswith("cuda"):
        raise TensorParallelError("tensor parallel: CUDA bundles are not split yet (nccl ranks on one GPU each); "
                                  "compile the recipe without tensor_parallel")
    loader = functools.partial(load_bundle_target, str(bundle), device)
    if launched is None:
        leader = start_ranks(model, loader, world, threads, device, load_graphs=load_graphs)
    else:
        rank = launched[0]
        spec = RankSpec(rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                        int(os.environ.get("MASTER_PORT", "29500")), threads, timeout_s())
        if rank != 0:
            run_rank(lambda: model, spec, device, load_graphs)  # exits the process
        leader = start_ranks(model, loader, world, threads, device, spec, load_graphs)
    atexit.register(leader.close)
    return leader
