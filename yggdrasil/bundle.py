"""Opening a compiled bundle (docs/design.md §4).

`open_bundle(path)` validates the manifest and returns a `Bundle` that has built nothing:
`bundle.generator()` loads the models, the step graphs (captured on CUDA) and the bucket policy,
has the one assembly (runtime/assembly.py) build the runners over them, and hands generate and
chat a Generator holding that Runtime; `bundle.engine(settings)` loads the models and the serve
graphs only and builds the server's engine over its own KV pool. Nothing compiles here.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from yggdrasil import kernels
from yggdrasil.buckets import SERVE_STAGE, SPAN_UNIT
from yggdrasil.user_dirs import cache_dir
from yggdrasil.runtime.deployed import DeployedWeights
from yggdrasil.errors import YggdrasilError
from yggdrasil.generator import Generator
from yggdrasil.storage.cuda_graphs import capture
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.manifest import BundleError, Environment, Manifest, check_bundle, elsewhere_warning, read_manifest
from yggdrasil.storage.models import model_digest
from yggdrasil.storage.registry import GraphSet, load_graph_set
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.models.loader import LoadedModel, load, parse_dtype
from yggdrasil.runtime.stage_plan import PlanTable
from yggdrasil.policy.auto import policy_from_calibration
from yggdrasil.runtime.assembly import assemble_runtime
from yggdrasil.runtime.ranks import bundle_world, load_bundle_graphs, start_bundle_ranks


class RecompileError(YggdrasilError):
    """Something compiled at run time, which a bundle must never need."""


def dynamo_compilations() -> int:
    """Graphs dynamo has compiled in this process (0 is the only right answer for a bundle).
    Dynamo is not imported for this (a second of every start): where nothing imported it,
    nothing can have compiled."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    counters = utils.counters
    return int(counters["stats"]["unique_graphs"]) + int(sum(counters["inductor"].values()) > 0)


def rebuild_hint(manifest_raw: dict, bundle: Path) -> str:
    source = (manifest_raw.get("recipe") or {}).get("source") or "RECIPE"
    return f"`yggdrasil compile {source} --out {bundle}`"


@dataclass(frozen=True)
class _Models:
    target: LoadedModel
    draft: LoadedModel | None


