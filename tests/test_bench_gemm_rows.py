"""bench/gemm_rows.py: its kernels compute the linear they stand for, and a tiny run writes its
table, JSON and plot."""

from __future__ import annotations

import json

import torch

from bench import gemm_rows


def test_each_kernel_computes_the_linear_within_its_quantization_error():
    torch.manual_seed(0)
    weight = torch.randn(48, 64) * 0.02
    x = torch.randn(5, 64)
    reference = x @ weight.t()
    packed, pairs = gemm_rows.int4_operands(weight)
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, gemm_rows.GROUP, pairs).float()
    q, scales = gemm_rows.int8_operands(weight)
    w8a8 = gemm_rows.w8a8(x, q.t().contiguous(), scales)
    scale = reference.abs().max()
    assert (int4 - reference).abs().max() < 0.1 * scale  # 4-bit weights, bf16 activations
    assert (w8a8 - reference).abs().max() < 0.02 * scale  # 8-bit weights and activations
    assert (w8a8 - reference).abs().max() > 0  # really quantized


def test_a_tiny_run_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        gemm_rows.main(["--in-features", "64", "--out-features", "32", "--copies", "1", "--repeats", "1",
                        "--threads", "1", "--tag", "t", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # the tests after this one run with the process's own count
    out = capsys.readouterr().out
    assert "T(16)/T(1)" in out and "w8a8" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["results"]) == {"int4pack", "int8-woq", "w8a8"}
    assert all(v > 0 for times in result["results"].values() for v in times.values())
    assert (tmp_path / "gemm-rows-t.png").stat().st_size > 0 and (tmp_path / "gemm-rows-t.json").is_file()
