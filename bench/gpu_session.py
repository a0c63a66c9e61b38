"""One command for a person with a GPU (issue 23, item 5): build random-weight Qwen-shaped bf16
models on the device, compile a reduced CUDA recipe, run the `gpu` tests and measure the CUDA
path, into one JSON report.

    pip install --no-deps -e .            # nothing else: torch, triton, transformers are there
    python bench/gpu_session.py --out gpu-session            # every step in turn
    python bench/gpu_session.py --out gpu-session --step measure   # one step

Steps (each well under 10 minutes on one H100; each reads the previous steps' files from --out,
so a step can be re-run alone, and `compile` resumes from its work cache if it was cut off):

  models   random-weight bf16 models on the device, saved as HF folders our loader reads: a
           Qwen2.5-1.5B-shaped target and a draft made of its first layers (the target's later
           layers scaled down, so that drafts are mostly accepted and speculation is exercised)
  compile  a reduced CUDA recipe over them (yggdrasil compile: profile, calibrate, graphs, check)
  tests    the `gpu`-marked tests (pytest -m gpu)
  measure  TPOT of eager, plain AOTInductor and CUDA-graph-captured decoding, and speculative;
           device→host syncs per iteration (torch.cuda.set_sync_debug_mode and the runners'
           host-read counters); capture memory; compiled-vs-eager agreement (compile's tie rule)
  report   report.json: everything above, with the device and torch version

`--device cpu --tiny --draft lookup` runs the same steps on a tiny model on the CPU (a CI test
runs it, so this script cannot rot); nothing CUDA-only is measured there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from yggdrasil.bundle import open_bundle
from yggdrasil.compile.aoti import full_span
from yggdrasil.compile.check import compare_greedy
from yggdrasil.device import device_name
from yggdrasil.errors import YggdrasilError
from yggdrasil.generate import greedy_tokens
from yggdrasil.graphs.cuda_graphs import replay_counts
from yggdrasil.graphs.registry import load_graph_set
from yggdrasil.sampling import SamplingParams
from yggdrasil.steps import StepRunner

STEPS = ("models", "compile", "tests", "measure", "report")
REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "The quick brown fox jumps over",
           "class Stack:\n    def push(self, item):", "for i in range(10):", "SELECT name FROM users WHERE",
           "Once upon a time", "def quicksort(xs):"]
# Qwen2.5-Coder-1.5B's shape; the draft is its first DRAFT_LAYERS layers
QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
TINY = {**QWEN_1_5B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
DRAFT_LAYERS = 4


class SessionError(YggdrasilError):
    """A step that cannot run (a missing earlier step, no CUDA)."""


@dataclass(frozen=True)
class Session:
    """One session's folder and choices. draft: "model" (the target's first layers) or "lookup"
    (no draft model: fewer graphs, the CPU dry run); stage_plan: the recipe's stage_plan."""

    out: Path
    device: str
    tiny: bool
    new_tokens: int
    draft: str = "model"
    stage_plan: str = "auto"
    layers: int | None = None  # the target's layers (None: the shape's own)
    budget_s: float = 540.0  # the compile step's time before it stops (and resumes next run)

    def path(self, *parts: str) -> Path:
        return self.out.joinpath(*parts)

    def write(self, name: str, body: dict) -> Path:
        target = self.path(name)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=2, sort_keys=True, default=str))
        tmp.replace(target)
        return target

    def read(self, name: str, step: str) -> dict:
        try:
            return json.loads(self.path(name).read_text())
        except FileNotFoundError:
            raise SessionError(f"{self.path(name)} is missing; run --step {step} first") from None


# ---- models -------------------------------------------------------------------------------------

def _byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer.json (ids 0..255), enough to encode any prompt."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))


def _random_qwen(shape: dict, device: str):
    import transformers  # slow to import; only the models step needs it

    config = transformers.Qwen2Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0, 0.02 if not name.endswith("embed_tokens.weight") else 1.0)
        for layer in model.model.layers[1:]:  # later layers add little: the draft agrees often
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    return model.eval()


