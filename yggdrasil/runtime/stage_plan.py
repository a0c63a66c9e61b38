"""Stage plans: how one speculative iteration's stages are executed (docs/design.md §3.5).

A plan names which ahead-of-time moves the runtime makes and where stages run. The planner
(yggdrasil.planner) chooses one per bucket offline; the speculator executes it. Every plan gives
the same tokens as the sequential one: the moves only compute a superset of the draft work
earlier and keep the part that acceptance picks.

- aot_tail: right after the last draft step, feed the last level to the draft (in the verify's
  shadow), so the next head only reads the root;
- aot_head: once verify's choices exist, run the next head on the bonus candidate of every
  verified node (and the last level too, without aot_tail); acceptance then picks the row of the
  accepted node, and the next iteration starts drafting without a head forward;
- side_stream: on CUDA, the ahead-of-time draft forwards go on a second stream so they overlap
  verify and acceptance (a CPU has one stream: there they run in order);
- accept_on_device: the tree walk is one tensor computation read back in one transfer, instead
  of host code reading the target's choices.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Iterable, Mapping

import torch

from yggdrasil.buckets import Bucket
from yggdrasil.errors import YggdrasilError
from yggdrasil.storage.layout import BundleLayout

_FLAGS = (("aot_tail", "aot-tail"), ("aot_head", "aot-head"), ("side_stream", "side-stream"),
          ("accept_on_device", "device-accept"))


@dataclass(frozen=True)
class StagePlan:
    aot_tail: bool = False
    aot_head: bool = False
    side_stream: bool = False
    accept_on_device: bool = False

    def __str__(self) -> str:
        return "+".join(name for field, name in _FLAGS if getattr(self, field)) or "sequential"

    @classmethod
    def parse(cls, text: str) -> "StagePlan":
        """The inverse of str(): "sequential" or flags joined by "+" (e.g. aot-tail+aot-head)."""
        if text.strip() == "sequential":
            return SEQUENTIAL
        names = {name: field for field, name in _FLAGS}
        parts = [p.strip() for p in text.split("+")]
        unknown = [p for p in parts if p not in names]
        if unknown:
            raise ValueError(f"unknown stage plan part(s) {unknown} in {text!r}; a plan is 'sequential' or "
                             f"any of {[n for _, n in _FLAGS]} joined by '+'")
        return cls(**{names[p]: True for p in parts})

    @property
    def moves(self) -> bool:
        """Whether the plan drafts ahead of time (needs a draft model)."""
        return self.aot_tail or self.aot_head


SEQUENTIAL = StagePlan()


def all_plans(streams: int = 2) -> list[StagePlan]:
    """Every distinct plan; a side stream only matters with an AOT move to put on it, and only
    where the device has a second stream (streams=1: a CPU)."""
    plans = []
    for tail, head, side, device in product((False, True), repeat=4):
        if side and (streams < 2 or not (tail or head)):
            continue
        plans.append(StagePlan(tail, head, side, device))
    return plans


def ahead_rows(plans: "PlanTable", shapes: Iterable[tuple[int, int]]) -> set[int]:
    """Rows of every ahead-of-time head forward that iterations of these (draft width, verify
    rows) shapes can run under the plans: the verified rows, plus the last level unless the
    AOT tail fed it (the graphs a bundle compiles for them: draft_ahead_w{rows})."""
    rows = set()
    for width, verify in shapes:
        for plan in plans.possible(width):
            if plan.aot_head:
                rows.add(verify + (0 if plan.aot_tail else width))
    return rows


class PlanTable:
    """The plan each bucket (named as "D3xW2/V8") runs with: a bundle's stage_plans.yaml;
    buckets it does not name run with `default`."""

    def __init__(self, plans: Mapping[str, StagePlan] | None = None, default: StagePlan = SEQUENTIAL) -> None:
        self.plans, self.default = dict(plans or {}), default

    def for_bucket(self, bucket: str) -> StagePlan:
        return self.plans.get(bucket, self.default)

    def possible(self, width: int | None = None) -> set[StagePlan]:
        """Every plan some bucket (of this draft width) may run with."""
        return {self.default, *(p for bucket, p in self.plans.items()
                                if width is None or Bucket.parse(bucket).width == width)}

    @property
    def any_moves(self) -> bool:
        return any(p.moves for p in self.possible())

    @property
    def any_ahead(self) -> bool:
        """Whether some bucket drafts its next head ahead of time (its candidates need K/V slots)."""
        return any(p.aot_head for p in self.possible())

    @classmethod
    def load(cls, bundle: Path) -> "PlanTable":
        layout = BundleLayout(bundle)
        raw, path = layout.read_stage_plans(), layout.stage_plans
        if raw is None:  # bundles without a draft model run everything sequentially
            return cls()
        try:
            return cls({str(Bucket.parse(bucket)): StagePlan.parse(entry["plan"])
                        for bucket, entry in raw.get("buckets", {}).items()},
                       StagePlan.parse(raw.get("default", "sequential")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise YggdrasilError(f"{path} is corrupt ({exc}); recompile the bundle") from exc


class SideStream:
    """Where a plan's ahead-of-time draft work runs: a second CUDA stream that waits for the
    work queued so far, or (any other device, or no side stream in the plan) the main order."""

    def __init__(self, device) -> None:
        self._torch = torch
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def use(self, on: bool):
        if self.stream is None or not on:
            yield
            return
        torch = self._torch
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self, *tensors) -> None:
        """The main stream waits for the side stream's work; tensors it made and the main
        stream will read are marked in use there (so the allocator does not hand them out)."""
        if self.stream is None:
            return
        main = self._torch.cuda.current_stream(self.stream.device)
        main.wait_stream(self.stream)
        for tensor in tensors:
            tensor.record_stream(main)
