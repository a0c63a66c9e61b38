"""llama.cpp as a peer in `bench compare --llama-cpp DIR`: its own tools, from a build directory,
on the same GGUF files, prompts, thread count, greedy settings and token count as our rows.

Rows (labelled backend "llama.cpp"):
  llama.cpp-ar          llama-completion, plain greedy decoding
  llama.cpp-draft-D<k>  llama-speculative-simple with the bundle's draft model, at most k drafted
                        tokens per step; the best of k = 2, 4, 8 is shown, all are in the JSON
  llama.cpp-lookup-D<k> llama-lookup (prompt n-gram lookup), same best-of-k

How the comparison is kept fair:
  * prompts: our prompt ids decoded back to text with their special tokens (chat template
    included where ours used one), given to the tool in a file; the tools parse special tokens,
    so both tokenize the same text (the prompt token counts of both are recorded);
  * greedy (--temp 0 --top-k 1), --ignore-eos, our --max-new-tokens, torch's thread count;
  * time per token from the tool's own decode timer (prompt evaluation excluded), which is
    what our TPOT = (wall(N) - wall(1)) / (N - 1) measures: llama-completion's "eval time"
    over its runs; the speculative tools' "decoded N tokens in T seconds" (T / N for the draft
    tool, whose timer starts with the forward of the last prompt token; T / (N - 1) for lookup,
    whose first token comes from the prompt's logits);
  * the calls are timed interleaved with our rows (one subprocess per prompt and run).
llama.cpp computes in its own quantized kernels, so its tokens may differ from ours; the row
says on how many prompts its text equals our autoregressive greedy text instead of INVALID.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from yggdrasil.models.catalog import resolve_model
from yggdrasil.errors import YggdrasilError
from yggdrasil.models.loader import load_tokenizer

from . import common
from .harness import STATISTIC, BenchOptions, Run, Setup, load_prompts, measure, summary_row, text_table
from .provenance import Results

BACKEND = "llama.cpp"
DRAFT_LENGTHS = (2, 4, 8)
TOOLS = {"ar": "llama-completion", "draft": "llama-speculative-simple", "lookup": "llama-lookup"}
BUILD_HINT = ("build with: cmake -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release && cmake --build build "
              "--target " + " ".join(TOOLS.values()))
TIMEOUT_S = 900  # one generation; a 1.5B model at a few tok/s stays well under this


class LlamaCppError(YggdrasilError):
    """A llama.cpp tool failed or printed output this module cannot read."""


@dataclass(frozen=True)
class LlamaOutput:
    """What one tool run reports about its decoding."""

    predicted: int  # tokens the decode timer covers
    decode_s: float  # seconds of decoding them, prompt evaluation excluded
    prompt_tokens: int | None
    drafted: int | None = None  # speculative tools only
    accepted: int | None = None
    text: str = ""  # the generated text, as printed on stdout

    @property
    def tpot(self) -> float:
        return self.decode_s / self.predicted


@dataclass(frozen=True)
class LlamaJob:
    """What every call of one bench run shares."""

    target: Path
    draft: Path | None
    threads: int
    context: int


@dataclass(frozen=True)
class Mode:
    name: str  # the row name
    family: str  # ar, draft or lookup
    tool: Path
    draft_length: int | None = None

    def command(self, job: LlamaJob, prompt_file: Path, tokens: int) -> list[str]:
        threads = str(job.threads)
        args = [str(self.tool), "-m", str(job.target), "-f", str(prompt_file), "-n", str(tokens),
                "-t", threads, "-tb", threads, "-c", str(job.context), "--temp", "0", "--top-k", "1",
                "--seed", "0", "--ignore-eos"]
        if self.family == "ar":
            return args + ["-no-cnv", "--no-display-prompt"]
        args += ["--spec-draft-n-max", str(self.draft_length)]
        if self.family == "draft":  # without --spec-type the tool starts no speculator at all
            args += ["-md", str(job.draft), "-td", threads, "--spec-type", "draft-simple"]
        return args


# ---------------------------------------------------------------- parsing

_EVAL = re.compile(r":\s+eval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)")  # not "prompt eval time"
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


def parse_output(family: str, stdout: str, stderr: str, prompt_text: str = "") -> LlamaOutput:
    """The decode numbers of one run from the tool's stdout and stderr (its log)."""
    log = stdout + "\n" + stderr
    if family == "ar":
        found = _EVAL.search(log)
        if found is None:
            raise LlamaCppError("llama-completion printed no 'eval time' line; " + _tail(stderr))
        prompt = _PROMPT_EVAL.search(log)
        return LlamaOutput(int(found.group(2)), float(found.group(1)) / 1e3,
                           int(prompt.group(1)) if prompt else None, text=stdout)
    decoded, drafted, accepted = _DECODED.search(log), _DRAFTED.search(log), _ACCEPTED.search(log)
    if decoded is None or drafted is None or accepted is None:
        raise LlamaCppError(f"{TOOLS[family]} printed no 'decoded ... tokens' / n_drafted / n_accept lines; "
                            + _tail(stderr))
    predicted = int(decoded.group(1)) - (1 if family == "lookup" else 0)  # see the module doc
    encoded = _ENCODED.search(log)
    return LlamaOutput(predicted, float(decoded.group(2)), int(encoded.group(1)) if encoded else None,
                       int(drafted.group(1)), int(accepted.group(1)), generated_text(stdout, prompt_text))


