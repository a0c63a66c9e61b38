"""Why AOTInductor packages do not load here, in seconds (issue 49).

Both GPU sessions so far (torch 2.11.0+cu130, H100 and H200; bench/results/gpu-session-*-2026-11-26)
died in the AOTInductor package loader's constructor, torch's own one-Linear package included.
This diagnoses that crash on the probe package `steps: auto` builds anyway (a one-Linear package,
compile/loader_check.aoti_probe, kept per machine and torch build), so beyond that probe it costs
two child processes:

  ldd, readelf  the package library's NEEDED libraries, its RUNPATH/RPATH, and what ldd resolves
                each to (a CUDA toolkit's stub libcuda found before the driver's would crash)
  load          the package opened as a bundle opens it, with LD_DEBUG=libs: the libcuda the
                process maps (/proc/self/maps, printed before the loader is called), the loader's
                search lines that name libcuda or the package, and how it ended
  preload       the same with the driver's own libcuda.so.1 (ldconfig's, never a stub) in
                LD_PRELOAD: whether that changes the outcome

    python3 -m yggdrasil.bench.gpu_probe --out DIR [--device cuda]   # writes DIR/probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import yggdrasil
from yggdrasil.compile.loader_check import LOAD_TIMEOUT_S, aoti_probe

TOOL_TIMEOUT_S = 10
KEEP_LINES = 40  # of LD_DEBUG's output: the last lines that name libcuda or the package


def _tool(command: list[str]) -> list[str]:
    """A system tool's output lines (or why there are none)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except FileNotFoundError:
        return [f"{command[0]} is not installed"]
    except subprocess.TimeoutExpired:
        return [f"{command[0]} did not finish in {TOOL_TIMEOUT_S} s"]
    return (done.stdout + done.stderr).splitlines()


def package_library(package: Path, into: Path) -> Path | None:
    """The package's compiled library, extracted (a .pt2 is a zip archive)."""
    with zipfile.ZipFile(package) as archive:
        names = [n for n in archive.namelist() if n.endswith(".so")]
        if not names:
            return None
        into.mkdir(parents=True, exist_ok=True)
        target = into / Path(names[0]).name
        target.write_bytes(archive.read(names[0]))
        return target


def driver_libcuda() -> str | None:
    """The driver's libcuda.so.1 as the dynamic linker's cache lists it (never a toolkit stub)."""
    for line in _tool(["ldconfig", "-p"]):
        if "libcuda.so.1" in line and "=>" in line and "stubs" not in line:
            return line.split("=>", 1)[1].strip()
    return None


def load_child(package: Path, device: str, library: str, extra_env: dict) -> dict:
    """Open the package in a child (compile/loader_check's `load`); its outcome and what it said."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "YGGDRASIL_PRINT_MAPS": "1", **extra_env}
    root = Path(yggdrasil.__file__).resolve().parent.parent
    command = [sys.executable, "-m", "yggdrasil.compile.loader_check", "load", str(package), device]
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return {"outcome": f"did not finish in {LOAD_TIMEOUT_S:.0f} s"}
    status = done.returncode
    outcome = ("loaded" if status == 0 else
               f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit {status}")
    mapped = [line.removeprefix("mapped: ") for line in done.stdout.splitlines() if line.startswith("mapped: ")]
    wanted = [line.strip() for line in done.stderr.splitlines() if "libcuda" in line or library in line]
    errors = [line for line in done.stderr.splitlines() if "Fatal Python error" in line or "Error" in line]
    return {"outcome": outcome, "libcuda_mapped": mapped[0] if mapped else None,
            "ld_debug": wanted[-KEEP_LINES:], "errors": errors[-10:]}


def diagnose(out: Path, device: str) -> dict:
    verdict = aoti_probe(device, log=print)
    package = Path(verdict.package)
    report = {"device": device, "loads": verdict.loads, "failure": verdict.failure,
              "probe_seconds": verdict.seconds, "probe_cached": verdict.cached, "package": str(package)}
    library = package_library(package, out / "probe-library") if package.is_file() else None
    if library is None:
        return {**report, "diagnosis": "the probe package was not built; nothing to inspect"}
    report["ldd"] = _tool(["ldd", str(library)])
    report["readelf"] = [line.strip() for line in _tool(["readelf", "-d", str(library)])
                         if any(tag in line for tag in ("NEEDED", "RUNPATH", "RPATH"))]
    report["load"] = load_child(package, device, library.name, {"LD_DEBUG": "libs"})
    libcuda = driver_libcuda()
    report["driver_libcuda"] = libcuda
    report["preload"] = (load_child(package, device, library.name, {"LD_PRELOAD": libcuda}) if libcuda else
                         {"outcome": "not tried: the linker cache lists no driver libcuda.so.1 (no NVIDIA driver)"})
    if libcuda and report["load"]["outcome"] != "loaded":
        changed = report["preload"]["outcome"] == "loaded"
        report["diagnosis"] = ("preloading the driver's libcuda.so.1 makes it load: the package resolved another "
                               "libcuda (see ldd and ld_debug)" if changed else
                               "preloading the driver's libcuda.so.1 does not change the outcome: the crash is not "
                               "which libcuda the package finds")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = diagnose(args.out, args.device)
    (args.out / "probe.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report.get(k) for k in ("loads", "failure", "diagnosis")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
