"""The bucket vocabulary every layer shares (docs/design.md §3.6).

- `Bucket`: one iteration's shape, draft depth D x draft width W, verify width V.
- `Grid`: the sizes a bundle may use: depths, draft widths, verify widths (and, for compiling,
  prefill chunks and batch sizes).
- `GraphKey`: one compiled graph (which model, which stage, how many rows): it knows its name
  and its path inside a bundle. Names are built here and nowhere else.

The dispatcher (dispatcher.py) maps requests onto these; compile iterates its keys to know what
to build, and the runtime asks it for padding.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from yggdrasil.errors import InvalidRequestError, YggdrasilError

SPAN_UNIT = 64  # attention spans are multiples of this (the dynamic dimension of every graph)
SERVE_STAGE = "serve"  # the server's graph: any rows over the KV pool (graphs/aoti.py)


class NotCompiledError(YggdrasilError):
    """A request no compiled bucket can hold."""


@dataclass(frozen=True, order=True)
class Bucket:
    """One bucket: draft depth D (0 = no speculation), draft width W, verify width V."""

    depth: int
    width: int
    verify: int

    def __str__(self) -> str:
        return "no-spec" if self.depth == 0 else f"D{self.depth}xW{self.width}/V{self.verify}"

    @classmethod
    def parse(cls, text: str) -> "Bucket":
        """The inverse of str() (bundles name buckets this way)."""
        if text == "no-spec":
            return NO_SPEC
        match = re.fullmatch(r"D(\d+)xW(\d+)/V(\d+)", text)
        if match is None:
            raise ValueError(f"not a bucket name: {text!r} (expected e.g. D3xW2/V4 or no-spec)")
        return cls(*(int(g) for g in match.groups()))


NO_SPEC = Bucket(0, 0, 1)


@dataclass(frozen=True)
class Grid:
    """The buckets the runtime may pick from: draft depths, draft widths, verify widths; and the
    prefill chunks and batch sizes a bundle compiles graphs for."""

    depths: tuple[int, ...]
    widths: tuple[int, ...]
    verifies: tuple[int, ...]
    chunks: tuple[int, ...] = ()
    batches: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        for name in ("depths", "widths", "verifies"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
                raise InvalidRequestError(f"grid {name} must be distinct increasing integers >= 1, "
                                          f"got {list(values)}")
        if self.verifies[0] != 1:
            # verify width 1 is a plain decode step: the fallback when speculation does not pay
            object.__setattr__(self, "verifies", (1, *self.verifies))

    @property
    def max_depth(self) -> int:
        return self.depths[-1]

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def as_dict(self) -> dict:
        return {"depths": list(self.depths), "widths": list(self.widths), "verifies": list(self.verifies)}


def chain_depths(depths: tuple[int, ...], widths: tuple[int, ...], verifies: tuple[int, ...]) -> tuple[int, ...]:
    """The draft depths, plus V - 1 for every verify width V > 1 when draft width 1 is among the
    widths: a width-1 tree of depth V - 1 is the plain chain that fills V, so calibration measures
    it and the objective can always choose it (a grid capped below the chain's depth makes every
    tree lose to a chain at large V; issue 25). Depths cost no graph of their own."""
    if 1 not in widths:
        return tuple(depths)
    return tuple(sorted({*depths, *(v - 1 for v in verifies if v > 1)}))


STAGE_NAMES = ("prefill", "decode", "verify", "draft_head", "draft_step", "draft_ahead", SERVE_STAGE)
_GRAPH_NAME = re.compile(r"(?P<stage>[a-z_]+?)(?P<hidden>_hidden)?(?:_w(?P<rows>\d+))?(?:_b(?P<batch>\d+))?")


def graph_name(stage: str, rows: int, hidden: bool = False, batch: int = 1) -> str:
    """The one name a step graph goes by (runner, registry and bundle alike); rows 0: any number
    of rows (the server's pool graph)."""
    return (f"{stage}{'_hidden' if hidden else ''}" + (f"_w{rows}" if rows else "")
            + (f"_b{batch}" if batch != 1 else ""))


@dataclass(frozen=True, order=True)
class GraphKey:
    """One compiled step graph: which model, which stage, how many rows (and batch), and whether
    it also returns the final hidden states (what the depth predictor reads)."""

    stage: str  # prefill, decode, verify, draft_head, draft_step, draft_ahead, serve
    rows: int  # tokens per sequence (padded); 0: symbolic (the serve graph runs any rows)
    batch: int = 1
    hidden: bool = False
    role: str = "target"  # "target" or "draft"

    @functools.cached_property
    def name(self) -> str:  # cached: a step runner asks for it on every forward
        return graph_name(self.stage, self.rows, self.hidden, self.batch)

    @property
    def logit_rows(self) -> str:
        """Which rows reach the LM head: the last real prompt row (prefill), the only row
        (decode), or all rows (verify and draft steps)."""
        return {"prefill": "one", "decode": "one"}.get(self.stage, "all")

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str, role: str = "target") -> GraphKey:
        """The key a graph_name() came from (a bundle lists its graphs by name)."""
        match = _GRAPH_NAME.fullmatch(name)
        if match is None or match["stage"] not in STAGE_NAMES:
            raise ValueError(f"{name!r} is not a step graph's name")
        return cls(match["stage"], int(match["rows"] or 0), int(match["batch"] or 1), bool(match["hidden"]), role)