def generated_text(stdout: str, prompt_text: str) -> str:
    """The speculative tools print the prompt, then the generation, framed by blank lines."""
    text = stdout.strip("\n")
    if prompt_text and prompt_text in text:
        text = text[text.index(prompt_text) + len(prompt_text):]
    return text


def _tail(text: str, lines: int = 3) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "last output: " + " | ".join(kept) if kept else "it printed nothing"


# ---------------------------------------------------------------- tools and modes

def find_tool(directory: Path, name: str) -> Path | None:
    """A tool in DIR, DIR/bin or DIR/build/bin (a build tree or an install prefix)."""
    for folder in (directory, directory / "bin", directory / "build" / "bin"):
        path = folder / name
        if path.is_file():
            return path
    return None


def plan_modes(directory: Path | None, has_draft: bool) -> tuple[list[Mode], list[str]]:
    """The modes this setup can run, and one note per mode left out saying what is missing."""
    if directory is None:
        return [], ["llama.cpp rows not run: pass --llama-cpp DIR (a llama.cpp build directory)"]
    if not directory.is_dir():
        return [], [f"llama.cpp rows not run: {directory} is not a directory ({BUILD_HINT})"]
    modes, notes = [], []
    for family, tool_name in TOOLS.items():
        if family == "draft" and not has_draft:
            notes.append("llama.cpp-draft not run: the bundle has no draft model")
            continue
        tool = find_tool(directory, tool_name)
        if tool is None:
            notes.append(f"llama.cpp-{family} not run: {tool_name} not found in {directory} ({BUILD_HINT})")
            continue
        if family == "ar":
            modes.append(Mode("llama.cpp-ar", family, tool))
        else:
            modes += [Mode(f"llama.cpp-{family}-D{k}", family, tool, k) for k in DRAFT_LENGTHS]
    return modes, notes


def gguf_of(name: str | None, role: str) -> tuple[Path | None, str | None]:
    """The model's joined GGUF file, or a note saying why llama.cpp cannot load it."""
    if name is None:
        return None, None
    model = resolve_model(name)
    if model.format != "gguf":
        return None, f"llama.cpp rows not run: the {role} model {name} is not a GGUF file ({model.path})"
    return model.path, None


# ---------------------------------------------------------------- running

