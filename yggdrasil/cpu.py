"""This machine's CPU as a bundle records it, and what a bundle's graphs need of a CPU.

A bundle is compiled on one box and may be copied to others. Its AOTInductor graphs hold
machine code for the vector ISA Inductor compiled them for (with -march=native: anything the
compiling CPU has), so the manifest records a fingerprint of the compiling CPU (`CpuFingerprint`)
and the ISA the graphs were compiled for with the CPU features that ISA may use (`GraphIsa`).
Opening a bundle compares them with this CPU: a missing feature is refused before any graph
library is opened (it would die on an illegal instruction), another CPU that has every feature
only makes the measured step times foreign.

Features are named as /proc/cpuinfo's flags name them. No torch here: `inspect` reads this too.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

# the ISA features that decide which code runs, and every other extension GCC may emit under
# -march=native (so a native bundle needs all of them that the compiling CPU had)
FEATURES = ("ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm",
            "movbe", "adx", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512ifma",
            "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq", "avx512_vnni", "avx512_bf16",
            "avx512_fp16", "avx512_vp2intersect", "avx_vnni", "gfni", "vaes", "vpclmulqdq",
            "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
# the x86-64 micro-architecture levels a portable bundle is compiled for (abm: LZCNT)
X86_64_V3 = ("ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe")
X86_64_V4 = X86_64_V3 + ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")
NATIVE = "native"
# --isa: (gcc -march, Inductor's vector width in bits, the features the graphs may then use)
PORTABLE = {"avx512": ("x86-64-v4", 512, X86_64_V4), "avx2": ("x86-64-v3", 256, X86_64_V3)}
ISAS = (NATIVE, *PORTABLE)
X86 = ("x86_64", "AMD64")


def ordered(features) -> tuple[str, ...]:
    """Features in FEATURES order (the ones FEATURES does not know last, sorted)."""
    features = set(features)
    return tuple(f for f in FEATURES if f in features) + tuple(sorted(features - set(FEATURES)))


@dataclass(frozen=True)
class CpuFingerprint:
    """What a bundle records of a CPU. features: which of FEATURES it has (None: unknown, no
    /proc/cpuinfo); threads: torch's CPU threads when it was measured (0: not known)."""

    machine: str
    vendor: str
    model_name: str
    family: int | None
    model: int | None
    stepping: int | None
    features: tuple[str, ...] | None
    physical_cores: int
    threads: int = 0

    def same_cpu(self, other: "CpuFingerprint") -> bool:
        """The same kind of CPU with as many cores (the thread count aside)."""
        return self.identity() == other.identity()

    def identity(self) -> tuple:
        return (self.machine, self.vendor, self.model_name, self.family, self.model, self.stepping,
                self.features, self.physical_cores)

    def lacks(self, features) -> tuple[str, ...]:
        """Which of these features this CPU does not have (none when its features are unknown)."""
        return () if self.features is None else ordered(set(features) - set(self.features))

    def portable_isa(self) -> str | None:
        """The widest portable --isa this CPU runs (None: not even avx2)."""
        if self.machine not in X86:
            return None
        return next((isa for isa, (_, _, needs) in PORTABLE.items() if not self.lacks(needs)), None)

    def summary(self) -> str:
        """'AMD EPYC (AuthenticAMD family 26 model 2 stepping 1, 2 cores)'"""
        ids = " ".join(f"{k} {v}" for k, v in (("family", self.family), ("model", self.model),
                                               ("stepping", self.stepping)) if v is not None)
        return f"{self.model_name} ({' '.join(p for p in (self.vendor, ids) if p)}, {self.physical_cores} cores)"

    def as_dict(self) -> dict:
        return {"machine": self.machine, "vendor": self.vendor, "model_name": self.model_name,
                "family": self.family, "model": self.model, "stepping": self.stepping,
                "features": None if self.features is None else list(self.features),
                "physical_cores": self.physical_cores, "threads": self.threads}

    @classmethod
    def from_dict(cls, raw: dict) -> "CpuFingerprint":
        features = raw.get("features")
        return cls(str(raw["machine"]), str(raw.get("vendor", "")), str(raw["model_name"]), raw.get("family"),
                   raw.get("model"), raw.get("stepping"), None if features is None else tuple(features),
                   int(raw["physical_cores"]), int(raw.get("threads", 0)))


@dataclass(frozen=True)
class GraphIsa:
    """What a bundle's graphs were compiled for: the --isa target, gcc's -march, Inductor's vector
    ISA, the CPU features that code may use (what a CPU must have to run it), the compiling
    CPU, and the paths our kernel library (q4) dispatches to at run time on it (it is built
    without -march, so it adds no requirement)."""

    target: str  # native, avx512, avx2
    march: str
    vec_isa: str
    requires: tuple[str, ...]
    compiled_on: str
    kernel_paths: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.target} (-march={self.march}, Inductor vector ISA {self.vec_isa or 'none'})"

    def as_dict(self) -> dict:
        body = {"target": self.target, "march": self.march, "vec_isa": self.vec_isa,
                "requires": list(self.requires), "compiled_on": self.compiled_on}
        return {**body, "kernel_paths": list(self.kernel_paths)} if self.kernel_paths else body

    @classmethod
    def from_dict(cls, raw: dict) -> "GraphIsa":
        return cls(str(raw["target"]), str(raw["march"]), str(raw.get("vec_isa", "")),
                   tuple(raw.get("requires") or ()), str(raw.get("compiled_on", "")),
                   tuple(raw.get("kernel_paths") or ()))

    def merge(self, other: "GraphIsa") -> "GraphIsa":
        """One record for graphs compiled for two targets (a --reprofile that compiled a graph
        here for a bundle compiled elsewhere): a CPU must have what either needs."""
        if other == self:
            return self

        def both(a: str, b: str) -> str:
            return a if a == b else f"{a}+{b}"

        return GraphIsa(both(self.target, other.target), both(self.march, other.march),
                        both(self.vec_isa, other.vec_isa), ordered({*self.requires, *other.requires}),
                        both(self.compiled_on, other.compiled_on), self.kernel_paths or other.kernel_paths)


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    """/proc/cpuinfo as one {field: value} per logical CPU."""
    blocks, block = [], {}
    for line in text.splitlines():
        if not line.strip():
            if block:
                blocks.append(block)
            block = {}
            continue
        key, _, value = line.partition(":")
        block[key.strip()] = value.strip()
    if block:
        blocks.append(block)
    return blocks


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def fingerprint_from_cpuinfo(text: str, machine: str, threads: int = 0) -> CpuFingerprint:
    """The fingerprint a /proc/cpuinfo text describes (tests give one of another CPU)."""
    blocks = _cpuinfo_blocks(text)
    first = blocks[0] if blocks else {}
    flags = first.get("flags")
    cores = {(b.get("physical id"), b.get("core id")) for b in blocks if "core id" in b}
    return CpuFingerprint(machine, first.get("vendor_id", ""), first.get("model name") or platform.processor()
                          or "cpu", _int(first.get("cpu family")), _int(first.get("model")), _int(first.get("stepping")),
                          None if flags is None else ordered(set(flags.split()) & set(FEATURES)),
                          len(cores) or len(blocks) or os.cpu_count() or 1, threads)


def cpu_fingerprint(threads: int = 0) -> CpuFingerprint:
    """This machine's CPU (threads: torch's thread count, which the caller knows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the model only, features unknown
        text = ""
    return fingerprint_from_cpuinfo(text, platform.machine(), threads)
