"""How a compiled graph calls our kernels (issue 42): through the C shim (what ships:
aoti_torch_cpu_q4_linear, linked from our library) or through AOTInductor's ProxyExecutor (the
default for a custom op: the op's schema is looked up and the call boxed at run time).

One AOTInductor package of CALLS small q4 linears in a row (256 x 256, one row: the kernel's own
work is small, so the call path shows), compiled both ways and run in this process; per call, the
difference is the ProxyExecutor's overhead. Statistic: best of `repeats` means of `runs` runs.

    yggdrasil bench shim-overhead [--calls 32] [--runs 2000] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch

from yggdrasil import kernels

from .common import best_mean_ms, environment, format_table, set_threads
from .provenance import Results

DIM = 256


class Chain(torch.nn.Module):
    """x -> q4_linear(x, W_i) for i in 0..calls-1."""

    def __init__(self, calls: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for i in range(calls):
            packed, scales, mins = kernels.quantize_q4(torch.randn(DIM, DIM, generator=g) * 0.05)
            self.register_buffer(f"p{i}", packed)
            self.register_buffer(f"s{i}", scales)
            self.register_buffer(f"m{i}", mins)
        self.calls = calls

    def forward(self, x):
        for i in range(self.calls):
            x = torch.ops.yggdrasil.q4_linear(x, getattr(self, f"p{i}"), getattr(self, f"s{i}"), getattr(self, f"m{i}"))
        return x


def package(module, x, path: Path, shim: bool):
    exported = torch.export.export(module, (x,), strict=False)
    configs = kernels.aoti_configs() if shim else {}
    with kernels.aoti_link_env() if shim else contextlib.nullcontext():
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
    return torch._inductor.aoti_load_package(str(path))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = set_threads(args.threads)
    kernels.load()
    module, x = Chain(args.calls).eval(), torch.randn(1, DIM)
    with tempfile.TemporaryDirectory() as tmp:
        shim = package(module, x, Path(tmp) / "shim.pt2", True)
        proxy = package(module, x, Path(tmp) / "proxy.pt2", False)
        with torch.inference_mode():
            want = module(x)
            assert torch.equal(shim(x), want) and torch.equal(proxy(x), want), "a package disagrees with eager"
        with torch.inference_mode():  # seconds per run
            times = {name: best_mean_ms(lambda _, fn=fn: fn(x), runs, args.repeats) / 1e3
                     for name, fn, runs in (("eager", module, args.runs // 4), ("c-shim", shim, args.runs),
                                            ("proxy-executor", proxy, args.runs))}
    per_call = {name: t / args.calls * 1e6 for name, t in times.items()}
    rows = [[name, f"{t * 1e6:.1f}", f"{per_call[name]:.2f}"] for name, t in times.items()]
    print(format_table(["path", f"us per run ({args.calls} calls)", "us per call"], rows))
    overhead = per_call["proxy-executor"] - per_call["c-shim"]
    print(f"ProxyExecutor costs {overhead:+.2f} us per call over the C shim")
    record.write({"benchmark": "shim_overhead", "environment": environment(threads=threads), "calls": args.calls,
                  "dim": DIM, "statistic": f"best of {args.repeats} means of {args.runs} runs",
               "us_per_run": {k: v * 1e6 for k, v in times.items()}, "us_per_call": per_call,
               "proxy_over_shim_us_per_call": overhead}, args.out)

