"""Where a CUDA bundle's graphs fail to load or run, piece by piece (issue 36).

The first GPU session's compile died with SIGSEGV right after compiling its graphs, in the
warm-load check (open the packages, bind the model's tensors, run, capture) and printed nothing.
This probe compiles one tiny decode graph the way compile does, then runs each piece of loading
it in a child process of its own, with Python's faulthandler on, so a crash names the call that
crashed and the pieces after it still run:

  open            the package loader alone (single-threaded runner, as bundles open them)
  open_index_default  the same with device index -1 (the current device; torch's own default)
  bind            + the model's tensors bound user-managed (no copy: the bundle's way)
  bind_unstacked  + bound user-managed, the KV cache as separate buffers (not views of one)
  bind_copy       + the model's tensors bound by copy (user_managed=False; on a CPU this
                  process crashes at exit, after the binding)
  run             + one run, compared with the eager forward
  run_threaded    the default multi-runner container, bound user-managed, one run
  registry        yggdrasil.graphs.registry.load_graph_set + one run (the runtime's own path)
  capture         + capture as a CUDA graph (graphs/cuda_graphs.capture) and one replay
  open_inso, run_inso  the graph packaged with its constants in the .so (torch's default)
  trivial_official     a one-Linear package through torch._inductor.aoti_load_package
  ours_official        our graph (constants in the .so) through torch._inductor.aoti_load_package

First found on an H100 with torch 2.11.0+cu130 (bench/results/gpu-session-h100-2026-11-26): the
package loader's constructor itself crashed (open, and open_inso), whatever the binding.

    python3 -m yggdrasil.bench.gpu_probe --out /tmp/probe [--report-dir "$OUT"]

Prints one line per piece and writes probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from yggdrasil.buckets import GraphKey
from yggdrasil.compile.aoti import StepModule, example_inputs, export_step, full_span
from yggdrasil.graphs.cuda_graphs import capture
from yggdrasil.graphs.registry import load_graph_set, model_constants, open_loader
from yggdrasil.models.hf_loader import load_hf_model

from .gpu_session import Session, step_models

CASES = ("open", "open_index_default", "bind", "bind_unstacked", "run", "run_threaded", "registry", "capture",
         "bind_copy")
# the same graph packaged WITH its constants in the .so (torch's default), opened and run
IN_SO_CASES = ("open_inso", "run_inso")
# torch's own loader (torch._inductor.aoti_load_package) on a one-Linear package, then on ours:
# whether AOTInductor packages load on this image at all
OFFICIAL_CASES = ("trivial_official", "ours_official")
REPO = Path(__file__).resolve().parent.parent


def _model(out: Path, device: str, stacked: bool = True):
    model = load_hf_model(out / "models" / "target", torch.bfloat16, device)
    model.setup_cache(1, 256, stacked=stacked)
    return model


def _inputs(device, span: int):
    tokens, positions, slots, mask, logit_index = example_inputs(GraphKey("decode", 1), span, device)
    return [tokens, positions, slots, mask, logit_index]


def build(out: Path, device: str) -> dict:
    """The tiny model (bench/gpu_session's models step) and its decode graph, compiled as compile does."""
    step_models(Session(out, device=device, tiny=True, draft="lookup"))
    model = _model(out, device)
    model.setup_cache(1, 256)
    seconds = export_step(model, GraphKey("decode", 1), 256, out / "graphs" / "target" / "decode_w1.pt2",
                          dynamic_span=not device.startswith("cuda"))
    started = time.perf_counter()
    _export_in_so(model, out / "decode_w1_inso.pt2")
    in_so = time.perf_counter() - started
    linear = torch.nn.Linear(64, 32, device=device)
    with torch.no_grad():
        exported = torch.export.export(linear, (torch.randn(4, 64, device=device),))
    torch._inductor.aoti_compile_and_package(exported, package_path=str(out / "linear.pt2"))
    return {"export_seconds": round(seconds, 1), "export_in_so_seconds": round(in_so, 1)}


def _export_in_so(model, path: Path) -> None:
    args = example_inputs(GraphKey("decode", 1), full_span(256), model.device)
    with torch.no_grad():
        exported = torch.export.export(StepModule(model, False), args, strict=False)
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


def child(case: str, out: Path, device: str) -> dict:
    """One piece, in this (child) process."""
    dev = torch.device(device)
    if case in OFFICIAL_CASES:
        return _official(case, out, dev)
    path = out / "graphs" / "target" / "decode_w1.pt2"
    if case.endswith("_inso"):
        path, case = out / "decode_w1_inso.pt2", case.removesuffix("_inso")
    model = _model(out, device, stacked=case != "bind_unstacked")
    span = full_span(256) if dev.type == "cuda" else 128
    result = {}
    if case in ("registry", "capture"):
        graphs = load_graph_set(out, "target", model, ["decode_w1"], "probe", "probe")
        if case == "capture":
            result["capture_bytes"] = capture(graphs, span, model.cache.scratch_slot, dev)
        run = graphs.get("decode_w1")
    else:
        if case == "open_index_default":
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", dev.type == "cuda", 1, -1)
        else:
            loader = (open_loader(path, dev) if case != "run_threaded" else
                      torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1,
                                                            (dev.index or 0) if dev.type == "cuda" else -1))
        result["constants"] = len(loader.get_constant_fqns())
        if case.startswith("open"):
            return result
        constants = model_constants(model)
        wanted = {fqn: constants[fqn.removeprefix("model.")] for fqn in loader.get_constant_fqns()}
        loader.load_constants(wanted, False, True, case != "bind_copy")
        if case.startswith("bind"):
            return result
        run = lambda *args: loader.run([t.contiguous() for t in args if t is not None])[0]  # noqa: E731
    inputs = _inputs(dev, span)
    with torch.inference_mode():
        got = run(*inputs)
        torch.cuda.synchronize() if dev.type == "cuda" else None
        want = model(*inputs[:4], logit_index=inputs[4])
    result["max_abs_diff"] = float((got.float() - want.float()).abs().max())
    result["finite"] = bool(torch.isfinite(got).all())
    return result


