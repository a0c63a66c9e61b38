"""Writing a graph bundle (docs/design.md §4, issues 5 and 24); reading and checking one is
yggdrasil/storage/manifest.py's, the runtime's side.

Bundles are written into a temporary sibling directory and renamed into place only once complete,
so a crash never leaves something that looks like a valid bundle. Only a bundle is ever replaced
(swapped out in one step, removed once the new one is in place); any other file or directory at
the path is refused, never deleted (issue 24).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from pathlib import Path

import yaml

from yggdrasil.errors import YggdrasilError
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.manifest import Manifest, file_digest


class OccupiedError(YggdrasilError):
    """The bundle path holds something that is not a bundle: compile never replaces it."""


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