class Bundle:
    """A validated bundle on disk. Models, graphs and policy load on first use and are kept."""

    def __init__(self, path: Path, manifest: Manifest, raw: dict, environment: Environment, quiet: bool,
                 warning: str | None = None) -> None:
        """warning: what to say once, when this bundle's models first load (its step times were
        measured on another CPU)."""
        self.path, self.layout, self.manifest = path, BundleLayout(path), manifest
        self.rebuild, self.environment, self.quiet = rebuild_hint(raw, path), environment, quiet
        self.warning = warning
        self._models: _Models | None = None
        self._policy: tuple | None = None
        self._serve_graphs: dict[str, GraphSet] | None = None
        self._latency: LatencyProfile | None = None
        self._weights: DeployedWeights | None = None
        self._profile_body: dict | None = None  # profile.yaml, read once
        self.ranks = None  # a tensor-parallel bundle's other ranks, once started (runtime/mirror.Leader)
        self.load_seconds = 0.0  # opening, loading the models and graphs so far
        self.startup: dict[str, float] = {}  # seconds per start-up phase (--verbose, stats line)

    @property
    def recipe(self) -> dict:
        return self.manifest.recipe

    @property
    def device(self) -> str:
        return self.recipe["device"]

    @property
    def max_context(self) -> int:
        return int(self.recipe["max_context"])

    @property
    def name(self) -> str:
        return self.recipe.get("name", self.path.name)

    # -- what every use needs ---------------------------------------------------------------
    def models(self) -> _Models:
        """The target and draft, loaded once and checked against the hashes the bundle records."""
        if self._models is None:
            if self.warning is not None:  # once per Bundle: its models load once
                print(self.warning, file=sys.stderr)
            started = time.perf_counter()
            roles = self.manifest.models
            self._load_kernels()
            self.startup["kernels"] = time.perf_counter() - started
            target = self._load("target")
            draft = self._load("draft") if "draft" in roles else None
            if self._weights is None:  # an older bundle: its models came from their source files
                hashes = {"target": model_digest(target.source)}
                if draft is not None:
                    hashes["draft"] = model_digest(draft.source)
                check_bundle(self.path, self.environment, hashes, self.rebuild, verify_artifacts=False)
            self._models = _Models(target, draft)
            self.startup["weights"] = time.perf_counter() - started - self.startup["kernels"]
            self.load_seconds += time.perf_counter() - started
        return self._models

    def _split_target(self, models: _Models, rank_graphs=None) -> None:
        """A tensor-parallel bundle: start the other ranks (once) and cut the target to rank 0's
        shard; they run every step and K/V operation of it, generate's and serve's alike.
        rank_graphs: loads a rank's own compiled graph set (None: eager sharded steps)."""
        if self.ranks is None:
            self.ranks = start_bundle_ranks(self.path, self.recipe, models.target.model, self.device,
                                            torch.get_num_threads(), rank_graphs)

    def _load_kernels(self) -> None:
        """The bundle's copy of our CPU kernels (the q4 format's graphs call them), before any
        model or graph: it runs where no compiler is (its hash was checked on open)."""
        if self.layout.kernel_library.is_file():
            try:
                kernels.load(self.layout.kernel_library)
            except kernels.KernelBuildError as exc:
                raise BundleError(f"{self.path}: {exc}; rebuild with {self.rebuild}") from None

    def _load(self, role: str) -> LoadedModel:
        """The role's model in the weight format its graphs were compiled for: mapped from the
        bundle's own weights (yggdrasil/runtime/deployed.py), or for a bundle compiled before those,
        loaded and converted from its source model file."""
        if self.layout.weights.is_dir():
            try:
                if self._weights is None:
                    self._weights = DeployedWeights(self.layout.weights)
                return self._weights.load(role, self.device)
            except YggdrasilError as exc:
                raise BundleError(f"{self.path}: {exc}; rebuild with {self.rebuild}") from None
        fmt = self.manifest.weight_format(role)
        name, dtype = self.manifest.models[role]["name"], parse_dtype(self.manifest.dtype)
        if fmt == "fp32":
            return load(name, dtype=dtype, device=self.device, quiet=self.quiet)
        try:
            return load(name, dtype=dtype, device=self.device, quiet=self.quiet, weights=fmt)
        except YggdrasilError as exc:  # the format, not the model: a model that is missing fails as fp32
            raise BundleError(f"{self.path} deploys the {role} in {fmt} weights, which cannot be loaded here "
                              f"({exc}); rebuild with {self.rebuild}") from None

    def latency(self) -> LatencyProfile:
        """The profiled step times of the bundle's own graphs."""
        if self._latency is None:
            self._latency = LatencyProfile.from_dict(self._profile()["latency"])
        return self._latency

    def piece_seconds(self) -> dict[str, dict[str, float]]:
        """Per role, the measured seconds of each graph that can prefill a prompt piece ({} for a
        bundle compiled before they were recorded: its prompts go in prefill chunks)."""
        recorded = self._profile().get("piece_seconds")
        return recorded if isinstance(recorded, dict) else {}

    def _profile(self) -> dict:
        if self._profile_body is None:
            self._profile_body = self.layout.read_profile()
        return self._profile_body

    def policy(self):
        """The bucket policy over the compiled buckets (None: the bundle decodes plainly)."""
        if self._policy is None:
            selection = self.layout.read_selection()
            widths, verifies = tuple(selection["draft_widths"]), tuple(selection["verify_widths"])
            policy = None
            if widths:
                policy = policy_from_calibration(self.layout.calibration, widths, verifies, self.latency(),
                                                 self.models().target.model.config.dim,
                                                 self.manifest.models["target"]["sha256"])
            self._policy = (policy,)
        return self._policy[0]

    def graph_names(self, role: str, serve: bool) -> list[str]:
        names = [g.split("/", 1)[1] for g in self.manifest.buckets if g.startswith(f"{role}/")]
        return [n for n in names if (n == SERVE_STAGE) == serve]

    def _hint(self) -> str:
        return f"buckets in {self.recipe.get('source') or 'the recipe'}"

    # -- generate and chat ------------------------------------------------------------------
    def generator(self) -> Generator:
        """The models on their step graphs (each bound to the model's own max_context cache,
        captured on CUDA), the policy and the stage plans."""
        models = self.models()
        started = time.perf_counter()
        # with compiled graphs each rank loads its own set (graphs/rank-K/target/)
        rank_graphs = (functools.partial(load_bundle_graphs, str(self.path), tuple(self.graph_names("target", False)),
                                         self.rebuild, self._hint()) if self.manifest.rank_graphs else None)
        self._split_target(models, rank_graphs)
        sets, capture_bytes = {}, 0
        for role, loaded in (("target", models.target), ("draft", models.draft)):
            names = self.graph_names(role, serve=False) if loaded is not None else []
            if not names:
                continue
            # stacked: one-op compaction; torch.compile'd (inductor) steps take separate buffers
            cache = loaded.model.setup_cache(1, self.max_context, stacked=self.manifest.steps != "inductor")
            if role == "target" and rank_graphs is not None:  # rank 0's set; its calls mirrored to the others
                sets[role] = rank_graphs(loaded.model, 0)
                self.ranks.mirror_graphs(sets[role])
            else:
                sets[role] = load_graph_set(self.path, role, loaded.model, names, self.rebuild, self._hint(),
                                            self.manifest.steps)
            if self.device.startswith("cuda"):
                capture_bytes += capture(sets[role], self.max_context // SPAN_UNIT * SPAN_UNIT,
                                         cache.scratch_slot, loaded.model.device)
        policy = self.policy()
        plans = PlanTable.load(self.path) if models.draft is not None else PlanTable()
        runtime = assemble_runtime(models.target.model, models.draft.model if "draft" in sets else None,
                                   self.max_context, chunk_sizes=tuple(self.manifest.chunk_sizes), graphs=sets,
                                   policy=policy, plans=plans, piece_seconds=self.piece_seconds())
        self.startup["graphs"] = time.perf_counter() - started
        self.load_seconds += time.perf_counter() - started
        return Generator(models.target, runtime, models.draft, graph_sets=sets, load_seconds=self.load_seconds,
                         capture_bytes=capture_bytes, latency=self.latency(), manifest=self.manifest,
                         device=self.device, path=self.path, startup=dict(self.startup))

    # -- serve ------------------------------------------------------------------------------
    def serve_graphs(self) -> dict[str, GraphSet]:
        """Each model's compiled serve graph (any rows over the server's KV pool), loaded once;
        empty for a bundle compiled before serve graphs existed, or whose buckets do not run
        AOTInductor packages (the server then runs its own eager step over the pool)."""
        if self._serve_graphs is None and self.manifest.steps != "aoti":
            self._serve_graphs = {}
        if self._serve_graphs is None:
            models, sets = self.models(), {}
            for role, loaded in (("target", models.target), ("draft", models.draft)):
                names = self.graph_names(role, serve=True) if loaded is not None else []
                if names:
                    sets[role] = load_graph_set(self.path, role, loaded.model, names, self.rebuild, self._hint())
            self._serve_graphs = sets
        return self._serve_graphs

    def engine(self, settings, report=lambda message: None):
        """The serving engine (serve/engine.py) under these ServeSettings: the models on their
        serve graphs (eager with settings.eager), no single-request runner or cache."""
        from yggdrasil.serve.setup import make_engine  # the server's machinery: generate and chat never load it

        models = self.models()
        self._split_target(models)  # the pool's target cache is then made on every rank, each its own heads
        graphs = {} if settings.eager else self.serve_graphs()
        policy = self.policy()
        return make_engine(models.target, models.draft, self.max_context, max(self.manifest.chunk_sizes),
                           self.latency(), policy.grid.max_depth if policy is not None else None,
                           {role: g.get(SERVE_STAGE) for role, g in graphs.items()}, settings, report,
                           self.ranks.check if self.ranks is not None else None)