@dataclass
class LlamaVariant:
    """fn(prompt index, tokens) -> Run for harness.measure; keeps every output it parsed."""

    mode: Mode
    job: LlamaJob
    prompt_files: list[Path]
    prompt_texts: list[str]
    max_new_tokens: int
    outputs: list[tuple[int, LlamaOutput]] = field(default_factory=list)  # (prompt index, output), timed runs

    def __call__(self, item: int, tokens: int | None = None) -> Run:
        """measure() times fn(i) and warms up with fn(0, tokens): only timed runs are kept."""
        output = self.generate(item, tokens or self.max_new_tokens)
        if tokens is None:
            self.outputs.append((item, output))
        committed = iterations = None
        if output.accepted is not None:  # every iteration commits its accepted drafts plus one
            committed, iterations = output.predicted, max(output.predicted - output.accepted, 1)
        return Run((), output.tpot, committed, iterations)

    def generate(self, item: int, tokens: int) -> LlamaOutput:
        command = self.mode.command(self.job, self.prompt_files[item], tokens)
        try:
            done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=TIMEOUT_S,
                                  stdin=subprocess.DEVNULL, cwd=command_folder(self.prompt_files))
        except (OSError, subprocess.TimeoutExpired) as error:
            raise LlamaCppError(f"{self.mode.tool.name} did not run: {error}") from error
        if done.returncode != 0:
            raise LlamaCppError(f"{self.mode.tool.name} exited with status {done.returncode}; "
                                + _tail(done.stderr))
        return parse_output(self.mode.family, done.stdout, done.stderr, self.prompt_texts[item])


def command_folder(prompt_files: list[Path]) -> Path:
    """The tools run in the prompts' temporary folder: llama-lookup writes an n-gram cache file."""
    return prompt_files[0].parent


def write_prompts(folder: Path, texts: list[str]) -> list[Path]:
    """One file per prompt, for -f. The tools drop one trailing newline from a prompt file
    (common/arg.cpp), which would cut a chat prompt's final newline: one extra is written."""
    paths = []
    for i, text in enumerate(texts):
        path = folder / f"prompt-{i}.txt"
        path.write_text(text + "\n")
        paths.append(path)
    return paths


class LlamaPeer:
    """The llama.cpp variants of one compare run, the notes on what was left out, and their rows."""

    def __init__(self, modes: list[Mode], job: LlamaJob | None, prompt_texts: list[str],
                 reference_texts: list[str] | None, max_new_tokens: int, notes: list[str]) -> None:
        self.notes = list(notes)
        self.job = job
        self.reference_texts = reference_texts
        self.variants: dict[str, LlamaVariant] = {}
        if job is None or not modes:
            return
        self._folder = tempfile.TemporaryDirectory(prefix="yggdrasil-llama-")  # removed with this object
        files = write_prompts(Path(self._folder.name), prompt_texts)
        for mode in modes:
            candidate = LlamaVariant(mode, job, files, prompt_texts, max_new_tokens)
            common.log(f"llama.cpp probe: {mode.name} (2 tokens)")
            try:  # a tool that cannot run is left out with its reason, not a failed bench
                candidate.generate(0, 2)
            except LlamaCppError as error:
                self.notes.append(f"{mode.name} not run: {error}")
                continue
            self.variants[mode.name] = candidate

    def described(self, name: str) -> dict:
        mode = self.variants[name].mode
        what = {"ar": "plain greedy decoding",
                "draft": f"draft-model speculation, at most {mode.draft_length} drafted tokens",
                "lookup": f"prompt lookup (n-gram), at most {mode.draft_length} drafted tokens"}[mode.family]
        return {"backend": BACKEND, "what": f"{mode.tool.name}: {what}"}

    def finish_row(self, row: dict) -> dict:
        """A summary row (built with greedy=False) with llama.cpp's own numbers and checks."""
        variant = self.variants[row["variant"]]
        outputs = variant.outputs
        items = sorted({i for i, _ in outputs})
        differs = sorted({i for i, out in outputs if self.reference_texts is not None
                          and not same_text(out.text, self.reference_texts[i])})
        drafted = sum(out.drafted or 0 for _, out in outputs)
        accepted = sum(out.accepted or 0 for _, out in outputs)
        row.update(self.described(row["variant"]))
        row.update({"family": f"llama.cpp-{variant.mode.family}", "draft_length": variant.mode.draft_length,
                    "acceptance": round(accepted / drafted, 3) if drafted else None,
                    "prompt_tokens": [out.prompt_tokens for _, out in outputs],
                    "valid": None, "check": {"same_text": len(items) - len(differs), "of": len(items),
                                             "differs_on": differs}})
        row["status"] = (f"text {len(items) - len(differs)}/{len(items)} same" if self.reference_texts is not None
                         else "no reference")
        if self.reference_texts is None:
            row["check"] = {"same_text": None, "of": len(items), "differs_on": []}
        return row


