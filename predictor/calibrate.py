"""Calibration (docs/design.md §3.4): run the widest Equal-Growth Tree over a prompt set and
record, per iteration, the target's last hidden state, the accepted depth, and what every drafted
(D, W, V) bucket of the grid would have accepted in hindsight.

Hindsight is exact, not estimated: greedy speculation commits the target's own greedy sequence, so
once a prompt is done its continuation after every iteration is known. One draft build per width
covers every depth up to the build's, because the first d steps of an Equal-Growth build are the
depth-d tree; pruning to V keeps the top-V nodes by path probability, as the runtime does.
(For the lookup drafter the depth-d tree is taken as the deepest trie cut at depth d, which can
differ slightly from a depth-d lookup when two continuations agree up to d.)

Only width 1 is built to the grid's deepest depth: the depths beyond the recipe's own exist for
the plain chain that fills each verify width (buckets.chain_depths), so wider widths are built to
`tree_depth` (the recipe's deepest) and their deeper buckets are not drafted: they hold 0
accepted tokens, CalibrationRun.drafted_depths says so, and selection never picks them
(select.record_costs makes them cost infinite time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from yggdrasil.buckets import Grid
from yggdrasil.errors import InvalidRequestError
from yggdrasil.progress import Progress
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.runtime.tree import TokenTree, WalkResult
from yggdrasil.policy.calibration import CalibrationRun


@dataclass
class _Record:
    prompt: int
    base: int  # slot of the iteration's root = committed length - 1
    hidden: torch.Tensor
    accepted_max: int
    trees: list[tuple[list[int], list[int], list[float], list[int]]]  # per width: tokens, parents, score, depth
    children: dict[int, list[int]] = field(default_factory=dict)  # widest build's proposals per node


def build_depths(grid: Grid, tree_depth: int | None = None) -> tuple[int, ...]:
    """Per grid width, the depth calibration builds it to: the grid's deepest for width 1 (the
    chain), the deepest grid depth within `tree_depth` for the others (default: the grid's deepest)."""
    within = [d for d in grid.depths if tree_depth is None or d <= tree_depth] or [grid.depths[0]]
    return tuple(grid.max_depth if w == 1 else within[-1] for w in grid.widths)


def _node_order(tree: TokenTree) -> tuple[list[int], list[int], list[float], list[int]]:
    n = tree.size
    return (tree.tokens[:n].tolist(), tree.parents[:n].tolist(), tree.rank_scores().tolist(),
            tree.depth[:n].tolist())


def _child_index(tokens: list[int], parents: list[int]) -> dict[tuple[int, int], int]:
    """(parent, token) -> node; unique, since each node proposes distinct tokens."""
    return {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}


def _matched_path(tokens: list[int], parents: list[int], continuation: list[int]) -> list[int]:
    """Nodes the target's continuation walks through from the root."""
    child = _child_index(tokens, parents)
    node, path = 0, []
    for token in continuation:
        node = child.get((node, token), -1)
        if node < 0:
            break
        path.append(node)
    return path


def node_steps(tree: tuple, width: int, by_steps: bool = True) -> list[int]:
    """Each node's step: the least D whose depth-D part of the width-W build holds it. by_steps:
    the depth-D part is the first D draft steps (Equal-Growth: the root and D * W nodes);
    otherwise the nodes at depth <= D (lookup tries, which are not grown step by step)."""
    _, _, _, node_depth = tree
    if by_steps:
        return [(i + width - 1) // width for i in range(len(node_depth))]
    return list(node_depth)


def bucket_acceptance(tree: tuple, width: int, grid: Grid, continuation: list[int],
                      by_steps: bool = True, built: int | None = None) -> torch.Tensor:
    """[depths, verifies]: tokens accepted by the depth-D part of a width-W build pruned to V
    (0 for depths beyond `built`, the depth the build reached: those trees were not drafted).

    by_steps: see node_steps.
    """
    tokens, parents, score, _ = tree
    path = _matched_path(tokens, parents, continuation)
    steps = node_steps(tree, width, by_steps)
    out = torch.zeros(len(grid.depths), len(grid.verifies), dtype=torch.int8)
    for i, depth in enumerate(grid.depths):
        if built is not None and depth > built:
            break
        nodes = [j for j, step in enumerate(steps) if step <= depth]
        ranked = sorted(nodes, key=lambda j: -score[j])
        for k, verify in enumerate(grid.verifies):
            kept = set(ranked[:verify])
            count = 0
            for node in path:
                if node not in kept:
                    break
                count += 1
            out[i, k] = count
    return out


def node_arrays(trees: list[tuple], widths: tuple[int, ...], continuation: list[int],
                by_steps: bool = True) -> tuple[torch.Tensor, ...]:
    """([widths, M] score, depth, step, on-path) of one record's builds, in build order, padded
    to the largest build (score -inf, depth and step -1, off the path). A node's step is the
    least D whose depth-D tree holds it (node_steps)."""
    size = max(len(tree[0]) for tree in trees)
    score = torch.full((len(trees), size), float("-inf"), dtype=torch.float64)
    depth = torch.full((len(trees), size), -1, dtype=torch.int8)
    step = torch.full((len(trees), size), -1, dtype=torch.int8)
    on_path = torch.zeros(len(trees), size, dtype=torch.bool)
    for j, (tree, width) in enumerate(zip(trees, widths)):
        tokens, parents, scores, depths = tree
        n = len(tokens)
        score[j, :n] = torch.tensor(scores, dtype=torch.float64)
        depth[j, :n] = torch.tensor(depths, dtype=torch.int8)
        step[j, :n] = torch.tensor(node_steps(tree, width, by_steps), dtype=torch.int8)
        on_path[j, _matched_path(tokens, parents, continuation)] = True
    return score, depth, step, on_path


def pad_nodes(parts: list[torch.Tensor], fill) -> torch.Tensor:
    """Concatenate [n, widths, m_i] node arrays along records, padding m to the largest."""
    size = max(p.shape[-1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, size - p.shape[-1]), value=fill) for p in parts])


