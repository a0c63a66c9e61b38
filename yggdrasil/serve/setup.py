"""Building a serving Engine from its parts: the speculation length rule, the KV pool size from the
budget, the host swap space, the proposer (draft model or prompt lookup) and the compiled serve
graphs. Bundle.engine() (yggdrasil/bundle.py) hands it a bundle's parts."""

from __future__ import annotations

import time
from dataclasses import dataclass

from yggdrasil.errors import InvalidRequestError
from yggdrasil.storage.cuda_graphs import row_buckets
from .drafting import LookupProposer, ModelProposer
from .engine import Engine, EngineSettings
from .goodput import SpeculationLength, StepCostModel
from .memory import available_memory, host_available_memory, kv_bytes_per_token, parse_bytes


@dataclass(frozen=True)
class ServeSettings:
    """How to serve: batch and queue limits, speculation mode, KV budget, swap space,
    preemption mode, and eager forwards instead of the compiled serve graphs."""

    max_batch: int = 4
    max_queue: int = 16
    speculation: str = "goodput"  # goodput | off | fixed:K
    kv_budget: str = "auto"  # bytes for the KV pool, or auto
    swap_space: str = "auto"  # host bytes for swapped-out KV, or auto
    preemption: str = "auto"  # auto | swap | recompute
    eager: bool = False


def speculation_length(text: str, latency, has_draft_model: bool, max_k: int) -> SpeculationLength:
    """goodput | off | fixed:K over the bundle's step cost model."""
    cost = StepCostModel.from_latency(latency, has_draft_model)
    if text.startswith("fixed:"):
        try:
            k = int(text.split(":", 1)[1])
        except ValueError:
            raise InvalidRequestError(f"--speculation fixed:K needs an integer K, got {text!r}") from None
        if not 1 <= k <= max_k:
            raise InvalidRequestError(f"--speculation fixed:K needs 1 <= K <= {max_k} (the bundle's deepest "
                                      f"draft), got {k}")
        return SpeculationLength("fixed", max_k, cost, k)
    if text not in ("goodput", "off"):
        raise InvalidRequestError(f"--speculation must be goodput, off or fixed:K, got {text!r}")
    return SpeculationLength(text, max_k, cost)


def kv_blocks(kv_budget: str, models, block_size: int, min_blocks: int = 2, needs: str = "") -> int:
    """Pool blocks the --kv-budget holds (auto: half the free host memory, or 90 % of the GPU's
    free memory), for the K/V of every model; at least min_blocks (what for: needs)."""
    per_block = block_size * sum(kv_bytes_per_token(m) for m in models)
    budget = parse_bytes(kv_budget, "--kv-budget")
    shown = kv_budget
    if budget is None:
        device = models[0].device
        budget = int(available_memory(device) * (0.9 if device.type == "cuda" else 0.5))
        shown = f"auto ({budget} bytes)"
    min_blocks = max(min_blocks, 2)
    if budget // per_block < min_blocks:
        raise InvalidRequestError(f"--kv-budget {shown} holds {budget // per_block} blocks of {block_size} tokens "
                                  f"({per_block} bytes each, every model's K and V) but the server needs "
                                  f"{min_blocks}{needs}; give --kv-budget {_size(min_blocks * per_block)} "
                                  f"({min_blocks * per_block} bytes) or more")
    return budget // per_block


def _size(n_bytes: int) -> str:
    """A byte count as --kv-budget takes it, rounded up to a tenth of a KiB or MiB."""
    unit, name = (2**20, "MiB") if n_bytes >= 2**20 else (2**10, "KiB")
    return f"{-(-n_bytes * 10 // unit) / 10:g}{name}"


def step_tokens(chunk_size: int, max_batch: int, speculation: SpeculationLength) -> int:
    """Pool slots the widest step takes (and start-up calibration measures): a prompt chunk plus
    every request's root and deepest chain."""
    k = speculation.max_k if speculation.mode != "off" else 0
    return chunk_size + max_batch * (k + 1)


def swap_bytes(swap_space: str) -> int:
    """Host bytes for swapped-out KV (auto: a quarter of the free host memory)."""
    budget = parse_bytes(swap_space, "--swap-space")
    return host_available_memory() // 4 if budget is None else budget


def make_engine(target, draft, max_context: int, chunk_size: int, latency, max_depth: int | None,
                serve_graphs: dict, settings: ServeSettings, report=lambda message: None, health=None) -> Engine:
    """An Engine over these loaded models (draft None: prompt lookup, when max_depth says the
    bundle speculates at all), its KV pool sized by the budget, and the serve graphs given
    (role -> compiled graph; none: eager); preemption costs are measured when that pool can run
    short. health: what the engine asks to know it can go on (Engine)."""
    models = [target.model] + ([draft.model] if draft is not None else [])
    speculates = max_depth is not None
    speculation = speculation_length(settings.speculation if speculates else "off", latency, draft is not None,
                                max_depth if speculates else 1)
    block_size = EngineSettings.block_size
    widest = step_tokens(chunk_size, settings.max_batch, speculation)
    # a pool of max-batch full contexts is all the engine makes, and its steps fit in it
    full_blocks = settings.max_batch * -(-max_context // block_size)
    needs = (f" for its widest step ({widest} tokens: a {chunk_size}-token prompt chunk and {settings.max_batch} "
             f"requests' verify rows; a smaller --max-batch needs less)")
    engine_settings = EngineSettings(max_context=max_context, max_batch=settings.max_batch,
                                     max_queue=settings.max_queue, chunk_size=chunk_size,
                                     kv_blocks=kv_blocks(settings.kv_budget, models, block_size,
                                                         min(-(-widest // block_size), full_blocks), needs),
                                     swap_bytes=swap_bytes(settings.swap_space), preemption=settings.preemption)
    make_proposer = None
    if speculates:
        draft_graph = serve_graphs.get("draft")
        make_proposer = ((lambda pool: ModelProposer(draft.model, pool, draft_graph)) if draft is not None
                         else (lambda pool: LookupProposer()))
    engine = Engine(target.model, target.tokenizer, engine_settings, speculation, make_proposer,
                    target_graph=serve_graphs.get("target"), health=health)
    pool, block_bytes = engine.pool, engine.store.block_bytes
    report("forwards: " + ("the bundle's compiled serve graphs" if engine.compiled else "eager"))
    if engine.compiled and target.model.device.type == "cuda":
        buckets = row_buckets(widest)
        taken = engine.capture_graphs(buckets)
        report(f"CUDA graphs: serve steps captured at {len(buckets)} row buckets ({buckets[0]}..{buckets[-1]} rows, "
               f"{taken / 2**20:.0f} MiB); wider steps run uncaptured")
    report(f"KV pool: {pool.n_blocks} blocks of {pool.block_size} tokens, {pool.n_blocks * block_bytes / 2**20:.1f} MiB "
           f"({'short of' if engine.can_run_short else 'room for'} {settings.max_batch} full contexts); swap space "
           f"{engine_settings.swap_bytes / 2**20:.0f} MiB; preemption {settings.preemption}")
    if engine.needs_calibration:
        report("measuring step and preemption costs ...")
        started = time.perf_counter()
        engine.calibrate(lambda line: report("  " + line))
        report(f"measuring step and preemption costs: done in {time.perf_counter() - started:.1f}s")
    return engine
