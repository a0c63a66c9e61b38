"""docs/results.md, generated from the committed result files in bench/results/.

From the repository root, any of

    yggdrasil bench report
    python -m yggdrasil.bench.report
    python bench/report.py

reads bench/results/ and writes docs/results.md. `--out -` prints the Markdown instead. Positional
arguments replace bench/results/: each is a directory of result files laid out like it, or one
directory written by `yggdrasil bench SUITE --out DIR` (its suites only).

Every table, bullet point and device line comes from the files (JSON, YAML, and the text of a
recorded chat session). Paragraphs marked "Commentary" are fixed explanations kept in this file and
in report_sections.py; numbers in them are filled in from the files as well."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from yggdrasil.bench import report_headline
from yggdrasil.bench import report_sections as rs
from yggdrasil.bench.report_headline import headline, readme_table, replace_readme_block, stale  # noqa: F401

RESULTS = Path(__file__).resolve().parent / "results"
OUT = Path("docs/results.md")
SUITES = ("compare", "ablation", "trees", "sensitivity")


# ---------------------------------------------------------------------------- evaluation suites

_pair = report_headline.pair


def _suite_intro(result: dict, suite: str, path: Path, ctx: rs.Ctx) -> list[str]:
    p = result["prompts"]
    cmd = (f"yggdrasil bench {suite} --bundle BUNDLE --prompts {','.join(p['sets'])} --n {p['per_set']} "
           f"--max-new-tokens {result['max_new_tokens']} --repeats {result['repeats']}")
    return [f"File `{ctx.show(path)}`, from `{cmd}`.", rs.device_line(result["environment"]), "",
            f"Bundle `{result['bundle']['recipe']}` ({_pair(result)}); {len(p['ids'])} {p['split']} prompts "
            f"({', '.join(p['sets'])}) x {result['max_new_tokens']} tokens x "
            f"{rs.times(result['repeats'], 'repeat')}.", ""]


def _compare_label(r: dict, result: dict) -> str:
    v = r["variant"]
    fixed = {"hf-greedy": "HF transformers greedy `generate`", "ar-eager": "ours, autoregressive, eager",
             "ar-torch.compile": "ours, autoregressive, torch.compile",
             "ar-compiled": "ours, autoregressive, bundle graphs", "egt": "**EGT from the bundle**"}
    if v in fixed:
        return fixed[v]
    if v == "hf-assisted":
        assisted = result.get("setup", {}).get("hf", {}).get("assisted", {})
        if "prompt_lookup_num_tokens" in assisted:
            return "HF prompt-lookup assisted generation"
        return f"HF assisted generation, {result['models'].get('draft', {}).get('name', 'draft')} assistant"
    if v.startswith("chain-D"):
        return f"chain D={v[len('chain-D'):]}, gpt-fast style"
    if v.startswith("sequoia-V"):
        return f"Sequoia static tree, budget {v[len('sequoia-V'):]}"
    return r.get("what", v)


def _check(rows: list[dict]) -> str:
    """Exactness of the rows checked token for token (llama.cpp's rows, valid None, compare text
    only; sampled rows are not compared)."""
    greedy = [r for r in rows if r.get("status") != "sampled" and r.get("valid", True) is not None]
    bad = [r["variant"] for r in greedy if _invalid(r)]
    if bad:
        return f"- INVALID rows (greedy output differs from autoregressive greedy): {', '.join(bad)}."
    ties = [f"{r['variant']}: {t}" for r in greedy for t in (r.get("check") or {}).get("ties", [])]
    if ties:
        return ("- Every greedy row's output equals autoregressive greedy or leaves it only at a tie of the "
                f"deployed model's logits ({'; '.join(ties)}).")
    counts = {f"{r['check']['exact']}/{r['check']['of']}" for r in greedy if r.get("check")}
    return (f"- Every greedy row's output equals autoregressive greedy on every prompt and repeat "
            f"({', '.join(sorted(counts))}).")


_invalid = report_headline.invalid


def _fastest_line(result: dict) -> str:
    ranked = [r for r in result["rows"] if not _invalid(r) and r.get("tpot_ms") is not None]
    if not ranked:
        return "- No valid row to rank."
    fastest = min(ranked, key=lambda r: r["tpot_ms"])
    left_out = " (INVALID rows not ranked)" if len(ranked) < len(result["rows"]) else ""
    return f"- Fastest valid row: {_compare_label(fastest, result)} at {rs.num(fastest['tpot_ms'], 1)} ms per token{left_out}."


def compare_section(result: dict, path: Path, ctx: rs.Ctx) -> list[str]:
    rows = {r["variant"]: r for r in result["rows"]}
    lines = _suite_intro(result, "compare", path, ctx)
    lines += rs.table(["variant", "backend", "TPOT ms", "AAL", "x AR compiled", "x HF greedy", "tokens"],
                      [[_compare_label(r, result), r["backend"], rs.num(r["tpot_ms"], 1), rs.num(r["aal"]),
                        rs.num(r.get("x_ar-compiled")), rs.num(r.get("x_hf-greedy")), r["status"]]
                       for r in result["rows"]])
    lines += ["", _check(result["rows"]), _fastest_line(result)]
    egt, hf_a = rows.get("egt"), rows.get("hf-assisted")
    if egt and hf_a:
        lines.append(f"- EGT from the bundle against HF assisted generation with the same drafting: "
                     f"{hf_a['tpot_ms'] / egt['tpot_ms']:.2f}x (ratio of median TPOTs).")
    setup = result.get("setup", {})
    if isinstance(setup.get("sequoia"), str):
        lines.append(f"- Sequoia: {setup['sequoia']}.")
    if egt and egt.get("buckets"):
        lines.append("- Buckets EGT chose: " + ", ".join(f"{k} x{v}" for k, v in egt["buckets"].items()) + ".")
    notes = []
    tc, ea = rows.get("ar-torch.compile"), rows.get("ar-eager")
    if tc and ea and tc["tpot_ms"] > ea["tpot_ms"]:
        notes.append(f"torch.compile'd decoding ({tc['tpot_ms']:.1f} ms) is slower than eager ({ea['tpot_ms']:.1f} ms) "
                     "here: its fixed shape attends over the whole static cache every step, and the gpt-fast style "
                     "chain inherits that. The bundle's graphs take the attention span as a dynamic dimension.")
    tied = [rows[k]["aal"] for k in rows if k.startswith(("chain-", "sequoia-")) or k == "egt"]
    if len(tied) > 2 and len({round(a, 2) for a in tied}) == 1:
        notes.append(f"The chain, the Sequoia tree and EGT all commit {tied[0]:.2f} tokens per verify: on this "
                     "device the objective picks one drafted token, so they verify the same nodes and differ by "
                     "backend only.")
    if hf_a and hf_a["aal"] and hf_a["aal"] > 3:
        notes.append(f"HF assisted generation with transformers' defaults drafts long chains: AAL {hf_a['aal']:.1f}, "
                     "but every iteration pays as many eager draft steps.")
    return lines + (rs.commentary(" ".join(notes)) if notes else [])


_ABLATION = {"O2 +graphs": "O2 + graph compilation (bundle graphs)", "O3 +pruning": "O3 + verify-width pruning",
             "O4 +stage plans": "O4 + stage plans", "O5 +predictor": "O5 + depth predictor (the bundle's policy)",
             "ar-eager": "autoregressive, eager", "ar-compiled": "autoregressive, bundle graphs"}


def _ablation_label(variant: str) -> str:
    """O1 runs on eager steps; the best-constant row ("const ...") on the bundle's graphs, as O5."""
    if variant.startswith("const "):
        return f"best constant bucket {variant.split()[1]} (bundle graphs)"
    return _ABLATION.get(variant, variant + ", eager")


