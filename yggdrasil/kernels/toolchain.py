"""What building the kernels needs, checked before anything compiles, and which source files
this machine's compiler takes.

The build needs a C++17 compiler and ninja (torch.utils.cpp_extension drives the build with it;
`pip install ninja` provides one). On x86 the ISA files need GCC >= 11 or clang >= 12 (the
AVX-VNNI intrinsics and target pragmas); anywhere else only the portable files are built, and any
C++17 compiler will do. A missing or too old piece is one line that says what to install.

The files are of two kinds: the portable core (the op glue, the scalar kernels), built
everywhere, and the x86 ISA files, built only on x86. Each ISA file is tried on its own first
(`probe`: a quick unoptimised compile of that file alone, which needs no torch headers): one this
compiler or assembler cannot take is left out with a line naming it, and the library is built
without that path, rather than losing q4 on this machine altogether.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from yggdrasil.errors import YggdrasilError

CSRC = Path(__file__).parent / "csrc"
CORE_SOURCES = ("q4_linear.cpp", "kernel_scalar.cpp", "invariant_ops.cpp", "float_scalar.cpp")
# x86 only; each defines, when built, the macro that tells the glue (q4_linear.cpp,
# invariant_ops.cpp) its path exists
X86_SOURCES = {"kernel_avx2.cpp": "YGG_HAS_AVX2", "kernel_avxvnni.cpp": "YGG_HAS_AVXVNNI",
               "kernel_avx512.cpp": "YGG_HAS_AVX512VNNI", "float_avx2.cpp": "YGG_HAS_FLOAT_AVX2",
               "float_avx512.cpp": "YGG_HAS_FLOAT_AVX512"}
PATH_OF = {"kernel_avx2.cpp": "the avx2 q4 path", "kernel_avxvnni.cpp": "the avxvnni q4 path",
           "kernel_avx512.cpp": "the avx512vnni q4 path", "float_avx2.cpp": "the avx2 float ops (scalar ones instead)",
           "float_avx512.cpp": "the avx512 float ops (avx2 or scalar ones instead)"}
MIN_GCC, MIN_CLANG = 11, 12
NEEDS = (f"a C++17 compiler (GCC >= {MIN_GCC} or clang >= {MIN_CLANG} on x86) and ninja "
         "(`pip install ninja`)")


class ToolchainError(YggdrasilError):
    """This machine cannot build the kernels: what is missing, in one line."""


@dataclass(frozen=True)
class Compiler:
    command: str
    family: str  # gcc or clang
    major: int

    def describe(self) -> str:
        return f"{self.command} ({self.family} {self.major})"


def compiler_command() -> str:
    return os.environ.get("CXX", "c++")


def is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def identify(command: str) -> Compiler | None:
    """The compiler's family and major version from its predefined macros (None: unknown)."""
    try:
        done = subprocess.run([command, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    macros = dict(re.findall(r"#define (__clang_major__|__GNUC__) (\d+)", done.stdout))
    if "__clang_major__" in macros:
        return Compiler(command, "clang", int(macros["__clang_major__"]))
    if "__GNUC__" in macros:
        return Compiler(command, "gcc", int(macros["__GNUC__"]))
    return None


def check_toolchain(x86: bool) -> Compiler | None:
    """Raise ToolchainError (one line) unless the kernels can be built here; the compiler found
    (None: one whose family this cannot tell, which is then simply tried)."""
    command = compiler_command()
    if shutil.which(command) is None:
        raise ToolchainError(f"cannot build the yggdrasil CPU kernels: no C++ compiler ({command!r}) on PATH; "
                             f"they need {NEEDS}: install g++ (or set CXX)")
    if shutil.which("ninja") is None:
        raise ToolchainError(f"cannot build the yggdrasil CPU kernels: ninja is not on PATH; they need {NEEDS}: "
                             "`pip install ninja`")
    compiler = identify(command)
    if compiler is not None and x86:
        floor = MIN_GCC if compiler.family == "gcc" else MIN_CLANG
        if compiler.major < floor:
            raise ToolchainError(f"cannot build the yggdrasil CPU kernels with {compiler.describe()}: the x86 "
                                 f"kernels need {compiler.family} >= {floor}; install a newer compiler and set "
                                 "CXX to it")
    return compiler


def probe(name: str, flags: tuple[str, ...]) -> str | None:
    """None when this one source file compiles and assembles here (unoptimised: a quick check of
    the compiler and assembler, not of the optimiser), else its first error line."""
    with tempfile.TemporaryDirectory(prefix="yggdrasil-probe-") as scratch:
        # -O0 after the build's flags: the last -O wins, and an optimised probe took as long as the build
        command = [compiler_command(), "-std=c++17", *flags, "-O0", "-I", str(CSRC), "-c", str(CSRC / name),
                   "-o", str(Path(scratch) / "probe.o")]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc)
    return None if done.returncode == 0 else first_error(done.stderr)


def first_error(text: str) -> str:
    """The compiler's first error line (a build log is long), else the text's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower() and "Error building" not in line),
                lines[-1] if lines else "unknown error")


def usable_x86_sources(flags: tuple[str, ...], log) -> list[str]:
    """The x86 files this compiler takes, each tried on its own (in parallel); one it cannot take
    is named with what it leaves out."""
    names = list(X86_SOURCES)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        errors = dict(zip(names, pool.map(lambda n: probe(n, flags), names)))
    for name, error in errors.items():
        if error is not None:
            log(f"yggdrasil: {name} does not compile here ({error[:200]}); building without {PATH_OF[name]}")
    return [name for name in names if errors[name] is None]


def failed_sources(build_log: str) -> list[str]:
    """The source files ninja's log says failed to compile ("FAILED: ... name.o")."""
    stems = re.findall(r"FAILED:[^\n]*?([\w-]+)\.o\b", build_log)
    return [f"{stem}.cpp" for stem in dict.fromkeys(stems)]
