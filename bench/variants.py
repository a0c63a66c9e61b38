"""Variants the speculative benchmark times: plain autoregressive runs and speculative ones
(model/lookup/static drafters with a fixed shape, or EGT with the calibrated --auto policy)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from yggdrasil.bench import common
from yggdrasil.bench.prompts import Prompt

from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.runtime.generate import generate
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.static_tree import StaticTreeDrafter, branching_shape, load_shape
from yggdrasil.runtime.steps import StepRunner

DEFAULT_SPECS = "model:4x1,model:3x2:4,model:4x3:6,static:3-2-1,lookup:4x1,lookup:4x3:6"
GREEDY = SamplingParams()
NO_STOP: frozenset[int] = frozenset()


@dataclass(frozen=True)
class SpecConfig:
    kind: str  # "model", "lookup" or "static" (Sequoia-style fixed tree with the draft model)
    depth: int
    width: int
    verify: int | None  # None: verify the whole tree (capacity)
    branching: tuple[int, ...] = ()  # static trees: children per node at each depth
    tree_file: str | None = None  # sequoia: the calibration's best static tree for a verify budget

    @property
    def name(self) -> str:
        if self.kind == "auto":
            return "egt-auto"
        if self.kind == "best":  # until resolved from the calibration to its constant bucket
            return "best"
        if self.kind == "sequoia":
            return f"sequoia-v{self.verify}"
        if self.kind == "static":
            return "static-" + "-".join(map(str, self.branching))
        label = "draft" if self.kind == "model" else "lookup"
        return f"{label}-{self.depth}x{self.width}" + (f"/v{self.verify}" if self.verify else "")

    @property
    def shape(self) -> str:
        if self.kind in ("static", "auto", "sequoia"):
            return self.kind
        return "chain" if self.width == 1 else "tree"


def parse_specs(text: str) -> list[SpecConfig]:
    """'model:4x1,model:4x3:6,lookup:4x1' → configs (kind:DEPTHxWIDTH[:VERIFY])."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item in ("auto", "best"):  # need --calibration; "best" is resolved from it later
            out.append(SpecConfig(item, 0, 0, None))
            continue
        if item.startswith("sequoia:"):  # sequoia:V, the calibration's sequoia-vV.json
            try:
                budget = int(item.split(":", 1)[1])
            except ValueError:
                raise argparse.ArgumentTypeError(f"bad spec {item!r}: want sequoia:V, e.g. sequoia:8") from None
            out.append(SpecConfig("sequoia", 0, 0, budget))
            continue
        if item.startswith("static:"):  # static:3-2-1 (branching per depth)
            try:
                branching = tuple(int(b) for b in item.split(":", 1)[1].split("-"))
                if not branching or min(branching) < 1:
                    raise ValueError
            except ValueError:
                raise argparse.ArgumentTypeError(f"bad spec {item!r}: want static:B1-B2-..., e.g. static:3-2-1") from None
            out.append(SpecConfig("static", len(branching), 0, None, branching))
            continue
        try:
            kind, shape, *rest = item.split(":")
            depth, width = (int(x) for x in shape.lower().split("x"))
            verify = int(rest[0]) if rest else None
            if kind not in ("model", "lookup") or len(rest) > 1 or depth < 1 or width < 1 \
                    or (verify is not None and verify < 1):
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad spec {item!r}: want model|lookup:DEPTHxWIDTH[:VERIFY], e.g. model:4x3:6") from None
        out.append(SpecConfig(kind, depth, width, verify))
    return out


def instrument(drafter) -> dict[str, float]:
    """Time the drafter's start (draft prefill) and build (drafting) calls on this instance."""
    seconds = {"start": 0.0, "build": 0.0}
    active = [0]  # build() calls build_shaped(): time only the outermost call
    for name, slot in (("start", "start"), ("build", "build"), ("build_shaped", "build")):
        fn = getattr(drafter, name, None)
        if fn is None:
            continue

        def wrapped(*args, _fn=fn, _slot=slot):
            active[0] += 1
            started = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                active[0] -= 1
                if active[0] == 0:
                    seconds[_slot] += time.perf_counter() - started
        setattr(drafter, name, wrapped)
    return seconds


def check_length(tokens: list[int], n: int, variant: str) -> None:
    if len(tokens) != n:  # TPOT divides by N - 1; a short run would be silently wrong
        raise RuntimeError(f"{variant} emitted {len(tokens)} tokens, expected {n}")


def ar_variant(runner: StepRunner, prompts: list[Prompt], n: int, name: str):
    def run(i: int, count: int = n) -> dict:
        res, wall, cpu = common.timed_cpu(generate, runner, prompts[i].ids, count, GREEDY, stop_ids=NO_STOP)
        check_length(res.tokens, count, name)
        s = res.stats
        return {"tpot": s.time_per_output_token, "tpot_internal": s.time_per_output_token,
                "wall_s": wall, "cpu_per_wall": cpu / wall, "first_token_s": s.first_token_seconds,
                "decode_s": s.decode_seconds, "tokens": res.tokens}
    return run


def spec_variant(target: StepRunner, draft: StepRunner | None, cfg: SpecConfig,
                 prompts: list[Prompt], n: int, policy=None):
    """A fresh drafter and SpeculativeGenerator per generation; runners (and caches) are shared.
    The latency profile the generator measures on its first run is reused by later runs, so every
    timed generation chooses verify widths from the same numbers. "auto" runs EGT with the
    calibrated policy (predictor + objective), drafting up to the grid's deepest/widest shape."""
    profile: list = []

    def run(i: int, count: int = n) -> dict:
        if cfg.kind == "auto":
            drafter = policy.drafter(draft)
        elif cfg.kind == "model":
            drafter = ModelDrafter(draft, cfg.depth, cfg.width)
        elif cfg.kind == "static":
            drafter = StaticTreeDrafter(draft, branching_shape(list(cfg.branching)))
        elif cfg.kind == "sequoia":
            drafter = StaticTreeDrafter(draft, load_shape(cfg.tree_file))
        else:
            drafter = LookupDrafter(cfg.depth, cfg.width)
        seconds = instrument(drafter)
        gen = build_speculator(target, drafter, policy=policy if cfg.kind == "auto" else None,
                               verify=[cfg.verify] if cfg.verify else [], latency=profile[0] if profile else "auto")
        if target.compiled and not profile:
            gen.warm_up()  # compile every verify/draft shape before anything is timed
        res, wall, cpu = common.timed_cpu(gen.generate, prompts[i].ids, count, GREEDY, NO_STOP)
        profile[:] = [gen.profile]
        check_length(res.tokens, count, cfg.name)
        s, sp = res.stats, res.spec
        decode = s.decode_seconds - seconds["start"]
        return {"tpot": decode / (count - 1), "tpot_internal": s.time_per_output_token,
                "wall_s": wall, "cpu_per_wall": cpu / wall, "first_token_s": s.first_token_seconds,
                "decode_s": decode,
                "draft_prefill_s": seconds["start"], "draft_s": seconds["build"],
                "host_s": sp.host_seconds, "host_frac": sp.host_seconds / decode,
                "draft_frac": seconds["build"] / decode, "aal": sp.aal,
                "iterations": sp.iterations, "committed": sp.committed,
                "accepted_at_depth": list(sp.accepted_at_depth),
                "offered_at_depth": list(sp.offered_at_depth),
                "verify_widths": gen.verify_widths, "buckets": dict(sp.shapes), "tokens": res.tokens}
    return run


