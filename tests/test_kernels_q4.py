"""yggdrasil.kernels: the 4-bit / 8-bit block-weight x int8-activation CPU ops.

Tolerance: none. Every ISA path does the reference's integer dots exactly and the same float32
operations in the same order (no fused multiply-add: the library is built with -ffp-contract=off),
so op == reference bit for bit (torch.equal), and a row's bits never depend on the call's other rows.
The library builds once per source version (a minute on 2 cores) into the user cache; the module
fixture pays that once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import yggdrasil.kernels as K
from kernel_fixtures import built, isa  # noqa: F401 (pytest fixtures)

ROWS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 64)
N, IN = 48, 96  # three 16-column groups, three 32-wide blocks
Q = gguf.GGMLQuantizationType


def _weight(seed: int = 0, n: int = N, k: int = IN) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _gguf_blocks(w: torch.Tensor, qtype) -> np.ndarray:
    return gguf.quants.quantize(w.numpy(), qtype)


def _weights() -> dict:
    """Q4_1-style (min/max), Q4_0-style (GGUF Q4_0 blocks: m = -8d), and 8-bit (GGUF Q8_0)."""
    w = _weight()
    return {
        "q4_1": K.quantize_q4(w),
        "q4_0": K.pack_gguf_q4(_gguf_blocks(w, Q.Q4_0), Q.Q4_0, tuple(w.shape)),
        "q4_0_ours": K.quantize_q4(w, symmetric=True),
        "q8_0": K.pack_gguf_q8_0(_gguf_blocks(w, Q.Q8_0), tuple(w.shape)),
    }


def _activations(rows: int, k: int = IN, seed: int = 1) -> torch.Tensor:
    """Random rows, plus the corner cases of the activation quantizer: an all-zero block, a block
    below the 1e-30 threshold, and half-way values that round to even (amax 127 -> scale 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 3
    if rows >= 3:
        x[1, :32] = 0
        x[1, 32:64] = 1e-31
        x[2, :32] = torch.arange(32) - 15.5  # ..., -0.5, 0.5, 1.5, ...: ties
        x[2, 0] = 127.0
    return x


def _op(kind: str, x: torch.Tensor, w) -> torch.Tensor:
    return K.q8_linear(x, w) if kind.startswith("q8") else K.q4_linear(x, w)


def _ref(kind: str, x: torch.Tensor, w) -> torch.Tensor:
    return K.q8_linear_reference(x, w) if kind.startswith("q8") else K.q4_linear_reference(x, w)


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q4_0_ours", "q8_0"])
def test_op_equals_reference_bit_for_bit(isa, kind):
    w = _weights()[kind]
    for rows in ROWS:
        x = _activations(rows)
        assert torch.equal(_op(kind, x, w), _ref(kind, x, w)), (isa, kind, rows)
    x = _activations(6).bfloat16().reshape(2, 3, IN)  # bfloat16 in and out, leading dims kept
    out = _op(kind, x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, N)
    assert torch.equal(out, _ref(kind, x, w))


def test_ops_compute_the_linear_within_quantization_error(built):
    w = _weight(3, 64, 256)
    # seeded: the reference itself exceeds the 0.1 bound on about 7 % of unseeded draws
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4))
    exact = x @ w.t()
    scale = exact.abs().max()
    for q, op, tol in ((K.quantize_q4(w), K.q4_linear, 0.1), (K.quantize_q8(w), K.q8_linear, 0.02)):
        err = (op(x, q) - exact).abs().max()
        assert 0 < err < tol * scale


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rows_are_batch_invariant(isa, kind):
    """Each row of an M-row call equals that row computed alone, for M = 1..64, any thread count."""
    w = {"q4_1": K.quantize_q4, "q8_0": K.quantize_q8}[kind](_weight(5, 64, 256))
    x = _activations(64, 256, seed=7)
    alone = torch.cat([_op(kind, x[i:i + 1], w) for i in range(64)])
    for rows in range(1, 65):
        assert torch.equal(_op(kind, x[:rows], w), alone[:rows]), (isa, kind, rows)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_op(kind, x, w), alone)
    finally:
        torch.set_num_threads(threads)


def test_gguf_blocks_round_trip_exactly_to_gguf_dequantization():
    w = _weight(9, 32, 128)
    for qtype in (Q.Q4_0, Q.Q4_1):
        raw = _gguf_blocks(w, qtype)
        ours = K.dequantize_q4(K.pack_gguf_q4(raw, qtype, (32, 128)))
        assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    raw = _gguf_blocks(w, Q.Q8_0)
    ours = K.dequantize_q8(K.pack_gguf_q8_0(raw, (32, 128)))
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0)))


def test_pack_and_unpack_are_inverse():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    d, m = torch.rand(32, 2, generator=g).half().float(), torch.randn(32, 2, generator=g).half().float()
    q2, d2, m2 = K.unpack_q4(K.pack_q4(q, d, m))
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)
    q8 = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)
    q8b, d8 = K.unpack_q8(K.pack_q8(q8, d))
    assert torch.equal(q8b, q8) and torch.equal(d8, d)
    w = _weight(4, 32, 64)
    for symmetric in (False, True):  # quantizing a float weight lands within one step of it
        q4 = K.quantize_q4(w, symmetric=symmetric)
        step = K.unpack_q4(q4)[1].abs().repeat_interleave(32, 1)
        assert ((K.dequantize_q4(q4) - w).abs() <= step).all()


