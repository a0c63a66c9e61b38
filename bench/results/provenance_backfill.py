"""One-off (issue 39, 2026-11-27): give every committed result JSON written before results carried
a `provenance` block one, from what the file itself recorded, marked `backfilled`. Nothing is
made up: what a run did not record (dirty tree, the machine's quiet/noisy state, often the
command) is null or "not recorded"; `commit` is the commit that added the file, so the run was at
or before it. A result missing a named statistic gets the text it used instead (`statistics`,
`method`, `timing`) or "not named when recorded".

    python bench/results/provenance_backfill.py   # from the repository root; idempotent
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from yggdrasil.bench.harness import STATISTIC, SUITES

ROOT = Path(__file__).resolve().parents[2]
NOT_RECORDED = {"verdict": "not recorded", "reasons": [], "others_cores": None, "steal": None}


def added_in(path: Path) -> str | None:
    done = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", str(path.relative_to(ROOT))],
                          cwd=ROOT, capture_output=True, text=True)
    lines = done.stdout.split()
    return lines[-1] if lines else None


def harness_statistic(result: dict) -> bool:
    """A bundle suite's result whose statistic is its harness's `method` text: name it as the harness
    names it now (the same computation: bench/harness.py's STATISTIC)."""
    method = result.get("method")
    if result.get("benchmark") in SUITES and isinstance(method, str) and result.get("statistic") == method \
            and method.startswith("TPOT = (wall(N tokens)"):
        result["statistic"] = STATISTIC
        return True
    return False


def backfill(path: Path) -> bool:
    result = json.loads(path.read_text())
    if not isinstance(result, dict):
        return False
    if "provenance" in result:
        if harness_statistic(result):
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")
            return True
        return False
    env = result.get("environment") or result.get("env") or {}
    commit = env.get("commit")
    bundle = result.get("bundle") if isinstance(result.get("bundle"), dict) else None
    result["provenance"] = {
        "backfilled": "2026-11-27 from this file's own fields (bench/results/provenance_backfill.py)",
        "commit": (commit or "").replace("+dirty", "") or added_in(path),
        "commit_source": "recorded by the run" if commit else "the commit that added this file (the run was at or before it)",
        "dirty": commit.endswith("+dirty") if commit else None,
        "command": env.get("command") or result.get("command"),
        "cwd": env.get("cwd"),
        "date": env.get("date"),
        "cpu": {"model": env.get("cpu") or env.get("device"), "isa_flags": env.get("isa_flags"),
                "cores": env.get("cores"), "threads": env.get("torch_threads") or env.get("threads")},
        "torch": env.get("torch") or result.get("torch"),
        "bundle": None if bundle is None else {k: bundle.get(k) for k in ("path", "id", "recipe", "recipe_source",
                                                                           "recipe_identity")},
        "machine_before": {**NOT_RECORDED, "load_average": env.get("load_average") or result.get("load_average_before")},
        "machine_after": {**NOT_RECORDED, "load_average": result.get("load_average_after")},
    }
    if not result.get("statistic"):
        named = result.get("statistics") or result.get("method") or env.get("timing")
        result["statistic"] = named or "not named when recorded"
        harness_statistic(result)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return True


def main() -> None:
    changed = [p for p in sorted((ROOT / "bench" / "results").rglob("*.json")) if backfill(p)]
    print(f"backfilled {len(changed)} result files")


if __name__ == "__main__":
    main()
