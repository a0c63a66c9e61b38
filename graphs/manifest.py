"""The graph bundle's manifest and its checks (docs/design.md §4, issue 5).

A bundle is a directory with manifest.yaml and artifact files. The manifest names the schema, the
recipe (and its identity hash), the model files (sha256), the torch/triton versions and the device,
and lists every artifact with its size and sha256. The bundle id is a hash of exactly the things
that make a bundle valid for a machine; an integrity hash over every other field catches edits.

Bundles are written into a temporary sibling directory and renamed into place only once complete,
so a crash never leaves something that looks like a valid bundle. Only a bundle is ever replaced
(swapped out in one step, removed once the new one is in place); any other file or directory at
the path is refused, never deleted (issue 24).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from yggdrasil.errors import YggdrasilError

from .layout import BundleLayout

SCHEMA = "yggdrasil-bundle/3"
# 2: BundleLayout names (selection.yaml replaced plan.yaml); 3: weights (each model's weight
# format, which its graphs are bound to) and formats (the formats compile measured and chose from)
SCHEMA_VERSION = 3


class BundleError(YggdrasilError):
    """A bundle that cannot be used here; the message names the difference and the fix."""


class OccupiedError(YggdrasilError):
    """The bundle path holds something that is not a bundle: compile never replaces it."""


@dataclass(frozen=True)
class Environment:
    torch: str
    triton: str | None
    device: str  # device name as the profiler reports it

    @classmethod
    def current(cls, device: str) -> "Environment":
        # torch (and device.py, which imports it) only here: reading and checking manifests
        # (`inspect`) never waits for torch's import
        import torch

        from yggdrasil.device import device_name

        try:
            import triton  # noqa: F401 - only its version is recorded

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        return cls(str(torch.__version__), triton_version, device_name(device))


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
    weights: dict = field(default_factory=dict)  # role -> weight format (yggdrasil/quant.py); absent: fp32
    formats: dict = field(default_factory=dict)  # compile's format choice and every measured alternative

    def weight_format(self, role: str) -> str:
        """The format the role's model is deployed in (the one its graphs were compiled for)."""
        return self.weights.get(role, "fp32")

    @property
    def bitwise(self) -> bool:
        """Whether compile measured the target's graphs batch-invariant (compile/invariance.py):
        its speculative greedy output must then equal its autoregressive output exactly, with no
        tie rule (older bundles, unmeasured: False)."""
        return bool((self.stats.get("batch_invariance_measured") or {}).get("bitwise"))

    @property
    def bundle_id(self) -> str:
        """Hash of what makes the bundle valid somewhere: recipe, model files, torch/triton, device."""
        key = {"recipe": self.recipe_identity, "models": {k: v.get("sha256") for k, v in sorted(self.models.items())},
               "torch": self.environment.torch, "triton": self.environment.triton,
               "device": self.environment.device}
        return hashlib.sha256(yaml.safe_dump(key, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        body = {"schema": SCHEMA, "bundle_id": self.bundle_id, "created": self.created,
                "recipe_identity": self.recipe_identity, "recipe": self.recipe, "models": self.models,
                "environment": {"torch": self.environment.torch, "triton": self.environment.triton,
                                "device": self.environment.device},
                "dtype": self.dtype, "tile": self.tile, "chunk_sizes": list(self.chunk_sizes),
                "buckets": list(self.buckets), "weights": self.weights, "formats": self.formats,
                "artifacts": self.artifacts, "stats": self.stats}
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


def refuse_occupied(out: Path) -> None:
    """Raise OccupiedError when writing a bundle at `out` would replace anything but a bundle."""
    what = BundleLayout(out).occupant()
    if what is not None:
        raise OccupiedError(f"{what}; choose another --out or remove it yourself")


def write_bundle(out: Path, manifest: Manifest, fill) -> Manifest:
    """Build a bundle at `out`: fill(tmp_dir) writes the artifacts, then the manifest (listing
    them with their hashes) is written last and the directory put in place of any old bundle."""
    out = Path(out)
    refuse_occupied(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_partials(out)
    tmp = _partial_dir(out)
    try:
        fill(tmp)
        artifacts = {p.relative_to(tmp).as_posix(): file_digest(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        final = Manifest(**{**manifest.__dict__, "artifacts": artifacts})
        BundleLayout(tmp).manifest.write_text(yaml.safe_dump(final.to_dict(), sort_keys=False))
        refuse_occupied(out)  # again: building took a while, and something may have appeared there
        _put_in_place(tmp, out)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the unfinished bundle, or (once swapped) the old one
        raise


PARTIAL = "partial"


def _partial_dir(out: Path) -> Path:
    """A new directory beside `out` to build into, named after this process. Made with
    os.mkdir, so it gets the usual permissions (the umask's), not mkdtemp's owner-only 0700."""
    path = out.with_name(f".{out.name}.{PARTIAL}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(path)
    return path


def _remove_abandoned_partials(out: Path) -> None:
    """Partial bundles left by compiles that were killed (their process is gone)."""
    prefix = f".{out.name}.{PARTIAL}-"
    for path in out.parent.iterdir():
        pid = path.name[len(prefix):].split("-", 1)[0] if path.name.startswith(prefix) else ""
        if pid.isdigit() and not _alive(int(pid)) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _put_in_place(new: Path, out: Path) -> None:
    """Rename `new` to `out`. An old bundle there is swapped out in one step where the system
    can, then removed; elsewhere it is moved aside, the new one renamed in, and the old one
    removed only then (moved back if the rename fails)."""
    if not os.path.lexists(out):
        os.rename(new, out)
    elif _exchange(new, out):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old bundle
    else:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where the C
    library, kernel or file system cannot, so the caller falls back to two renames."""
    try:
        renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except (OSError, TypeError):  # no C library to ask (Windows)
        return False
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def read_manifest(bundle: Path, rebuild: str) -> tuple[Manifest, dict]:
    path = BundleLayout(bundle).manifest
    try:
        raw = yaml.safe_load(path.read_text())
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
    if int(version) < SCHEMA_VERSION:
        raise BundleError(f"{bundle} uses bundle schema {raw['schema']}, older than this yggdrasil reads "
                          f"({SCHEMA}); rebuild with {rebuild} (cached work is reused)")
    try:
        env = raw["environment"]
        manifest = Manifest(raw["recipe"], raw["recipe_identity"], raw["models"],
                            Environment(env["torch"], env.get("triton"), env["device"]),
                            tuple(raw["buckets"]), raw["dtype"], int(raw["tile"]),
                            tuple(raw["chunk_sizes"]), dict(raw["artifacts"]), dict(raw.get("stats") or {}),
                            raw.get("created", ""), dict(raw["weights"]), dict(raw.get("formats") or {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{path} is malformed ({type(exc).__name__}: {exc}); rebuild with {rebuild}") from None
    if raw.get("integrity") != integrity(raw) or raw.get("bundle_id") != manifest.bundle_id:
        raise BundleError(f"{path} was edited after it was written (its integrity hash no longer matches "
                          f"its contents); rebuild with {rebuild}")
    return manifest, raw


def _thread_counts(built: str, here: str) -> tuple[int, int] | None:
    """(built, here) thread counts when two device names (yggdrasil.device.device_name) differ
    only in them."""
    pattern = re.compile(r"^(.*) \((\d+) threads\)$")
    a, b = pattern.match(built), pattern.match(here)
    if a and b and a[1] == b[1] and a[2] != b[2]:
        return int(a[2]), int(b[2])
    return None


def check_bundle(bundle: Path, environment: Environment, model_hashes: dict[str, str | None],
                 rebuild: str, verify_artifacts: bool = True) -> Manifest:
    """Validate a bundle for this machine and these model files; raise BundleError naming the
    first difference and the command that rebuilds it."""
    manifest, _ = read_manifest(bundle, rebuild)
    env = manifest.environment
    for what, built, here in (("torch version", env.torch, environment.torch),
                              ("triton version", env.triton, environment.triton),
                              ("device", env.device, environment.device)):
        counts = _thread_counts(built, here) if what == "device" else None
        if counts is not None:  # same CPU, another --threads: the fix is the flag, not a rebuild
            raise BundleError(f"{bundle} was built for {counts[0]} CPU thread(s) but this run uses {counts[1]}; "
                              f"pass --threads {counts[0]} to run it as built, or rebuild it with {rebuild}")
        if built != here:
            raise BundleError(f"{bundle} was compiled for {what} {built!r} but this machine has {here!r}; "
                              f"rebuild with {rebuild}")
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
            if path.stat().st_size != expected["bytes"] or file_digest(path)["sha256"] != expected["sha256"]:
                raise BundleError(f"{bundle}: artifact {rel} is corrupt (size or sha256 differs from the "
                                  f"manifest); rebuild with {rebuild}")
    return manifest


def describe(manifest: Manifest, raw: dict[str, Any] | None = None) -> str:
    """What `yggdrasil inspect` prints."""
    env = manifest.environment
    total = sum(a["bytes"] for a in manifest.artifacts.values())
    lines = [f"bundle {manifest.bundle_id} ({SCHEMA}), created {manifest.created}",
             f"recipe     {manifest.recipe.get('name')} ({manifest.recipe_identity[:12]})",
             *(f"{role:<10} {m.get('name')} sha256 {str(m.get('sha256'))[:12]}…" for role, m in manifest.models.items()),
             f"built for  {env.device}, torch {env.torch}, triton {env.triton or '-'}, {manifest.dtype}",
             "weights    " + ", ".join(f"{role} {manifest.weight_format(role)}" for role in manifest.models),
             f"tile       {manifest.tile}; prefill chunks {list(manifest.chunk_sizes)}",
             f"buckets    {len(manifest.buckets)}: {', '.join(manifest.buckets)}",
             f"artifacts  {len(manifest.artifacts)} files, {total / 1e6:.1f} MB"]
    # nested records (the policy's per-bucket verdict) get their own sections in inspect
    lines += [f"{k:<10} {v}" for k, v in manifest.stats.items() if not isinstance(v, dict)]
    return "\n".join(lines + describe_formats(manifest.formats))


def describe_formats(formats: dict) -> list[str]:
    """The weight-format choice and each measured alternative, as `inspect` prints them."""
    if not formats.get("candidates"):
        return []
    lines = [f"{'formats':<10} chose {formats.get('chosen')}: {formats.get('reason', '')}",
             f"{'':<10} {'format':<7} {'T(1) ms':>8} {'T(16) ms':>9} {'agree':>7} {'ppl':>8} {'weights MB':>10}  verdict"]
    for c in formats["candidates"]:
        def num(key, fmt, c=c):
            value = c.get(key)
            return format(value, fmt) if isinstance(value, (int, float)) else "-"
        weight_mb = c["weight_bytes"] / 1e6 if isinstance(c.get("weight_bytes"), int) else None
        lines.append(f"{'':<10} {c['format']:<7} {num('t1_ms', '.2f'):>8} {num('t16_ms', '.2f'):>9} "
                     f"{num('agreement', '.4f'):>7} {num('perplexity', '.3f'):>8} "
                     f"{format(weight_mb, '.1f') if weight_mb is not None else '-':>10}  {c.get('verdict', '')}")
    how = formats.get("agreement_method")
    if how:
        lines.append(f"{'':<10} agreement: {how}")
    return lines
