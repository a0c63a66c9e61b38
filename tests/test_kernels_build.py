"""Building the kernels on every machine (issue 53): the toolchain is checked first with one line;
the x86 files build only on x86 and the portable core everywhere (a build with the x86 files
left out, as a non-x86 machine makes, runs the scalar path and equals the reference); an ISA
file this compiler cannot take is left out alone, with a line naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from yggdrasil.kernels import toolchain


def test_a_missing_compiler_or_ninja_is_one_line_saying_what_to_install(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(toolchain.ToolchainError) as info:
        toolchain.check_toolchain(x86=True)
    assert "no C++ compiler ('no-such-compiler-xyz')" in str(info.value) and "\n" not in str(info.value)
    monkeypatch.delenv("CXX")
    real_which = toolchain.shutil.which
    monkeypatch.setattr(toolchain.shutil, "which", lambda name: None if name == "ninja" else real_which(name))
    with pytest.raises(toolchain.ToolchainError, match="pip install ninja"):
        toolchain.check_toolchain(x86=False)


def test_an_old_gcc_is_refused_for_the_x86_files_but_not_for_the_portable_core(monkeypatch):
    monkeypatch.setattr(toolchain, "identify", lambda command: toolchain.Compiler(command, "gcc", 9))
    with pytest.raises(toolchain.ToolchainError, match="gcc >= 11"):
        toolchain.check_toolchain(x86=True)
    assert toolchain.check_toolchain(x86=False).major == 9  # scalar only: any C++17 compiler


def test_the_compiler_is_identified_from_its_macros():
    found = toolchain.identify(toolchain.compiler_command())
    assert found is not None and found.family in ("gcc", "clang") and found.major >= 1


def test_x86_is_recognised_by_machine_name():
    assert toolchain.is_x86("x86_64") and toolchain.is_x86("AMD64")
    assert not toolchain.is_x86("aarch64") and not toolchain.is_x86("arm64") and not toolchain.is_x86("riscv64")


def test_an_isa_file_the_compiler_cannot_take_is_left_out_alone(monkeypatch):
    monkeypatch.setattr(toolchain, "probe", lambda name, flags: "error: unknown target 'avx512vnni'"
                        if name == "kernel_avx512.cpp" else None)
    said = []
    kept = toolchain.usable_x86_sources(("-O3",), said.append)
    assert kept == [n for n in toolchain.X86_SOURCES if n != "kernel_avx512.cpp"]
    assert len(said) == 1 and "kernel_avx512.cpp does not compile here" in said[0] and "avx512vnni q4 path" in said[0]


def test_a_failing_file_is_found_in_ninjas_log():
    log = ("[1/3] c++ -c kernel_scalar.cpp\nFAILED: [code=1] kernel_avx512.o\nc++ -MMD ... -c kernel_avx512.cpp "
           "-o kernel_avx512.o\nkernel_avx512.cpp:3: error: bad\nFAILED: float_avx2.o\n")
    assert toolchain.failed_sources(log) == ["kernel_avx512.cpp", "float_avx2.cpp"]


def test_every_x86_file_probes_clean_with_this_compiler():
    if not toolchain.is_x86():
        pytest.skip("not an x86 machine")
    for name in toolchain.X86_SOURCES:
        assert toolchain.probe(name, ("-ffp-contract=off",)) is None, name


def test_the_probe_compiles_unoptimised_whatever_the_build_flags(monkeypatch):
    # an -O3 among the build's flags once made every probe a full optimised compile (25 s a file)
    commands = []
    monkeypatch.setattr(toolchain.subprocess, "run", lambda command, **_: commands.append(command)
                        or subprocess.CompletedProcess(command, 0, "", ""))
    assert toolchain.probe("kernel_avx2.cpp", ("-O3", "-ffp-contract=off")) is None
    assert [flag for flag in commands[0] if flag.startswith("-O")][-1] == "-O0"


# a fresh process builds into its own folder (a second library in one process would register the
# ops twice), then checks which paths it has and that each op equals its reference bit for bit
CHILD = textwrap.dedent("""
    import json, os, sys
    import torch
    import yggdrasil.kernels as K
    from yggdrasil.kernels import build, toolchain
    drop = set(json.loads(sys.argv[3]))
    if drop:  # what a compiler that cannot take these files leaves
        toolchain.probe = lambda name, flags: "error: cannot" if name in drop else None
    path = build.build_library(sys.argv[1], x86=sys.argv[2] == "x86", log=lambda line: None)
    K.load(path)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 96, generator=g), torch.randn(48, 96, generator=g) * 0.05
    q4, q8 = K.quantize_q4(w), K.quantize_q8(w)
    q, k, v = (torch.randn(1, 4, 3, 32, generator=g), torch.randn(1, 2, 7, 32, generator=g),
               torch.randn(1, 2, 7, 32, generator=g))
    mask = torch.ones(1, 1, 3, 7, dtype=torch.bool).tril(4)
    norm = torch.randn(96, generator=g)
    same = {}
    for isa in K.kernel_isas():
        with K.forced_isa(isa):
            same[isa] = [torch.equal(K.q4_linear(x, q4), K.q4_linear_reference(x, q4)),
                         torch.equal(K.q8_linear(x, q8), K.q8_linear_reference(x, q8)),
                         torch.equal(K.rms_norm(x, norm, 1e-6), K.rms_norm_reference(x, norm, 1e-6)),
                         torch.equal(K.attention(q, k, v, mask, 0.2), K.attention_reference(q, k, v, mask, 0.2))]
    try:
        with K.forced_isa("avx2"):
            K.q4_linear(x, q4)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc).splitlines()[0]
    print(json.dumps({"isas": K.kernel_isas(), "same": same, "refused": refused}))
""")


def _build_in_child(tmp_path, x86: bool, drop: list[str]) -> dict:
    # the child checks the paths this build has: a forced path from the suite's run would ask for one it lacks
    env = {key: value for key, value in os.environ.items() if key != "YGGDRASIL_KERNEL_ISA"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), "x86" if x86 else "core", json.dumps(drop)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_portable_core_alone_builds_and_runs_the_scalar_path_exactly(tmp_path):
    """What a non-x86 machine builds: no x86 file, no __builtin_cpu_supports; the scalar path."""
    got = _build_in_child(tmp_path, x86=False, drop=[])
    assert got["isas"] == ["scalar"] and got["same"] == {"scalar": [True, True, True, True]}
    if toolchain.is_x86():
        assert "this build of the kernels lacks" in got["refused"], got["refused"]


@pytest.mark.slow
def test_a_build_without_some_isa_files_keeps_the_others_and_falls_back_exactly(tmp_path):
    if not toolchain.is_x86():
        pytest.skip("not an x86 machine")
    got = _build_in_child(tmp_path, x86=True, drop=["kernel_avx512.cpp", "float_avx2.cpp"])
    assert "avx512vnni" not in got["isas"] and got["isas"][-1] == "scalar"
    assert all(all(checks) for checks in got["same"].values()), got["same"]
