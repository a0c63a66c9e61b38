"""What every compile phase works from: the recipe, where the bundle goes, the work cache beside
it, this machine's environment and the loaded models. Built once by `load_context`, then passed
to each phase (compile/build.py runs them in order)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml

from yggdrasil.models import model as model_module
from yggdrasil.models import quant, quant_base, quant_blocks, quant_embed, quant_q4
from yggdrasil.buckets import SERVE_STAGE, Grid
from yggdrasil.cpu import GraphIsa
from yggdrasil.policy.auto import policy_from_calibration
from yggdrasil.errors import YggdrasilError
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.manifest import BundleError, Environment, Manifest, check_bundle
from yggdrasil.graphs.manifest import refuse_occupied
from yggdrasil.storage.models import model_digest
from yggdrasil.kernels.build import source_hash
from yggdrasil.models.loader import LoadedModel, check_same_vocabulary, load, parse_dtype

from yggdrasil.graphs import aoti
from yggdrasil.graphs.isa import graph_isa
from .recipe import Recipe, check_models
from .work_cache import open_work_cache, work_root
from yggdrasil.runtime.assembly import assemble_runtime


def rebuild_command(recipe: Recipe, out: Path, force: bool = False) -> str:
    return f"`yggdrasil compile {recipe.source or recipe.name} --out {out}{' --force' if force else ''}`"


def work_key(*parts) -> str:
    """The cache key of a piece of work: a hash of exactly what it depends on."""
    return hashlib.sha256(yaml.safe_dump(list(parts), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class BuildContext:
    recipe: Recipe
    out: Path
    work: BundleLayout  # the cache beside the bundle: calibration and compiled graphs (work_cache.py)
    env: Environment
    # the command that rebuilds this bundle, for errors raised while compiling: those come from
    # the work cache itself (its hashes were checked, yet it fails), which only --force clears
    rebuild: str
    target: LoadedModel
    draft: LoadedModel | None
    models: dict  # role -> {"name", "sha256"}: what the manifest records
    log: Callable[[str], None] = print
    # role -> the weight format the loaded model is in (compile/formats.py chooses it); what the
    # graphs are compiled for, the calibration is run in and the manifest records
    weights: dict = field(default_factory=lambda: {"target": "fp32"})
    # what graphs compiled in this build are compiled for (the recipe's isa on this CPU)
    isa: GraphIsa | None = None
    # what runs the buckets, decided before graphs compile (loader_check.decide_steps)
    steps: str = "aoti"
    # bytes per second between memory and the cores (device.memory_bandwidth, a 1 s probe), on
    # a CPU once compile has work to do: the formats phase's floors, the expected compile time
    bandwidth: float | None = None
    # the draft's trimmed head ("K sha256-prefix of its token ids"), None: the full head
    # (compile/draft_vocab.py); part of the draft's weight key: its calibration and graphs differ
    draft_vocab: str | None = None

    def weight_key(self, role: str) -> tuple:
        """What a cached piece of work adds to its key for the role's weight format: nothing for
        fp32, so work cached before formats existed stays valid."""
        vocab = (f"draft vocab {self.draft_vocab}",) if role == "draft" and self.draft_vocab else ()
        return self._format_key(role) + vocab

    def _format_key(self, role: str) -> tuple:
        fmt = self.weights.get(role, "fp32")
        if fmt == "q4":  # the graphs call our kernels: a new kernel source is new work
            return (f"{role} weights {fmt}", f"kernels {kernel_source_hash()}")
        return () if fmt == "fp32" else (f"{role} weights {fmt}",)

    @property
    def rank_graphs(self) -> bool:
        """Whether the target's graphs are one set per rank (a tensor-parallel target's, compiled
        and checked by compile/rank_graphs.py); compile's own phases run the whole target eagerly."""
        return self.recipe.tensor_parallel > 1 and self.steps != "eager"

    def role_steps(self, role: str) -> str:
        """What runs the role's steps in compile's own process (a split target's graphs are per rank)."""
        return "eager" if role == "target" and self.rank_graphs else self.steps

    def graph_files(self, key) -> list[tuple[Path, int | None]]:
        """The work cache's files of one graph key, with the rank each belongs to (None: the one
        graph of a whole model; a split target's key has one per rank)."""
        if self.steps == "eager":
            return []
        ranks = range(self.recipe.tensor_parallel) if key.role == "target" and self.rank_graphs else [None]
        return [(self.work.graph(key, self.steps, rank), rank) for rank in ranks]

    def model(self, role: str):
        """The loaded target or draft model."""
        return (self.target if role == "target" else self.draft).model

    def model_hashes(self) -> dict[str, str]:
        return {role: m["sha256"] for role, m in self.models.items()}

    @property
    def hint(self) -> str:
        return f"buckets in {self.recipe.source}"

    def grid(self) -> Grid:
        return self.recipe.buckets.grid

    def runners(self, graphs: dict | None = None, piece_seconds: dict | None = None):
        """Target and draft step runners over the recipe's context (eager, or on these graphs;
        with piece_seconds, prefilling on the graphs that cost least, as the bundle will)."""

        runtime = assemble_runtime(self.target.model, self.draft.model if self.draft is not None else None,
                                   self.recipe.max_context, chunk_sizes=self.recipe.buckets.prefill_chunks,
                                   graphs=graphs, piece_seconds=piece_seconds)
        return runtime.runner, runtime.draft_runner

    def policy(self, directory: Path, selection=None, latency=None):
        """The bucket policy over a calibration (restricted to what selection kept)."""

        kept = selection is not None and selection.speculates
        return policy_from_calibration(directory, selection.widths if kept else None,
                                       selection.verifies if kept else None, latency,
                                       self.target.model.config.dim, self.models["target"]["sha256"])


