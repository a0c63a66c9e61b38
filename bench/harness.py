"""What every `yggdrasil bench` suite shares: options, the opened bundle and prompts, one timed
generation, the correctness check against autoregressive greedy, and the result files.

A suite builds variants (name -> fn(prompt index) -> Run), times them interleaved with
`measure`, and hands its rows to `write_outputs`. Every variant is timed the same way, ours and
HF's alike:

    TPOT = (wall(generate N tokens) - wall(generate 1 token)) / (N - 1)

so prefill (and a draft model's prefill) cancels out and what is left is the steady decode rate.
A run whose N-token wall time is not above its 1-token one (timing noise on a loaded machine) gets
TPOT 0, flagged: its row's tpot_clipped counts such runs.

Correctness: every greedy row's tokens are compared, on every prompt and repeat, with the suite's
reference (`compute_reference`: an autoregressive greedy decode), unless the suite gave the row a
reference of its own (`own_reference`: the autoregressive greedy output of the row's own engine,
used for bundles whose weights are not fp32; such rows say "(own reference)"; `deployed_reference`
applies that rule to the ablation and trees suites). For such bundles a row that leaves its
reference only at a tie of the deployed model's logits (compile's warm-load rule) stays valid and
names the tie: low-precision activations make even plain decoding split ties by path.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from yggdrasil.bundle import open_bundle
from yggdrasil.compile.check import TIE_ULPS, compare_greedy
from yggdrasil.errors import InvalidRequestError
from yggdrasil.predictor import prompts as prompt_sets
from yggdrasil.sampling import SamplingParams

from . import common
from .provenance import Provenance, Results

GREEDY = SamplingParams()
STATISTIC = {"tpot_ms": "median over (prompt, repeat) runs of TPOT, with min and max",
             "speedup": "median of per-(prompt, repeat) TPOT ratios, paired on the same prompt and repeat",
             "aal": "delivered tokens per target forward (none past the length limit or the stop token), "
                    "pooled over the row's runs"}
SUITES = ("compare", "ablation", "trees", "sensitivity")
WARM_UP_TOKENS = 16  # untimed; enough for a speculator to use its common shapes
TIE_NOTE = (f"a row that leaves the reference only where the deployed model's eager logits tie (best two within "
            f"{TIE_ULPS} ulps of its matmul dtype, compile's warm-load rule) is ok with the tie named: the deployed "
            "model itself splits such ties by the path its activations took (prefill vs decode vs verify rows)")


@dataclass(frozen=True)
class BenchOptions:
    suite: str
    bundle: Path
    prompts: tuple[str, ...] = ("humaneval", "mtbench")  # built-in sets or .jsonl files
    n: int = 4  # prompts per set
    max_new_tokens: int = 64
    repeats: int = 1
    out: Path = Path("bench-results")
    split: str = "held-out"  # calibration never saw these (a file is used whole)
    temperatures: tuple[float, ...] = (0.0, 0.6, 1.0)
    seed: int = 0
    skip: tuple[str, ...] = ()  # variant names (or prefixes) to leave out, e.g. hf-assisted
    llama_cpp: Path | None = None  # compare: a llama.cpp build directory whose tools run as peer rows
    threads: int | None = None  # torch threads (--threads); None: one per core

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise InvalidRequestError(f"unknown suite {self.suite!r}: choose one of {', '.join(SUITES)}")
        if self.n < 1 or self.repeats < 1:
            raise InvalidRequestError(f"--n and --repeats must be >= 1, got {self.n} and {self.repeats}")
        if self.max_new_tokens < 2:
            raise InvalidRequestError(f"--max-new-tokens must be >= 2 (TPOT needs two tokens), "
                                      f"got {self.max_new_tokens}")
        if any(t < 0 for t in self.temperatures):
            raise InvalidRequestError(f"temperatures must be >= 0, got {list(self.temperatures)}")

    def skipped(self, name: str) -> bool:
        return name in self.skip


@dataclass(frozen=True)
class Prompt:
    set: str
    id: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Run:
    """One timed generation of one variant on one prompt."""

    tokens: tuple[int, ...]
    tpot: float  # seconds per output token after the first
    committed: int | None = None  # tokens committed by speculation iterations (None: no speculation)
    iterations: int | None = None  # target forwards that committed them
    buckets: tuple[tuple[str, int], ...] = ()  # shapes chosen and how often
    clipped: bool = False  # the N-token run took no longer than the 1-token run (noise): tpot is 0


@dataclass
class Setup:
    """The bundle, the prompts and each prompt's autoregressive greedy reference tokens."""

    options: BenchOptions
    runtime: object  # yggdrasil.generator.Generator over the bundle's graphs
    prompts: list[Prompt]
    prompt_info: dict
    reference: list[tuple[int, ...]] = field(default_factory=list)  # what greedy rows must reproduce
    reference_name: str = "autoregressive greedy"  # the row (or decoder) the reference came from
    own_tokens: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)  # reference row -> its tokens
    own_reference: dict[str, str] = field(default_factory=dict)  # row -> the reference row it is checked against
    # the deployed reduced-precision model whose eager logits judge a divergence a tie (compile's
    # rule, compile/check.py); None: only exact equality passes (fp32)
    tie_model: object | None = None
    provenance: Provenance | None = None  # taken when the suite started (None: taken when it writes)


