"""One GPU session in one command (issues 23, 36): build random-weight Qwen-shaped bf16 models on
the device, compile a reduced CUDA recipe, measure the CUDA path and run the `gpu` tests, into one
JSON report. It runs from a plain checkout with the device image's own `python3` (no install):

    sh bench/gpu_session.sh --out /tmp/gpu-session --report-dir "$OUT"   # runs python3 -m yggdrasil.bench.gpu_session

bench/gpu_session.cmd is the exact command to give a lent GPU machine (see docs/cli.md).

Steps, in this order: preflight, models, compile, measure, tests, report (docs/cli.md describes
each). A step that fails is recorded in the report and the steps that do not need its output still
run; each reads the earlier steps' files from --out, so one can be re-run alone with --step on the
same machine; each step's report goes to --report-dir as it ends. `--device cpu --tiny --draft
lookup` runs the same steps on a tiny model on the CPU: CI runs it (tests/test_gpu_session.py,
with gguf and the server packages hidden, as on the device image), so this script cannot rot.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from yggdrasil.errors import YggdrasilError

from .gpu_models import QWEN_1_5B, TINY, save_models

# the checkout: gpu_session.sh names it (and runs this file from it, bench/checkout_path)
REPO = Path(os.environ.get("YGGDRASIL_CHECKOUT") or Path(__file__).resolve().parent.parent)

STEPS = ("preflight", "models", "compile", "measure", "tests", "report")
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "The quick brown fox jumps over",
           "class Stack:\n    def push(self, item):", "for i in range(10):", "SELECT name FROM users WHERE",
           "Once upon a time", "def quicksort(xs):"]
# modules the session imports on the device (its image has them all; `gguf` and the server's
# packages are not among them: nothing here reads a GGUF file or starts a server)
REQUIRED = ("torch", "yaml", "numpy", "networkx", "jinja2", "safetensors", "tokenizers", "transformers")
OPTIONAL = ("triton", "matplotlib", "pytest", "gguf")  # reported; gguf only reads GGUF models
WHEEL_HINT = ("carry it as a wheel: here `python3 -m pip download --no-deps --only-binary=:all: "
              "--python-version 3.12 --platform manylinux2014_x86_64 -d .whl NAME`, then in the command "
              "`python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
              "export PYTHONPATH=/tmp/site` (bench/gpu_session.cmd)")


class SessionError(YggdrasilError):
    """A step that cannot run (a missing earlier step, no CUDA, a missing module, a failed
    child); details: what the step found before it failed (kept in its report)."""

    def __init__(self, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


@dataclass(frozen=True)
class Session:
    """One session's folder and choices. draft: "model" (the target's first layers) or "lookup"
    (no draft model: fewer graphs, the CPU dry run); stage_plan: the recipe's stage_plan."""

    out: Path
    device: str = "cuda"
    tiny: bool = False
    new_tokens: int = 64
    draft: str = "model"
    stage_plan: str = "aot-tail+aot-head+side-stream+device-accept"
    layers: int = 8  # the target's layers
    draft_layers: int = 1
    budget_s: float = 540.0  # the whole session's time; each step gets a share of what is left
    report_dir: Path | None = None  # where report.json and the logs are copied after each step
    steps: str = "auto"  # the recipe's steps: auto (packages where they load, else inductor), aoti, inductor, eager
    skip: tuple[str, ...] = ()  # steps not run (recorded as skipped)
    child: bool = False  # this process runs one step for a parent session (its share of the budget)
    argv: tuple[str, ...] = ()  # the session's own arguments, for its children

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


# ---- preflight ----------------------------------------------------------------------------------

def step_preflight(s: Session) -> dict:
    """Versions and the device; every module the session imports, and the wheels to carry."""
    missing, versions = [], {}
    for name in REQUIRED + OPTIONAL:
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except ImportError:
            versions[name] = None
            if name in REQUIRED:
                missing.append(name)
    if missing:
        raise SessionError(f"missing module(s) {', '.join(missing)}: {WHEEL_HINT}")
    body = {"python": platform.python_version(), "versions": versions, "cpu_count": os.cpu_count(),
            "torch_cuda": torch.version.cuda,
            # where yggdrasil came from: the checkout gpu_session.sh runs, not an install
            "package": str(Path(importlib.import_module("yggdrasil.bench").__file__).parent.parent)}
    if s.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        body.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, capability=list(torch.cuda.get_device_capability(0)))
    return body


# ---- models -------------------------------------------------------------------------------------

