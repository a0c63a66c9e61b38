"""Building a speculator: over a target step runner, a drafter or a bucket policy, the verify
widths the objective may pick from, the step times it weighs, and the stage plans. The runners
come from the one assembly (runtime/assembly.py); generate, chat, bench, compile's checks and the
planner build their speculators here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from yggdrasil.runtime.drafters import choose_drafter
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.sampling import SamplingParams
from yggdrasil.errors import InvalidRequestError
from yggdrasil.runtime.policy import BucketPolicy
from yggdrasil.runtime.speculative import IterationHook, SpeculativeGenerator
from yggdrasil.runtime.stage_plan import SEQUENTIAL, PlanTable, StagePlan
from yggdrasil.runtime.static_tree import StaticTreeDrafter, branching_shape, load_shape
from yggdrasil.runtime.steps import StepRunner

MODES = ("none", "chain", "static-tree", "egt")


@dataclass(frozen=True)
class DraftShape:
    """A fixed speculation shape: the mode, depth D and width W of every iteration's tree
    (a static tree's branching or tree file instead of W), and the verify widths allowed."""

    mode: str = "none"  # none, chain, static-tree, egt
    depth: int = 4
    width: int = 3
    verify: tuple[int, ...] = ()
    branching: tuple[int, ...] | None = None
    tree_file: str | None = None

    @property
    def tree_width(self) -> int:
        return 1 if self.mode == "chain" else self.width


def make_drafter(shape: DraftShape, draft_runner: StepRunner | None):
    """The drafter a fixed shape asks for: prompt lookup without a draft model, else the draft
    model growing an Equal-Growth tree (a chain at width 1) or a static tree."""

    if shape.mode != "static-tree":
        return choose_drafter(draft_runner, shape.depth, shape.tree_width)
    if draft_runner is None:
        raise InvalidRequestError("--spec static-tree needs a draft model (--draft NAME_OR_PATH)")
    tree = (load_shape(shape.tree_file) if shape.tree_file else branching_shape(
        list(shape.branching or [shape.width, 2] + [1] * (shape.depth - 2))[:shape.depth]))
    return StaticTreeDrafter(draft_runner, tree)


def build_speculator(target: StepRunner, drafter=None, *, policy: BucketPolicy | None = None, draft_runner: StepRunner | None = None,
                     verify: Sequence[int] = (), latency="auto",
                     plans: StagePlan | PlanTable | None = None,
                     hook: IterationHook | None = None) -> SpeculativeGenerator | None:
    """A SpeculativeGenerator over `target`, or None for plain decoding (no drafter, no policy).

    policy: a BucketPolicy (yggdrasil.policy.auto.AutoPolicy) picking each iteration's (D, W, V);
    it makes its own drafter over draft_runner (None: prompt lookup). Otherwise `drafter` builds
    a fixed shape whose verify width the objective picks among `verify` with `latency`'s step
    times ("auto": measured on first use).

    hook: builds every tree and observes every walk (calibration runs this loop through it)."""
    plans = SEQUENTIAL if plans is None else plans
    if policy is not None:
        return SpeculativeGenerator(target, drafter or policy.drafter(draft_runner), policy=policy, plans=plans)
    if drafter is None:
        return None
    return SpeculativeGenerator(target, drafter, verify, latency, plans=plans, hook=hook)


def greedy_generator(target: StepRunner, draft: StepRunner | None, policy, plans=None):
    """A greedy `generate(prompt_ids, n) -> tokens` over these runners (plain decoding when
    there is no policy), under these stage plans (default sequential): what compile's warm-load
    check compares, compiled against eager."""

    if policy is None:
        return lambda ids, n: greedy_tokens(target, ids, n)
    speculator = build_speculator(target, policy=policy, draft_runner=draft, plans=plans)
    return lambda ids, n: speculator.generate(ids, n, SamplingParams(temperature=0.0)).tokens
