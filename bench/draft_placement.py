"""Where a tensor-parallel bundle's draft runs (issue 55): whole on rank 0, or replicated on every
rank -- measured on one CPU box, 2 gloo ranks x 1 thread, the way a split bundle runs them.

Whole on rank 0 (what bundles do): rank 0 drafts while the other rank waits, then broadcasts each
verify's inputs (the mirror's step message: header, the index rows in one tensor, the tree mask)
before the split verify runs. Replicated: every rank drafts the same tree itself, so the verify's inputs need not
travel -- but every rank's core and the box's one memory bus draft at once, and the verify waits
for the slowest replica. So one iteration's draft costs:

    whole      = a tree drafted while the other rank idles + one verify's message
    replicated = the slower of two trees drafted at the same time (no message)

All three are timed here in interleaved rounds (draft steps eager on the real draft model, one
thread per rank), and the replicas' trees are compared (they must be equal for replication to be
lossless). The faster placement per iteration is the answer; the bundle's is whole on rank 0.

    yggdrasil bench draft-placement [--draft qwen2.5-coder-0.5b] [--weights q4] [--depth 4]
                                    [--width 2] [--verify 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yggdrasil.models.loader import load
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.runtime.mirror import FORWARD, HEADER, OWN_CACHE, broadcast, receive, receive_step, step_message
from yggdrasil.runtime.ranks import RankSpec, free_port, join, timeout_s
from yggdrasil.runtime.steps import StepRunner

from .common import environment, log
from .provenance import Results

CONTEXT = 512
PROMPT = [(1000 + 37 * i) % 30000 for i in range(96)]  # token ids; a 96-token context to draft after


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalog model or path: the draft")
    parser.add_argument("--weights", default="q4", help="its weight format")
    parser.add_argument("--depth", type=int, default=4, help="tree depth (draft steps per tree)")
    parser.add_argument("--width", type=int, default=2, help="tree width (rows per draft step)")
    parser.add_argument("--verify", type=int, default=8, help="verify rows: the message's size")
    parser.add_argument("--trees", type=int, default=8, help="trees drafted per timed round")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="also write the JSON here")


def _drafter(args: dict) -> tuple[ModelDrafter, list[int]]:
    """The draft, its context prefilled: (drafter, the context's token ids)."""
    model = load(args["draft"], quiet=True, weights=args["weights"]).model
    history = [t % model.config.vocab_size for t in PROMPT]
    drafter = ModelDrafter(StepRunner(model, CONTEXT), args["depth"], args["width"])
    drafter.start(history)
    return drafter, history


def _trees(drafter: ModelDrafter, history: list[int], args: dict) -> tuple[float, list]:
    """Seconds per tree over args["trees"] builds from the same root, and the last tree's tokens."""
    started = time.perf_counter()
    for _ in range(args["trees"]):
        drafter.rewind(history)
        tree = drafter.build_shaped(history, args["depth"], args["width"])
    return (time.perf_counter() - started) / args["trees"], list(tree.nodes().tokens)


def _messages(rank: int, control, args: dict) -> float:
    """Seconds per verify message from rank 0 to rank 1, sent and received as the mirror does
    (mirror.step_message, broadcast, receive_step; on both ranks: the receiver waits for it)."""
    rows = args["verify"]
    inputs = [torch.zeros((1, rows), dtype=torch.int64) for _ in range(3)]
    mask, logit_index = torch.zeros((1, rows, CONTEXT), dtype=torch.bool), torch.zeros((1, rows), dtype=torch.int64)
    dist.barrier(control)
    started = time.perf_counter()
    for _ in range(args["trees"]):
        if rank == 0:
            header, *tensors = step_message(FORWARD, OWN_CACHE, *inputs, mask, logit_index)
            broadcast(header, tensors, control)
        else:
            _, _, *sizes = receive((HEADER,), control).tolist()
            receive_step(*sizes[:4], control)
    return (time.perf_counter() - started) / args["trees"]


def _round(rank: int, control, drafter: ModelDrafter, history: list[int], args: dict) -> dict:
    """One interleaved round on this rank: alone (rank 0 drafts, rank 1 waits), replicated (both
    draft at once), message; each rank's seconds, and the replicated tree."""
    out = {}
    dist.barrier(control)
    if rank == 0:
        out["alone"], _ = _trees(drafter, history, args)
    dist.barrier(control)
    out["replicated"], out["tree"] = _trees(drafter, history, args)
    dist.barrier(control)
    out["message"] = _messages(rank, control, args)
    return out


def _rank(spec: RankSpec, args: dict) -> list[dict]:
    """This rank's rounds, and then both ranks' (rank 1 is spawned with this as its target)."""
    control = join(spec)
    drafter, history = _drafter(args)
    rounds = [_round(spec.rank, control, drafter, history, args) for _ in range(args["repeats"] + 1)]  # the first warms up
    gathered = [None] * spec.world
    dist.all_gather_object(gathered, rounds[1:], group=control)
    dist.barrier(control)
    dist.destroy_process_group()
    return gathered


def measure(args: argparse.Namespace) -> dict:
    """Both ranks' rounds: rank 0 here, rank 1 spawned, one thread each."""
    settings = {k: getattr(args, k) for k in ("draft", "weights", "depth", "width", "verify", "trees", "repeats")}
    spec = RankSpec(0, 2, "127.0.0.1", free_port(), 1, timeout_s())
    other = mp.get_context("spawn").Process(target=_rank, daemon=True, name="yggdrasil-draft-rank1",
                                            args=(RankSpec(1, 2, spec.address, spec.port, 1, spec.timeout_s),
                                                  settings))
    other.start()
    try:
        gathered = _rank(spec, settings)
    finally:
        other.join(timeout=60)
        if other.is_alive():
            other.kill()
    return summarize(gathered)


def summarize(gathered: list[list[dict]]) -> dict:
    """Per-iteration medians (ms) of each placement from both ranks' rounds."""
    zero, one = gathered
    alone = [r["alone"] for r in zero]
    replicated = [max(a["replicated"], b["replicated"]) for a, b in zip(zero, one)]
    message = [r["message"] for r in zero]
    whole = [a + m for a, m in zip(alone, message)]
    ms = {name: round(statistics.median(values) * 1e3, 3) for name, values in
          (("draft_alone", alone), ("verify_message", message), ("whole_on_rank_0", whole), ("replicated", replicated))}
    return {"ms_per_iteration": ms, "faster": "whole_on_rank_0" if ms["whole_on_rank_0"] <= ms["replicated"]
            else "replicated", "replicated_over_whole": round(ms["replicated"] / ms["whole_on_rank_0"], 4),
            "replica_trees_equal": all(a["tree"] == b["tree"] for a, b in zip(zero, one))}


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = torch.get_num_threads()
    try:
        result = measure(args)
    finally:
        torch.set_num_threads(threads)
    ms = result["ms_per_iteration"]
    log(f"draft {args.draft} ({args.weights}), D{args.depth}xW{args.width}, V{args.verify} message: "
        f"whole on rank 0 {ms['whole_on_rank_0']:.2f} ms per iteration (draft {ms['draft_alone']:.2f} + message "
        f"{ms['verify_message']:.3f}), replicated {ms['replicated']:.2f} ms; faster: {result['faster']}")
    record.write({"benchmark": "draft_placement", "draft": args.draft, "weights": args.weights,
                  "tree": {"depth": args.depth, "width": args.width, "verify_rows": args.verify},
                  "context_slots": CONTEXT, **result, "environment": environment(ranks="2 gloo ranks x 1 thread"),
                  "statistic": f"medians of {args.repeats} interleaved rounds (after one warm-up round) of the mean "
                               f"over {args.trees} trees (eager draft steps, 1 thread per rank); replicated: the "
                               "slower rank's mean in each round"},
                 args.out)
    return 0 if result["replica_trees_equal"] else 1
