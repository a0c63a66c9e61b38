"""Start-up of a bundle (issue 41): how long `yggdrasil generate --bundle` takes from launch to
its first token, phase by phase, with a warm page cache and (where this process may drop the
page cache: root on Linux) a cold one; how big the bundle's weights are beside the GGUF files they
were built from; and the resident memory once it has generated, beside the deployed weights.

    yggdrasil bench startup --bundle DIR [--runs 5] [--threads N] [--out FILE]

Each run is a fresh process (`generate --bundle DIR --verbose --max-new-tokens 8`); the
numbers are its own stats lines: "first token X s after process start" (launch to first token,
Python's own start included, the statistic a user feels; median over runs; "after import" where
the system does not say when a process started) and the start-up phases. The original GGUF path
(loading both models from their GGUFs in the bundle's weight format, as bundles did before
they carried weights) is timed once in this process for comparison. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from yggdrasil.bundle import open_bundle
from yggdrasil.runtime.deployed import INDEX_FILE, MODELS_FILE
from yggdrasil.runtime.prefill_plan import chunk_pieces, measure_piece_seconds, piece_options, plan_pieces
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.manifest import read_manifest
from yggdrasil.errors import YggdrasilError
from yggdrasil.models.catalog import resolve_model
from yggdrasil.models.loader import load

from .common import environment, log, timed
from .llama_cpp import find_tool
from .provenance import Results

PROMPT = "def fibonacci(n):"
RSS_PROBE = """
import sys
from yggdrasil.bundle import open_bundle
from yggdrasil.sampling import SamplingParams
g = open_bundle(sys.argv[1], quiet=True).generator()
spec = g.speculator()
ids = g.tokenizer.encode(sys.argv[2])
if spec is not None:
    spec.generate(ids, 64, SamplingParams(temperature=0.0))
