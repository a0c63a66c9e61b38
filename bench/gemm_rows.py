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
  q4-ours-ISA our `yggdrasil::q4_linear` (yggdrasil.kernels: 4-bit blocks of 32 with fp16 d and m,
              int8 activations per block, integer dot products), once per ISA path this CPU has
              (forced through $YGGDRASIL_KERNEL_ISA; the scalar fallback is left out: far too slow)
  q8-ours     our `yggdrasil::q8_linear` (8-bit blocks, GGUF Q8_0's form), best path: the LM head's

It also measures the machine's read bandwidth (best of torch sum/amax over 256 MB) and prints each
kernel's weight bytes and T(1) against bytes / bandwidth (the floor at one row).

Several copies of the weight (default 16: over 4x a 32 MB last-level cache) are cycled, so every call
reads its weight from DRAM as a model step does. Prints a table naming the CPU, writes
OUT/gemm-rows-TAG.{json,png} and ends with one JSON line:

    yggdrasil bench gemm-rows --threads 2 --tag epyc-zen5-2c
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

from yggdrasil import kernels as ours
from yggdrasil.errors import InvalidRequestError
from yggdrasil.kernels import forced_isa

from .common import best_mean_ms, environment, load_average, set_threads, timed
from .provenance import Results
from . import plots

GROUP = 32
ROWS = (1, 2, 4, 8, 16, 32, 64)
BANDWIDTH_BYTES = 256 * 2**20


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


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def our_kernels(q4: list, q8: list) -> tuple[dict, dict, dict]:
    """(name -> fn, name -> ISA to force or None, name -> weight bytes) for yggdrasil.kernels' ops
    over packed copies (pack.Q4Weight / Q8Weight); empty without copies."""
    if not q4:
        return {}, {}, {}
    fns, isas, nbytes = {}, {}, {}
    for isa in ours.kernel_isas():
        if isa != "scalar":
            fns[f"q4-ours-{isa}"] = lambda x, c: ours.q4_linear(x, q4[c])
            isas[f"q4-ours-{isa}"], nbytes[f"q4-ours-{isa}"] = isa, _nbytes(*q4[0])
    fns["q8-ours"] = lambda x, c: ours.q8_linear(x, q8[c])
    isas["q8-ours"], nbytes["q8-ours"] = None, _nbytes(*q8[0])
    return fns, isas, nbytes


def our_packer():
    """weight -> (Q4Weight, Q8Weight) with yggdrasil.kernels, or None (saying why on stderr) where
    the library cannot be built or loaded here."""
    try:
        ours.load()
    except ours.KernelBuildError as exc:  # no compiler, failed build: the ATen rows still run
        print(f"our kernels skipped: {exc}", file=sys.stderr)
        return None
    return lambda w: (ours.quantize_q4(w), ours.quantize_q8(w))


def kernels(in_features: int, out_features: int, copies: int) -> tuple[dict, dict, dict]:
    """(kernel name -> fn(x fp32 [n, in], copy index), name -> ISA to force or None, name -> bytes
    of one weight) over `copies` random weights (made one at a time: only the packed copies stay)."""
    pack_ours = our_packer()
    if pack_ours is not None and (out_features % 16 or in_features % 32):
        print("our kernels skipped: they take out_features % 16 == 0 and in_features % 32 == 0", file=sys.stderr)
        pack_ours = None
    int4, int8, int8_t, q4, q8 = [], [], [], [], []
    for _ in range(copies):
        w = torch.randn(out_features, in_features) * 0.02
        int4.append(int4_operands(w))
        int8.append(int8_operands(w))
        int8_t.append((int8[-1][0].t().contiguous(), int8[-1][1]))
        if pack_ours is not None:
            packed_q4, packed_q8 = pack_ours(w)
            q4.append(packed_q4)
            q8.append(packed_q8)
    fns = {
        "int4pack": lambda x, c: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), int4[c][0], GROUP, int4[c][1]),
        "int8-woq": lambda x, c: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), int8[c][0], int8[c][1].bfloat16()),
        "w8a8": lambda x, c: w8a8(x, *int8_t[c]),
    }
    isas = dict.fromkeys(fns)
    nbytes = {"int4pack": _nbytes(*int4[0]), "int8-woq": _nbytes(*int8[0]), "w8a8": _nbytes(*int8_t[0])}
    ours, our_isas, our_bytes = our_kernels(q4, q8)
    return {**fns, **ours}, {**isas, **our_isas}, {**nbytes, **our_bytes}


