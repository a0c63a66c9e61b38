"""The kernel tests' shared fixtures: the built library (skipping where it cannot be built), a tiny
random Qwen2 folder for the quantized-model tests, and
each ISA path this CPU has, forced through kernels.forced_isa (the environment variable is read
once per process)."""

from __future__ import annotations

import pytest
from helpers import save_random_hf_model

import torch

import yggdrasil.kernels as K
from yggdrasil.models import quant_q4

needs_kernels = pytest.mark.skipif(quant_q4.kernels_available() is not None, reason="no C++ compiler for the kernels")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random-weight Qwen2-shaped HF folder, once per test module."""
    path = tmp_path_factory.mktemp("tiny-qwen") / "m"
    save_random_hf_model(path, "qwen2")
    return path


@pytest.fixture(scope="module")
def built():
    try:
        return K.load()
    except K.KernelBuildError as exc:
        pytest.skip(f"kernels not buildable here: {exc}")


@pytest.fixture(params=K.ISAS)
def isa(request, built):
    """Each ISA path this CPU has (the float ops: avx512 on avx512vnni, avx2 on avxvnni and avx2)."""
    if request.param not in K.kernel_isas():
        pytest.skip(f"this CPU lacks the {request.param} path (has {K.kernel_isas()})")
    with K.forced_isa(request.param):
        assert K.kernel_isa() == request.param
        yield request.param


def assert_graph_matches_model(graphs, model, spec, tolerance: float) -> None:
    """The loaded step graph `spec` (a verify of 4 rows) against the eager model on one causal step."""
    tokens = torch.tensor([[5, 17, 99, 3]])
    positions = torch.arange(4)[None]
    mask = torch.zeros(1, 4, 64, dtype=torch.bool)
    mask[0, :, :4] = torch.ones(4, 4).tril().bool()
    want = model(tokens, positions, positions.clone(), mask)
    got = graphs.get(spec.name)(tokens, positions, positions.clone(), mask)
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
