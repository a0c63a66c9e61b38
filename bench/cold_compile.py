"""A cold compile of a recipe, phase by phase (issue 37): what a person waits for the first time.

    yggdrasil bench cold-compile RECIPE [--threads N] [--out FILE] [--keep DIR]
                                           [--compare-with BUNDLE [--prompts N]]

Runs `yggdrasil compile RECIPE --out TMP/bundle --force` in a fresh process with nothing cached:
an empty work cache (--force), an empty Inductor cache (TORCHINDUCTOR_CACHE_DIR) and an empty
yggdrasil cache (YGGDRASIL_CACHE_DIR; its models/ is the real one, linked, so nothing is
downloaded or converted again: the GGUF files are the user's input, not compile's work). The
numbers are the wall time of the whole command (the statistic a user feels; one run, since a
cold compile cannot be repeated warm) and the bundle manifest's phase_seconds (compile's own
clock per phase). Records what compile chose (weight format, buckets, shipped policy) so runs
before and after a change to compile can be compared choice by choice; --keep keeps the bundle,
and --compare-with BUNDLE then times the new bundle and an earlier one (each with its own
policy) on the same held-out prompts, interleaved, and reports the median of the per-prompt TPOT
ratios new/old with its quartiles and whether the greedy tokens are equal. Ends with one JSON
line; --out writes it to a file too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from yggdrasil.user_dirs import cache_dir
from yggdrasil.errors import InvalidRequestError, YggdrasilError
from yggdrasil.storage.manifest import read_manifest

from . import engines, harness
from .common import environment, interleaved, load_average, log, paired_ratios, summarize, timed
from .provenance import Results


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


def cold_compile(recipe: Path, threads: int | None, keep: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="ygg-cold-") as scratch:
        scratch = Path(scratch)
        command = [sys.executable, "-m", "yggdrasil.cli", "compile", str(recipe), "--out", str(scratch / "bundle"),
                   "--force", *(["--threads", str(threads)] if threads else [])]
        before = load_average()
        log(f"cold compile: {' '.join(command[1:])}")
        done, wall = timed(subprocess.run, command, env=cold_environment(scratch), capture_output=True, text=True,
                           check=False)
        if done.returncode != 0:
            raise YggdrasilError(f"compile failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        manifest, _ = read_manifest(scratch / "bundle", "rerun")
        if keep is not None:
            shutil.copytree(scratch / "bundle", keep, symlinks=True)
        return {"recipe": str(recipe), "compile_command": " ".join(["yggdrasil", *command[3:]]),
                "wall_seconds": round(wall, 1), "statistic": "one cold run: wall seconds of the compile command",
                "phase_seconds": manifest.stats.get("phase_seconds"), "choices": choices(manifest),
                "load_average_before": before, "load_average_after": load_average(),
                "log_tail": done.stdout[-4000:]}


def paired_tpot(new: Path, old: Path, prompts: int, tokens: int) -> dict:
    """new vs old bundle on the same held-out prompts (the first `prompts` of each set), greedy,
    interleaved and alternating which runs first: the median of per-prompt TPOT ratios new/old."""
    bundles = {"new": new, "old": old}
    setups = {name: harness.open_setup(harness.BenchOptions("compare", path, n=prompts, max_new_tokens=tokens))
              for name, path in bundles.items()}
    runtimes = {name: setup.runtime for name, setup in setups.items()}
    chosen = setups["new"].prompts

    def variant(name: str):
        runtime = runtimes[name]
        decode = engines.bundle_policy(runtime) or engines.autoregressive(engines.bundle_runners(runtime))
        return lambda i: {"run": harness.timed_run(decode, chosen[i].ids, tokens)}

    samples = interleaved(1, len(chosen), {name: variant(name) for name in bundles}, label="paired ")
    for sample in samples:
        sample.values["tpot"] = sample.values["run"].tpot
    tokens_of = {name: [s.values["run"].tokens for s in samples if s.variant == name] for name in bundles}
    # a run no longer than its own 1-token run (noise, on a fast model) has TPOT 0: no ratio
    clipped = {(s.repeat, s.item) for s in samples if s.values["run"].clipped}
    ratios = paired_ratios([s for s in samples if (s.repeat, s.item) not in clipped], "new", "old", "tpot")
    return {"prompts": [f"{p.set}/{p.id}" for p in chosen], "max_new_tokens": tokens,
            "statistic": "median (and quartiles) over held-out prompts of TPOT new / TPOT old, paired, one "
                         "run each, interleaved; a pair with a clipped run (TPOT 0: timing noise) is left out "
                         "(clipped_pairs)",
            "tpot_ratio_new_over_old": summarize(ratios), "ratios": [round(r, 4) for r in ratios],
            "tpot_ms": {name: summarize([s.values["tpot"] * 1e3 for s in samples if s.variant == name])
                        for name in bundles},
            "clipped_pairs": len(clipped), "same_greedy_tokens": tokens_of["new"] == tokens_of["old"],
            "old_bundle": str(old)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--threads", type=int, default=None, help="compile --threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    parser.add_argument("--keep", type=Path, default=None, help="copy the compiled bundle here (a new directory)")
    parser.add_argument("--compare-with", type=Path, default=None, metavar="BUNDLE",
                        help="then time the new bundle against this one on held-out prompts (needs --keep)")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per set for --compare-with")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt for --compare-with")


def run(args: argparse.Namespace, record: Results) -> int | None:
    if args.keep is not None and args.keep.exists():
        raise InvalidRequestError(f"--keep {args.keep} exists; name a new directory")
    if args.compare_with is not None and args.keep is None:
        raise InvalidRequestError("--compare-with needs --keep DIR (the new bundle it is compared as)")
    result = {"environment": environment(), **cold_compile(args.recipe, args.threads, args.keep)}
    if args.compare_with is not None:
        result["paired_with_old"] = paired_tpot(args.keep, args.compare_with, args.prompts, args.max_new_tokens)
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in (result["phase_seconds"] or {}).items())
    log(f"cold compile of {args.recipe}: {result['wall_seconds']:.0f} s wall ({phases})")
    record.write(result, args.out, bundle=args.keep)
    return 0