OLD_NEVER_SLOWER = "never slower: the interval reaches 1.0"


def _honest_note(note: str) -> str:
    """Results written before the one-sided test called a policy "never slower" when a two-sided
    95 % interval merely reached 1.0 (which passes at x0.989): say what was tested."""
    if OLD_NEVER_SLOWER in note:
        return note.replace(OLD_NEVER_SLOWER, "its two-sided 95 % interval reaches 1.0, which is not a test of "
                                              "\"never slower\" (recorded before the one-sided test)")
    return note


def ablation_section(result: dict, path: Path, ctx: rs.Ctx) -> list[str]:
    lines = _suite_intro(result, "ablation", path, ctx)
    lines += rs.table(["step", "TPOT ms", "AAL", "x O1", "x AR compiled", "tokens"],
                      [[_ablation_label(r["variant"]), rs.num(r["tpot_ms"], 1),
                        rs.num(r["aal"]), rs.num(r.get("x_O1")), rs.num(r.get("x_ar-compiled")), r["status"]]
                       for r in result["rows"]])
    lines += ["", _check(result["rows"])] + [f"- {_honest_note(note)}." for note in result.get("notes", [])]
    rows = {r["variant"].split()[0]: r for r in result["rows"]}
    if "O4" in rows and "O5" in rows:
        o4, o5 = rows["O4"], rows["O5"]
        lines.append(f"- O5 against O4: AAL {o4['aal']:.2f} → {o5['aal']:.2f}, TPOT {o4['tpot_ms']:.1f} → "
                     f"{o5['tpot_ms']:.1f} ms.")
    lines += ctx.image(path.with_suffix(".png"), f"ablation, {_pair(result)}")
    return lines + rs.commentary_on("ablation_section")


