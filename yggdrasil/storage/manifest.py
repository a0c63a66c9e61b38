"""The graph bundle's manifest and its checks (docs/design.md §4, issue 5).

A bundle is a directory with manifest.yaml and artifact files. The manifest names the schema, the
recipe (and its identity hash), the model files (sha256), the torch/triton versions, the device and
a fingerprint of the CPU it was compiled and measured on, the ISA its graphs were compiled for,
and lists every artifact with its size and sha256. The bundle id is a hash of exactly the things
that make a bundle valid for a machine; an integrity hash over every other field catches edits.

A bundle may be copied to another machine (yggdrasil/cpu.py): one whose CPU lacks a feature the
graphs may use is refused before any graph library is opened; one with every feature but another
CPU runs, with a warning that its step times were measured elsewhere (`measured_elsewhere`).

This is the read side, what an edge box needs to open a bundle; writing one (into a temporary
sibling, put in place once complete) is graphs/manifest.py's.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from yggdrasil.cpu import CpuFingerprint, GraphIsa
from yggdrasil.errors import YggdrasilError

from .layout import BundleLayout
from yggdrasil.yaml_files import parse_yaml

SCHEMA = "yggdrasil-bundle/5"
# 2: BundleLayout names (selection.yaml replaced plan.yaml); 3: weights (each model's weight
# format, which its graphs are bound to) and formats (the formats compile measured and chose from);
# 4: environment.cpu (the CPU fingerprint) and isa (what the graphs were compiled for);
# 5: a tensor-parallel target's graphs, one set per rank (graphs/rank-K/target/: an older reader
# would look for graphs/target/)
SCHEMA_VERSION = 5
# what runs a bundle's buckets: its AOTInductor packages, Inductor's saved steps, or the models' eager steps
STEP_KINDS = ("aoti", "inductor", "eager")
OLDEST_READ = 3  # schema 3 has no fingerprint: it is checked by its device name, as it always was


class BundleError(YggdrasilError):
    """A bundle that cannot be used here; the message names the difference and the fix."""


@dataclass(frozen=True)
class Environment:
    torch: str
    triton: str | None
    device: str  # device name as the profiler reports it
    cpu: CpuFingerprint | None = None  # the host CPU (None: a manifest from before fingerprints)

    @classmethod
    def current(cls, device: str) -> "Environment":
        # torch (and device.py, which imports it) only here: reading and checking manifests
        # (`inspect`) never waits for torch's import
        import torch

        from yggdrasil.cpu import cpu_fingerprint
        from yggdrasil.device import device_name

        try:
            import triton  # noqa: F401 - only its version is recorded

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        return cls(str(torch.__version__), triton_version, device_name(device),
                   cpu_fingerprint(torch.get_num_threads()))

    def as_dict(self) -> dict:
        body = {"torch": self.torch, "triton": self.triton, "device": self.device}
        return body if self.cpu is None else {**body, "cpu": self.cpu.as_dict()}


@dataclass(frozen=True)
class Manifest:
    recipe: dict
    recipe_identity: str
    models: dict  # role -> {"name", "sha256"}
    environment: Environment
    buckets: tuple[str, ...]
    dtype: str
    tile: int
    chunk_sizes: tuple[int, ...]
    artifacts: dict = field(default_factory=dict)  # relative path -> {"bytes", "sha256"}
    stats: dict = field(default_factory=dict)
    created: str = ""
    weights: dict = field(default_factory=dict)  # role -> weight format (yggdrasil/models/quant.py); absent: fp32
    formats: dict = field(default_factory=dict)  # compile's format choice and every measured alternative
    isa: GraphIsa | None = None  # what the graphs were compiled for (None: before fingerprints)
    # what runs each bucket (STEP_KINDS): "aoti", the bundle's AOTInductor packages; "inductor",
    # Inductor's saved steps restored at open (where this torch build cannot load its packages:
    # compile/loader_check.py); or "eager", the model's own step. All captured as CUDA graphs on CUDA
    steps: str = "aoti"

    @property
    def world_size(self) -> int:
        """The ranks the target is split over (1: whole; docs/tensor-parallel.md)."""
        return int(self.recipe.get("tensor_parallel", 1) or 1)

    @property
    def rank_graphs(self) -> bool:
        """Whether the target's graphs are one set per rank (graphs/rank-K/target/)."""
        return self.world_size > 1 and self.steps != "eager"

    def graph_names(self, role: str) -> list[str]:
        """The role's graphs, by name, as the bundle lists them."""
        return [b.split("/", 1)[1] for b in self.buckets if b.startswith(f"{role}/")]

    def weight_format(self, role: str) -> str:
        """The format the role's model is deployed in (the one its graphs were compiled for)."""
        return self.weights.get(role, "fp32")

    @property
    def bitwise(self) -> bool:
        """Whether compile measured the target's graphs batch-invariant and proved that nothing
        outside the fixed-order ops can make them differ (compile/invariance.py, pointwise.py):
        its speculative greedy output must then equal its autoregressive output exactly, with no
        tie rule (older bundles, unmeasured: False)."""
        return bool((self.stats.get("batch_invariance_measured") or {}).get("bitwise"))

    def exactness(self) -> str:
        """What `generate --verbose` and `inspect` say of it: "bitwise: ..." only when measured so,
        else "up to ties (max gap G): ..." (the tie rule applies), else that it was not measured."""
        said = self.stats.get("batch_invariance")
        if not said:
            return "not measured (compiled before batch invariance was): up to ties, the tie rule applies"
        return said if self.bitwise or said.startswith("up to ties") else f"up to ties: {said}"

    @property
    def bundle_id(self) -> str:
        """Hash of what makes the bundle valid somewhere: recipe, model files, torch/triton, device,
        and the CPU and graph ISA where recorded (absent ones leave older bundles' ids as they were)."""
        key = {"recipe": self.recipe_identity, "models": {k: v.get("sha256") for k, v in sorted(self.models.items())},
               "torch": self.environment.torch, "triton": self.environment.triton,
               "device": self.environment.device}
        if self.environment.cpu is not None:
            key["cpu"] = self.environment.cpu.as_dict()
        if self.isa is not None:
            key["isa"] = self.isa.as_dict()
        if self.steps != "aoti":  # absent: the ids of bundles of packages stay as they were
            key["steps"] = self.steps
        return hashlib.sha256(yaml.safe_dump(key, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        body = {"schema": SCHEMA, "bundle_id": self.bundle_id, "created": self.created,
                "recipe_identity": self.recipe_identity, "recipe": self.recipe, "models": self.models,
                "environment": self.environment.as_dict(),
                **({"isa": self.isa.as_dict()} if self.isa is not None else {}),
                "dtype": self.dtype, "tile": self.tile, "chunk_sizes": list(self.chunk_sizes),
                "buckets": list(self.buckets), "weights": self.weights, "formats": self.formats,
                **({"steps": self.steps} if self.steps != "aoti" else {}), "artifacts": self.artifacts, "stats": self.stats}
        return {**body, "integrity": integrity(body)}


def integrity(body: dict) -> str:
    """sha256 of every manifest field but this one: any later edit shows."""
    rest = {k: v for k, v in body.items() if k != "integrity"}
    return hashlib.sha256(yaml.safe_dump(rest, sort_keys=True).encode()).hexdigest()


def file_digest(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": Path(path).stat().st_size, "sha256": digest.hexdigest()}


def read_manifest(bundle: Path, rebuild: str) -> tuple[Manifest, dict]:
    path = BundleLayout(bundle).manifest
    try:
        raw = parse_yaml(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{bundle} is not a bundle (no manifest.yaml); build one with {rebuild}") from None
    except OSError as exc:  # a regular file given for the bundle directory, an unreadable manifest
        if Path(bundle).is_file():
            raise BundleError(f"{bundle} is a file, not a bundle directory; give the directory "
                              f"`yggdrasil compile` wrote, or build one with {rebuild}") from None
        raise BundleError(f"cannot read {path} ({exc.strerror}); rebuild with {rebuild}") from None
    except yaml.YAMLError as exc:
        raise BundleError(f"{path} is not valid YAML ({exc}); rebuild with {rebuild}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("schema"), str):
        raise BundleError(f"{path} has no schema; rebuild with {rebuild}")
    version = raw["schema"].rsplit("/", 1)[-1]
    if not raw["schema"].startswith("yggdrasil-bundle/") or not version.isdigit():
        raise BundleError(f"{path}: unknown schema {raw['schema']!r}; rebuild with {rebuild}")
    if int(version) > SCHEMA_VERSION:
        raise BundleError(f"{bundle} uses bundle schema {raw['schema']}, newer than this yggdrasil "
                          f"understands ({SCHEMA}); upgrade yggdrasil or rebuild with {rebuild}")
    if int(version) < OLDEST_READ:
        raise BundleError(f"{bundle} uses bundle schema {raw['schema']}, older than this yggdrasil reads "
                          f"({SCHEMA}); rebuild with {rebuild} (cached work is reused)")
    try:
        manifest = parse_manifest(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{path} is malformed ({type(exc).__name__}: {exc}); rebuild with {rebuild}") from None
    if raw.get("integrity") != integrity(raw) or raw.get("bundle_id") != manifest.bundle_id:
        raise BundleError(f"{path} was edited after it was written (its integrity hash no longer matches "
                          f"its contents); rebuild with {rebuild}")
    return manifest, raw


def parse_manifest(raw: dict) -> Manifest:
    """The Manifest a manifest.yaml body describes (not checked: read_manifest checks it)."""
    env = raw["environment"]
    cpu = CpuFingerprint.from_dict(env["cpu"]) if env.get("cpu") else None
    if raw.get("steps", "aoti") not in STEP_KINDS:
        raise ValueError(f"steps {raw['steps']!r} is none of {', '.join(STEP_KINDS)}")
    return Manifest(raw["recipe"], raw["recipe_identity"], raw["models"],
                    Environment(env["torch"], env.get("triton"), env["device"], cpu),
                    tuple(raw["buckets"]), raw["dtype"], int(raw["tile"]),
                    tuple(raw["chunk_sizes"]), dict(raw["artifacts"]), dict(raw.get("stats") or {}),
                    raw.get("created", ""), dict(raw["weights"]), dict(raw.get("formats") or {}),
                    GraphIsa.from_dict(raw["isa"]) if raw.get("isa") else None, raw.get("steps", "aoti"))


def _thread_counts(built: str, here: str) -> tuple[int, int] | None:
    """(built, here) thread counts when two device names (yggdrasil.device.device_name) differ
    only in them."""
    pattern = re.compile(r"^(.*) \((\d+) threads\)$")
    a, b = pattern.match(built), pattern.match(here)
    if a and b and a[1] == b[1] and a[2] != b[2]:
        return int(a[2]), int(b[2])
    return None


def check_bundle(bundle: Path, environment: Environment, model_hashes: dict[str, str | None],
                 rebuild: str, verify_artifacts: bool = True, stamps: Path | None = None,
                 manifest: Manifest | None = None) -> Manifest:
    """Validate a bundle for this machine and these model files; raise BundleError naming the
    first difference and the command that rebuilds it. stamps: see artifact_intact. manifest:
    the bundle's, when the caller has read it already (read_manifest)."""
    if manifest is None:
        manifest, _ = read_manifest(bundle, rebuild)
    env = manifest.environment
    _check_isa(bundle, manifest, environment, rebuild)  # first: the one difference that would crash
    for what, built, here in (("torch version", env.torch, environment.torch),
                              ("triton version", env.triton, environment.triton)):
        if built != here:
            raise BundleError(f"{bundle} was compiled for {what} {built!r} but this machine has {here!r}; "
                              f"rebuild with {rebuild}")
    _check_device(bundle, manifest, environment, rebuild)
    check_rank_graphs(bundle, manifest, rebuild)  # before the artifacts: names the ranks, not one file
    for role, sha in model_hashes.items():
        built = (manifest.models.get(role) or {}).get("sha256")
        if sha is not None and built != sha:
            name = (manifest.models.get(role) or {}).get("name", role)
            raise BundleError(f"the {role} model file changed since {bundle} was compiled ({name}: sha256 "
                              f"{str(built)[:12]}… then, {sha[:12]}… now); rebuild with {rebuild}")
    if verify_artifacts:
        for rel, expected in manifest.artifacts.items():
            path = Path(bundle) / rel
            if not path.is_file():
                raise BundleError(f"{bundle} is missing its artifact {rel}; rebuild with {rebuild}")
            if not artifact_intact(path, expected, stamps):
                raise BundleError(f"{bundle}: artifact {rel} is corrupt (size or sha256 differs from the "
                                  f"manifest); rebuild with {rebuild}")
    return manifest


def check_rank_graphs(bundle: Path, manifest: Manifest, rebuild: str) -> None:
    """A tensor-parallel target's graph sets: one per rank 0..N-1, each with every target graph.
    Another count of sets (a rank's folder lost, or sets of another world size copied in) is one
    error naming the world size and the sets found."""
    if not manifest.rank_graphs:
        return
    layout, world = BundleLayout(bundle), manifest.world_size
    found = layout.graph_set_ranks()
    if found != list(range(world)):
        held = f"rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}" if found else "no rank"
        raise BundleError(f"{bundle} splits its target over {world} ranks (tensor_parallel: {world}) but holds "
                          f"compiled graph sets for {held} (graphs/rank-K/target/); every rank 0..{world - 1} needs "
                          f"its own; rebuild with {rebuild}")
    names = manifest.graph_names("target")
    for rank in found:
        missing = [n for n in names if not layout.graph_named("target", n, manifest.steps, rank).is_file()]
        if missing:
            raise BundleError(f"{bundle}: rank {rank}'s graph set lacks {len(missing)} of the {len(names)} target "
                              f"graphs every rank needs ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} "
                              f"in {layout.rank_graphs(rank) / 'target'}); rebuild with {rebuild}")


LARGE_ARTIFACT = 32 << 20  # bytes: an artifact this big is hashed once per (size, mtime, inode)


def artifact_intact(path: Path, expected: dict, stamps: Path | None) -> bool:
    """Size, then sha256, against the manifest. With `stamps` (a directory in the user's cache),
    a large artifact (the deployed weights: a full hash of 2 GB costs a second or more at every
    start) whose size, mtime and inode are those it had when its hash last matched is taken as
    intact without hashing it again: anything that rewrites the file changes its mtime, so only
    damage that leaves all three alone (a disk error) goes unseen; `--verify` (stamps None)
    hashes everything."""
    stat = path.stat()
    if stat.st_size != expected["bytes"]:
        return False
    stamp = None
    if stamps is not None and stat.st_size >= LARGE_ARTIFACT:
        stamp = stamps / hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
        mark = f"{stat.st_size} {stat.st_mtime_ns} {stat.st_ino} {expected['sha256']}"
        try:
            if stamp.read_text() == mark:
                return True
        except OSError:
            pass
    if file_digest(path)["sha256"] != expected["sha256"]:
        return False
    if stamp is not None:
        try:  # a cache that cannot be written only costs the hash again next time
            stamp.parent.mkdir(parents=True, exist_ok=True)
            tmp = stamp.with_suffix(f".{os.getpid()}")
            tmp.write_text(mark)
            os.replace(tmp, stamp)
        except OSError:
            pass
    return True


def with_flag(command: str, flag: str) -> str:
    """A `yggdrasil compile ...` command (in backticks) with one more flag."""
    return f"{command[:-1]} {flag}`" if command.endswith("`") else f"{command} {flag}"


def _check_isa(bundle: Path, manifest: Manifest, environment: Environment, rebuild: str) -> None:
    """Refuse a bundle whose graphs may use a CPU feature this CPU lacks: its first forward would
    die on an illegal instruction. Bundles from before fingerprints are not checked."""
    built, here, isa = manifest.environment.cpu, environment.cpu, manifest.isa
    if here is None or built is None:
        return
    if built.machine != here.machine:
        raise BundleError(f"{bundle} was compiled for {built.machine} CPUs but this machine is {here.machine}; "
                          f"rebuild it here with {rebuild}")
    missing = here.lacks(isa.requires) if isa is not None else ()
    if not missing:
        return
    portable = here.portable_isa()
    way_out = (f"compile a portable bundle with {with_flag(rebuild, f'--isa {portable}')} (this CPU runs "
               f"{portable}), or rebuild it here with {rebuild}" if portable else
               f"rebuild it here with {rebuild} (this CPU has no AVX2, so no portable --isa runs on it)")
    raise BundleError(f"{bundle} cannot run on this CPU: its graphs were compiled for {isa.describe()} on "
                      f"{isa.compiled_on} and may use {', '.join(missing)}, which this CPU, {here.summary()}, "
                      f"lacks; {way_out}")


def _check_device(bundle: Path, manifest: Manifest, environment: Environment, rebuild: str) -> None:
    """Refuse another device, or another thread count on the same CPU. A CPU bundle with a
    fingerprint runs on another CPU that passed _check_isa (measured_elsewhere warns)."""
    built, here = manifest.environment, environment
    if (built.cpu is not None and here.cpu is not None and not manifest.recipe.get("device", "cpu").startswith("cuda")):
        if built.cpu.same_cpu(here.cpu) and built.cpu.threads != here.cpu.threads:
            counts = (built.cpu.threads, here.cpu.threads)
        else:
            return
    else:
        counts = _thread_counts(built.device, here.device)
    if counts is not None:  # same CPU, another --threads: the fix is the flag, not a rebuild
        raise BundleError(f"{bundle} was built for {counts[0]} CPU thread(s) but this run uses {counts[1]}; "
                          f"pass --threads {counts[0]} to run it as built, or rebuild it with {rebuild}")
    if built.device != here.device:
        raise BundleError(f"{bundle} was compiled for device {built.device!r} but this machine has "
                          f"{here.device!r}; rebuild with {rebuild}")


def measured_elsewhere(manifest: Manifest, environment: Environment) -> str | None:
    """Which other CPU the bundle's step times were measured on (None: this kind of CPU, or not
    known). Such a bundle runs here, but its speculation was tuned for that CPU's step times."""
    built, here = manifest.environment.cpu, environment.cpu
    if built is None or here is None or built.same_cpu(here):
        return None
    return f"{built.summary()}; this is {here.summary()}"


def elsewhere_warning(bundle: Path, manifest: Manifest, environment: Environment, rebuild: str) -> str | None:
    """The one line a bundle measured on another CPU gets when it is opened (None: measured here)."""
    elsewhere = measured_elsewhere(manifest, environment)
    if elsewhere is None:
        return None
    target = manifest.isa.target if manifest.isa is not None else "compiled"
    return (f"WARNING: {bundle}'s step times were measured on another CPU ({elsewhere}), so its speculation "
            f"was tuned for that one; it runs here, since this CPU has every feature its {target} graphs use. "
            f"{with_flag(rebuild, '--reprofile')} re-measures them here and keeps the graphs")
