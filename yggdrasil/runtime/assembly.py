"""The one assembly of the runtime: the step runners of a target and its draft (eager,
torch.compile'd, or on a bundle's graphs, each with its one dispatcher), and how speculation over
them is made (a bucket policy and stage plans, or a speculator built once for a fixed shape).
Bundle.generator, generator.from_models, compile's phases, the CLI and bench assemble runners here
instead of by hand; a Generator holds the Runtime this returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from yggdrasil.buckets import Grid
from yggdrasil.storage.registry import GraphSet
from yggdrasil.models.model import Transformer
from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter, choose_drafter
from yggdrasil.runtime.policy import BucketPolicy
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.stage_plan import PlanTable
from yggdrasil.runtime.steps import StepRunner


@dataclass(frozen=True)
class Runtime:
    """A target's (and draft's) step runners, and what speculation over them runs with."""

    runner: StepRunner
    draft_runner: StepRunner | None = None
    kind: str = "eager"  # how the steps run: "eager", "torch.compile" or "graphs" (a bundle's)
    policy: BucketPolicy | None = None
    plans: PlanTable | None = None  # each bucket's stage plan (None: sequential)
    # a speculator built once and shared by every call (from_models: a fixed shape, or --auto's
    # policy); None: speculator() makes a fresh one from the policy
    built: SpeculativeGenerator | None = None

    def speculator(self) -> SpeculativeGenerator | None:
        """The speculator every generation on these runners uses (None: plain decoding)."""
        if self.built is not None or self.policy is None:
            return self.built
        return build_speculator(self.runner, policy=self.policy, draft_runner=self.draft_runner, plans=self.plans)


def assemble_runtime(target: Transformer, draft: Transformer | None, max_context: int, *,
                     chunk_sizes: tuple[int, ...] = (), chunk_size: int = 64, compile: bool = False,
                     graphs: Mapping[str, GraphSet] | None = None, policy: BucketPolicy | None = None,
                     plans: PlanTable | None = None,
                     piece_seconds: Mapping[str, dict[str, float]] | None = None) -> Runtime:
    """Runners for both models over one context and one set of prefill chunks: on their graphs
    (a bundle's graph set per role), torch.compile'd, or eager. piece_seconds: per role, the
    measured seconds of each graph's forward (a bundle's profile): prompts are then prefilled on
    the graphs that cost least."""
    graphs, piece_seconds = graphs or {}, piece_seconds or {}

    def runner(model: Transformer, role: str) -> StepRunner:
        return StepRunner(model, max_context, chunk_size, compile=compile, graphs=graphs.get(role),
                          chunk_sizes=chunk_sizes, piece_seconds=piece_seconds.get(role))

    kind = "graphs" if graphs else "torch.compile" if compile else "eager"
    return Runtime(runner(target, "target"), runner(draft, "draft") if draft is not None else None, kind,
                   policy, plans)


def grid_drafter(grid: Grid, draft: StepRunner | None) -> LookupDrafter | ModelDrafter:
    """A drafter that can build every bucket of the grid (choose_drafter over its largest tree)."""
    return choose_drafter(draft, grid.max_depth, grid.max_width, grid.widths)
