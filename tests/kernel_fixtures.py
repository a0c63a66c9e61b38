"""The kernel tests' shared fixtures: the built library (skipping where it cannot be built) and
each ISA path this CPU has, forced through the environment variable the ops read per call."""

from __future__ import annotations

import pytest

import yggdrasil.kernels as K


@pytest.fixture(scope="module")
def built():
    try:
        return K.load()
    except K.KernelBuildError as exc:
        pytest.skip(f"kernels not buildable here: {exc}")


@pytest.fixture(params=K.ISAS)
def isa(request, built, monkeypatch):
    """Each ISA path this CPU has (avx512vnni: zmm; avxvnni, avx2: ymm; scalar)."""
    if request.param not in K.kernel_isas():
        pytest.skip(f"this CPU lacks the {request.param} path (has {K.kernel_isas()})")
    monkeypatch.setenv(K.ISA_ENV, request.param)
    assert K.kernel_isa() == request.param
    return request.param
