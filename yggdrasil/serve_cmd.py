"""`yggdrasil serve BUNDLE`: build the engine from a bundle and run the HTTP server (no argparse
here; cli.py parses)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidRequestError

DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServeOptions:
    bundle: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_batch: int = 4
    max_queue: int = 16
    speculation: str = "goodput"  # goodput | off | fixed:K
    model_name: str | None = None
    log_level: str = "info"
    kv_budget: str = "auto"  # bytes for the KV pool, or auto
    swap_space: str = "auto"  # host bytes for swapped-out KV, or auto
    preemption: str = "auto"  # auto | swap | recompute
    eager: bool = False  # eager forwards instead of the bundle's serve graphs

    @classmethod
    def from_args(cls, args) -> "ServeOptions":
        return cls(args.bundle, args.host, args.port, args.max_batch, args.max_queue, args.speculation,
                   args.model_name, args.log_level, args.kv_budget, args.swap_space, args.preemption,
                   args.eager)


def speculation_policy(text: str, runtime, max_k: int):
    """goodput | off | fixed:K over the bundle's step cost model."""
    from .serve.goodput import SpeculationPolicy, StepCostModel

    cost = StepCostModel.from_latency(runtime.latency, runtime.draft is not None)
    if text.startswith("fixed:"):
        try:
            k = int(text.split(":", 1)[1])
        except ValueError:
            raise InvalidRequestError(f"--speculation fixed:K needs an integer K, got {text!r}") from None
        if not 1 <= k <= max_k:
            raise InvalidRequestError(f"--speculation fixed:K needs 1 <= K <= {max_k} (the bundle's deepest "
                                      f"draft), got {k}")
        return SpeculationPolicy("fixed", max_k, cost, k)
    if text not in ("goodput", "off"):
        raise InvalidRequestError(f"--speculation must be goodput, off or fixed:K, got {text!r}")
    return SpeculationPolicy(text, max_k, cost)


def kv_blocks(kv_budget: str, models, block_size: int) -> int:
    """Pool blocks the --kv-budget holds (auto: half the free host memory, or 90 % of the GPU's
    free memory), for the K/V of every model."""
    from .serve.memory import available_memory, kv_bytes_per_token, parse_bytes

    per_block = block_size * sum(kv_bytes_per_token(m) for m in models)
    budget = parse_bytes(kv_budget, "--kv-budget")
    if budget is None:
        device = models[0].device
        budget = int(available_memory(device) * (0.9 if device.type == "cuda" else 0.5))
    if budget // per_block < 2:
        raise InvalidRequestError(f"--kv-budget {kv_budget} holds {budget // per_block} blocks of {block_size} "
                                  f"tokens ({per_block} bytes each, every model's K and V); give at least "
                                  f"{2 * per_block} bytes")
    return budget // per_block


def swap_bytes(swap_space: str) -> int:
    """Host bytes for swapped-out KV (auto: a quarter of the free host memory)."""
    from .serve.memory import host_available_memory, parse_bytes

    budget = parse_bytes(swap_space, "--swap-space")
    return host_available_memory() // 4 if budget is None else budget


