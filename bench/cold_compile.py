"""A cold compile of a recipe, phase by phase (issue 37): what a person waits for the first time.

    python -m yggdrasil.bench.cold_compile RECIPE [--threads N] [--out FILE] [--keep DIR]

Runs `yggdrasil compile RECIPE --out TMP/bundle --force` in a fresh process with nothing cached:
an empty work cache (--force), an empty Inductor cache (TORCHINDUCTOR_CACHE_DIR) and an empty
yggdrasil cache (YGGDRASIL_CACHE_DIR; its models/ is the real one, linked, so nothing is
downloaded or converted again: the GGUF files are the user's input, not compile's work). The
numbers are the wall time of the whole command (the statistic a user feels; one run, since a
cold compile cannot be repeated warm) and the bundle manifest's phase_seconds (compile's own
clock per phase). Records what compile chose (weight format, buckets, shipped policy) so runs
before and after a change to compile can be compared choice by choice (--keep keeps the bundle,
for a paired `bench compare` of the two). Ends with one JSON line; --out writes it to a file too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from yggdrasil.catalog import cache_dir
from yggdrasil.graphs.manifest import read_manifest

from .common import emit_json, environment, load_average, log


def cold_environment(scratch: Path) -> dict:
    """os.environ with empty compile caches under scratch, the user's models still found."""
    cache = scratch / "yggdrasil-cache"
    cache.mkdir(parents=True)
    models = cache_dir() / "models"
    if models.is_dir():
        (cache / "models").symlink_to(models, target_is_directory=True)
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"), "YGGDRASIL_CACHE_DIR": str(cache)}


def choices(manifest) -> dict:
    """What compile decided: the comparisons a faster compile must keep."""
    stats = manifest.stats
    return {"weights": dict(manifest.weights), "buckets": list(manifest.buckets),
            "policy_shipped": stats.get("policy_shipped"), "steps": manifest.steps,
            "chosen_format": manifest.formats.get("chosen")}


def run(recipe: Path, threads: int | None, keep: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="ygg-cold-") as scratch:
        scratch = Path(scratch)
        command = [sys.executable, "-m", "yggdrasil", "compile", str(recipe), "--out", str(scratch / "bundle"),
                   "--force", *(["--threads", str(threads)] if threads else [])]
        before = load_average()
        log(f"cold compile: {' '.join(command[1:])}")
        started = time.perf_counter()
        done = subprocess.run(command, env=cold_environment(scratch), capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"compile failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        manifest, _ = read_manifest(scratch / "bundle", "rerun")
        if keep is not None:
            shutil.copytree(scratch / "bundle", keep, symlinks=True)
        return {"recipe": str(recipe), "command": " ".join(["python", "-m", "yggdrasil.bench.cold_compile",
                                                           *sys.argv[1:]]),
                "compile_command": " ".join(["yggdrasil", *command[3:]]),
                "wall_seconds": round(wall, 1), "statistic": "one cold run: wall seconds of the compile command",
                "phase_seconds": manifest.stats.get("phase_seconds"), "choices": choices(manifest),
                "load_average_before": before, "load_average_after": load_average(),
                "log_tail": done.stdout[-4000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--threads", type=int, default=None, help="compile --threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    parser.add_argument("--keep", type=Path, default=None, help="copy the compiled bundle here (a new directory)")
    args = parser.parse_args(argv)
    if args.keep is not None and args.keep.exists():
        parser.error(f"--keep {args.keep} exists; name a new directory")
    result = {"environment": environment(), **run(args.recipe, args.threads, args.keep)}
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in (result["phase_seconds"] or {}).items())
    log(f"cold compile of {args.recipe}: {result['wall_seconds']:.0f} s wall ({phases})")
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
