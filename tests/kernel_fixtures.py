"""The kernel tests' shared fixtures: the built library (skipping where it cannot be built) and
each ISA path this CPU has, forced through kernels.forced_isa (the environment variable is read
once per process)."""

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
def isa(request, built):
    """Each ISA path this CPU has (the float ops: avx512 on avx512vnni, avx2 on avxvnni and avx2)."""
    if request.param not in K.kernel_isas():
        pytest.skip(f"this CPU lacks the {request.param} path (has {K.kernel_isas()})")
    with K.forced_isa(request.param):
        assert K.kernel_isa() == request.param
        yield request.param