def read_bandwidth(repeats: int = 5) -> float:
    """GB/s reading memory: the best of torch's sum and amax over a tensor far beyond the caches."""
    big = torch.ones(BANDWIDTH_BYTES // 4)
    best = min(timed(reduce, big)[1] for _ in range(repeats) for reduce in (torch.sum, torch.amax))
    return BANDWIDTH_BYTES / best / 1e9


@contextlib.contextmanager
def _isa(name: str | None):
    if name is None:
        yield
    else:
        with forced_isa(name):
            yield


def measure(in_features: int, out_features: int, copies: int, repeats: int) -> tuple[dict, dict]:
    """(kernel -> {rows: ms}, kernel -> weight bytes), kernels interleaved within each row count."""
    fns, isas, nbytes = kernels(in_features, out_features, copies)
    results = {name: {} for name in fns}
    for rows in ROWS:
        x = torch.randn(rows, in_features)
        for name, fn in fns.items():
            with _isa(isas[name]):
                results[name][rows] = round(best_mean_ms(lambda c: fn(x, c), copies, repeats), 4)
    return results, nbytes


def ratio(times: dict, rows: int) -> float:
    return round(times[rows] / times[1], 2)


def table(results: dict, nbytes: dict, bandwidth: float) -> str:
    """One line per kernel: T(n), the curve's ratios, weight MB, the GB/s it reads at one row, and
    T(1) against bytes / bandwidth."""
    head = (f"{'kernel':<20}" + "".join(f"{'T(' + str(n) + ')':>8}" for n in ROWS)
            + f"{'T8/T1':>7}{'T16/T1':>7}{'MB':>7}{'GB/s@1':>8}{'floor':>7}{'T1/floor':>9}")
    lines = [head + "   (ms)"]
    for name, times in results.items():
        floor = nbytes[name] / bandwidth / 1e6
        lines.append(f"{name:<20}" + "".join(f"{times[n]:>8.3f}" for n in ROWS)
                     + f"{ratio(times, 8):>7.2f}{ratio(times, 16):>7.2f}{nbytes[name] / 1e6:>7.2f}"
                     + f"{nbytes[name] / times[1] / 1e6:>8.1f}{floor:>7.3f}{times[1] / floor:>9.2f}")
    return "\n".join(lines)


def plot(results: dict, path: Path, title: str) -> None:
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, times in results.items():
        ax.plot(list(ROWS), [times[n] for n in ROWS], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows n")
    ax.set_ylabel("ms per linear")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    plots.save(fig, path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--in-features", type=int, default=1536)
    parser.add_argument("--out-features", type=int, default=8960)
    parser.add_argument("--copies", type=int, default=16,
                        help="weights cycled (default 16: ~140 MB at 4 bits, over 4x a 32 MB L3; at 8 copies "
                             "part of the 4-bit weights still came from L3 on Zen 5)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out", default="bench/results")


def run(args: argparse.Namespace, record: Results) -> int | None:
    if args.in_features % GROUP:
        raise InvalidRequestError(f"--in-features must be a multiple of {GROUP} (the int4 group size)")
    threads = set_threads(args.threads)
    bandwidth = read_bandwidth()
    curves, nbytes = measure(args.in_features, args.out_features, args.copies, args.repeats)
    env = environment(threads=threads, shape=[args.in_features, args.out_features], copies=args.copies,
                      repeats=args.repeats, timing="best of repeats of the mean over the cycled copies",
                      kernel_isas=_our_isas())
    print(f"{env['device']}, torch {torch.__version__}, {threads} threads, linear {args.in_features} -> "
          f"{args.out_features}, load {load_average()}, our kernel paths {env['kernel_isas']}")
    print(f"read bandwidth {bandwidth:.1f} GB/s (best of torch sum/amax over {BANDWIDTH_BYTES >> 20} MB, hardware "
          "prefetch only); floor = weight bytes / bandwidth; GB/s@1 = weight bytes / T(1)")
    print(table(curves, nbytes, bandwidth))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(curves, out / f"gemm-rows-{args.tag}.png",
         f"one {args.in_features}->{args.out_features} linear vs rows, {env['device']}, {threads} thread(s)")
    floors = {name: round(nbytes[name] / bandwidth / 1e6, 4) for name in curves}
    record.write({"bench": "gemm_rows", "environment": env, "results": curves,
                  "t8_over_t1": {name: ratio(times, 8) for name, times in curves.items()},
                  "t16_over_t1": {name: ratio(times, 16) for name, times in curves.items()},
                  "weight_bytes": nbytes, "read_bandwidth_gbs": round(bandwidth, 2), "t1_floor_ms": floors,
                  "statistic": f"ms per call: the best of {args.repeats} repeats of the mean over the cycled "
                               "weight copies; t8_over_t1 and t16_over_t1 are ratios of those"},
                 out / f"gemm-rows-{args.tag}.json")


def _our_isas() -> list[str] | None:
    return ours.kernel_isas() if ours.is_loaded() else None