def step_models(s: Session) -> dict:
    started = time.perf_counter()
    shape = dict(TINY if s.tiny else QWEN_1_5B)
    if s.layers:
        shape["num_hidden_layers"] = s.layers
    target = _random_qwen(shape, s.device)
    draft_layers = 1 if s.tiny else DRAFT_LAYERS
    for name, model in (("target", target), ("draft", None))[:1 if s.draft == "lookup" else 2]:
        directory = s.path("models", name)
        directory.mkdir(parents=True, exist_ok=True)
        if model is None:  # the target's first layers, with its embeddings, norm and head
            import transformers  # see _random_qwen

            config = transformers.Qwen2Config(**{**shape, "num_hidden_layers": draft_layers})
            with torch.device(s.device):
                model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
            keep = {k: v for k, v in target.state_dict().items()
                    if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
            model.load_state_dict(keep)
        model.save_pretrained(directory, safe_serialization=True)
        _byte_tokenizer(directory)
        del model
    with open(s.path("prompts.jsonl"), "w") as f:
        for prompt in PROMPTS:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    recipe = {
        "schema": "yggdrasil-recipe/1", "name": "gpu-session-tiny" if s.tiny else "gpu-session-qwen",
        "target": "models/target", "draft": "lookup" if s.draft == "lookup" else "models/draft",
        "dtype": "bfloat16", "device": s.device, "max_context": 256 if s.tiny else 1024,
        "tile": 1 if s.tiny else 16, "selection": "all", "stage_plan": s.stage_plan,
        "buckets": {"depths": [2], "draft_widths": [1], "verify_widths": [4], "prefill_chunks": [16],
                    "batch_sizes": [1]} if s.tiny else
                   {"depths": [2, 4], "draft_widths": [1, 2], "verify_widths": [8, 16],
                    "prefill_chunks": [128], "batch_sizes": [1]},
        "calibration": {"prompts": ["prompts.jsonl"], "num_prompts": 4 if s.tiny else 8,
                        "max_new_tokens": 16 if s.tiny else 48},
    }
    s.path("recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return {"shape": shape, "draft_layers": draft_layers, "seconds": time.perf_counter() - started}


# ---- compile ------------------------------------------------------------------------------------

def _run_child(command: list[str], budget_s: float) -> tuple[int | None, str]:
    """(exit status, stdout and stderr) of a child run from the repository root; None when it
    ran past budget_s and was stopped. It runs in a session of its own, so that on the budget
    the whole group goes (Inductor's compile workers, pytest's children, too)."""
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
    return proc.returncode, output


def step_compile(s: Session) -> dict:
    """`yggdrasil compile` in a child process, stopped after s.budget_s seconds: a stopped
    compile resumes from its work cache (compiled graphs, calibration checkpoints) when this
    step runs again, so a slow build is finished in several runs of under 10 minutes each."""
    s.read("models.json", "models")
    started = time.perf_counter()
    status, output = _run_child([sys.executable, "-m", "yggdrasil", "compile", str(s.path("recipe.yaml")),
                                 "--out", str(s.path("bundle"))], s.budget_s)
    if status is None:
        raise SessionError(f"compile was stopped after {s.budget_s:.0f} s (the step's budget); run --step "
                           f"compile again: it resumes from its work cache. Last output:\n{output[-3000:]}")
    if status != 0:
        raise SessionError(f"compile failed (exit {status}):\n{output[-4000:]}")
    return {"seconds": time.perf_counter() - started, "log": output.splitlines()[-40:]}


# ---- tests --------------------------------------------------------------------------------------

def step_tests(s: Session) -> dict:
    """The gpu-marked tests in a child pytest (skipped, and said so, without CUDA), stopped after
    s.budget_s seconds (returncode None in tests.json)."""
    started = time.perf_counter()
    junit = s.path("tests.xml")
    status, output = _run_child([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p",
                                 "no:cacheprovider", f"--junitxml={junit}", "tests/test_bundle_gpu.py"], s.budget_s)
    summary = output.strip().splitlines()[-1:] or [""]
    return {"returncode": status, "summary": summary[0] if status is not None else "stopped at the step's budget",
            "junit": str(junit), "seconds": time.perf_counter() - started, "output_tail": output[-6000:]}


# ---- measure ------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tpot(generate, ids: list[int], n: int, device: torch.device) -> tuple[float, list[int]]:
    """Seconds per output token of generate(ids, n) (after one untimed warm run)."""
    generate(ids, n)
    _sync(device)
    started = time.perf_counter()
    tokens = generate(ids, n)
    _sync(device)
    return (time.perf_counter() - started) / n, tokens


def _counting_syncs(run, device: torch.device):
    """(run(), synchronizing CUDA calls during it as torch.cuda.set_sync_debug_mode('warn')
    reports them; None off CUDA, where nothing synchronizes)."""
    if device.type != "cuda":
        return run(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            value = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return value, sum("synchroniz" in str(w.message) for w in caught)


def _host_reads(runners) -> int | None:
    """The runners' device→host read counters (StepRunner.reads, yggdrasil/host_reads.py), where
    they have one."""
    counts = [getattr(getattr(r, "reads", None), "count", None) for r in runners if r is not None]
    counts = [c for c in counts if isinstance(c, int)]
    return sum(counts) if counts else None


def _plain_aoti_runner(runtime, bundle: Path, device: torch.device) -> StepRunner:
    """The bundle's target graphs loaded again but not captured: plain AOTInductor calls."""
    model = runtime.target.model
    names = [n for n in runtime.graph_sets["target"].graphs]
    graphs = load_graph_set(bundle, "target", model, names, "rerun --step compile", "the recipe")
    if device.type == "cuda":
        graphs.fixed_span = full_span(runtime.runner.max_context)
    return StepRunner(model, runtime.runner.max_context, chunk_sizes=runtime.runner.chunk_sizes, graphs=graphs)


def step_measure(s: Session) -> dict:
    bundle = s.path("bundle")
    if not (bundle / "manifest.yaml").is_file():
        raise SessionError(f"no bundle in {bundle}; run --step compile first")
    runtime = open_bundle(bundle, quiet=True).generator()
    device, n = runtime.runner.device, s.new_tokens
    model, ids = runtime.target.model, runtime.tokenizer.encode(PROMPTS[0])
    eager = StepRunner(model, runtime.runner.max_context, chunk_sizes=runtime.runner.chunk_sizes)
    plain = _plain_aoti_runner(runtime, bundle, device)
    greedy = SamplingParams(temperature=0.0)
    result = {"capture_bytes": runtime.capture_bytes, "new_tokens": n, "prompt": PROMPTS[0]}
    tpot = {}
    tpot["eager"], want = _tpot(lambda i, k: greedy_tokens(eager, i, k), ids, n, device)
    tpot["aoti_plain"], got_plain = _tpot(lambda i, k: greedy_tokens(plain, i, k), ids, n, device)
    replays_before = sum(replay_counts(runtime.graph_sets).values())
    tpot["aoti_captured" if device.type == "cuda" else "aoti_bundle"], got = _tpot(
        lambda i, k: greedy_tokens(runtime.runner, i, k), ids, n, device)
    result["replays_plain_decode"] = sum(replay_counts(runtime.graph_sets).values()) - replays_before
    agreement = {"aoti_plain": compare_greedy(model, ids, want, got_plain).__dict__,
                 "bundle": compare_greedy(model, ids, want, got).__dict__}
    reads_before = _host_reads([runtime.runner])
    _, syncs = _counting_syncs(lambda: greedy_tokens(runtime.runner, ids, n), device)
    result["syncs_per_plain_step"] = None if syncs is None else syncs / n  # the prefill's included
    if reads_before is not None:
        result["host_reads_per_plain_step"] = (_host_reads([runtime.runner]) - reads_before) / n
    speculator = runtime.speculator()
    if speculator is not None:
        tpot["speculative"], got_spec = _tpot(lambda i, k: speculator.generate(i, k, greedy).tokens, ids, n, device)
        agreement["speculative"] = compare_greedy(model, ids, want, got_spec).__dict__
        runners = [runtime.runner, runtime.draft_runner]
        reads_before = _host_reads(runners)
        outcome, syncs = _counting_syncs(lambda: speculator.generate(ids, n, greedy), device)
        iterations = max(outcome.spec.iterations, 1)
        result["speculative_iterations"] = iterations
        result["aal"] = outcome.spec.committed / iterations
        result["syncs_per_iteration"] = None if syncs is None else syncs / iterations  # prefill included
        if reads_before is not None:
            result["host_reads_per_iteration"] = (_host_reads(runners) - reads_before) / iterations
    result["tpot_ms"] = {k: round(v * 1e3, 4) for k, v in tpot.items()}
    result["agreement"] = agreement
    result["agree"] = all(a["same"] or (a["gap"] is not None and a["gap"] <= a["tolerance"])
                          for a in agreement.values())
    result["replays"] = replay_counts(runtime.graph_sets)
    return result


# ---- report -------------------------------------------------------------------------------------

def step_report(s: Session) -> dict:
    parts = {name: s.read(f"{name}.json", name) for name in ("models", "compile", "tests", "measure")}
    cuda = s.device.startswith("cuda")
    return {"device": device_name(s.device), "torch": torch.__version__, "tiny": s.tiny,
            "cuda": torch.version.cuda if cuda else None,
            "models": parts["models"],
            "compile_seconds": parts["compile"]["seconds"],
            "tests": {k: parts["tests"][k] for k in ("returncode", "summary")},
            **{k: v for k, v in parts["measure"].items()}}


RUNNERS = {"models": step_models, "compile": step_compile, "tests": step_tests,
           "measure": step_measure, "report": step_report}


def run_step(s: Session, step: str) -> Path:
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise SessionError("CUDA is not available here; use --device cpu --tiny for a dry run")
    started = time.perf_counter()
    body = RUNNERS[step](s)
    body.setdefault("seconds", time.perf_counter() - started)
    path = s.write("report.json" if step == "report" else f"{step}.json", body)
    print(f"[{step}] done in {time.perf_counter() - started:.1f} s -> {path}", flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="session folder (created; steps resume from it)")
    parser.add_argument("--step", choices=STEPS, help="run this step only (default: every step in turn)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run, with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the Qwen-1.5B shape")
    parser.add_argument("--draft", choices=("model", "lookup"), default="model",
                        help="a draft model (the target's first layers; default) or prompt lookup")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per timed generation")
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: the shape's own, 28)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds the compile step runs before it stops; re-run it to resume (default 540)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    session = Session(args.out.resolve(), args.device, args.tiny, args.new_tokens or (16 if args.tiny else 128),
                      args.draft, layers=args.layers, budget_s=args.budget_s)
    try:
        for step in ([args.step] if args.step else STEPS):
            run_step(session, step)
    except YggdrasilError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
