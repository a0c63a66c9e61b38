"""What runs a bundle's buckets (recipe `steps`): its AOTInductor packages, or the models' eager steps.

A torch build can compile AOTInductor packages it cannot load: on the lent GPU image (torch
2.11.0+cu130, H100 and H200) the package loader's constructor dies with SIGSEGV on every CUDA
package, torch's own one-Linear package included (bench/results/gpu-session-h200-2026-11-26).
A crash cannot be caught in the process that has it, so with `steps: auto` on CUDA, compile
opens the first package it compiles in a child process. Where that child does not come back
cleanly, the bundle is marked `steps: eager`: no packages are compiled or shipped, and at load
each bucket's step runs the model's own forward, captured as a CUDA graph like a package's would
be (graphs/registry.EagerStep, graphs/cuda_graphs.capture). On a CPU, auto means aoti: torch's
CPU packages load (every CPU test opens them) and run far faster than eager steps.

    python -m yggdrasil.compile.loader_check PACKAGE DEVICE   # the child: exit 0 if it opens
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

import yggdrasil
from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.graphs.registry import open_loader

from .compile_graphs import compile_graphs
from .context import BuildContext

LOAD_TIMEOUT_S = 180.0  # a child that imports torch, initialises CUDA and opens one package


def decide_steps(ctx: BuildContext, keys: list[GraphKey]) -> BuildContext:
    """ctx with the steps the bundle runs: the recipe's, or for auto, what works here."""
    recipe = ctx.recipe
    if recipe.steps != "auto":
        steps = recipe.steps
    elif not recipe.device.startswith("cuda") or not keys:
        steps = "aoti"
    else:
        first = next((k for k in keys if k.stage != SERVE_STAGE), keys[0])
        try:
            compile_graphs(replace(ctx, steps="aoti"), [first])  # kept in the work cache for the rest
            failure = package_load_failure(ctx.work.graph(first), recipe.device)
        except Exception as exc:  # noqa: BLE001 - any failure to make a package rules packages out
            failure = f"compiling {first.name} failed ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
        steps = "aoti" if failure is None else "eager"
        if failure is not None:
            ctx.log(f"this torch ({torch.__version__}) cannot load the AOTInductor packages it compiles on "
                    f"{recipe.device}: {failure}. The bundle runs the models' eager steps instead, captured as "
                    "CUDA graphs at load (recipe `steps: eager` skips this check; `steps: aoti` insists)")
    return replace(ctx, steps=steps)


def package_load_failure(package: Path, device: str, timeout_s: float = LOAD_TIMEOUT_S) -> str | None:
    """None if a fresh process opens the package on device; otherwise what went wrong."""
    command = [sys.executable, "-m", "yggdrasil.compile.loader_check", str(package), device]
    root = Path(yggdrasil.__file__).resolve().parent.parent  # a plain checkout runs from here too
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    except subprocess.TimeoutExpired:
        return f"opening {package.name} in a child process did not finish in {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"opening {package.name} killed the process ({signal.Signals(-done.returncode).name})"
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"opening {package.name} failed (exit {done.returncode}: {last})"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m yggdrasil.compile.loader_check PACKAGE DEVICE", file=sys.stderr)
        return 2
    device = torch.device(argv[1])
    torch.zeros(1, device=device)  # the device initialised, as it is when a bundle opens
    open_loader(Path(argv[0]), device)
    print("loaded", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
