"""bench/gemm_rows.py: its kernels compute the linear they stand for, and a tiny run writes its
table, JSON and plot (with our q4/q8 rows where yggdrasil.kernels builds here)."""

from __future__ import annotations

import json

import torch

from yggdrasil.bench import gemm_rows
from yggdrasil.bench.provenance import missing_fields
from yggdrasil.bench.run import run_measurement


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
    pack_ours = gemm_rows.our_packer()
    fns, isas, nbytes = gemm_rows.our_kernels(*zip(pack_ours(weight))) if pack_ours else ({}, {}, {})
    for name, fn in fns.items():  # ours: 4-bit or 8-bit blocks of 32, int8 activations
        with gemm_rows._isa(isas[name]):
            ours = fn(x, 0)
        assert 0 < (ours - reference).abs().max() < (0.1 if name.startswith("q4") else 0.02) * scale, name
        assert nbytes[name] > 0


def _ours_available() -> bool:
    try:
        from yggdrasil import kernels

        kernels.load()
        return True
    except kernels.KernelBuildError:
        return False


def test_a_tiny_run_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        run_measurement("gemm-rows", ["--in-features", "64", "--out-features", "32", "--copies", "1",
                                      "--repeats", "1", "--threads", "1", "--tag", "t", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # the tests after this one run with the process's own count
    out = capsys.readouterr().out
    assert "T16/T1" in out and "w8a8" in out and "read bandwidth" in out and "T1/floor" in out
    result = json.loads(out.strip().splitlines()[-1])
    names = set(result["results"])
    assert {"int4pack", "int8-woq", "w8a8"} <= names
    if _ours_available():
        from yggdrasil import kernels

        expected = {f"q4-ours-{isa}" for isa in kernels.kernel_isas() if isa != "scalar"} | {"q8-ours"}
        assert names - {"int4pack", "int8-woq", "w8a8"} == expected and "q8-ours" in out
    assert all(set(times) == {str(n) for n in gemm_rows.ROWS} for times in result["results"].values())
    assert all(v > 0 for times in result["results"].values() for v in times.values())
    assert result["read_bandwidth_gbs"] > 0 and set(result["t1_floor_ms"]) == names
    assert (tmp_path / "gemm-rows-t.png").stat().st_size > 0 and (tmp_path / "gemm-rows-t.json").is_file()
    assert missing_fields(result) == [] and result["provenance"]["command"].startswith("yggdrasil bench gemm-rows")