def shape_of(s: Session) -> dict:
    return dict(TINY) if s.tiny else {**QWEN_1_5B, "num_hidden_layers": s.layers}


def draft_layers_of(s: Session) -> int:
    """The draft's layers: at most the target's (a --layers below the draft default is fine)."""
    return min(1 if s.tiny else s.draft_layers, shape_of(s)["num_hidden_layers"])


def session_recipe(s: Session) -> dict:
    """The recipe the session compiles: a small grid whose graphs fit the compile's budget
    (tests/test_gpu_session.py loads every variant with the recipe loader)."""
    grid = ({"depths": [2], "draft_widths": [1], "verify_widths": [4], "prefill_chunks": [16], "batch_sizes": [1]}
            if s.tiny else
            {"depths": [2, 3], "draft_widths": [2], "verify_widths": [8], "prefill_chunks": [64], "batch_sizes": [1]})
    return {
        "schema": "yggdrasil-recipe/1", "name": "gpu-session-tiny" if s.tiny else f"gpu-session-qwen-{s.layers}l",
        "target": "models/target", "draft": "lookup" if s.draft == "lookup" else "models/draft",
        "dtype": "bfloat16", "device": s.device, "max_context": 256 if s.tiny else 512,
        "tile": 1 if s.tiny else 8, "selection": "all",
        "stage_plan": "sequential" if s.draft == "lookup" else s.stage_plan,
        "steps": s.steps, "buckets": grid,
        "calibration": {"prompts": ["prompts.jsonl"], "num_prompts": 4 if s.tiny else 6,
                        "max_new_tokens": 16 if s.tiny else 32},
    }


def step_models(s: Session) -> dict:
    started = time.perf_counter()
    save_models(s.path("models"), shape_of(s), None if s.draft == "lookup" else draft_layers_of(s), s.device)
    with open(s.path("prompts.jsonl"), "w") as f:
        for prompt in PROMPTS:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    s.path("recipe.yaml").write_text(yaml.safe_dump(session_recipe(s), sort_keys=False))
    return {"shape": shape_of(s), "draft_layers": draft_layers_of(s), "seconds": time.perf_counter() - started}


# ---- child processes (compile, tests) -----------------------------------------------------------

def run_child(command: list[str], budget_s: float, log: Path, env: dict | None = None) -> tuple[int | None, str]:
    """(exit status, output) of a child run from this process's directory (gpu_session.sh runs in
    the checkout; the child inherits PYTHONPATH's bench/checkout_path, so it imports as this does), its output also
    streamed into `log`; None when it ran past budget_s and was stopped. It runs in a session of its own,
    so that on the budget the whole group goes (Inductor's compile workers, pytest's children)."""
    with open(log, "w") as sink:
        # faulthandler: a child that crashes (SIGSEGV in a native library) still names the call
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
        try:
            proc.wait(timeout=max(budget_s, 1.0))
            status = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = None
    return status, log.read_text(errors="replace")


def step_compile(s: Session, budget_s: float) -> dict:
    """`yggdrasil compile` in a child process, stopped after budget_s seconds: a stopped compile
    resumes from its work cache (compiled graphs, calibration checkpoints) when this step runs
    again on the same machine."""
    s.read("models.json", "models")
    started = time.perf_counter()
    status, output = run_child([sys.executable, "-m", "yggdrasil.cli", "compile", str(s.path("recipe.yaml")),
                                "--out", str(s.path("bundle"))], budget_s, s.path("compile.log"))
    work = s.path(".bundle.work")  # compile's work cache beside the bundle: NAME.seconds per graph
    seconds = {f"{p.parent.name}/{p.stem}": float(p.read_text()) for p in work.rglob("*.seconds")
               if p.read_text().strip()} if work.is_dir() else {}
    details = {"graph_seconds": seconds, "returncode": status, "seconds": time.perf_counter() - started}
    if status is None:
        raise SessionError(f"compile was stopped after {budget_s:.0f} s (its share of the budget); run --step "
                           f"compile again on the same machine to resume. Last output:\n{output[-2500:]}", details)
    if status != 0:
        raise SessionError(f"compile failed (exit {status}):\n{output[-4000:]}", details)
    return {"seconds": time.perf_counter() - started, "graph_seconds": seconds, "log": output.splitlines()[-40:]}


