"""The README's results section, generated from committed suite results:

    python -m yggdrasil.bench.report bench/results/smollm2-lookup-cpu-xeon2c [more dirs]

prints Markdown (device and date, the compare table, the ablation table and plot, the tree and
sensitivity headlines) for every directory holding the suites' JSON files."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _load(directory: Path, suite: str) -> dict | None:
    path = directory / f"{suite}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def header(result: dict) -> str:
    env = result["environment"]
    models = ", ".join(f"{role} {m['name']}" for role, m in result["models"].items())
    prompts = result["prompts"]
    return (f"{result['bundle']['recipe']} ({models}); {env['device']}, torch {env['torch']}, {env['dtype']}, "
            f"{env['date'][:10]}; {len(prompts['ids'])} prompts ({', '.join(prompts['sets'])}, {prompts['split']}) "
            f"x {result['max_new_tokens']} tokens x {result['repeats']} repeats")


def compare_section(result: dict) -> list[str]:
    lines = [f"**compare** — {header(result)}", "",
             "| variant | backend | TPOT ms | AAL | x AR compiled | x HF greedy | tokens |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['backend']} | {_num(r['tpot_ms'], 1)} | {_num(r['aal'])} | "
                     f"{_num(r.get('x_ar-compiled'))} | {_num(r.get('x_hf-greedy'))} | {r['status']} |")
    return lines


def ablation_section(result: dict, directory: Path, readme_dir: Path) -> list[str]:
    lines = [f"**ablation** — {header(result)}", "",
             "| step | TPOT ms | AAL | x O1 | x AR compiled | tokens |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {_num(r['tpot_ms'], 1)} | {_num(r['aal'])} | {_num(r.get('x_O1'))} | "
                     f"{_num(r.get('x_ar-compiled'))} | {r['status']} |")
    lines += [""] + [f"- {note}" for note in result.get("notes", [])]
    plot = directory / "ablation.png"
    if plot.is_file():
        lines += ["", f"![ablation]({plot.relative_to(readme_dir) if plot.is_relative_to(readme_dir) else plot})"]
    return lines


def trees_section(result: dict) -> list[str]:
    best = {}
    for r in result["rows"]:
        if r["objective_speedup"] is not None and r["objective_speedup"] > best.get(r["structure"], {}).get(
                "objective_speedup", -1):
            best[r["structure"]] = r
    bits = [f"{s} {r['objective_speedup']:.2f}x at V={r['verify']} (AAL {r['aal']:.2f})" for s, r in best.items()]
    return ["**trees** — best objective speed-up per structure: " + "; ".join(bits) + "."]


def sensitivity_section(result: dict) -> list[str]:
    temps = ", ".join(f"{r['variant']} {_num(r['tpot_ms'], 1)} ms"
                      + (f" (AAL {_num(r['aal'])}, {_num(r['x_ar'])}x AR)" if r.get("aal") else "")
                      for r in result["temperatures"])
    return [f"**sensitivity** — fastest (D, W, V) bucket: {result['fastest_bucket']}; temperatures: {temps}."]


def section(directory: Path, readme_dir: Path) -> str:
    lines: list[str] = []
    for suite, make in (("compare", lambda r: compare_section(r)),
                        ("ablation", lambda r: ablation_section(r, directory, readme_dir)),
                        ("trees", trees_section), ("sensitivity", sensitivity_section)):
        result = _load(directory, suite)
        if result is not None:
            lines += make(result) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    dirs = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    if not dirs:
        print(__doc__, file=sys.stderr)
        return 2
    for directory in dirs:
        print(section(directory, Path.cwd()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
