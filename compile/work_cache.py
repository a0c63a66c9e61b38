"""The work cache beside a bundle (`.NAME.work`): the compiled graphs and the calibration that a
later compile reuses. Each cached piece has a record of its files' content hashes (sha256),
written when it is cached and checked before it is reused, so a damaged or missing piece is
rebuilt instead of being shipped again (issue 24):

    graphs/ROLE/NAME.pt2     NAME.key (what it was compiled from), NAME.sha256 (its content)
    calibration/             calibration.key, calibration.sha256 (every file in it)

Bundles get copies of these files, not hard links (compile/write.py), so damage to a bundle
never reaches the cache; the hashes catch damage that reaches it some other way, including
through the links older versions made.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import yaml

from yggdrasil.storage.manifest import file_digest
from yggdrasil.graphs.manifest import OccupiedError

MARKER = "yggdrasil-work-cache"  # a file at the root: this directory is ours to clear
# what the cache held before it had a marker: recognised as ours too
LEGACY_NAMES = frozenset({"graphs", "calibration", "calibration.key", "calibration.seconds"})


def work_root(out: Path) -> Path:
    return Path(out).parent / f".{Path(out).name}.work"


def _is_ours(root: Path) -> bool:
    names = {p.name for p in root.iterdir()}
    return not names or MARKER in names or names <= LEGACY_NAMES


def open_work_cache(root: Path) -> None:
    """Make the cache directory (or check one already there is a cache)."""
    if root.exists() and not (root.is_dir() and _is_ours(root)):
        raise OccupiedError(f"{root} (where compile keeps its work cache) is not a yggdrasil work cache; "
                            "choose another --out or remove it yourself")
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("compiled graphs and calibration that `yggdrasil compile` reuses; "
                               "safe to delete (the next compile redoes the work)\n")


def clear_work_cache(root: Path, log: Callable[[str], None]) -> None:
    """Delete everything cached (for --force): what follows is built from scratch."""
    open_work_cache(root)
    for entry in root.iterdir():
        if entry.name == MARKER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    log(f"--force: cleared the work cache {root}; rebuilding everything")


def _record(path: Path) -> Path:
    return path.with_suffix(".sha256")


def _key(path: Path) -> Path:
    return path.with_suffix(".key")


def _digests(path: Path) -> dict:
    """Size and sha256 of the file at `path`, or of every file under the directory at `path`."""
    if path.is_file():
        return {path.name: file_digest(path)}
    return {p.relative_to(path).as_posix(): file_digest(p) for p in sorted(path.rglob("*")) if p.is_file()}


def seal(path: Path) -> None:
    """Record the content hashes of a piece just written into the cache."""
    _record(path).write_text(yaml.safe_dump(_digests(path), sort_keys=True))


def damage(path: Path) -> str | None:
    """Why the cached piece at `path` cannot be reused as it is; None when its files are
    exactly the ones recorded when it was cached."""
    if not path.exists():
        return "it is missing"
    record = _record(path)
    try:
        recorded = yaml.safe_load(record.read_text())
    except FileNotFoundError:
        return "no content hashes were recorded for it (cached by an older yggdrasil, or interrupted)"
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        recorded = None
    if not isinstance(recorded, dict):
        return f"its hash record {record.name} is damaged"
    found = _digests(path)
    for name in sorted(set(recorded) | set(found)):
        if name not in found:
            return f"{name} is missing"
        if name not in recorded:
            return f"{name} was not there when it was cached"
        if found[name] != recorded[name]:
            return f"{name} differs from what was cached (size or sha256)"
    return None


def drop(path: Path) -> None:
    """Remove a cached piece with its key and hash record, so it is rebuilt."""
    for entry in (_key(path), _record(path)):
        entry.unlink(missing_ok=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def reusable(path: Path, key: str, what: str, log: Callable[[str], None]) -> bool:
    """Whether the piece at `path` was cached under this key and is undamaged; a damaged one is
    dropped (and the log says so)."""
    key_file = _key(path)
    if not (key_file.is_file() and key_file.read_text() == key):
        return False
    why = damage(path)
    if why is None:
        return True
    log(f"cached {what} {path.name} is damaged ({why}); rebuilding it")
    drop(path)
    return False


def check_calibration(directory: Path, log: Callable[[str], None]) -> None:
    """Before calibrate reuses a finished calibration (one with its key), check its hashes;
    a damaged one is dropped, so it is calibrated again. An unfinished one is left alone."""
    if not _key(directory).is_file():
        return
    why = damage(directory)
    if why is not None:
        log(f"cached calibration is damaged ({why}); calibrating again")
        drop(directory)