Generate = Callable[[tuple[int, ...], int, SamplingParams], object]  # -> a result with .tokens


def open_setup(options: BenchOptions, provenance: Provenance | None = None) -> Setup:
    common.log(f"opening bundle {options.bundle}")
    runtime = open_bundle(options.bundle, quiet=True).generator()
    prompts, info = load_prompts(options, runtime)
    common.log(f"{len(prompts)} prompts ({', '.join(options.prompts)}), {options.max_new_tokens} tokens each")
    return Setup(options, runtime, prompts, info, provenance=provenance)


def load_prompts(options: BenchOptions, runtime) -> tuple[list[Prompt], dict]:
    """The first n prompts of each set (held-out split of the built-in sets), encoded, with the
    ones that would not fit the bundle's context left out (and counted)."""

    room = int(runtime.manifest.recipe["max_context"]) - options.max_new_tokens - 64
    prompts, dropped = [], 0
    for name in options.prompts:
        part = "all" if name not in prompt_sets.BUILT_IN else options.split
        for text in prompt_sets.split(prompt_sets.load_set(name), part)[:options.n]:
            ids = tuple(prompt_sets.encode(text, runtime.target.tokenizer))
            if len(ids) > room:
                dropped += 1
                continue
            prompts.append(Prompt(text.set if name in prompt_sets.BUILT_IN else Path(name).stem, text.id, ids))
    if not prompts:
        raise InvalidRequestError(f"no prompt of {', '.join(options.prompts)} fits the bundle's context "
                                  f"with {options.max_new_tokens} new tokens; use fewer --max-new-tokens")
    info = {"sets": list(options.prompts), "split": options.split, "per_set": options.n,
            "dropped_too_long": dropped, "ids": [f"{p.set}/{p.id}" for p in prompts],
            "prompt_tokens": [len(p.ids) for p in prompts]}
    return prompts, info


def timed_run(generate: Generate, ids: tuple[int, ...], n: int, sampling: SamplingParams = GREEDY) -> Run:
    """Time N tokens and 1 token (same prompt, same sampling) and take the difference."""
    started = time.perf_counter()
    result = generate(ids, n, sampling)
    full = time.perf_counter() - started
    started = time.perf_counter()
    generate(ids, 1, sampling)
    first = time.perf_counter() - started
    if len(result.tokens) != n:  # no stop ids: a short run would make TPOT silently wrong
        raise RuntimeError(f"a variant emitted {len(result.tokens)} tokens, expected {n}")
    spec = getattr(result, "spec", None)
    committed = iterations = None
    buckets: tuple = ()
    if spec is not None:
        committed, iterations = spec.committed, spec.iterations
        buckets = tuple(sorted(spec.shapes.items()))
    elif hasattr(result, "target_calls"):  # HF generate: every target forward is one iteration
        committed, iterations = n, result.target_calls
    return Run(tuple(result.tokens), max(full - first, 0.0) / (n - 1), committed, iterations, buckets,
               clipped=full <= first)


