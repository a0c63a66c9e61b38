"""What one generation runs on, however it was assembled: from a bundle (Bundle.generator())
or from models named on the command line (from_models). generate and chat take a Generator and
never care which."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from yggdrasil.device import check_device, device_name
from yggdrasil.runtime.latency import from_device_profile
from yggdrasil.models.loader import LoadedModel, check_same_vocabulary, load, parse_dtype
from yggdrasil.policy.calibration import load_run
from yggdrasil.policy.auto import check_draft, load_policy
from yggdrasil.policy.device_profile import DeviceProfile
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.policy import BucketPolicy
from yggdrasil.runtime.speculative import generate_with
from yggdrasil.runtime.speculator import DraftShape, build_speculator, make_drafter
from yggdrasil.runtime.stage_plan import PlanTable
from yggdrasil.runtime.assembly import Runtime, assemble_runtime
from yggdrasil.runtime.steps import StepRunner, check_fits, context_bucket


@dataclass
class Generator:
    """The loaded target (and draft) and the Runtime their step runners make up (on a bundle's
    graphs, or eager/compiled), with what a bundle records about them."""

    target: LoadedModel
    runtime: Runtime
    draft: LoadedModel | None = None
    graph_sets: dict = field(default_factory=dict)  # role -> GraphSet of compiled graphs
    load_seconds: float = 0.0
    capture_bytes: int = 0  # CUDA graph pool (0 on CPU)
    latency: object = None  # LatencyProfile: profiled step times
    manifest: object = None  # the bundle's Manifest (None: not from a bundle)
    device: str = "cpu"
    path: Path | None = None  # the bundle's directory (None: not from a bundle)
    startup: dict = field(default_factory=dict)  # a bundle's start-up phases, seconds (Bundle.startup)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def runner(self) -> StepRunner:
        return self.runtime.runner

    @property
    def draft_runner(self) -> StepRunner | None:
        return self.runtime.draft_runner

    @property
    def policy(self) -> BucketPolicy | None:
        """The bundle's bucket policy, if it speculates with one."""
        return self.runtime.policy

    @property
    def plans(self) -> PlanTable:
        """Each bucket's stage plan."""
        return self.runtime.plans or PlanTable()

    def speculator(self):
        """The speculator over this generator's runners (None: plain decoding)."""
        return self.runtime.speculator()

    def graph_seconds(self) -> float:
        return sum(s.seconds for s in self.graph_sets.values())


def generate_tokens(generator: Generator, speculator, prompt_ids, max_new_tokens: int, sampling: SamplingParams,
                    on_tokens=None, reuse: int = 0, control=None):
    """One generation on this generator's target runner, speculating when a speculator is given;
    control: penalties and a grammar (runtime/logits.py)."""
    return generate_with(generator.runner, speculator, prompt_ids, max_new_tokens, sampling,
                         generator.tokenizer.stop_ids, on_tokens=on_tokens, reuse=reuse, control=control)


@dataclass(frozen=True)
class ModelSettings:
    """Models named on the command line: the target, a draft (or "lookup"), and how to run them."""

    model: str
    draft: str = "lookup"
    device: str = "cpu"
    dtype: str | None = None
    max_context: int = 2048
    chunk_size: int = 64
    compile: bool = False  # torch.compile the fixed-shape steps
    shape: DraftShape = DraftShape()
    auto: bool = False  # EGT picking (D, W, V) per iteration from a calibration directory
    calibration: str | None = None
    profile: str | None = None  # a device profile file for the objective's step times
    weights: str = "fp32"  # weight format of the target and draft (yggdrasil/models/quant.py)


def load_target(settings: ModelSettings) -> LoadedModel:
    """The target model (its tokenizer sizes the prompt before anything else loads)."""
    check_device(settings.device)
    return load(settings.model, dtype=parse_dtype(settings.dtype) if settings.dtype else None,
                device=settings.device, weights=settings.weights)


def from_models(settings: ModelSettings, target: LoadedModel, prompt_tokens: int, max_new_tokens: int,
                note=lambda text: print(text, file=sys.stderr)) -> Generator:
    """Step runners sized for the prompt and reply, the draft model and the speculator the
    settings ask for. Bad input fails before anything slow (a prompt that cannot fit, a draft
    the calibration was not made with)."""
    dtype = parse_dtype(settings.dtype) if settings.dtype else None
    # size the cache for this request: compiled steps attend over all of it
    context = context_bucket(prompt_tokens + max_new_tokens + 1, settings.max_context)
    check_fits(prompt_tokens, context)
    speculates = settings.shape.mode != "none"
    calibration = _calibration(settings) if speculates and settings.auto else None
    draft = None
    if speculates and settings.draft != "lookup":
        draft = load(settings.draft, dtype=dtype or target.model.dtype, device=settings.device,
                     weights=settings.weights)
        check_same_vocabulary(target, draft)
    runtime = assemble_runtime(target.model, draft.model if draft is not None else None, context,
                               chunk_size=settings.chunk_size, compile=settings.compile)
    speculator = None
    if speculates and settings.auto:
        speculator = _auto_speculator(settings, calibration, target, draft, runtime, note)
    elif speculates:
        drafter = make_drafter(settings.shape, runtime.draft_runner)
        speculator = build_speculator(runtime.runner, drafter, verify=settings.shape.verify,
                                      latency=_latency(settings, target, drafter.kind))
    return Generator(target, replace(runtime, built=speculator), draft, load_seconds=target.load_seconds,
                     device=settings.device)


def _calibration(settings: ModelSettings):
    """The calibration run --auto reads, checked against the draft named (before loading it)."""

    calibration = load_run(settings.calibration)
    check_draft(settings.calibration, calibration[1], settings.draft)
    return calibration


def _auto_speculator(settings: ModelSettings, calibration, target, draft, runtime: Runtime, note):
    """EGT whose (D, W, V) bucket is picked per iteration by the calibrated policy."""

    if draft is not None:
        check_draft(settings.calibration, calibration[1], settings.draft, draft.source.sha256)
    kind = "model" if draft is not None else "lookup"
    latency = profile_latency(settings.profile, target, kind, draft) if settings.profile else None
    policy, text = load_policy(settings.calibration, calibration, latency, target.config.dim, target.source.sha256)
    note(f"[auto: {text}; latency from {settings.profile or 'the calibration run'}]")
    return build_speculator(runtime.runner, policy=policy, draft_runner=runtime.draft_runner)


def _latency(settings: ModelSettings, target, draft_kind: str):
    """A profile file checked against this device, dtype and models; else measure at start."""
    if settings.profile is None:
        return "auto"
    return profile_latency(settings.profile, target, draft_kind)


def profile_latency(path: str, target, draft_kind: str, draft=None):
    profile = DeviceProfile.load(path)
    device = "cuda" if target.model.device.type == "cuda" else "cpu"
    profile.check_matches(device_name(device), str(target.model.dtype).replace("torch.", ""),
                          target.source.sha256, draft.source.sha256 if draft is not None else None)
    return from_device_profile(profile, draft_kind != "lookup")