def test_shapes_and_dtypes_the_kernels_cannot_take_are_refused(built):
    w = K.quantize_q4(_weight())
    with pytest.raises(RuntimeError, match="has 95 features.*multiple of 32"):
        K.q4_linear(torch.randn(2, 95), w)
    with pytest.raises(RuntimeError, match="has 64 features.*takes 96"):
        K.q4_linear(torch.randn(2, 64), w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16, got Double"):
        K.q4_linear(torch.randn(2, IN, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16, got Int"):
        K.q4_linear(torch.ones(2, IN, dtype=torch.int32), w)
    with pytest.raises(RuntimeError, match=r"packed must be a CPU Byte tensor, got Char"):
        torch.ops.yggdrasil.q4_linear(torch.randn(2, IN), w.packed.view(torch.int8), w.scales, w.mins)
    with pytest.raises(RuntimeError, match=r"scales has shape \[3, 3, 8\]; expected \[3, 3, 16\]"):
        torch.ops.yggdrasil.q4_linear(torch.randn(2, IN), w.packed, w.scales[..., :8].contiguous(), w.mins)
    with pytest.raises(K.KernelShapeError, match=r"multiple of 16.*got \[40, 96\]"):
        K.quantize_q4(torch.randn(40, IN))
    with pytest.raises(K.KernelShapeError, match=r"multiple of 32.*got \[48, 80\]"):
        K.quantize_q8(torch.randn(48, 80))
    with pytest.raises(K.KernelShapeError, match="0..15"):
        K.pack_q4(torch.full((16, 32), 16, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(K.KernelShapeError, match="no -128"):
        K.pack_q8(torch.full((16, 32), -128, dtype=torch.int8), torch.ones(16, 1))


def test_forcing_a_path_the_cpu_lacks_or_does_not_know_is_refused(built):
    best = K.kernel_isa()
    with pytest.raises(RuntimeError, match="avx1024 is not a kernel path"):
        with K.forced_isa("avx1024"):
            pass
    for name in set(K.ISAS) - set(K.kernel_isas()):  # none on a CPU that has every path
        with pytest.raises(RuntimeError, match="asks for a kernel path this CPU lacks"):
            with K.forced_isa(name):
                pass
    assert K.kernel_isa() == best  # a refused path changes nothing


def test_the_variable_is_read_once_at_the_first_op_call(tmp_path):
    """$YGGDRASIL_KERNEL_ISA picks the path for the whole process (a bad one: every call raises);
    changing it later changes nothing, forced_isa does."""
    code = ("import os, yggdrasil.kernels as K\n"
            "first = K.kernel_isa()\n"
            "os.environ[K.ISA_ENV] = 'avx1024'\n"
            "assert K.kernel_isa() == first\n"
            "with K.forced_isa(K.kernel_isas()[0]):\n    inside = K.kernel_isa() == K.kernel_isas()[0]\n"
            "print(first, inside, K.kernel_isa())")
    done = _fresh_python(code, YGGDRASIL_KERNEL_ISA="scalar")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["scalar", "True", "scalar"]
    done = _fresh_python("import yggdrasil.kernels as K\nK.kernel_isa()", YGGDRASIL_KERNEL_ISA="avx1024")
    assert done.returncode != 0 and "avx1024 is not a kernel path" in done.stderr


def _fresh_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_import_builds_nothing_and_no_compiler_is_a_clear_error(tmp_path):
    code = ("import yggdrasil.kernels as K, json\n"
            "state = [K.is_loaded(), K.library_path().exists()]\n"
            "try:\n    K.load()\nexcept K.KernelBuildError as e:\n    state.append(str(e))\n"
            "print(json.dumps(state))")
    done = _fresh_python(code, YGGDRASIL_CACHE_DIR=str(tmp_path), CXX="/nonexistent/c++")
    assert done.returncode == 0, done.stderr
    loaded, exists, message = json.loads(done.stdout.strip().splitlines()[-1])
    assert not loaded and not exists
    assert "no C++ compiler" in message and "\n" not in message
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").rglob("*.so"))


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name, t in zip(("p4", "s4", "m4"), K.quantize_q4(_weight(11, 64, 96))):
            self.register_buffer(name, t)
        for name, t in zip(("p8", "s8"), K.quantize_q8(_weight(12, 32, 64))):
            self.register_buffer(name, t)

    def forward(self, x):
        h = torch.ops.yggdrasil.q4_linear(x, self.p4, self.s4, self.m4)
        return torch.ops.yggdrasil.q8_linear(torch.relu(h), self.p8, self.s8)


def test_torch_export_traces_the_ops(built):
    model, x = _Tiny(), torch.randn(5, 96)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("rows", max=1024)},))
    targets = {str(n.target) for n in ep.graph.nodes}
    assert {"yggdrasil.q4_linear.default", "yggdrasil.q8_linear.default"} <= targets
    assert torch.equal(ep.module()(x), model(x))
    assert torch.equal(ep.module()(x[:2]), model(x[:2]))


def test_aoti_package_calls_the_c_shims_and_runs_in_a_fresh_process(built, tmp_path):
    model, x = _Tiny(), torch.randn(5, 96)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("rows", max=1024)},))
    with K.aoti_link_env():
        package = torch._inductor.aoti_compile_and_package(
            ep, package_path=str(tmp_path / "tiny.pt2"), inductor_configs=K.aoti_configs())
    with zipfile.ZipFile(package) as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert "aoti_torch_cpu_q4_linear(" in wrapper and "aoti_torch_cpu_q8_linear(" in wrapper
    assert "aoti_torch_proxy_executor_call_function" not in wrapper
    torch.save(x, tmp_path / "x.pt")
    code = (f"import torch\ntorch.ops.load_library({str(built)!r})\n"
            f"runner = torch._inductor.aoti_load_package({package!r})\n"
            f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
            f"torch.save([runner(x), runner(x[:2])], {str(tmp_path / 'y.pt')!r})")
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    full, two = torch.load(tmp_path / "y.pt")
    assert torch.equal(full, model(x)) and torch.equal(two, model(x[:2]))