def variant(setup: Setup, generate: Generate, sampling: SamplingParams = GREEDY):
    """fn(prompt index, tokens=N) -> Run for measure()."""
    n = setup.options.max_new_tokens
    return lambda i, tokens=n: timed_run(generate, setup.prompts[i].ids, tokens, sampling)


def compute_reference(setup: Setup, greedy: Generate, name: str = "autoregressive greedy") -> None:
    """Autoregressive greedy tokens of every prompt: what every greedy variant must reproduce
    (unless given its own reference). name: where they came from, for the check's record."""
    setup.reference = greedy_tokens(setup, greedy)
    setup.reference_name = name


def own_reference(setup: Setup, row: str, reference_row: str, greedy: Generate) -> None:
    """Check row against reference_row's autoregressive greedy tokens (greedy decodes them, once
    per reference row) instead of the suite's reference: for rows whose kernels differ from the
    reference's, where rounding may split a logit near-tie the other way."""
    if reference_row not in setup.own_tokens:
        setup.own_tokens[reference_row] = greedy_tokens(setup, greedy)
    setup.own_reference[row] = reference_row


def deployed_reference(setup: Setup, fmt: str, deployed: Generate, eager: Generate,
                       eager_rows: list[str]) -> str | None:
    """Issue 22's exactness rule for suites whose rows run on the bundle's graphs or on eager steps
    (compare applies it to its other backends too). fmt: the bundle's deployed weight format.
    fp32: every row against eager autoregressive greedy (deployed: the bundle's autoregressive
    graphs, then unused). Otherwise the deployed model, the bundle's own graphs, is the reference,
    and eager_rows are checked against eager autoregressive greedy, "(own reference)": eager
    reduced-precision kernels round differently and may split a logit near-tie the other way.
    Returns the table's footnote on it (None for fp32, whose tables say nothing new)."""
    if fmt == "fp32":
        compute_reference(setup, eager, name="ar-eager")
        return None
    compute_reference(setup, deployed, name="ar-compiled")
    model = setup.runtime.target.model
    # a bundle measured (and proven) batch-invariant at compile must equal its own output exactly:
    # no tie rule for it; one that is not, or whose manifest predates the measurement, keeps it
    bitwise = bool(getattr(getattr(setup.runtime, "manifest", None), "bitwise", False))
    setup.tie_model = None if bitwise else model
    for row in eager_rows:
        own_reference(setup, row, "ar-eager", eager)
    agree = sum(a == b for a, b in zip(setup.reference, setup.own_tokens.get("ar-eager", [])))
    eager_note = (f"; eager {fmt} autoregressive greedy equals the deployed model's on "
                  f"{agree}/{len(setup.prompts)} prompts" if eager_rows else "")
    rule = (f"exact (the bundle's {fmt} steps were measured batch-invariant at compile: no tie rule)" if bitwise
            else TIE_NOTE)
    return (f"tokens: greedy output vs the deployed {fmt} model's autoregressive greedy, i.e. the bundle's own "
            "graphs (ar-compiled), on every prompt; \"(own reference)\": rows on eager steps, checked against "
            f"eager autoregressive greedy (ar-eager), since eager {fmt} kernels round differently and may split "
            f"logit near-ties the other way{eager_note}; {rule}")


def greedy_tokens(setup: Setup, greedy: Generate) -> list[tuple[int, ...]]:
    n = setup.options.max_new_tokens
    return [tuple(greedy(p.ids, n, GREEDY).tokens) for p in setup.prompts]


def measure(setup: Setup, variants: dict[str, Callable[[int], Run]], label: str = "") -> list[common.Sample]:
    """Warm every variant up once (untimed), then time them interleaved: repeat > prompt > variant,
    the variant order rotating each repeat so drift hits all alike."""
    warm = min(setup.options.max_new_tokens, WARM_UP_TOKENS)
    for name, run in variants.items():  # first-call allocations and every step shape it uses
        common.log(f"{label}warm-up: {name} ({warm} tokens)")
        run(0, warm)
    total = setup.options.repeats * len(setup.prompts) * len(variants)
    common.log(f"{label}timing {len(variants)} variants x {len(setup.prompts)} prompts x "
               f"{setup.options.repeats} repeats = {total} runs")
    wrapped = {name: (lambda fn: lambda i: _values(fn(i)))(fn) for name, fn in variants.items()}
    return common.interleaved(setup.options.repeats, len(setup.prompts), wrapped, label=label)