def trees_section(result: dict, path: Path, ctx: rs.Ctx) -> list[str]:
    lines = _suite_intro(result, "trees", path, ctx)
    by_v: dict[int, dict[str, dict]] = {}
    for r in result["rows"]:
        kind = "egt" if r["structure"].startswith("egt") else r["structure"]
        best = by_v.setdefault(r["verify"], {}).get(kind)
        if best is None or (r["objective_speedup"] or 0) > (best["objective_speedup"] or 0):
            by_v[r["verify"]][kind] = r
    kinds = [k for k in ("chain", "egt", "sequoia") if any(k in v for v in by_v.values())]
    names = {"chain": "chain", "egt": "best EGT", "sequoia": "Sequoia"}
    header = ["V"] + [f"{names[k]} {col}" for k in kinds for col in ("shape", "AAL", "objective")]
    rows = [[v] + [c for k in kinds for c in ((by_v[v][k]["shape"], rs.num(by_v[v][k]["aal"]),
                                               f"{rs.num(by_v[v][k]['objective_speedup'])}x")
                                              if k in by_v[v] else ("-", "-", "-"))] for v in sorted(by_v)]
    lines += rs.table(header, rows) + ["", _check(result["rows"])]
    for k in kinds:
        best = max((v[k] for v in by_v.values() if k in v), key=lambda r: r["objective_speedup"] or 0)
        lines.append(f"- {names[k]}: best objective {best['objective_speedup']:.2f}x at V = {best['verify']} "
                     f"(AAL {best['aal']:.2f}).")
    against = [_egt_against_chain(v, by_v[v]) for v in sorted(by_v) if "chain" in by_v[v] and "egt" in by_v[v]]
    if any("differs" in line for line in against):
        against.append("- (EGT's shapes come from the calibration set; the AAL here is measured on these prompts, "
                       "so EGT can come out below the chain, which its grid contains.)")
    lines += against
    verify = dict(result.get("latency", {}).get("verify", []))
    if 1 in verify:
        lines.append("- Verify cost in the bundle's profile, relative to one row: "
                     + ", ".join(f"{n} rows {t / verify[1]:.2f}x" for n, t in sorted(verify.items()) if n > 1) + ".")
    return lines + rs.commentary_on("trees_section", design_31=rs.DESIGN_31)


