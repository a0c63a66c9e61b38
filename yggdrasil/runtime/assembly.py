"""The one assembly of the runtime's ingredients: the step runners of a target and its draft
(eager, torch.compile'd, or on a bundle's graphs), the drafter that can build every bucket of a
grid, and the speculator over them with a bucket policy and stage plans. Bundle.generator,
compile's phases, the CLI and bench assemble them here instead of by hand."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from yggdrasil.buckets import Grid
from yggdrasil.storage.registry import GraphSet
from yggdrasil.models.model import Transformer
from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.runtime.policy import BucketPolicy
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.stage_plan import PlanTable
from yggdrasil.runtime.steps import StepRunner


@dataclass(frozen=True)
class Runtime:
    """A target's (and draft's) step runners, and what speculation over them runs with."""

    target: StepRunner
    draft: StepRunner | None = None
    kind: str = "eager"  # how the steps run: "eager", "torch.compile" or "graphs" (a bundle's)
    policy: BucketPolicy | None = None
    plans: PlanTable | None = None  # each bucket's stage plan (None: sequential)

    def speculator(self) -> SpeculativeGenerator | None:
        """The speculator the policy drives (None: no policy, plain decoding)."""
        if self.policy is None:
            return None
        return build_speculator(self.target, policy=self.policy, draft_runner=self.draft, plans=self.plans)


def assemble_runtime(target: Transformer, draft: Transformer | None, max_context: int, *,
                     chunk_sizes: tuple[int, ...] = (), chunk_size: int = 64, compile: bool = False,
                     graphs: Mapping[str, GraphSet] | None = None, policy: BucketPolicy | None = None,
                     plans: PlanTable | None = None) -> Runtime:
    """Runners for both models over one context and one set of prefill chunks: on their graphs
    (a bundle's graph set per role), torch.compile'd, or eager."""
    graphs = graphs or {}

    def runner(model: Transformer, role: str) -> StepRunner:
        return StepRunner(model, max_context, chunk_size, compile=compile, graphs=graphs.get(role),
                          chunk_sizes=chunk_sizes)

    kind = "graphs" if graphs else "torch.compile" if compile else "eager"
    return Runtime(runner(target, "target"), runner(draft, "draft") if draft is not None else None, kind,
                   policy, plans)


def grid_drafter(grid: Grid, draft: StepRunner | None) -> LookupDrafter | ModelDrafter:
    """A drafter that can build every bucket of the grid: Equal-Growth Trees with the draft
    model's runner, or prompt lookup without one."""
    if draft is None:
        return LookupDrafter(grid.max_depth, grid.max_width)
    return ModelDrafter(draft, grid.max_depth, grid.max_width, grid.widths)
