"""Cost of the batch-invariant ops (yggdrasil.kernels.attention / rms_norm) against PyTorch's.

Attention, per model shape (SmolLM2-135M: 9 heads over 3 kv heads of 64; Qwen2.5-1.5B: 12 over 2
of 128), span S (512, 2048) and rows T (1: decode, 16: verify, 64: prefill chunk): q is the
transpose of a [1, T, H, D] projection, k/v are the first S slots of a [1, Hkv, S + 64, D] cache
(views, as the model passes them), the mask lets row t see keys 0 .. S - T + t (a full context).
Several layers' caches (--copies, default 8: about L3 size) are cycled so K/V come from memory as
in a model step. Each op is timed against F.scaled_dot_product_attention(enable_gqa=True) on the
same operands, interleaved, best of --repeats means. RMSNorm: T rows of the two models' widths
against F.rms_norm and the model's own expression. Prints tables and ends with one JSON line:

    yggdrasil bench attention-rows --threads 2 [--isa all]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import yggdrasil.kernels as K

from .common import best_mean_ms, cpu_name, environment, format_table, set_threads
from .provenance import Results

SHAPES = {"smollm2-135m": (9, 3, 64, 576), "qwen2.5-1.5b": (12, 2, 128, 1536)}  # H, Hkv, D, dim
SPANS = (512, 2048)
ROWS = (1, 16, 64)


def attention_case(heads: int, kv_heads: int, dim: int, span: int, rows: int, copies: int):
    g = torch.Generator().manual_seed(span + rows)
    shape = (1, kv_heads, span + 64, dim)
    caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(copies)]
    q = torch.randn(1, rows, heads, dim, generator=g).transpose(1, 2)
    t = torch.arange(rows)[:, None]
    mask = (torch.arange(span)[None, :] <= span - rows + t)[None, None]
    scale = dim ** -0.5

    def ours(c):
        k, v = caches[c]
        return K.attention(q, k[:, :, :span], v[:, :, :span], mask, scale)

    def sdpa(c):
        k, v = caches[c]
        return F.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    return ours, sdpa


def measure_attention(isas: list[str], copies: int, repeats: int) -> list[dict]:
    results = []
    for model, (heads, kv_heads, dim, _) in SHAPES.items():
        for span in SPANS:
            for rows in ROWS:
                ours, sdpa = attention_case(heads, kv_heads, dim, span, rows, copies)
                row = {"model": model, "S": span, "T": rows, "sdpa": round(best_mean_ms(sdpa, copies, repeats), 4)}
                for isa in isas:
                    with K.forced_isa(isa):
                        row[isa] = round(best_mean_ms(ours, copies, repeats), 4)
                results.append(row)
    return results


def measure_rms_norm(isas: list[str], repeats: int) -> list[dict]:
    results = []
    for model, (*_, width) in SHAPES.items():
        weight = torch.randn(width)
        for rows in ROWS:
            x = torch.randn(1, rows, width)

            def expression(_):
                return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

            row = {"model": model, "D": width, "T": rows,
                   "F.rms_norm": round(best_mean_ms(lambda _: F.rms_norm(x, (width,), weight, 1e-5), 50, repeats), 4),
                   "expression": round(best_mean_ms(expression, 50, repeats), 4)}
            for isa in isas:
                with K.forced_isa(isa):
                    row[isa] = round(best_mean_ms(lambda _: K.rms_norm(x, weight, 1e-5), 50, repeats), 4)
            results.append(row)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--copies", type=int, default=8, help="layer caches cycled (default 8)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isa", default="best", help="best | all | a path name (ours)")
    parser.add_argument("--out", default=None, help="also write the JSON here")


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = set_threads(args.threads)
    K.load()
    isas = {"best": K.kernel_isas()[:1], "all": [i for i in K.kernel_isas() if i != "scalar"]}.get(args.isa, [args.isa])
    attention = measure_attention(isas, args.copies, args.repeats)
    norms = measure_rms_norm(isas, args.repeats)
    print(f"{cpu_name()}, {threads} threads, ms per call")
    print(format_table(["model", "S", "T", "sdpa", *isas, f"{isas[0]}/sdpa"],
                       [[r["model"], r["S"], r["T"], r["sdpa"], *(r[i] for i in isas), round(r[isas[0]] / r["sdpa"], 2)]
                        for r in attention]))
    print(format_table(["model", "D", "T", "F.rms_norm", "expression", *isas],
                       [[r["model"], r["D"], r["T"], r["F.rms_norm"], r["expression"], *(r[i] for i in isas)]
                        for r in norms]))
    record.write({"bench": "attention_rows", "env": environment(threads=threads), "attention": attention,
                  "rms_norm": norms, "statistic": f"ms per call: the best of {args.repeats} repeats of the mean "
                                                  "over the cycled caches"}, args.out)