def step_tests(s: Session, budget_s: float) -> dict:
    """The gpu-marked tests in a child pytest on the session's bundle (skipped, and said so,
    without CUDA), stopped after budget_s seconds (returncode None). Not run when compile failed:
    they would compile a bundle of their own, which the budget has no room for."""
    compiled = s.path("compile.json")
    if compiled.is_file() and "error" in json.loads(compiled.read_text()):
        return {"skipped": "compile failed: no session bundle to test (see the compile step)"}
    started = time.perf_counter()
    junit = s.path("tests.xml")
    bundle = s.path("bundle")
    env = {"YGGDRASIL_GPU_SESSION_BUNDLE": str(bundle)} if (bundle / "manifest.yaml").is_file() else {}
    status, output = run_child([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
                                f"--junitxml={junit}", str(REPO / "tests" / "test_bundle_gpu.py")], budget_s,
                               s.path("tests.log"), env)
    summary = output.strip().splitlines()[-1:] or [""]
    body = {"returncode": status, "summary": summary[0] if status is not None else "stopped at the step's budget",
            "on_session_bundle": bool(env), "seconds": time.perf_counter() - started, "output_tail": output[-6000:]}
    if status != 0:
        raise SessionError(f"the gpu tests did not pass: {body['summary']}", body)
    return body


# ---- measure (in a child process of the session) ------------------------------------------------

def step_measure(s: Session) -> dict:
    from .gpu_measure import measure  # imports the runtime: only this step needs it

    bundle = s.path("bundle")
    if not (bundle / "manifest.yaml").is_file():
        raise SessionError(f"no bundle in {bundle}; run --step compile first")
    return measure(bundle, PROMPTS, s.new_tokens, s.stage_plan if s.draft != "lookup" else None)


def step_report(s: Session) -> dict:
    """Every step's file (or its error) in one report, with the device and versions."""
    parts = {}
    for name in STEPS[:-1]:
        path = s.path(f"{name}.json")
        parts[name] = json.loads(path.read_text()) if path.is_file() else {"error": "not run"}
    cuda = s.device.startswith("cuda")
    device = parts["preflight"].get("gpu") or platform.processor() or platform.machine()
    return {"device": device, "torch": torch.__version__, "tiny": s.tiny, "cuda": torch.version.cuda if cuda else None,
            "session": {"layers": shape_of(s)["num_hidden_layers"], "draft_layers": draft_layers_of(s),
                        "draft": s.draft, "stage_plan": s.stage_plan, "new_tokens": s.new_tokens,
                        "budget_s": s.budget_s, "steps": s.steps, "skipped": list(s.skip)},
            "steps": {name: ("error" not in part) for name, part in parts.items()}, **parts}


# ---- running steps ------------------------------------------------------------------------------

IN_PROCESS = {"preflight": step_preflight, "models": step_models, "measure": step_measure, "report": step_report}
# a step's share of the time left; the rest is kept for the steps after it. compile and tests
# run children of their own (yggdrasil compile, pytest); measure runs in a child session
# (--child), so that a step past its share is stopped, not waited for
SHARES = {"compile": 0.6, "measure": 0.55, "tests": 0.9}
CHILD_STEPS = ("measure",)
LOGS = ("report.json", "compile.log", "tests.log", "measure.log")


def run_step(s: Session, step: str, deadline: float | None = None) -> Path:
    """Run one step; its result, or its error, goes to STEP.json (and to the report directory)."""
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise SessionError("CUDA is not available here; use --device cpu --tiny for a dry run")
    started = time.perf_counter()
    left = (deadline - time.time()) if deadline is not None else s.budget_s
    try:
        if step in s.skip:
            body = {"skipped": "--skip"}
        elif step in CHILD_STEPS and not s.child:
            body = _child_step(s, step, left * SHARES[step])
        elif step in ("compile", "tests"):
            body = (step_compile if step == "compile" else step_tests)(s, left * SHARES[step])
        else:
            body = IN_PROCESS[step](s)
        body.setdefault("seconds", time.perf_counter() - started)
    except Exception as exc:  # recorded, and the next steps still run
        body = {**getattr(exc, "details", {}), "error": f"{type(exc).__name__}: {exc}"[-6000:],
                "seconds": time.perf_counter() - started}
    path = s.write("report.json" if step == "report" else f"{step}.json", body)
    print(f"[{step}] {'FAILED' if 'error' in body else 'skipped' if 'skipped' in body else 'done'} in "
          f"{time.perf_counter() - started:.1f} s -> {path}", flush=True)
    if "error" in body:
        print(f"error in step {step}: {body['error'][:2000]}", file=sys.stderr, flush=True)
    if not s.child:
        _copy_out(s, final=step == "report")
    return path