def _egt_against_chain(verify: int, rows: dict[str, dict]) -> str:
    """Whether EGT's choice at this verify width differs from the chain, and by how much: its
    grid holds the chain, so "not worse" is no finding; a different shape and its margin are."""
    chain, egt = rows["chain"], rows["egt"]
    if egt["shape"] == chain["shape"]:
        return f"- V = {verify}: EGT picks the chain itself ({chain['shape']}): no difference to measure."
    ratio = (f"{egt['objective_speedup'] / chain['objective_speedup']:.2f}x the chain's objective"
             if egt["objective_speedup"] and chain["objective_speedup"] else "objective not measured")
    return (f"- V = {verify}: EGT's {egt['shape']} differs from the chain's {chain['shape']}: AAL "
            f"{rs.num(egt['aal'])} vs {rs.num(chain['aal'])}, {ratio}.")


def sensitivity_section(result: dict, path: Path, ctx: rs.Ctx) -> list[str]:
    lines = _suite_intro(result, "sensitivity", path, ctx)
    grid: dict[int, list[dict]] = {}
    for r in result["grid"]:
        grid.setdefault(r["verify"], []).append(r)
    lines += rs.table(["verify width", "buckets", "TPOT ms", "x compiled AR", "AAL"],
                      [[v, len(rs_), rs.span([r["tpot_ms"] for r in rs_], 1), rs.span([r["x_ar"] for r in rs_]),
                        rs.span([r["aal"] for r in rs_])] for v, rs_ in sorted(grid.items())])
    fastest = min(result["grid"], key=lambda r: r["tpot_ms"])
    lines += ["", f"- Fastest (D, W, V) bucket: {fastest['variant']} at {fastest['tpot_ms']:.1f} ms, "
                  f"{fastest['x_ar']:.2f}x compiled autoregressive decoding.", ""]
    temps: dict[float, dict[str, dict]] = {}
    for r in result["temperatures"]:
        temps.setdefault(r["temperature"], {})[r["kind"]] = r
    lines += rs.table(["temperature", "EGT ms", "AR compiled ms", "speed-up", "AAL", "tokens"],
                      [[f"{t:g}", rs.num(k["egt"]["tpot_ms"], 1), rs.num(k["ar-compiled"]["tpot_ms"], 1),
                        f"{rs.num(k['egt']['x_ar'])}x", rs.num(k["egt"]["aal"]), k["egt"]["status"]]
                       for t, k in sorted(temps.items())])
    return lines + rs.commentary_on("sensitivity_section")


def suites(directory: Path, ctx: rs.Ctx) -> list[str]:
    lines: list[str] = []
    for suite, make in (("compare", compare_section), ("ablation", ablation_section),
                        ("trees", trees_section), ("sensitivity", sensitivity_section)):
        path = directory / f"{suite}.json"
        if path.is_file():
            lines += [f"### {suite}: {_pair(rs.load(path))}", ""] + make(rs.load(path), path, ctx) + [""]
    return lines


# ------------------------------------------------------------------------------------- document