def load_context(recipe: Recipe, out: Path, log=print) -> BuildContext:
    """Check the recipe can be built here (and that `out` is free or a bundle: nothing else
    is ever replaced) and load its models."""
    out = Path(out)
    refuse_occupied(out)
    if recipe.device.startswith("cuda") and not torch.cuda.is_available():
        raise YggdrasilError(f"{recipe.source}: the recipe is for {recipe.device} but this machine has no "
                             "CUDA device; compile the matching -cpu recipe here instead")
    check_models(recipe)
    if recipe.threads is not None:  # before Environment.current: the device name records the count
        torch.set_num_threads(recipe.threads)
    dtype = parse_dtype(recipe.dtype)
    target = load(recipe.resolve(recipe.target), dtype=dtype, device=recipe.device)
    draft = None
    models = {"target": {"name": recipe.resolve(recipe.target), "sha256": model_digest(target.source)}}
    if recipe.draft != "lookup":
        draft = load(recipe.resolve(recipe.draft), dtype=dtype, device=recipe.device)
        check_same_vocabulary(target, draft)
        models["draft"] = {"name": recipe.resolve(recipe.draft), "sha256": model_digest(draft.source)}
    open_work_cache(work_root(out))
    env = Environment.current(recipe.device)
    return BuildContext(recipe, out, BundleLayout(work_root(out)), env, rebuild_command(recipe, out, force=True),
                        target, draft, models, log, {role: "fp32" for role in models}, graph_isa(recipe.isa, env.cpu))


def up_to_date(ctx: BuildContext) -> Manifest | None:
    """The existing bundle, if it was built from this very recipe for these models, and runs
    here (its step times may have been measured on another CPU: manifest.measured_elsewhere)."""
    if not BundleLayout(ctx.out).exists():
        return None
    try:
        manifest = check_bundle(ctx.out, ctx.env, ctx.model_hashes(), rebuild_command(ctx.recipe, ctx.out))
    except BundleError as exc:
        ctx.log(f"existing bundle is stale, rebuilding: {exc}")
        return None
    if manifest.environment.cpu is None:
        ctx.log("existing bundle records no CPU fingerprint (built by an older yggdrasil), rewriting it")
        return None
    built_for = manifest.recipe.get("isa", "native")
    if built_for != ctx.recipe.isa:
        ctx.log(f"existing bundle's graphs were compiled for isa {built_for}, this build is for {ctx.recipe.isa}; "
                "rebuilding")
        return None
    if manifest.recipe_identity != ctx.recipe.identity():
        ctx.log("existing bundle was built from another version of the recipe, rebuilding")
        return None
    if (manifest.steps == "aoti" and not manifest.rank_graphs and ctx.recipe.serve_graphs
            and f"target/{SERVE_STAGE}" not in manifest.buckets):
        # other steps (and a split target) run the eager serve step
        ctx.log("existing bundle has no serve graphs (built by an older yggdrasil), rebuilding")
        return None
    if manifest.stats.get("graph_code") != graph_code_hash():
        ctx.log("existing bundle's graphs were compiled from another version of the model code, rebuilding")
        return None
    built_with = (manifest.stats.get("kernels") or {}).get("source_hash")
    if "q4" in manifest.weights.values() and built_with != kernel_source_hash():
        ctx.log("existing bundle was built with another version of yggdrasil's CPU kernels, rebuilding")
        return None
    return manifest


def _source_hash(modules) -> str:
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


# read once, when this process imported that code: a file edited while a compile runs must not
# lend its hash to graphs the code already loaded compiles
_GRAPH_CODE = _source_hash((model_module, quant, quant_base, quant_blocks, quant_embed, quant_q4, aoti))


def graph_code_hash() -> str:
    """Of the code that defines what a compiled graph computes (the model's forward, the packed
    weight formats' modules and the export), as this process loaded it: a graph compiled by
    other code is stale even if nothing else changed."""
    return _GRAPH_CODE


def kernel_source_hash() -> str:
    return source_hash()