def same_text(theirs: str, ours: str) -> bool:
    """The same greedy text over the shorter of the two (the speculative tools may overshoot N)."""
    theirs, ours = theirs.rstrip(), ours.rstrip()
    shorter = min(len(theirs), len(ours))
    return shorter > 0 and theirs[:shorter] == ours[:shorter]


def best_of_lengths(rows: list[dict]) -> tuple[list[dict], dict]:
    """Per speculative family, only the draft length with the lowest median TPOT stays a row;
    every length's TPOT and acceptance goes into the returned info."""
    kept, lengths, best = [], {}, {}
    for row in rows:
        family = row.get("family")
        if row.get("backend") != BACKEND or row.get("draft_length") is None:
            kept.append(row)
            continue
        lengths.setdefault(family, {})[row["draft_length"]] = {"tpot_ms": row["tpot_ms"],
                                                               "acceptance": row["acceptance"], "aal": row["aal"]}
        if row["tpot_ms"] is not None and (family not in best or row["tpot_ms"] < best[family]["tpot_ms"]):
            best[family] = row
    kept += best.values()
    return kept, lengths


def summarize(peer: LlamaPeer, rows: list[dict], our_prompt_tokens: list[int] | None = None
              ) -> tuple[list[dict], dict]:
    """The rows with one best draft length per speculative family, and what the JSON records."""
    rows, lengths = best_of_lengths(rows)
    info = {"notes": peer.notes, "draft_lengths": lengths}
    if peer.job is not None and peer.variants:
        first = next(iter(peer.variants.values()))
        theirs = dict(sorted((i, out.prompt_tokens) for i, out in first.outputs))
        info["prompt_tokens"] = {"ours": our_prompt_tokens, "llama.cpp": list(theirs.values())}
        info.update({"target": str(peer.job.target), "draft": str(peer.job.draft) if peer.job.draft else None,
                     "threads": peer.job.threads, "context": peer.job.context,
                     "commands": {name: " ".join(v.mode.command(peer.job, Path("PROMPT.txt"), first.max_new_tokens))
                                  for name, v in peer.variants.items()},
                     "method": METHOD})
    return rows, info


METHOD = ("llama.cpp rows: its tools on the same GGUF, our prompt ids decoded to text (special tokens kept), "
          "greedy (--temp 0 --top-k 1 --ignore-eos), same threads and new tokens; TPOT from its decode "
          "timer (prompt evaluation excluded); speculative rows show the best of draft lengths "
          + "/".join(map(str, DRAFT_LENGTHS)) + "; tokens: its text vs our autoregressive greedy text")


def table_notes(info: dict) -> str:
    """Lines under the compare table: how llama.cpp was run, every draft length, what was left out."""
    lines = [info["method"]] if "method" in info else []
    tokens = info.get("prompt_tokens", {})
    if tokens.get("ours") is not None:
        same = sum(a == b for a, b in zip(tokens["ours"], tokens["llama.cpp"]))
        lines.append(f"prompt tokens, ours vs llama.cpp's tokenizer: the same on {same}/{len(tokens['ours'])} prompts"
                     + ("" if same == len(tokens["ours"]) else f" (ours {tokens['ours']}, its {tokens['llama.cpp']})"))
    for family, by_length in info.get("draft_lengths", {}).items():
        bits = [f"D{k} {v['tpot_ms']:.1f} ms" + (f" (accept {v['acceptance']:.0%})" if v["acceptance"] is not None
                                                  else "") for k, v in sorted(by_length.items())]
        lines.append(f"{family}: " + ", ".join(bits))
    lines += info.get("notes", [])
    return "".join("\n" + line for line in lines)


def open_peer(setup, directory: Path | None) -> LlamaPeer:
    """The peer for a compare setup: same GGUF files, prompts (as text), threads and token count."""
    runtime = setup.runtime
    roles = runtime.manifest.models
    tokenizer = runtime.target.tokenizer
    reference_texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in setup.reference]
    return make_peer(directory, roles["target"]["name"], roles["draft"]["name"] if "draft" in roles else None,
                     [tokenizer.decode(p.ids, skip_special_tokens=False) for p in setup.prompts], reference_texts,
                     setup.options, int(runtime.manifest.recipe["max_context"]))


