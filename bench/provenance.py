"""Where a result came from, recorded the same way by every suite (issue 39): the commit and
whether the tree was dirty, the exact command, the CPU (model, ISA flags, cores, threads), torch,
the bundle and its recipe's identity when a bundle was measured, and the machine's state before
and after: load average and a quiet/noisy verdict from a short idle window, in which every busy
CPU second belongs to someone else.

`yggdrasil bench reproduce RESULT.json` runs `provenance.command` again; docs/results.md refuses
to set side by side results whose `provenance.cpu` differs.
"""

from __future__ import annotations

import datetime as _dt
import platform
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from yggdrasil.cpu import cpu_fingerprint
from yggdrasil.device import cpu_snapshot, cpu_window
from yggdrasil.storage.manifest import read_manifest

from .common import core_count, emit_json, git_head, load_average, log

QUIET, NOISY = "quiet", "noisy"
QUIET_OTHERS_CORES = 0.25  # other processes may use this many cores' worth during the window
QUIET_STEAL = 0.05  # and the hypervisor this share of the CPUs' time
WINDOW_SECONDS = 1.0
# what every result's provenance holds (tests/test_bench_suites.py checks committed results too,
# and the values of every one not backfilled: invalid_values)
FIELDS = ("commit", "dirty", "command", "cwd", "date", "cpu", "torch", "bundle", "machine_before", "machine_after")
CPU_FIELDS = ("model", "isa_flags", "cores", "threads")


def machine_state(window_seconds: float = WINDOW_SECONDS) -> dict:
    """The machine's load now: CPU used by other processes over a short window in which this
    process sleeps, stolen time, the load average, and the verdict with its reasons."""
    before = cpu_snapshot()
    time.sleep(window_seconds)
    window = cpu_window(before, cpu_snapshot())
    reasons = []
    if window.others_cores is not None and window.others_cores > QUIET_OTHERS_CORES:
        reasons.append(f"other processes used {window.others_cores:.2f} cores")
    if window.steal is not None and window.steal > QUIET_STEAL:
        reasons.append(f"{window.steal:.0%} of CPU time stolen")
    unmeasured = window.others_cores is None
    return {"verdict": "unmeasured" if unmeasured else (NOISY if reasons else QUIET), "reasons": reasons,
            "others_cores": None if unmeasured else round(window.others_cores, 3),
            "steal": None if window.steal is None else round(window.steal, 4),
            "window_seconds": window_seconds, "load_average": load_average()}


def cpu_record() -> dict:
    fingerprint = cpu_fingerprint()
    return {"model": fingerprint.model_name, "id": fingerprint.summary(), "isa_flags": list(fingerprint.features or ()),
            "cores": core_count(), "threads": torch.get_num_threads()}


def bundle_record(path: Path | None) -> dict | None:
    """The measured bundle: its id and its recipe's name, source and identity (None: no bundle)."""
    if path is None:
        return None
    try:
        manifest = read_manifest(Path(path), "bench")[0]
    except Exception as exc:  # a result still records what it was pointed at, and why it has no id
        return {"path": str(path), "id": None, "error": str(exc).splitlines()[0][:200]}
    return {"path": str(path), "id": manifest.bundle_id, "recipe": manifest.recipe.get("name"),
            "recipe_source": manifest.recipe.get("source"), "recipe_identity": manifest.recipe_identity}


@dataclass(frozen=True)
class Provenance:
    """Taken when a suite starts (`start`), completed when it writes its result (`record`)."""

    command: str  # as a person would type it: `yggdrasil bench SUITE ARGS`
    cwd: str
    started: str
    machine_before: dict

    @classmethod
    def start(cls, command: str | None) -> "Provenance":
        """command: as typed; None: this process's own command line (interpreter and -m included)."""
        command = command or shlex.join(getattr(sys, "orig_argv", sys.argv))
        return cls(command, str(Path.cwd()), _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   machine_state())

    def record(self, bundle: Path | None = None) -> dict:
        commit, dirty = git_head()
        return {"commit": commit, "dirty": dirty, "command": self.command, "cwd": self.cwd, "date": self.started,
                "cpu": cpu_record(), "torch": torch.__version__, "python": platform.python_version(),
                "bundle": bundle_record(bundle), "machine_before": self.machine_before,
                "machine_after": machine_state()}


@dataclass(frozen=True)
class Results:
    """How a suite writes what it measured: the provenance block added, the statistic required,
    pretty JSON to `path` (when given) and the compact JSON as stdout's last line."""

    provenance: Provenance

    def write(self, result: dict, path: str | Path | None = None, bundle: Path | None = None) -> dict:
        if not result.get("statistic"):
            raise ValueError("a result must name its statistic (median of paired ratios, ratio of means, ...)")
        result = {**result, "provenance": self.provenance.record(bundle)}
        wrong = invalid_values(result)
        if wrong:  # still written (a run outside a checkout is worth its numbers), but said once
            log(f"this result's provenance cannot be committed ({'; '.join(wrong)})")
        emit_json(result, path)
        return result


def machine(result: dict) -> tuple:
    """What makes two results' times comparable: the CPU model, its ISA flags, cores and threads."""
    cpu = (result.get("provenance") or {}).get("cpu") or {}
    return (cpu.get("model"), tuple(sorted(cpu.get("isa_flags") or ())), cpu.get("cores"), cpu.get("threads"))


VERDICTS = (QUIET, NOISY)
_COMMIT = re.compile(r"[0-9a-f]{40}")


def invalid_values(result: dict) -> list[str]:
    """What is wrong with the values of a result's provenance (issue 53): a result written by the
    harness must name the full commit, whether the tree was dirty, the command, a quiet/noisy
    verdict before and after, the date and the CPU. A result backfilled from older files (marked
    `backfilled`) is exempt: it says itself what its run did not record."""
    prov = result.get("provenance")
    if not isinstance(prov, dict) or prov.get("backfilled"):
        return []
    wrong = []
    if not isinstance(prov.get("commit"), str) or not _COMMIT.fullmatch(prov["commit"]):
        wrong.append(f"commit {prov.get('commit')!r} is not a full git commit hash")
    if not isinstance(prov.get("dirty"), bool):
        wrong.append(f"dirty {prov.get('dirty')!r} is not true or false")
    if not isinstance(prov.get("command"), str) or not prov["command"].strip():
        wrong.append(f"command {prov.get('command')!r} is not a command line")
    for when in ("machine_before", "machine_after"):
        verdict = (prov.get(when) or {}).get("verdict")
        if verdict not in VERDICTS:
            wrong.append(f"{when}.verdict {verdict!r} is not one of {', '.join(VERDICTS)}")
    try:
        _dt.datetime.fromisoformat(str(prov.get("date")))
    except ValueError:
        wrong.append(f"date {prov.get('date')!r} is not an ISO date")
    cpu = prov.get("cpu") or {}
    if not cpu.get("model") or not cpu.get("isa_flags"):
        wrong.append("cpu names no model or ISA flags")
    for count in ("cores", "threads"):
        if not isinstance(cpu.get(count), int) or cpu[count] < 1:
            wrong.append(f"cpu.{count} {cpu.get(count)!r} is not a positive count")
    return wrong


def missing_fields(result: dict) -> list[str]:
    """The provenance fields a result lacks (a result needs every one, and a named statistic)."""
    prov = result.get("provenance")
    if not isinstance(prov, dict):
        return ["provenance"]
    missing = [f for f in FIELDS if f not in prov]
    missing += [f"cpu.{f}" for f in CPU_FIELDS if f not in (prov.get("cpu") or {})]
    if not result.get("statistic"):
        missing.append("statistic")
    return missing
