"""GEMM cost against rows for the CPU weight kernels, weights streamed from memory.

Why the int4 verify curve is steep (issue 22): at one row a weight-only kernel is bound by the
bytes it reads, so int4 wins; at more rows it turns compute-bound, and a kernel that dequantizes
to floats and multiplies in fp32 FMAs then costs rows x FLOPs at the core's float throughput.
This measures, at one model's MLP shape (default Qwen2.5-Coder-1.5B's w13, 1536 -> 8960), one
linear of n rows for:

  int4pack    ATen's `_weight_int4pack_mm_for_cpu` (group 32, bf16 activations): our int4 format
  int8-woq    ATen's `_weight_int8pack_mm` (per-channel int8, bf16 activations): our int8 format
  w8a8        activations quantized per row to int8, then `torch._int_mm` (int8 x int8 -> int32,
              VNNI where the CPU has it) and rescaled: not a format of ours, measured to see
              whether an integer dot-product kernel would flatten the curve

Several copies of the weight (more bytes than the last-level cache) are cycled, so every call
reads its weight from DRAM as a model step does. Prints a table naming the CPU, writes
OUT/gemm-rows-TAG.{json,png} and ends with one JSON line:

    python -m bench.gemm_rows --threads 2 --tag epyc-zen5-2c
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .common import emit_json, environment, load_average, set_threads

GROUP = 32
ROWS = (1, 2, 4, 8, 16)


def int4_operands(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int4, bf16 scales_and_zeros) for ATen's CPU int4 kernel, asymmetric per group."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    pairs = torch.stack([scale.squeeze(-1), (low + 8 * scale).squeeze(-1)], -1).transpose(0, 1)
    return packed, pairs.contiguous().bfloat16()


def int8_operands(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], fp32 per-channel scales)."""
    scales = weight.abs().amax(1).clamp(min=1e-8) / 127
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def w8a8(x: torch.Tensor, weight_t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dynamic per-row int8 activations times int8 weights (weight_t: [in, out]), fp32 out."""
    row_scale = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    xq = (x / row_scale).round().clamp(-127, 127).to(torch.int8)
    return torch._int_mm(xq, weight_t) * row_scale * scales


def kernels(in_features: int, out_features: int, copies: int) -> dict:
    """kernel name -> fn(x fp32 [n, in], copy index) over `copies` random weights."""
    weights = [torch.randn(out_features, in_features) * 0.02 for _ in range(copies)]
    int4 = [int4_operands(w) for w in weights]
    int8 = [int8_operands(w) for w in weights]
    int8_t = [(q.t().contiguous(), s) for q, s in int8]
    del weights
    return {
        "int4pack": lambda x, c: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), int4[c][0], GROUP, int4[c][1]),
        "int8-woq": lambda x, c: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), int8[c][0], int8[c][1].bfloat16()),
        "w8a8": lambda x, c: w8a8(x, *int8_t[c]),
    }


def time_per_call(fn, x: torch.Tensor, copies: int, repeats: int) -> float:
    """Best over repeats of the mean ms per call, cycling through the copies."""
    for c in range(copies):
        fn(x, c)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for c in range(copies):
            fn(x, c)
        best = min(best, (time.perf_counter() - start) / copies)
    return 1e3 * best


def measure(in_features: int, out_features: int, copies: int, repeats: int) -> dict:
    fns = kernels(in_features, out_features, copies)
    results = {name: {} for name in fns}
    for rows in ROWS:
        x = torch.randn(rows, in_features)
        for name, fn in fns.items():
            results[name][rows] = round(time_per_call(fn, x, copies, repeats), 4)
    return results


def table(results: dict) -> str:
    lines = [f"{'kernel':<10}" + "".join(f"{'T(' + str(n) + ') ms':>11}" for n in ROWS) + f"{'T(16)/T(1)':>12}"]
    for name, times in results.items():
        lines.append(f"{name:<10}" + "".join(f"{times[n]:>11.3f}" for n in ROWS) + f"{times[16] / times[1]:>12.2f}")
    return "\n".join(lines)


def plot(results: dict, path: Path, title: str) -> None:
    # matplotlib is optional and slow to import: only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, times in results.items():
        ax.plot(list(ROWS), [times[n] for n in ROWS], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows n")
    ax.set_ylabel("ms per linear")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-features", type=int, default=1536)
    parser.add_argument("--out-features", type=int, default=8960)
    parser.add_argument("--copies", type=int, default=8, help="weights cycled (default 8: ~110 MB int8)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if args.in_features % GROUP:
        parser.error(f"--in-features must be a multiple of {GROUP} (the int4 group size)")
    threads = set_threads(args.threads)
    results = measure(args.in_features, args.out_features, args.copies, args.repeats)
    env = environment(threads=threads, shape=[args.in_features, args.out_features], copies=args.copies,
                      repeats=args.repeats, timing="best of repeats of the mean over the cycled copies")
    print(f"{env['device']}, torch {torch.__version__}, {threads} threads, linear {args.in_features} -> "
          f"{args.out_features}, load {load_average()}")
    print(table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / f"gemm-rows-{args.tag}.png",
         f"one {args.in_features}->{args.out_features} linear vs rows, {env['device']}, {threads} thread(s)")
    summary = {name: round(times[16] / times[1], 2) for name, times in results.items()}
    emit_json({"bench": "gemm_rows", "environment": env, "results": results, "t16_over_t1": summary},
              out / f"gemm-rows-{args.tag}.json")


if __name__ == "__main__":
    main()
