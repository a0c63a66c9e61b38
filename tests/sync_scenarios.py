"""Decode-loop scenarios over every speculation mode and stage plan (issue 23), shared by the
read-budget test and the host-tree equality test. `python tests/sync_scenarios.py` records the
tokens each scenario produces into tests/data/host_tree_tokens.json (recorded with the code
from before trees moved to the host; the test asserts the current code still produces them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import save_random_hf_model  # noqa: E402
from yggdrasil.buckets import Grid  # noqa: E402
from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter  # noqa: E402
from yggdrasil.runtime.generate import generate  # noqa: E402
from yggdrasil.models.hf_loader import load_hf_model  # noqa: E402
from yggdrasil.runtime.latency import LatencyProfile  # noqa: E402
from yggdrasil.policy.depth_model import DepthMLP  # noqa: E402
from yggdrasil.policy.auto import AutoPolicy  # noqa: E402
from yggdrasil.policy.select import Selector  # noqa: E402
from yggdrasil.sampling import SamplingParams  # noqa: E402
from yggdrasil.runtime.speculative import SpeculativeGenerator  # noqa: E402
from yggdrasil.runtime.stage_plan import SEQUENTIAL, StagePlan, all_plans  # noqa: E402
from yggdrasil.runtime.static_tree import StaticTreeDrafter, branching_shape  # noqa: E402
from yggdrasil.runtime.steps import StepRunner  # noqa: E402

FIXTURE = Path(__file__).parent / "data" / "host_tree_tokens.json"
CONTEXT, NEW_TOKENS = 256, 40
PROMPT = list(range(3, 20))
REPEATING = [7, 8, 9, 10, 11] * 4 + [7, 8]  # prompt lookup finds continuations here
GRID = Grid((1, 2, 3), (1, 2), (1, 2, 4, 8))
SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=3)}
MODES = ("plain", "chain", "egt", "static-tree", "lookup", "auto", "auto-lookup")


def load_models(root: Path) -> dict:
    save_random_hf_model(root / "target", "qwen2", seed=11)
    save_random_hf_model(root / "draft", "qwen2", seed=12, num_hidden_layers=1)
    target = load_hf_model(root / "target", torch.float32)
    return {"target": target, "draft": load_hf_model(root / "draft", torch.float32),
            "self": target.truncated(target.config.n_layers)}


def _policy(dim: int) -> AutoPolicy:
    """A depth predictor with sharp, input-dependent tails, so buckets change between iterations."""
    torch.manual_seed(0)
    model = DepthMLP(dim, GRID.max_depth).eval()
    with torch.no_grad():
        model.heads.weight.mul_(40.0)
        model.std.fill_(0.1)
    table = torch.rand(len(GRID.depths), len(GRID.widths), len(GRID.verifies)).cumsum(0).cumsum(2)
    profile = LatencyProfile(draft=((1, 0.05), (2, 0.06)), verify=((1, 1.0), (8, 1.3)))
    return AutoPolicy(Selector(GRID, profile, table, table[:, -1, -1] + 0.1), model)


def speculator(models: dict, mode: str, plan: StagePlan = SEQUENTIAL, draft: str = "draft"):
    """(target runner, draft runner or None, SpeculativeGenerator or None for plain decoding)."""
    target = StepRunner(models["target"], CONTEXT, 8)
    draft_runner = StepRunner(models[draft], CONTEXT, 8)
    fixed = LatencyProfile()  # no timing in the choice of verify width
    if mode == "plain":
        return target, None, None
    if mode == "chain":
        return target, draft_runner, SpeculativeGenerator(target, ModelDrafter(draft_runner, 4, 1), [5], fixed, plans=plan)
    if mode == "egt":
        return target, draft_runner, SpeculativeGenerator(target, ModelDrafter(draft_runner, 3, 2), [1, 3, 5], fixed,
                                                          plans=plan)
    if mode == "static-tree":
        drafter = StaticTreeDrafter(draft_runner, branching_shape([2, 2, 1]))
        return target, draft_runner, SpeculativeGenerator(target, drafter, [4, 8], fixed, plans=plan)
    if mode == "lookup":
        return target, None, SpeculativeGenerator(target, LookupDrafter(4, 2), [1, 3, 6], fixed, plans=plan)
    if mode == "auto":
        drafter = ModelDrafter(draft_runner, 3, 2, (1, 2))
        return target, draft_runner, SpeculativeGenerator(target, drafter, policy=_policy(models["target"].config.dim),
                                                          plans=plan)
    if mode == "auto-lookup":
        return target, None, SpeculativeGenerator(target, LookupDrafter(3, 2), policy=_policy(models["target"].config.dim),
                                                  plans=plan)
    raise ValueError(mode)


def run(models: dict, mode: str, sampling: str, plan: StagePlan = SEQUENTIAL, draft: str = "draft"):
    target, _, spec = speculator(models, mode, plan, draft)
    prompt = REPEATING if "lookup" in mode else PROMPT
    if spec is None:
        return generate(target, prompt, NEW_TOKENS, SAMPLINGS[sampling])
    return spec.generate(prompt, NEW_TOKENS, SAMPLINGS[sampling])


def cases() -> list[tuple[str, str, str, str]]:
    """(mode, sampling, plan, draft): every mode sequentially, every plan on EGT (the fixture
    also holds the chain's plans, recorded but not run by the tests: they add time, not cover)."""
    out = [(m, s, "sequential", "draft") for m in MODES for s in SAMPLINGS]
    out += [("egt", s, str(p), d) for s in SAMPLINGS for d in ("draft", "self")
            for p in all_plans(streams=1) if p != SEQUENTIAL]
    return out


def recorded_cases() -> list[tuple[str, str, str, str]]:
    return cases() + [("chain", s, str(p), d) for s in SAMPLINGS for d in ("draft", "self")
                      for p in all_plans(streams=1) if p != SEQUENTIAL]


def case_id(case) -> str:
    return "/".join(case)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        models = load_models(Path(tmp))
        recorded = {case_id(c): run(models, c[0], c[1], StagePlan.parse(c[2]), c[3]).tokens for c in recorded_cases()}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(recorded, indent=0) + "\n")
    print(f"recorded {len(recorded)} cases into {FIXTURE}")
