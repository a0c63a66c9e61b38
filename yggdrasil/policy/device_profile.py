"""Device profiles: measured step times of the target and draft on this device and dtype.

A profile is a versioned YAML file naming the device (and the CPU's fingerprint,
yggdrasil/cpu.py), torch version, dtype and models (with sha256). Loading checks all of that against what the caller is about to run and says exactly
what differs, so a profile measured elsewhere is never used silently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from yggdrasil.device import device_name, median_time, now_iso  # noqa: F401 (re-exported)
from yggdrasil.errors import YggdrasilError

from yggdrasil.policy.costs import LinearStepModel, StepCurve
from yggdrasil.yaml_files import parse_yaml

SCHEMA = "yggdrasil-profile/1"


class ProfileError(YggdrasilError):
    """A profile file that is malformed or measured for something else."""


@dataclass(frozen=True)
class Point:
    """One measured configuration: n new tokens attending `context` cached ones."""

    n: int
    context: int
    median_s: float
    min_s: float
    max_s: float
    mode: str  # "compiled" or "eager"


@dataclass(frozen=True)
class ModelProfile:
    name: str
    sha256: str | None
    params: int
    steps: tuple[Point, ...]
    prefill_chunks: tuple[Point, ...] = ()

    def curve(self, mode: str | None = None, context: int | None = None) -> StepCurve:
        """T(n) from the points of one mode (compiled preferred) at one context (the largest)."""
        mode = mode or ("compiled" if any(p.mode == "compiled" for p in self.steps) else "eager")
        points = [p for p in self.steps if p.mode == mode]
        if not points:
            raise ProfileError(f"profile of {self.name} has no {mode} step times")
        context = context if context is not None else max(p.context for p in points)
        chosen = sorted((p.n, p.median_s) for p in points if p.context == context)
        return StepCurve(tuple(n for n, _ in chosen), tuple(t for _, t in chosen))

    def linear_model(self, mode: str = "eager"):
        points = [p for p in self.steps if p.mode == mode]
        return LinearStepModel.fit([p.context for p in points], [p.n for p in points],
                                   [p.median_s for p in points])


@dataclass(frozen=True)
class DeviceProfile:
    device: str
    torch_version: str
    dtype: str
    target: ModelProfile
    draft: ModelProfile | None = None
    bandwidth: dict = field(default_factory=dict)
    created: str = ""
    schema: str = SCHEMA
    cpu: dict | None = None  # the CPU it was measured on (CpuFingerprint.as_dict; None: not recorded)

    def to_yaml(self) -> str:
        return yaml.safe_dump(_plain(asdict(self)), sort_keys=False)

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_yaml())
        tmp.replace(path)  # never leave a half-written profile under the real name

    @classmethod
    def load(cls, path: Path) -> "DeviceProfile":
        try:
            raw = parse_yaml(Path(path).read_text())
        except FileNotFoundError:
            raise ProfileError(f"profile {path} does not exist; create it with `yggdrasil profile`") from None
        except yaml.YAMLError as exc:
            raise ProfileError(f"profile {path} is not valid YAML ({exc}); re-run `yggdrasil profile`") from None
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "profile") -> "DeviceProfile":
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
            found = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
            raise ProfileError(f"{source}: expected schema {SCHEMA}, found {found!r}; re-run `yggdrasil profile`")
        try:
            return cls(raw["device"], raw["torch_version"], raw["dtype"], _model(raw["target"]),
                       _model(raw["draft"]) if raw.get("draft") else None,
                       dict(raw.get("bandwidth") or {}), raw.get("created", ""), raw["schema"], raw.get("cpu"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{source} is malformed ({type(exc).__name__}: {exc}); re-run `yggdrasil profile`") from None

    def check_matches(self, device: str, dtype: str, target_sha: str | None,
                      draft_sha: str | None = None) -> None:
        """Refuse a profile measured on another device, dtype or model files."""
        wanted = {"device": device, "dtype": dtype, "target sha256": target_sha}
        found = {"device": self.device, "dtype": self.dtype, "target sha256": self.target.sha256}
        if draft_sha is not None:
            wanted["draft sha256"] = draft_sha
            found["draft sha256"] = self.draft.sha256 if self.draft else None
        diffs = [f"{k}: profile has {found[k]!r}, this run has {wanted[k]!r}"
                 for k in wanted if wanted[k] is not None and found[k] != wanted[k]]
        if diffs:
            raise ProfileError("the profile was measured for something else (" + "; ".join(diffs)
                               + "); re-run `yggdrasil profile` for this device and models")


def _plain(value: Any) -> Any:
    """Tuples to lists and str subclasses (torch's version string) to str, for safe YAML."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


def _model(raw: dict) -> ModelProfile:
    return ModelProfile(raw["name"], raw.get("sha256"), int(raw["params"]),
                        tuple(Point(**p) for p in raw["steps"]),
                        tuple(Point(**p) for p in raw.get("prefill_chunks", ())))