def _child_step(s: Session, step: str, budget_s: float) -> dict:
    """This session's `--step STEP --child` in a child (run_child: stopped after budget_s); the
    child writes STEP.json itself."""
    s.path(f"{step}.json").unlink(missing_ok=True)  # what the child writes is this run's
    command = [sys.executable, "-m", "yggdrasil.bench.gpu_session", *s.argv, "--step", step, "--child"]
    status, output = run_child(command, budget_s, s.path(f"{step}.log"))
    if status is None:
        raise SessionError(f"the {step} step was stopped after {budget_s:.0f} s (its share of the budget); its "
                           f"output is in {step}.log")
    if not s.path(f"{step}.json").is_file():
        raise SessionError(f"the {step} step's process ended (exit {status}) without a report:\n{output[-3000:]}")
    return json.loads(s.path(f"{step}.json").read_text())


def _copy_out(s: Session, final: bool) -> None:
    """The report so far and the logs to the report directory (the device tool returns at most
    8 files): report.json is rebuilt after every step, so a cut-off session still reports."""
    if s.report_dir is None:
        return
    s.report_dir.mkdir(parents=True, exist_ok=True)
    if not final:
        s.write("report.json", {**step_report(s), "partial": True})
    for name in LOGS:
        if s.path(name).is_file():
            shutil.copy(s.path(name), s.report_dir / name)


def parse_args(argv: list[str] | None) -> tuple[Session, str | None]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="session folder (created; steps resume from it)")
    parser.add_argument("--report-dir", type=Path, help="copy report.json and the logs here after each step")
    parser.add_argument("--step", choices=STEPS, help="run this step only (default: every step in turn)")
    parser.add_argument("--skip", default="", help="comma-separated steps not to run (recorded as skipped)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a parent session's step
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run, with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the Qwen-1.5B shape")
    parser.add_argument("--scale", choices=("reduced", "full"), default="reduced",
                        help="reduced: 8 target layers, 1 draft layer (default); full: 28 and 4")
    parser.add_argument("--draft", choices=("model", "lookup"), default="model",
                        help="a draft model (the target's first layers; default) or prompt lookup")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per timed generation (default 64)")
    parser.add_argument("--layers", type=int, default=None, help="target layers (overrides --scale)")
    parser.add_argument("--draft-layers", type=int, default=None, help="draft layers (overrides --scale)")
    parser.add_argument("--steps", choices=("auto", "aoti", "inductor", "eager"), default="auto",
                        help="what runs the buckets (recipe `steps`): auto (default: AOTInductor packages where "
                             "this torch loads them, else Inductor's saved steps), aoti, inductor or eager")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for the whole session; each step stops at its share (default 540)")
    args = parser.parse_args(argv)
    skip = tuple(name for name in args.skip.split(",") if name)
    if set(skip) - set(STEPS):
        parser.error(f"--skip: unknown step(s) {', '.join(sorted(set(skip) - set(STEPS)))}; steps: {', '.join(STEPS)}")
    for name in ("out", "report_dir"):  # relative to where the command was typed (gpu_session.sh moves)
        path = getattr(args, name)
        if path is not None and not path.is_absolute():
            setattr(args, name, REPO / path if os.environ.get("YGGDRASIL_CHECKOUT") else path.resolve())
    layers, draft_layers = (28, 4) if args.scale == "full" else (8, 1)
    layers, draft_layers = args.layers or layers, args.draft_layers or draft_layers
    if layers < 1 or draft_layers < 1:
        parser.error("--layers and --draft-layers must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    # a child gets these arguments and its own --step and --child after them (argparse keeps the last
    # of a repeated option; a child copies nothing to --report-dir)
    own = list(argv)
    own[own.index("--out") + 1] = str(args.out)  # absolute: a child runs from the same place, but be plain
    session = Session(args.out.resolve(), args.device, args.tiny, args.new_tokens or (16 if args.tiny else 64),
                      args.draft, layers=layers, draft_layers=draft_layers, budget_s=args.budget_s,
                      report_dir=args.report_dir, steps=args.steps, skip=skip, child=args.child, argv=tuple(own))
    return session, args.step


def main(argv: list[str] | None = None) -> int:
    session, step = parse_args(argv)
    deadline = time.time() + session.budget_s
    try:
        for name in (step,) if step else STEPS:
            run_step(session, name, deadline)
    except YggdrasilError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if step:
        body = json.loads(session.path("report.json" if step == "report" else f"{step}.json").read_text())
        return 1 if "error" in body else 0
    report = json.loads(session.path("report.json").read_text())
    print(json.dumps({k: report.get(k) for k in ("device", "steps")}), flush=True)
    return 0 if all(report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
