"""`yggdrasil bench reproduce RESULT.json`: run again, here, the exact command a result file
records (provenance.command, or environment.command in older results, from the directory it ran
in), and print the recorded numbers and
the new ones side by side.

A result is only comparable on the machine that made it: a different CPU model, ISA or thread
count is refused (--other-machine runs it anyway and says so beside every number). The bundle a
command names must exist here (--bundle DIR points it at another copy; the result's recipe
rebuilds it with `yggdrasil compile`)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from yggdrasil.errors import YggdrasilError
from yggdrasil.storage.manifest import read_manifest
from yggdrasil.recipes import shipped_recipe

from .common import environment, git_head
from .provenance import cpu_record
from .suites import MEASUREMENT_SUITES

SKIPPED_KEYS = {"environment", "env", "command", "compile_command", "provenance"}  # provenance, not results


class ReproduceError(YggdrasilError):
    """A result that cannot be re-run here as it was recorded."""


class BundleMissing(ReproduceError):
    """The bundle the recorded command names is not here (--rebuild compiles it from its recipe)."""


@dataclass(frozen=True)
class Rerun:
    argv: list[str]  # the recorded command, with this interpreter and the output redirected
    cwd: Path  # where it ran (relative paths in it are relative to this)
    output: Path | None  # the file or folder its --out now points at (None: the last JSON line of stdout)


def recorded_environment(result: dict) -> dict:
    """The machine and command a result records, in the older `environment` keys."""
    env = dict(result.get("environment") or result.get("env") or {})
    prov = result.get("provenance") or {}
    if prov:
        cpu = prov.get("cpu") or {}
        env.update(command=prov.get("command"), cwd=prov.get("cwd"), commit=prov.get("commit"),
                   cpu=cpu.get("model"), cores=cpu.get("cores"), torch_threads=cpu.get("threads"),
                   isa_flags=cpu.get("isa_flags"))
    return env


def here(result: dict) -> dict:
    """This machine in the keys the result records it in (its provenance, or an older environment)."""
    if not result.get("provenance"):
        return environment()
    cpu = cpu_record()
    return {"cpu": cpu["model"], "cores": cpu["cores"], "torch_threads": cpu["threads"],
            "isa_flags": cpu["isa_flags"], "commit": git_head()[0]}


def runnable(argv: list[str]) -> list[str]:
    """A recorded command as this Python runs it: `yggdrasil ...` through -m, and the scripts a
    measurement was once run as (`python -m yggdrasil.bench.cold_compile ...`) as their suites."""
    if argv[0] == "yggdrasil":
        return [sys.executable, "-m", "yggdrasil.cli", *argv[1:]]
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        for suite in MEASUREMENT_SUITES:
            if module == f"yggdrasil.bench.{suite.module}":
                return [sys.executable, "-m", "yggdrasil.cli", "bench", suite.name, *argv[argv.index("-m") + 2:]]
    return [sys.executable, *argv[1:]]  # the recorded interpreter's path need not exist here


def machine_difference(recorded: dict, here: dict) -> list[str]:
    """What differs between the machine that made the result and this one (empty: the same)."""
    differences = []
    for key, label in (("cpu", "CPU"), ("cores", "cores"), ("torch_threads", "threads")):
        if key in recorded and recorded[key] != here.get(key):
            differences.append(f"{label} {recorded[key]!r} there, {here.get(key)!r} here")
    if "isa_flags" in recorded and set(recorded["isa_flags"]) != set(here.get("isa_flags") or ()):
        differences.append("the ISA flags differ")
    return differences


def plan_rerun(result: dict, scratch: Path, bundle: Path | None = None) -> Rerun:
    """The recorded command, run by this Python, writing into `scratch` instead of its --out."""
    env = recorded_environment(result)
    command = env.get("command") or result.get("command")
    if not command:
        raise ReproduceError("this result does not record the command that made it (results written before "
                             "environment.command existed); re-run its benchmark by hand")
    argv = runnable(shlex.split(command))
    cwd = Path(env.get("cwd") or ".")
    output = None
    if "--out" in argv[:-1]:
        at = argv.index("--out") + 1
        old = Path(argv[at])
        output = scratch / old.name if old.suffix else scratch
        argv[at] = str(output)
    if "--bundle" in argv[:-1]:
        at = argv.index("--bundle") + 1
        if bundle is not None:
            argv[at] = str(bundle)
        named = Path(argv[at]) if Path(argv[at]).is_absolute() else cwd / argv[at]
        if not named.is_dir():
            made = next((b for b in (result.get("bundle"), (result.get("provenance") or {}).get("bundle"))
                         if isinstance(b, dict)), {})
            recipe = made.get("recipe_source") or made.get("recipe")
            raise BundleMissing(f"the bundle this result ran on, {argv[at]}, is not here; pass --bundle DIR, or --rebuild, or "
                                 f"build it with `yggdrasil compile {recipe or 'RECIPE'} --out {argv[at]}`")
    return Rerun(argv, cwd if cwd.is_dir() else Path("."), output)


def new_result(rerun: Rerun, recorded_name: str, stdout: str) -> dict:
    """The re-run's result: the file its --out names, the file of the recorded name inside its
    --out folder, or the last JSON line it printed."""
    candidates = []
    if rerun.output is not None:
        candidates = [rerun.output] if rerun.output.is_file() else [rerun.output / recorded_name,
                                                                   *sorted(rerun.output.glob("*.json"))]
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text())
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ReproduceError("the re-run wrote no result file and printed no JSON line")


def numbers(value, path: str = "") -> dict[str, float]:
    """Every number in a result, by its path (a.b[2].c), provenance left out."""
    out: dict[str, float] = {}
    if isinstance(value, bool):
        return out
    if isinstance(value, (int, float)):
        out[path] = float(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in SKIPPED_KEYS:
                out.update(numbers(item, f"{path}.{key}" if path else str(key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.update(numbers(item, f"{path}[{i}]"))
    return out


def side_by_side(old: dict, new: dict, limit: int = 60) -> list[str]:
    """A table of the numbers both results hold: recorded, now, and now / recorded."""
    before, after = numbers(old), numbers(new)
    shared = [key for key in before if key in after]
    width = max((len(key) for key in shared[:limit]), default=10)
    lines = [f"{'number':<{width}}  {'recorded':>12}  {'now':>12}  {'now/recorded':>12}"]
    for key in shared[:limit]:
        ratio = f"{after[key] / before[key]:12.3f}" if before[key] else f"{'-':>12}"
        lines.append(f"{key:<{width}}  {before[key]:12.5g}  {after[key]:12.5g}  {ratio}")
    if len(shared) > limit:
        lines.append(f"... and {len(shared) - limit} more numbers (both files are JSON)")
    if not shared:
        lines.append("(the two results share no numbers: the benchmark's output changed)")
    return lines


def recorded_bundle(result: dict) -> dict:
    return next((b for b in (result.get("bundle"), (result.get("provenance") or {}).get("bundle")) if isinstance(b, dict)),
                {})


def recipe_of(result: dict) -> Path:
    """The recipe file the result's bundle was compiled from, here: its recorded path, else the
    shipped recipe of its name."""
    made = recorded_bundle(result)
    for candidate in (made.get("recipe_source"), made.get("recipe") and f"recipes/{made['recipe']}.yaml"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    if made.get("recipe") and shipped_recipe(made["recipe"]).is_file():
        return shipped_recipe(made["recipe"])
    raise ReproduceError("the result records no recipe this machine has, so its bundle cannot be rebuilt; "
                         "pass --bundle DIR")


def rebuild_bundle(recipe: Path, dest: Path, report=print) -> Path:
    """`yggdrasil compile RECIPE --out DEST`, for a result whose bundle is not here."""
    report(f"rebuilding the bundle: yggdrasil compile {recipe} --out {dest}")
    done = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "compile", str(recipe), "--out", str(dest)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ReproduceError(f"compiling {recipe} failed (exit status {done.returncode}):\n{done.stderr[-2000:]}")
    return dest


def reproduce(path: Path, bundle: Path | None = None, other_machine: bool = False, report=print,
              rebuild: bool = False) -> int:
    """Re-run RESULT's command here and print old and new side by side; the re-run's exit status.
    rebuild: compile the result's bundle from its recipe when it is not here."""
    result = json.loads(Path(path).read_text())
    now = here(result)
    differences = machine_difference(recorded_environment(result), now)
    if differences and not other_machine:
        raise ReproduceError(f"{path} was measured on another machine ({'; '.join(differences)}): its numbers "
                             "are not comparable with this one's; pass --other-machine to run it anyway")
    with tempfile.TemporaryDirectory(prefix="yggdrasil-reproduce-") as scratch:
        try:
            rerun = plan_rerun(result, Path(scratch), bundle)
        except BundleMissing:
            if not rebuild:
                raise
            built = rebuild_bundle(recipe_of(result), Path(scratch) / "rebuilt-bundle", report)
            rerun = plan_rerun(result, Path(scratch), built)
            identity = recorded_bundle(result).get("recipe_identity")
            if identity and read_manifest(built, "rebuild")[0].recipe_identity != identity:
                report("NOTE: the recipe has changed since the result was recorded: the rebuilt bundle is not the "
                       "one it measured")
        report(f"re-running: {shlex.join(rerun.argv)}  (in {rerun.cwd})")
        done = subprocess.run(rerun.argv, cwd=rerun.cwd, capture_output=True, text=True)
        if done.returncode != 0:
            report(done.stdout[-3000:] + done.stderr[-3000:])
            report(f"the re-run failed (exit status {done.returncode})")
            return done.returncode
        fresh = new_result(rerun, Path(path).name, done.stdout)
    if differences:
        report(f"ACROSS MACHINES ({'; '.join(differences)}): the ratios below mix two machines")
    recorded_commit = recorded_environment(result).get("commit")
    report(f"recorded at commit {recorded_commit or '?'}; now at {now.get('commit') or '?'}")
    for line in side_by_side(result, fresh):
        report(line)
    return 0