def tree_sizes(tree: tuple, width: int, grid: Grid, by_steps: bool = True) -> torch.Tensor:
    """[depths]: nodes (root included) of the depth-D part of a width-W build."""
    steps = node_steps(tree, width, by_steps)
    return torch.tensor([sum(1 for step in steps if step <= d) for d in grid.depths], dtype=torch.int16)


def _rank_stats(record: _Record, continuation: list[int], hits: list[int]) -> int:
    """Count the rank of the target's token among the draft's proposals along its path."""
    tokens, parents, _, _ = record.trees[-1]
    child = _child_index(tokens, parents)
    node, trials = 0, 0
    for token in continuation:
        proposals = record.children.get(node)
        if not proposals:
            break
        trials += 1
        if token not in proposals:
            break
        hits[proposals.index(token)] += 1
        node = child.get((node, token), -1)
        if node < 0:
            break
    return trials


class _Recorder:
    """The IterationHook calibration runs the speculative loop with (yggdrasil/runtime/speculative.py)."""

    def __init__(self, calibrator: "Calibrator", index: int, prompt_ids: list[int]) -> None:
        self.calibrator, self.index = calibrator, index
        self._prompt = prompt_ids
        self.history = list(prompt_ids)  # the whole sequence so far, every committed token in it
        self.records: list[_Record] = []
        self._builds: tuple[list[tuple], dict[int, list[int]]] = ([], {})

    def emitted(self, tokens: list[int]) -> None:
        if not self.records and len(self.history) == len(self._prompt):  # the prefill's token
            self.history.extend(tokens)

    def build(self, history: list[int]) -> TokenTree:
        trees, tree, children = self.calibrator._builds(history)
        self._builds = (trees, children)
        self.history = list(history)
        return tree

    def observe(self, base: int, hidden: torch.Tensor, tree: TokenTree, result: WalkResult) -> None:
        trees, children = self._builds
        self.records.append(_Record(self.index, base, hidden.float().cpu().half(),
                                    len(result.accepted_tokens), trees, children))
        self.history.extend(result.committed)