def _values(run: Run) -> dict:
    """A sample's values: the run, and its TPOT where common.paired_ratios looks for it."""
    return {"run": run, "tpot": run.tpot}


# ---------------------------------------------------------------- summaries

def runs_of(samples: list[common.Sample], name: str) -> list[Run]:
    return [s.values["run"] for s in samples if s.variant == name]


def aal(runs: list[Run]) -> float | None:
    """Tokens per target forward, pooled over runs (Σ committed / Σ iterations)."""
    iterations = sum(r.iterations or 0 for r in runs)
    if not iterations or any(r.committed is None for r in runs):
        return None
    return sum(r.committed for r in runs) / iterations


def check_tokens(setup: Setup, samples: list[common.Sample], name: str) -> dict:
    """Greedy tokens vs the row's autoregressive reference on every prompt and repeat. With a
    tie_model, a run that leaves the reference where the deployed model's logits tie (TIE_NOTE)
    is listed under ties and stays valid; any other difference makes the row invalid."""
    own = setup.own_reference.get(name)
    expected = setup.reference if own is None else setup.own_tokens[own]
    wrong, ties = set(), {}
    for s in samples:
        tokens = s.values["run"].tokens
        if s.variant != name or tokens == expected[s.item]:
            continue
        prompt = setup.prompts[s.item]
        agreement = (None if setup.tie_model is None else
                     compare_greedy(setup.tie_model, list(prompt.ids), list(expected[s.item]), list(tokens)))
        if agreement is not None and agreement.tie:
            ties[prompt.id] = f"{prompt.id} at token {agreement.at} (gap {agreement.gap:.3g} <= {agreement.tolerance:.3g})"
        else:
            wrong.add(prompt.id)
    differs = sorted(wrong | set(ties))
    check = {"valid": not wrong, "exact": len(setup.prompts) - len(differs), "of": len(setup.prompts),
             "differs_on": sorted(wrong), "reference": own or setup.reference_name}
    if ties:
        check["ties"] = [ties[k] for k in sorted(ties) if k not in wrong]
    return check if own is None else {**check, "own_reference": True}


def speedup(samples: list[common.Sample], base: str, name: str) -> float | None:
    """Median over (prompt, repeat) pairs of base TPOT / this TPOT (> 1: faster than base)."""
    if base == name:
        return None
    return common.summarize(common.paired_ratios(samples, base, name, "tpot"))["median"]


def summary_row(setup: Setup, samples: list[common.Sample], name: str, bases: tuple[str, ...],
                greedy: bool = True) -> dict:
    """One table row: TPOT median and range, AAL, speed-ups over the bases, correctness."""
    runs = runs_of(samples, name)
    tpot = common.summarize([r.tpot for r in runs])
    buckets: dict[str, int] = {}
    for r in runs:
        for key, count in r.buckets:
            buckets[key] = buckets.get(key, 0) + count
    row = {"variant": name, "tpot_ms": _ms(tpot["median"]), "tpot_min_ms": _ms(tpot["min"]),
           "tpot_max_ms": _ms(tpot["max"]), "tok_per_s": round(1 / tpot["median"], 2) if tpot["median"] else None,
           "aal": _round(aal(runs)), "runs": len(runs),
           "tpot_clipped": sum(r.clipped for r in runs)}  # runs whose TPOT was clipped to 0 (timing noise)
    for base in bases:
        row[f"x_{base}"] = _round(speedup(samples, base, name))
    check = check_tokens(setup, samples, name) if greedy else {"valid": None, "sampled": True}
    row["valid"] = check["valid"]
    row["check"] = check
    if buckets:
        row["buckets"] = dict(sorted(buckets.items(), key=lambda kv: -kv[1]))
    return row


