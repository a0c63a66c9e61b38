"""What runs a bundle's buckets (recipe `steps`): AOTInductor packages, Inductor's saved steps, or
the models' eager steps.

A torch build can compile AOTInductor packages it cannot load: on the lent GPU image (torch
2.11.0+cu130, H100 and H200) the package loader's constructor dies with SIGSEGV on every CUDA
package, torch's own one-Linear package included (bench/results/gpu-session-h200-2026-11-26).
A crash cannot be caught in the process that has it, so with `steps: auto` on CUDA, compile asks
a probe: a one-Linear AOTInductor package built in one child process and opened in another, each
with a short timeout. Where it opens, the bundle runs packages (aoti); where it does not, the
bundle runs Inductor's saved steps (inductor: yggdrasil/storage/inductor_steps.py), captured as CUDA graphs
at load like packages. The verdict is kept per machine and torch build (the user cache dir), so
later compiles ask nothing, and the package stays there for `yggdrasil bench gpu-probe`'s
diagnosis. On a CPU, auto means aoti: torch's CPU packages load (every CPU test opens them) and
their graphs attend over just the used context.

    python -m yggdrasil.compile.loader_check build PACKAGE DEVICE  # a child: compile the probe package
    python -m yggdrasil.compile.loader_check load PACKAGE DEVICE   # a child: exit 0 if it opens and runs
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import yggdrasil
from yggdrasil.storage.registry import open_loader
from yggdrasil.user_dirs import cache_dir

from .context import BuildContext
from yggdrasil.graphs.isa import NATIVE, IsaError

BUILD_TIMEOUT_S = 240.0  # a child that imports torch and Inductor and compiles a one-Linear package
LOAD_TIMEOUT_S = 90.0  # a child that imports torch, initialises the device and opens one package
PROBE_SHAPE = (64, 32)  # the probe Linear's in and out features


@dataclass(frozen=True)
class ProbeVerdict:
    """Whether this machine's torch opens the AOTInductor packages it compiles on `device`;
    failure: what went wrong (None when they open); package: the probe package, kept."""

    device: str
    loads: bool
    failure: str | None
    package: str
    seconds: float = 0.0
    cached: bool = False


def decide_steps(ctx: BuildContext) -> BuildContext:
    """ctx with the steps the bundle runs: the recipe's, or for auto, what works here."""
    recipe = ctx.recipe
    steps = recipe.steps
    if steps == "auto":
        steps = "aoti"
        if recipe.device.startswith("cuda"):
            verdict = aoti_probe(recipe.device, ctx.log)
            if not verdict.loads:
                steps = "inductor"
                ctx.log(f"this torch ({torch.__version__}) cannot load the AOTInductor packages it compiles on "
                        f"{recipe.device} ({verdict.failure}{'; found earlier' if verdict.cached else ''}). The "
                        "bundle runs Inductor's saved steps instead, captured as CUDA graphs at load (recipe "
                        "`steps: inductor` skips this check, `steps: aoti` insists)")
    if steps == "inductor" and not recipe.device.startswith("cuda") and recipe.isa != NATIVE:
        raise IsaError(f"steps: inductor compiles for this CPU only; --isa {recipe.isa} needs steps: aoti")
    return replace(ctx, steps=steps)


def probe_key(device: str) -> str:
    """What the verdict depends on: this torch build, its CUDA, the device and its driver."""
    parts = [torch.__version__, str(torch.version.cuda), sys.version.split()[0], device]
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        parts += [props.name, f"{props.major}.{props.minor}", str(torch._C._cuda_getDriverVersion())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def probe_dir(device: str) -> Path:
    return cache_dir() / "aoti-probe" / probe_key(device)


def aoti_probe(device: str, log=print, directory: Path | None = None) -> ProbeVerdict:
    """The verdict for `device`, from the cache or measured now (a build, then a load, each in a
    child process). A timed-out build is not cached: a busy machine is not a broken torch."""
    directory = directory or probe_dir(device)
    record = directory / "verdict.json"
    if record.is_file():
        return replace(ProbeVerdict(**json.loads(record.read_text())), cached=True)
    directory.mkdir(parents=True, exist_ok=True)
    package = directory / "linear.pt2"
    log(f"checking whether this torch loads the AOTInductor packages it compiles on {device} "
        f"(once per machine and torch build; at most {BUILD_TIMEOUT_S + LOAD_TIMEOUT_S:.0f} s)")
    started = time.perf_counter()
    failure = child_failure(["build", str(package), device], BUILD_TIMEOUT_S, "compiling the probe package")
    timed_out = failure is not None and "did not finish" in failure
    if failure is None:
        failure = child_failure(["load", str(package), device], LOAD_TIMEOUT_S, f"opening {package.name}")
    verdict = ProbeVerdict(device, failure is None, failure, str(package), round(time.perf_counter() - started, 1))
    if not timed_out:
        record.write_text(json.dumps({k: v for k, v in verdict.__dict__.items() if k != "cached"}))
    return verdict


def child_failure(args: list[str], timeout_s: float, what: str, env: dict | None = None) -> str | None:
    """None if `python -m yggdrasil.compile.loader_check ARGS` exits 0; otherwise what went wrong."""
    command = [sys.executable, "-m", "yggdrasil.compile.loader_check", *args]
    root = Path(yggdrasil.__file__).resolve().parent.parent  # a plain checkout runs from here too
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
    except subprocess.TimeoutExpired:
        return f"{what} in a child process did not finish in {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"{what} killed the process ({signal.Signals(-done.returncode).name})"
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"{what} failed (exit {done.returncode}: {last[:300]})"


def package_load_failure(package: Path, device: str, timeout_s: float = LOAD_TIMEOUT_S) -> str | None:
    """None if a fresh process opens the package on device and runs it; otherwise what went wrong."""
    return child_failure(["load", str(package), device], timeout_s, f"opening {package.name}")


def build_probe(package: Path, device: str) -> None:
    """The probe package: one Linear, exported and AOTInductor-compiled on device."""
    linear = torch.nn.Linear(*PROBE_SHAPE, device=device)
    with torch.no_grad():
        exported = torch.export.export(linear, (torch.randn(4, PROBE_SHAPE[0], device=device),))
    package.parent.mkdir(parents=True, exist_ok=True)
    torch._inductor.aoti_compile_and_package(exported, package_path=str(package))


def load_probe(package: Path, device: str) -> None:
    """Open a package the way a bundle does and run it once (probe packages only take one input)."""
    dev = torch.device(device)
    torch.zeros(1, device=dev)  # the device initialised, as it is when a bundle opens
    if os.environ.get("YGGDRASIL_PRINT_MAPS"):  # the diagnosis: which libcuda this process maps
        with open("/proc/self/maps") as maps:
            mapped = sorted({line.split()[-1] for line in maps if "libcuda" in line})
        print("mapped: " + (" ".join(mapped) or "no libcuda"), flush=True)
    loader = open_loader(package, dev)
    if package.name == "linear.pt2":
        out = loader.run([torch.randn(4, PROBE_SHAPE[0], device=dev)])
        assert out[0].shape == (4, PROBE_SHAPE[1]), out[0].shape
    print("loaded", flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("build", "load"):
        print("usage: python -m yggdrasil.compile.loader_check build|load PACKAGE DEVICE", file=sys.stderr)
        return 2
    (build_probe if argv[0] == "build" else load_probe)(Path(argv[1]), argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
