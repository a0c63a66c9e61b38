"""Build and load the kernels' C++ library, once per source version.

The library is compiled on first use with torch.utils.cpp_extension (-O3, no -march: each kernel
file names its own ISA and the op picks one at run time, so one build runs on any x86-64 CPU) into
user_dirs.cache_dir() / "kernels" / <hash of the sources, flags, torch and Python versions>. A later
process finds the .so there and loads it with torch.ops.load_library without compiling. Importing
yggdrasil.kernels builds nothing; `pip install -e .` stays pure Python.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from yggdrasil.user_dirs import cache_dir
from yggdrasil.errors import YggdrasilError

NAME = "yggdrasil_kernels"
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("q4_linear.cpp", "kernel_scalar.cpp", "kernel_avx2.cpp", "kernel_avxvnni.cpp", "kernel_avx512.cpp",
           "invariant_ops.cpp", "float_scalar.cpp", "float_avx2.cpp", "float_avx512.cpp")
HEADERS = ("q4_common.h", "kernel_ymm.h", "float_common.h", "attention_driver.h")
# -ffp-contract=off: no fused multiply-adds, so every path rounds like the plain-PyTorch reference.
# -fopenmp: at::parallel_for is inline OpenMP; without it the op runs on one thread (it links the
# libgomp.so.1 torch has already loaded, so there is one thread pool)
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
# the soname is what an AOTInductor model .so records as its dependency: a process that loaded this
# library first satisfies it without a search path
LDFLAGS = (f"-Wl,-soname,{NAME}.so", "-fopenmp")

_lock = threading.Lock()
_loaded: Path | None = None


class KernelBuildError(YggdrasilError):
    """The C++ kernels cannot be built or loaded here (no compiler, failed build): callers fall back
    to ATen's int4/int8 kernels."""


@functools.cache
def source_hash() -> str:
    """Of the sources as first read in this process (they do not change under a running op)."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    digest.update(repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2])).encode())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    """Where this source version's library is (or will be) built; does not build."""
    return cache_dir() / "kernels" / source_hash() / f"{NAME}.so"


def is_loaded() -> bool:
    return _loaded is not None


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _build(path: Path) -> None:
    """Compile into path.parent/build, then move the .so to path (a reader never sees half a file)."""
    if shutil.which(_compiler()) is None:
        raise KernelBuildError(f"cannot build the yggdrasil CPU kernels: no C++ compiler ({_compiler()!r}) on PATH "
                               "(install g++ or set CXX)")
    from torch.utils import cpp_extension  # pulls in the compiler machinery: only when building

    build_dir = path.parent / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"yggdrasil: building the CPU kernels once (~30 s) into {path.parent} ...", end=" ", file=sys.stderr,
          flush=True)
    try:
        built = cpp_extension.load(
            name=NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS), extra_include_paths=[str(CSRC)], build_directory=str(build_dir),
            is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # compiler errors, missing ninja
        print("failed", file=sys.stderr)
        raise KernelBuildError(f"building the yggdrasil CPU kernels failed: {_first_error(str(exc))}") from exc
    os.replace(built, path)
    print(f"done in {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)


def _first_error(text: str) -> str:
    """The compiler's first error line (the build log is long), else the message's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower() and "Error building" not in line),
                lines[-1] if lines else "unknown error")


def load(path: Path | None = None) -> Path:
    """Make torch.ops.yggdrasil.* available in this process and return the library's path.
    path: a built library to load (a bundle's copy: no compiler needed); default this source
    version's in the user cache, built there first if missing. The first library loaded stays
    for the life of the process (a second one would register the ops twice). Idempotent and
    thread-safe."""
    global _loaded
    with _lock:
        if _loaded is None:
            library = Path(path) if path is not None else library_path()
            if library.is_file():
                try:
                    torch.ops.load_library(str(library))
                except OSError as exc:
                    hint = "rebuild the bundle" if path is not None else f"delete {library.parent} to rebuild"
                    raise KernelBuildError(f"cannot load {library} ({exc}); {hint}") from exc
            elif path is not None:
                raise KernelBuildError(f"the kernel library {library} is missing; rebuild the bundle")
            else:
                _build(library)  # cpp_extension.load also loaded it
            from . import ops  # ops imports this module: a module-level import would be circular

            ops.register_fakes()
            _loaded = library
        return _loaded