def clipped_note(rows: list[dict]) -> str:
    """A table footnote naming the rows with TPOTs clipped to 0 by timing noise ('' if none)."""
    clipped = [f"{r['variant']} ({r['tpot_clipped']}/{r['runs']})" for r in rows if r.get("tpot_clipped")]
    if not clipped:
        return ""
    return ("\nTPOT clipped to 0 (the N-token run took no longer than the 1-token one: timing noise) in runs of "
            + ", ".join(clipped))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def status(row: dict) -> str:
    if row["valid"] is None:
        return "sampled"
    check = row["check"]
    verdict = "ok" if row["valid"] else f"INVALID ({check['exact']}/{check['of']})"
    if row["valid"] and check.get("ties"):
        verdict += f" ({check['exact']}/{check['of']} exact, tie on {len(check['ties'])})"
    return verdict + (" (own reference)" if check.get("own_reference") else "")


# ---------------------------------------------------------------- records and files

def record(setup: Setup) -> dict:
    """Where the numbers came from: device, dtype, versions, model hashes, bundle, prompts."""
    rt = setup.runtime
    manifest = rt.manifest
    return {"environment": common.environment(dtype=manifest.dtype, bundle_device=manifest.environment.device),
            "bundle": {"path": str(rt.path), "id": manifest.bundle_id, "recipe": manifest.recipe.get("name"),
                       "recipe_source": manifest.recipe.get("source"), "recipe_identity": manifest.recipe_identity,
                       "buckets": list(manifest.buckets),
                       "weights": {role: manifest.weight_format(role) for role in manifest.models}},
            "models": {role: {"name": m.get("name"), "sha256": m.get("sha256")} for role, m in manifest.models.items()},
            "prompts": setup.prompt_info, "max_new_tokens": setup.options.max_new_tokens,
            "repeats": setup.options.repeats,
            "method": "TPOT = (wall(N tokens) - wall(1 token)) / (N-1), same prompts and N for every "
                      "variant, one process, interleaved repeat > prompt > variant with rotating order; "
                      "speed-ups are medians of per (prompt, repeat) TPOT ratios; AAL = tokens per "
                      "target forward, pooled",
            "statistic": STATISTIC}


def title(setup: Setup, suite: str) -> str:
    """The plot and table heading: suite, recipe (and weight format unless fp32), workload and device."""
    manifest = setup.runtime.manifest
    fmt = manifest.weight_format("target")
    weights = "" if fmt == "fp32" else f" ({fmt} weights)"
    return (f"{suite}, {manifest.recipe.get('name')}{weights}: {len(setup.prompts)} prompts x "
            f"{setup.options.max_new_tokens} tokens, {common.environment()['device']}")


def write_outputs(setup: Setup, suite: str, result: dict, table: str, rows: list[dict],
                  plot: Callable[[Path], None]) -> dict:
    """<suite>.txt (the table), .csv (the rows), .json (everything), .md and .png into --out; the
    table to stdout and the compact JSON as stdout's last line."""
    out = Path(setup.options.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"{suite}.{kind}" for kind in ("txt", "csv", "json", "md", "png")}
    paths["txt"].write_text(table + "\n")
    write_csv(paths["csv"], rows)
    paths["md"].write_text(markdown(rows) + "\n")
    plot(paths["png"])
    print(table)
    common.log(f"wrote {', '.join(str(p) for k, p in paths.items() if k != 'json')}")
    results = Results(setup.provenance or Provenance.start(None))  # the one way every suite writes a result
    return results.write({"benchmark": suite, **result, "files": {k: str(p) for k, p in paths.items()}},
                         paths["json"], bundle=Path(setup.runtime.path))


def flat(row: dict) -> dict:
    """A row without its nested parts (CSV and Markdown cells)."""
    return {k: v for k, v in row.items() if not isinstance(v, (dict, list))}


def write_csv(path: Path, rows: list[dict]) -> None:
    flats = [flat(r) for r in rows]
    columns = list(dict.fromkeys(k for r in flats for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(flats)


def markdown(rows: list[dict]) -> str:
    flats = [flat(r) for r in rows]
    columns = list(dict.fromkeys(k for r in flats for k in r))
    return "\n".join(common.markdown_table(columns, [[r.get(c) for c in columns] for r in flats]))


def text_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """columns: (header, row key); None prints as '-'."""
    cells = [[("-" if r.get(key) is None else _cell(r[key])) for _, key in columns] for r in rows]
    return common.format_table([h for h, _ in columns], cells)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)