def make_peer(directory: Path | None, target_name: str, draft_name: str | None, prompt_texts: list[str],
              reference_texts: list[str] | None, options, context: int) -> LlamaPeer:
    """Modes for what DIR holds minus --skip, the models' GGUF files, torch's thread count."""
    modes, notes = plan_modes(directory, draft_name is not None)
    skipped = options.skipped  # --skip llama.cpp, llama.cpp-lookup or one row name
    modes = [m for m in modes if not (skipped(BACKEND) or skipped(f"llama.cpp-{m.family}") or skipped(m.name))]
    peer = partial(LlamaPeer, prompt_texts=prompt_texts, reference_texts=reference_texts,
                   max_new_tokens=options.max_new_tokens)
    if not modes:
        return peer([], None, notes=notes)
    target, target_note = gguf_of(target_name, "target")
    draft, draft_note = gguf_of(draft_name, "draft")
    if target is None:
        return peer([], None, notes=notes + [target_note])
    if draft_note:
        notes.append(draft_note)
        modes = [m for m in modes if m.family != "draft"]
    return peer(modes, LlamaJob(target, draft, torch.get_num_threads(), context), notes=notes)


# ---------------------------------------------------------------- llama.cpp alone (no bundle)

def run_alone(directory: Path, target: str, draft: str | None, options, record: Results,
              context: int = 2048) -> dict:
    """llama.cpp's rows for a model pair no bundle exists for: the same prompt sets, encoded by the
    target's own tokenizer (chat template where ours uses one), timed interleaved; no text check."""
    tokenizer = load_tokenizer(resolve_model(target))
    runtime = SimpleNamespace(target=SimpleNamespace(tokenizer=tokenizer),
                              manifest=SimpleNamespace(recipe={"max_context": context}))
    prompts, prompt_info = load_prompts(options, runtime)  # only reads the tokenizer and max_context
    texts = [tokenizer.decode(p.ids, skip_special_tokens=False) for p in prompts]
    peer = make_peer(directory, target, draft, texts, None, options, context)
    setup = Setup(options, runtime, prompts, prompt_info)
    samples = measure(setup, dict(peer.variants), label="llama.cpp ") if peer.variants else []
    rows = [peer.finish_row(summary_row(setup, samples, name, ("llama.cpp-ar",), greedy=False))
            for name in peer.variants]
    rows, info = summarize(peer, rows)
    heading = (f"llama.cpp alone, {target}" + (f" + {draft}" if draft else "") + f": {len(prompts)} prompts x "
               f"{options.max_new_tokens} tokens, {common.environment()['device']}")
    table = heading + "\n" + text_table(rows, [
        ("variant", "variant"), ("TPOT ms", "tpot_ms"), ("min", "tpot_min_ms"), ("max", "tpot_max_ms"),
        ("tok/s", "tok_per_s"), ("AAL", "aal"), ("accept", "acceptance"), ("x llama AR", "x_llama.cpp-ar")])
    table += table_notes(info)
    result = {"benchmark": "llama.cpp-alone", "environment": common.environment(),
              "models": {"target": target, "draft": draft}, "prompts": prompt_info,
              "max_new_tokens": options.max_new_tokens, "repeats": options.repeats, "setup": info, "rows": rows,
              "statistic": STATISTIC}
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llama-cpp.txt").write_text(table + "\n")
    print(table)
    return record.write(result, out / "llama-cpp.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-cpp", required=True, metavar="DIR", help="llama.cpp build directory")
    parser.add_argument("--target", required=True, help="catalog name or .gguf path")
    parser.add_argument("--draft", default=None, help="draft model (catalog name or .gguf path)")
    parser.add_argument("--prompts", default="humaneval,mtbench")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip", default="")
    parser.add_argument("--out", default="bench-results")


def run(args: argparse.Namespace, record: Results) -> int | None:
    common.set_threads(args.threads)
    options = BenchOptions("compare", Path(args.llama_cpp), prompts=tuple(filter(None, args.prompts.split(","))),
                           n=args.n, max_new_tokens=args.max_new_tokens, repeats=args.repeats, out=Path(args.out),
                           skip=tuple(filter(None, args.skip.split(","))))
    run_alone(Path(args.llama_cpp).expanduser(), args.target, args.draft, options, record)
    return 0