def document(root: Path | None, suite_dirs: list[Path], ctx: rs.Ctx) -> str:
    sections: list[tuple[str, list[str]]] = [("Headline", headline(suite_dirs))]
    for directory in suite_dirs:
        first = next(directory / f"{s}.json" for s in SUITES if (directory / f"{s}.json").is_file())
        recipe = rs.load(first)["bundle"]["recipe"]
        why = report_headline.marked_stale(directory)
        body = ([f"> **STALE.** {why}", ""] if why else []) + suites(directory, ctx)
        sections.append((f"Evaluation suites: {recipe} ({directory.name}){' (STALE)' if why else ''}", body))
    if root is not None:
        def each(pattern, make, title=None):
            lines = []
            for path in sorted(root.glob(pattern)):
                lines += ([f"### {title(path)}", ""] if title else []) + make(path, ctx) + [""]
            return lines

        stem = lambda prefix: (lambda p: p.stem[len(prefix):])  # noqa: E731
        single = lambda p: p.stem  # noqa: E731
        cal = sorted(root.glob("calibration-*.yaml"))
        sections += [
            ("Bundles", each("bundle-*.json", rs.bundle, stem("bundle-"))),
            ("Chat session", each("chat-*.txt", rs.chat)),
            ("Stage plans: predicted against measured", each("planner-*.json", rs.planner)),
            ("Serving", each("serve-[!g]*.json", rs.serve)),
            ("Serve graph against eager and padded forwards", each("serve-graph-*.json", rs.serve_graph)),
            ("KV memory pressure", each("memory-*.json", rs.memory)),
            ("Structured output and prefix reuse", each("structured-*/structured.json", rs.structured)),
            ("Autoregressive decode", each("decode-*.json", rs.decode)),
            ("Speculative decoding with fixed shapes", each("spec-*.json", rs.spec, stem("spec-"))),
            ("`--spec egt --auto` end to end", each("auto-*.json", rs.spec, stem("auto-"))),
            ("Device profiles", each("profile-*.yaml", rs.profile, single)),
            ("Calibration and the depth predictor", rs.calibration(cal, ctx) if cal else []),
        ]
    sections = [(title, body) for title, body in sections if body]
    out = ["# Measured results", "",
           "Generated by `python -m yggdrasil.bench.report` from the committed files in `bench/results/`. "
           "Do not edit by hand: change the generator (`bench/report.py`, `bench/report_sections.py`) or the "
           "results, and run it again. Each section names the file it reads and the device that file records."]
    out += rs.commentary_on("intro") + ["## Contents", ""]
    out += [f"- [{title}](#{_anchor(title)})" for title, _ in sections] + [""]
    for title, body in sections:
        out += [f"## {title}", ""] + body + [""]
    return "\n".join(_squeeze(out)).rstrip() + "\n"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _squeeze(lines: list[str]) -> list[str]:
    """No runs of blank lines."""
    out: list[str] = []
    for line in lines:
        if line == "" and out and out[-1] == "":
            continue
        out.append(line)
    return out


def _is_suite_dir(path: Path) -> bool:
    return any((path / f"{s}.json").is_file() for s in SUITES)


def suite_dirs_of(directory: Path) -> list[Path]:
    """The suite directories a results directory holds (itself, when it is one)."""
    if _is_suite_dir(directory):
        return [directory]
    return sorted(d for d in directory.iterdir() if d.is_dir() and _is_suite_dir(d))


def render(dirs: list[Path], page_dir: Path) -> str:
    """The results page for these directories, its links relative to page_dir (where it goes)."""
    ctx = rs.Ctx(page_dir)
    return "".join(document(None if _is_suite_dir(d) else d, suite_dirs_of(d), ctx) for d in dirs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="*", type=Path,
                        help="result directories (default: bench/results next to this file), or suite directories")
    parser.add_argument("--out", default=str(OUT), help="Markdown file to write (default docs/results.md); - prints it")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also rewrite the results table between the markers in this README")


def run(args: argparse.Namespace, record=None) -> int:
    """`yggdrasil bench report`: writes documents, not a result (record is unused)."""
    dirs = args.dirs or [RESULTS]
    missing = [d for d in dirs if not d.is_dir()]
    if missing:
        print(f"error: not a directory: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    out = None if args.out == "-" else Path(args.out)
    text = render(dirs, out.parent if out else Path.cwd())
    if args.readme is not None:
        suite_dirs = [s for d in dirs for s in suite_dirs_of(d)]
        args.readme.write_text(replace_readme_block(args.readme.read_text(), readme_table(suite_dirs)))
        print(f"rewrote the results table in {args.readme}", file=sys.stderr)
    if out is None:
        sys.stdout.write(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out} ({len(text.splitlines())} lines)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m yggdrasil.bench.report` (the same as `yggdrasil bench report`; no torch import)."""
    parser = argparse.ArgumentParser(prog="python -m yggdrasil.bench.report",
                                     description="Write docs/results.md from committed result files.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