def open_bundle(bundle: Path, quiet: bool = False, verify: bool = False) -> Bundle:
    """Validate the bundle's manifest, environment and artifacts; load nothing else. A bundle
    whose graphs need a CPU feature this CPU lacks is refused here, before any graph library
    or kernel library is opened; one measured on another CPU gets a warning (once,
    when its models load). verify:
    hash every artifact, the large ones too, rather than trust a large one whose size, mtime
    and inode are those it had when its hash last matched (storage/manifest.artifact_intact)."""
    started = time.perf_counter()
    bundle = Path(bundle)
    manifest, raw = read_manifest(bundle, "`yggdrasil compile RECIPE --out BUNDLE`")
    rebuild = rebuild_hint(raw, bundle)
    recipe = raw["recipe"]
    device = recipe["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BundleError(f"{bundle} was compiled for {device} but this machine has no CUDA device; "
                          f"compile a CPU recipe instead (e.g. recipes/{recipe['name'].replace('cuda', 'cpu')}.yaml)")
    environment = Environment.current(device)
    check_bundle(bundle, environment, {}, rebuild, stamps=None if verify else cache_dir() / "verified",
                 manifest=manifest)
    warning = elsewhere_warning(bundle, manifest, environment, rebuild)
    opened = Bundle(bundle, manifest, raw, environment, quiet, warning)
    opened.load_seconds = opened.startup["open"] = time.perf_counter() - started
    return opened