def build_engine(runtime, max_batch: int = 4, max_queue: int = 16, speculation: str = "goodput",
                 kv_budget: str = "auto", swap_space: str = "auto", preemption: str = "auto",
                 report=lambda message: None):
    """An Engine over a BundleRuntime: its target, its draft model or prompt lookup, its chunk
    size, context and cost model, its KV pool sized by the budget, and the runtime's serve graphs
    when it loaded them (open_bundle(graphs="serve")); preemption costs are measured when that
    pool can run short."""
    from .serve.drafting import LookupProposer, ModelProposer
    from .serve.engine import Engine, EngineSettings

    max_context = runtime.runner.max_context
    models = [runtime.target.model] + ([runtime.draft.model] if runtime.draft is not None else [])
    settings = EngineSettings(max_context=max_context, max_batch=max_batch, max_queue=max_queue,
                              chunk_size=max(runtime.manifest.chunk_sizes),
                              kv_blocks=kv_blocks(kv_budget, models, EngineSettings.block_size),
                              swap_bytes=swap_bytes(swap_space), preemption=preemption)
    speculates = runtime.policy is not None
    max_k = runtime.policy.grid.max_depth if speculates else 1  # the deepest draft it calibrated
    policy = speculation_policy(speculation if speculates else "off", runtime, max_k)
    make_proposer = None
    if speculates:
        draft, draft_graph = runtime.draft, serve_graph(runtime, "draft")
        make_proposer = ((lambda pool: ModelProposer(draft.model, pool, draft_graph)) if draft is not None
                         else (lambda pool: LookupProposer()))
    engine = Engine(runtime.target.model, runtime.target.tokenizer, settings, policy, make_proposer,
                    target_graph=serve_graph(runtime, "target"))
    pool, block_bytes = engine.pool, engine.store.block_bytes
    report("forwards: " + ("the bundle's compiled serve graphs" if engine.compiled else "eager"))
    report(f"KV pool: {pool.n_blocks} blocks of {pool.block_size} tokens, {pool.n_blocks * block_bytes / 2**20:.1f} MiB "
           f"({'short of' if engine.can_run_short else 'room for'} {max_batch} full contexts); swap space "
           f"{settings.swap_bytes / 2**20:.0f} MiB; preemption {preemption}")
    if engine.needs_calibration:
        report("measuring step and preemption costs ...")
        started = time.perf_counter()
        engine.calibrate(lambda line: report("  " + line))
        report(f"measuring step and preemption costs: done in {time.perf_counter() - started:.1f}s")
    return engine


def serve_graph(runtime, role: str):
    """The role's compiled serve graph, if the runtime loaded it."""
    from .graphs.registry import SERVE_STAGE

    graphs = runtime.graph_sets.get(role)
    return graphs.get(SERVE_STAGE) if graphs is not None and SERVE_STAGE in graphs else None


def run_serve(opts: ServeOptions) -> int:
    import uvicorn

    from .graphs.runtime import open_bundle, rebuild_hint
    from .serve.api import create_app
    from .serve.memory import parse_bytes

    logging.basicConfig(level=opts.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    for text, option in ((opts.kv_budget, "--kv-budget"), (opts.swap_space, "--swap-space")):
        parse_bytes(text, option)  # a typo fails before the weights load
    runtime = open_bundle(Path(opts.bundle), graphs="none" if opts.eager else "serve")
    if not opts.eager and "target" not in runtime.graph_sets:
        rebuild = rebuild_hint({"recipe": runtime.manifest.recipe}, Path(opts.bundle))
        print(f"note: {opts.bundle} has no serve graphs (compiled by an older yggdrasil), so the server runs "
              f"eager forwards; recompile it ({rebuild}) "
              "to serve on compiled graphs", file=sys.stderr, flush=True)
    engine = build_engine(runtime, opts.max_batch, opts.max_queue, opts.speculation, opts.kv_budget,
                          opts.swap_space, opts.preemption, report=lambda line: print(line, file=sys.stderr, flush=True))
    name = opts.model_name or runtime.manifest.recipe["name"]
    print(f"serving {name} from {opts.bundle} on http://{opts.host}:{opts.port}/v1 "
          f"(batch <= {opts.max_batch}, queue <= {opts.max_queue}, speculation {engine.policy.mode}"
          f"{', ' + engine.proposer.kind if engine.proposer else ''})", file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(engine, name, owns_engine=False), host=opts.host, port=opts.port,
                            log_level=opts.log_level, timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    # the engine steps on this (the main) thread, where the weights were loaded: PyTorch's
    # OpenMP pool is fast only on the thread that used it first (see serve/engine.py)
    http = threading.Thread(target=server.run, name="yggdrasil-http", daemon=True)
    previous = {sig: signal.signal(sig, _stop_server(server)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        http.start()
        # uvicorn finishes the requests in flight after a signal (up to 30 s), and those need
        # the engine, so it steps until the HTTP thread has gone
        engine.run(should_stop=lambda: not http.is_alive())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True
        http.join(5)
        engine.stop()
    if not server.started:
        print(f"error: the server could not start on {opts.host}:{opts.port} (see the log above)",
              file=sys.stderr)
        return 1
    print("server stopped", file=sys.stderr)
    return 0


def _stop_server(server):
    """A signal handler that asks uvicorn to finish in-flight requests and stop; a second
    signal stops at once (as uvicorn's own handler does)."""

    def handler(signum, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    return handler