else:
    from yggdrasil.runtime.generate import generate
    generate(g.runner, ids, 64, SamplingParams(temperature=0.0))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("RSS", *(int(status[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssFile")))
"""


def one_run(bundle: Path, threads: int | None) -> dict:
    command = [sys.executable, "-m", "yggdrasil.cli", "generate", "--bundle", str(bundle), "--prompt", PROMPT,
               "--max-new-tokens", "8", "--verbose", *(["--threads", str(threads)] if threads else [])]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if run.returncode != 0:
        raise SystemExit(f"generate failed: {run.stderr[-2000:]}")
    first = float(re.search(r"first token ([\d.]+) s after (?:process start|import)", run.stderr).group(1))
    phases = re.search(r"\[start-up: (.*)\]", run.stderr).group(1)
    named = (part.rsplit(" ", 2)[:2] for part in phases.split(" | "))  # "weights 0.75 s"
    return {"first_token_s": first, "phases": {name: float(seconds) for name, seconds in named}}


def first_tokens(bundle: Path, threads: int | None, tokens: int = 64) -> dict:
    """When the first tokens came against the steady pace (issue 50: tokens 1-4 each <= 1.5x the
    steady TPOT): generate --verbose's token arrival times; a speculative iteration brings several
    at once, so the first tokens' pace is (t(4) - t(1)) / 3 per token, the steady one the median
    pace of the tokens after the 16th."""
    command = [sys.executable, "-m", "yggdrasil.cli", "generate", "--bundle", str(bundle), "--prompt", PROMPT,
               "--max-new-tokens", str(tokens), "--verbose", *(["--threads", str(threads)] if threads else [])]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    arrivals = [(int(n), float(t)) for n, t in re.findall(r"(\d+) ([\d.]+) s", re.search(r"\[tokens at: (.*)\]",
                                                                                          run.stderr).group(1))]
    at = dict(arrivals)
    reached = lambda k: next(t for n, t in arrivals if n >= k)  # noqa: E731 - the time the k-th token arrived
    first_pace = (reached(4) - reached(1)) / 3
    tpot = float(re.search(r"TPOT ([\d.]+) ms", run.stderr).group(1)) / 1e3
    return {"arrivals": arrivals, "first_tokens_pace_s": round(first_pace, 4), "steady_tpot_s": round(tpot, 4),
            "ratio": round(first_pace / tpot, 2), "first_token_s": at.get(1) or reached(1)}


def launch_to_tokens(bundle: Path, threads: int | None, tokens: int) -> float:
    """Wall seconds of a fresh `generate --bundle --max-new-tokens N`, as a user's shell times it."""
    command = [sys.executable, "-m", "yggdrasil.cli", "generate", "--bundle", str(bundle), "--prompt", PROMPT,
               "--max-new-tokens", str(tokens), *(["--threads", str(threads)] if threads else [])]
    return timed(subprocess.run, command, capture_output=True, text=True, timeout=600, check=True)[1]


def llama_launch_to_tokens(tool: Path, gguf: Path, threads: int, tokens: int) -> float:
    """Wall seconds of llama.cpp's llama-completion generating N tokens of the same prompt from the
    same GGUF with the same threads (greedy), from launch to exit."""
    command = [str(tool), "-m", str(gguf), "-p", PROMPT, "-n", str(tokens), "-t", str(threads), "-tb", str(threads),
               "--temp", "0", "--top-k", "1", "--seed", "0", "-no-cnv", "--no-display-prompt"]
    return timed(subprocess.run, command, capture_output=True, text=True, timeout=600, check=True)[1]


def versus_llama_cpp(bundle: Path, directory: Path, threads: int, runs: int, tokens: int = 4) -> dict:
    """Launch to N tokens, ours and llama.cpp's on the target's GGUF, interleaved run by run."""
    tool = find_tool(directory, "llama-completion")
    gguf = source_gguf(bundle, "target")
    if tool is None or not gguf.is_file() or gguf.suffix != ".gguf":
        return {"skipped": f"needs llama-completion in {directory} and the target's GGUF ({gguf})"}
    ours, theirs = [], []
    for _ in range(runs):
        ours.append(launch_to_tokens(bundle, threads, tokens))
        theirs.append(llama_launch_to_tokens(tool, gguf, threads, tokens))
    return {"tokens": tokens, "ours_s": round(statistics.median(ours), 3), "llama_cpp_s": round(statistics.median(theirs), 3),
            "ours_all_s": [round(t, 3) for t in ours], "llama_cpp_all_s": [round(t, 3) for t in theirs],
            "ratio": round(statistics.median(ours) / statistics.median(theirs), 3), "gguf": str(gguf)}


def source_gguf(bundle: Path, role: str) -> Path:
    """The GGUF file the role's weights came from: the path compile recorded, or, where that is
    gone (a scratch cache), the catalog's copy of the same model."""
    recorded = Path(yaml.safe_load((BundleLayout(bundle).weights / INDEX_FILE).read_text())[role]["path"])
    if recorded.is_file():
        return recorded
    try:
        return resolve_model(read_manifest(bundle, "x")[0].models[role]["name"]).path
    except (KeyError, YggdrasilError):
        return recorded


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def gguf_load_seconds(bundle: Path) -> float:
    """Both models loaded from their GGUF files in the bundle's format (the path before issue 41)."""
    manifest = read_manifest(bundle, "x")[0]
    return timed(lambda: [load(model["name"], quiet=True, weights=manifest.weight_format(role))
                          for role, model in manifest.models.items()])[1]


def sizes(bundle: Path) -> dict:
    weights = BundleLayout(bundle).weights / MODELS_FILE
    index = yaml.safe_load((BundleLayout(bundle).weights / INDEX_FILE).read_text())
    sources = {role: path.stat().st_size for role in index if (path := source_gguf(bundle, role)).is_file()}
    return {"weights_bytes": weights.stat().st_size, "gguf_bytes": sources,
            "ratio_to_gguf": round(weights.stat().st_size / sum(sources.values()), 3) if sources else None}


def resident(bundle: Path) -> dict:
    run = subprocess.run([sys.executable, "-c", RSS_PROBE, str(bundle), PROMPT], capture_output=True, text=True,
                         timeout=600, check=True)
    rss, anon, file = (int(x) * 1024 for x in run.stdout.split("RSS", 1)[1].split())
    weights = (BundleLayout(bundle).weights / MODELS_FILE).stat().st_size
    return {"rss_bytes": rss, "rss_anon_bytes": anon, "rss_file_bytes": file, "ratio_to_weights": round(rss / weights, 3)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the JSON here too")
    parser.add_argument("--llama-cpp", metavar="DIR", default=None,
                        help="also time llama.cpp's llama-completion -n 4 on the target's GGUF, interleaved with "
                             "`generate --max-new-tokens 4` (launch to exit, warm page cache)")


def run(args: argparse.Namespace, record: Results) -> int | None:
    bundle = Path(args.bundle)
    log("one run to hash the weights once (later runs trust their size/mtime/inode stamp)")
    one_run(bundle, args.threads)
    warm = [one_run(bundle, args.threads) for _ in range(args.runs)]
    cold = [one_run(bundle, args.threads) for _ in range(2) if drop_page_cache()]
    result = {"bundle": str(bundle),
              "statistic": "first_token_s: launch to first token, median over fresh processes; phases: median; "
                           "first_prefill: median seconds of 5 interleaved in-process prefills of the prompt per way",
              "warm": _summary(warm), "cold": _summary(cold) if cold else "not measured (needs root to drop caches)",
              "gguf_load_s": round(gguf_load_seconds(bundle), 2), **sizes(bundle), **resident(bundle),
              "first_tokens": first_tokens(bundle, args.threads),
              "first_prefill": first_prefill(bundle),
              "environment": environment(threads=args.threads)}
    if args.llama_cpp:
        result["launch_to_4_tokens"] = versus_llama_cpp(bundle, Path(args.llama_cpp).expanduser(),
                                                        args.threads or torch.get_num_threads(), args.runs)
        result["statistic"] += ("; launch_to_4_tokens: wall seconds from launch to exit generating 4 tokens, median "
                                "over runs interleaved with llama.cpp's")
    log(f"first token after start: warm {result['warm']['first_token_s']} s, cold "
        f"{result['cold']['first_token_s'] if cold else '-'} s; GGUF load path {result['gguf_load_s']} s")
    record.write(result, args.out, bundle=bundle)
    return 0


def first_prefill(bundle: Path, repeats: int = 5) -> dict:
    """Per model, the bench prompt's prefill on the pieces its runner plans (prefill_plan.py) and
    on the prefill chunks, timed interleaved in this process (median seconds), and whether both
    give the same logits bit for bit. Forward times: the bundle's own (profile.yaml
    piece_seconds), or measured here for a bundle compiled before it recorded them."""
    opened = open_bundle(bundle, quiet=True)
    generator, recorded, result = opened.generator(), opened.piece_seconds(), {}
    ids = generator.tokenizer.encode(PROMPT)
    for runner in (generator.runner, generator.draft_runner):
        if runner is None or runner.graphs is None:
            continue
        seconds = recorded.get(runner.role) or measure_piece_seconds(runner)
        ways = {"plan": plan_pieces(len(ids), piece_options(runner.graphs.keys, seconds)),
                "chunks": chunk_pieces(runner.chunk_sizes, len(ids))}
        times, logits = {way: [] for way in ways}, {}
        for _ in range(repeats):
            for way, pieces in ways.items():
                started = time.perf_counter()
                logits[way] = runner.prefill(ids, pieces=pieces)
                times[way].append(time.perf_counter() - started)
        result[runner.role] = {"prompt_tokens": len(ids), "plan": [p.key.name for p in ways["plan"]],
                               "chunks": [p.key.name for p in ways["chunks"]],
                               "plan_s": round(statistics.median(times["plan"]), 4),
                               "chunks_s": round(statistics.median(times["chunks"]), 4),
                               "same_logits": bool(torch.equal(logits["plan"], logits["chunks"])),
                               "forward_times": "recorded by compile" if recorded.get(runner.role) else "measured here"}
    return result


def _summary(runs: list[dict]) -> dict:
    phases = {name: round(statistics.median(r["phases"][name] for r in runs), 3) for name in runs[0]["phases"]}
    return {"first_token_s": round(statistics.median(r["first_token_s"] for r in runs), 3),
            "first_token_all_s": [r["first_token_s"] for r in runs], "phases": phases}

