"""Build and load the kernels' C++ library, once per source version.

The library is compiled on first use with torch.utils.cpp_extension (-O3, no -march: each kernel
file names its own ISA and the op picks one at run time, so one build runs on any CPU of its
architecture) into user_dirs.cache_dir() / "kernels" / <hash of the sources, flags, architecture,
torch and Python versions>. A later process finds the .so there and loads it with
torch.ops.load_library without compiling. Importing yggdrasil.kernels builds nothing; `pip
install -e .` stays pure Python.

What the build needs is checked first, in one line (toolchain.py: a C++17 compiler, ninja, GCC
>= 11 or clang >= 12 for the x86 files). The portable files build everywhere, the x86 ISA files
only on x86, and an ISA file this compiler cannot take is left out with its path (toolchain.py),
so one failing file never loses q4 on the machine.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from yggdrasil.user_dirs import cache_dir
from yggdrasil.errors import YggdrasilError

from . import toolchain
from .toolchain import CORE_SOURCES, CSRC, X86_SOURCES

NAME = "yggdrasil_kernels"
SOURCES = CORE_SOURCES + tuple(X86_SOURCES)
HEADERS = ("q4_common.h", "kernel_ymm.h", "float_common.h", "attention_driver.h", "simd_rows.h")
# -ffp-contract=off: no fused multiply-adds, so every path rounds like the plain-PyTorch reference.
# -fopenmp: at::parallel_for is inline OpenMP; without it the op runs on one thread (it links the
# libgomp.so.1 torch has already loaded, so there is one thread pool)
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
# the soname is what an AOTInductor model .so records as its dependency: a process that loaded this
# library first satisfies it without a search path
LDFLAGS = (f"-Wl,-soname,{NAME}.so", "-fopenmp")

# A cache of what this process has loaded: torch.ops.load_library registers the ops process-wide
# and a second library would register them twice, so the first one loaded is the one for good.
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
    digest.update(repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2], platform.machine())).encode())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    """Where this source version's library is (or will be) built; does not build."""
    return cache_dir() / "kernels" / source_hash() / f"{NAME}.so"


def is_loaded() -> bool:
    return _loaded is not None


def build_library(directory: Path, x86: bool | None = None, log=None) -> Path:
    """Compile the library into directory/NAME.so (built in directory/build, moved there whole, so
    a reader never sees half a file) and load it into this process. x86: build the x86 ISA files
    (default: on an x86 machine); False builds the portable core alone, as a non-x86 machine does.
    Raises KernelBuildError with one line when the toolchain lacks something or the core fails."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    x86 = toolchain.is_x86() if x86 is None else x86
    try:
        toolchain.check_toolchain(x86)
    except toolchain.ToolchainError as exc:
        raise KernelBuildError(str(exc)) from None
    from torch.utils import cpp_extension  # pulls in the compiler machinery: only when building

    optional = toolchain.usable_x86_sources(CFLAGS, log) if x86 else []
    build_dir = Path(directory) / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log(f"yggdrasil: building the CPU kernels once (~30 s) into {directory} ...")
    for attempt in range(2):  # a file the quick probe passed may still fail optimised: once more without it
        defines = tuple(f"-D{X86_SOURCES[name]}=1" for name in optional)
        try:
            built = cpp_extension.load(
                name=NAME, sources=[str(CSRC / s) for s in CORE_SOURCES + tuple(optional)],
                extra_cflags=list(CFLAGS + defines), extra_ldflags=list(LDFLAGS), extra_include_paths=[str(CSRC)],
                build_directory=str(build_dir), is_python_module=False, verbose=False)
            break
        except (RuntimeError, OSError, ImportError) as exc:  # compiler errors
            failed = [name for name in toolchain.failed_sources(str(exc)) if name in optional]
            if attempt or not failed or any(name not in X86_SOURCES for name in toolchain.failed_sources(str(exc))):
                raise KernelBuildError(f"building the yggdrasil CPU kernels failed: "
                                       f"{toolchain.first_error(str(exc))}") from exc
            for name in failed:
                log(f"yggdrasil: {name} failed to build ({toolchain.first_error(str(exc))[:200]}); building "
                    f"without {toolchain.PATH_OF[name]}")
            optional = [name for name in optional if name not in failed]
    path = Path(directory) / f"{NAME}.so"
    os.replace(built, path)
    log(f"yggdrasil: built the CPU kernels in {time.perf_counter() - start:.0f}s "
        f"({', '.join(CORE_SOURCES + tuple(optional))})")
    return path


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
                build_library(library.parent)  # cpp_extension.load also loaded it
            from . import ops  # ops imports this module: a module-level import would be circular

            ops.register_fakes()
            _loaded = library
        return _loaded