class Calibrator:
    """Runs the widest, deepest EGT greedily (eager) and keeps per-iteration records."""

    def __init__(self, target: StepRunner, drafter, grid: Grid, tree_depth: int | None = None) -> None:
        """tree_depth: the deepest depth widths above 1 are built to (the recipe's own deepest;
        default the grid's): the grid's deeper depths are there for the chain (width 1) only."""
        if drafter.depth != grid.max_depth or drafter.width != grid.max_width:
            raise InvalidRequestError("calibrate with a drafter built at the grid's deepest and widest shape")
        self.target, self.drafter, self.grid = target, drafter, grid
        self.by_steps = drafter.kind != "lookup"
        self.depths = build_depths(grid, tree_depth)
        self.stopped = None  # the stopper's settled Verdict, when run() stopped early

    def _builds(self, history: list[int]) -> tuple[list[tuple], TokenTree, dict[int, list[int]]]:
        """One build per grid width to its own depth, the widest last (it is the one verified and
        committed)."""
        trees, tree = [], None
        for width, depth in zip(self.grid.widths, self.depths):
            self.drafter.rewind(history)
            tree = self.drafter.build_shaped(history, depth, width)
            trees.append(_node_order(tree))
        pool = getattr(self.drafter, "last_pool", None)
        children = {} if pool is None else {n: pool.children_of(n) for n in set(pool.parents[:pool.used].tolist())}
        return trees, tree, children

    def run_prompt(self, prompt_ids: list[int], index: int, max_new_tokens: int,
                   stop_ids: frozenset[int]) -> tuple[list[_Record], list[int]]:
        """Greedy speculative generation; returns the records and the whole token sequence.
        It runs the runtime's own loop with a hook (one build per width, the widest verified)
        and goes on max_depth tokens past max_new_tokens so every kept tree can be judged."""
        recorder = _Recorder(self, index, list(prompt_ids))
        speculator = build_speculator(self.target, self.drafter, latency=None, hook=recorder)
        speculator.generate(prompt_ids, max_new_tokens + self.grid.max_depth, SamplingParams(),
                            stop_ids, on_tokens=recorder.emitted)
        return recorder.records, recorder.history

    def run(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: frozenset[int],
            show_progress: bool = True, checkpoint=None, stopper=None) -> CalibrationRun:
        """Calibrate over the prompts, one part per prompt (its iterations' rows and its share
        of the counts). checkpoint (predictor/checkpoint.py's CalibrationCheckpoint): each part
        is saved as its prompt finishes, and a part a killed run already saved is loaded instead
        of run again; the parts are the same tensors either way, so a resumed run returns exactly
        what an uninterrupted one would. stopper (predictor/stopping.py's CalibrationStopper):
        fed each part; once its verdict is settled the remaining prompts are not run."""
        grid = self.grid
        room = self.target.max_context - max_new_tokens - 2 * self.drafter.capacity - grid.max_depth

        def prompt_part(index: int, ids: list[int]) -> dict[str, torch.Tensor]:
            hits, trials, rows = [0] * grid.max_width, 0, []
            if len(ids) > room:
                return {"hits": torch.tensor(hits), "counts": torch.tensor([0, 0, 1])}  # skipped
            records, history = self.run_prompt(list(ids), index, max_new_tokens, stop_ids)
            for record in records:
                continuation = history[record.base + 1:record.base + 1 + grid.max_depth]
                if len(continuation) < grid.max_depth:
                    continue  # the sequence ended before this iteration's tree could be judged
                per_width = [bucket_acceptance(tree, w, grid, continuation, self.by_steps, built)
                             for tree, w, built in zip(record.trees, grid.widths, self.depths)]
                accepted = torch.stack(per_width, dim=1)  # [depths, widths, verifies]
                whole = [len(_matched_path(tree[0], tree[1], continuation)) for tree in record.trees]
                if whole[-1] != record.accepted_max:  # the widest build is the one verified whole
                    raise RuntimeError("calibration hindsight disagrees with the realised walk "
                                       f"({whole[-1]} vs {record.accepted_max})")
                trials += _rank_stats(record, continuation, hits)
                rows.append((record.hidden, max(whole), accepted,
                             torch.stack([tree_sizes(tree, w, grid, self.by_steps)
                                          for tree, w in zip(record.trees, grid.widths)], dim=1),
                             *node_arrays(record.trees, grid.widths, continuation, self.by_steps),
                             torch.tensor(continuation, dtype=torch.int32)))
            part = {"hits": torch.tensor(hits), "counts": torch.tensor([trials, len(history) - len(ids), 0]),
                    "sequence": torch.tensor(history, dtype=torch.int32)}
            if rows:
                hidden, accepted_max, accepted, sizes, score, depth, step, on_path, follows = zip(*rows)
                part.update(hidden=torch.stack(hidden), accepted_max=torch.tensor(accepted_max),
                            accepted=torch.stack(accepted), tree_size=torch.stack(sizes),
                            node_score=pad_nodes([s[None] for s in score], float("-inf")),
                            node_depth=pad_nodes([d[None] for d in depth], -1),
                            node_step=pad_nodes([s[None] for s in step], -1),
                            node_on_path=pad_nodes([p[None] for p in on_path], False),
                            continuation=torch.stack(follows))
            return part

        parts = []
        bar = Progress("calibrating (prompts)", len(prompts), enabled=show_progress)
        for index, ids in enumerate(prompts):
            part = None if checkpoint is None else checkpoint.load(index)
            if part is None:
                part = prompt_part(index, ids)
                if checkpoint is not None:
                    checkpoint.save(index, part)
            parts.append(part)
            bar.update()
            verdict = stopper.add(part) if stopper is not None else None
            if verdict is not None and verdict.settled:
                self.stopped = verdict
                break
        kept = [(index, part) for index, part in enumerate(parts) if "accepted_max" in part]
        trials, generated, skipped = (torch.stack([p["counts"] for p in parts]).sum(0).tolist() if parts
                                      else (0, 0, 0))
        iterations = sum(part["accepted_max"].numel() for _, part in kept)
        stopped = f"; settled after {len(parts)} of {len(prompts)} prompts" if self.stopped is not None else ""
        bar.close(f"{iterations} iterations, {generated} tokens{stopped}")
        if not kept:
            raise InvalidRequestError("calibration produced no iterations: give more or shorter prompts, "
                                      "or raise --max-new-tokens / --max-context")

        def joined(name: str) -> torch.Tensor:
            return torch.cat([part[name] for _, part in kept])

        prompt_index = torch.cat([torch.full((part["accepted_max"].numel(),), index, dtype=torch.long)
                                  for index, part in kept])
        hits = tuple(torch.stack([p["hits"] for p in parts]).sum(0).tolist())
        # parts a checkpoint saved before node arrays were recorded have none: then no run has them
        has_nodes = all(name in part for _, part in kept
                        for name in ("node_score", "node_depth", "node_step", "node_on_path"))

        def nodes(name: str, fill) -> torch.Tensor | None:
            return pad_nodes([part[name] for _, part in kept], fill) if has_nodes else None

        has_tokens = all("continuation" in part and "sequence" in part for _, part in kept)
        return CalibrationRun(grid, joined("hidden"), joined("accepted_max"), joined("accepted"), prompt_index,
                              hits, trials, generated, skipped, joined("tree_size"), self.depths,
                              node_score=nodes("node_score", float("-inf")), node_depth=nodes("node_depth", -1),
                              node_step=nodes("node_step", -1), node_on_path=nodes("node_on_path", False),
                              continuation=joined("continuation") if has_tokens else None,
                              sequence_tokens=joined("sequence") if has_tokens else None)