def _official(case: str, out: Path, dev: torch.device) -> dict:
    """torch's own package loader (it reads the package's metadata in Python first)."""
    if case == "trivial_official":
        compiled = torch._inductor.aoti_load_package(str(out / "linear.pt2"))
        x = torch.randn(4, 64, device=dev)
        return {"shape": list(compiled(x).shape)}
    model = _model(out, str(dev))
    compiled = torch._inductor.aoti_load_package(str(out / "decode_w1_inso.pt2"))
    inputs = _inputs(dev, full_span(256) if dev.type == "cuda" else 128)
    with torch.inference_mode():
        got = compiled(*inputs)
        want = model(*inputs[:4], logit_index=inputs[4])
    got = got[0] if isinstance(got, (list, tuple)) else got
    return {"max_abs_diff": float((got.float() - want.float()).abs().max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report-dir", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--child", choices=CASES + IN_SO_CASES + OFFICIAL_CASES, help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(OFFICIAL_CASES + CASES[:1] + IN_SO_CASES[:1] + CASES[1:]),
                        help="which pieces to run, in order (comma-separated)")
    args = parser.parse_args(argv)
    if args.child:
        print("PROBE " + json.dumps(child(args.child, args.out, args.device)), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device}
    started = time.perf_counter()
    report["build"] = build(args.out, args.device)
    report["build"]["seconds"] = round(time.perf_counter() - started, 1)
    print(f"build: {report['build']}", flush=True)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    for case in args.cases.split(","):
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "yggdrasil.bench.gpu_probe", "--out", str(args.out),
                                   "--device", args.device, "--child", case], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=120)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")), None)
            row = {"rc": done.returncode, "result": json.loads(line[6:]) if line else None,
                   "stderr_tail": done.stderr[-2500:] if done.returncode else ""}
        except subprocess.TimeoutExpired as exc:
            row = {"rc": "timeout", "stderr_tail": (exc.stderr or b"")[-2500:].decode(errors="replace")
                   if isinstance(exc.stderr, bytes) else str(exc.stderr)[-2500:]}
        row["seconds"] = round(time.perf_counter() - started, 1)
        report[case] = row
        print(f"{case}: rc={row['rc']} {row.get('result')} {row['seconds']}s", flush=True)
        if row["rc"] not in (0,):
            print(row["stderr_tail"][-1500:], flush=True)
    (args.out / "probe.json").write_text(json.dumps(report, indent=2))
    if args.report_dir:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "probe.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
