"""Bundles that move between machines: the manifest's CPU fingerprint and graph ISA, the refusal
of a bundle whose graphs need a feature this CPU lacks (before any graph library is opened),
the warning for a bundle measured on another CPU, `compile --isa avx2` (no AVX-512 code in its
graphs) and `compile --reprofile` on a copied bundle (new fingerprint, same graphs)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from helpers import tiny_profile

import yggdrasil.cpu as cpu_mod
from yggdrasil.cpu import X86_64_V3, X86_64_V4, CpuFingerprint, GraphIsa, fingerprint_from_cpuinfo
from yggdrasil.graphs.describe import describe
from yggdrasil.storage.manifest import BundleError, Environment, Manifest, check_bundle, elsewhere_warning, integrity, parse_manifest, read_manifest
from yggdrasil.graphs.manifest import write_bundle

REBUILD = "`yggdrasil compile recipes/x.yaml --out b`"
ZEN5 = CpuFingerprint("x86_64", "AuthenticAMD", "AMD EPYC", 26, 2, 1, X86_64_V4 + ("avx512_vnni", "avx_vnni"), 2, 2)
ZEN3 = CpuFingerprint("x86_64", "AuthenticAMD", "AMD EPYC", 25, 1, 1, X86_64_V3, 2, 2)
NATIVE_ZEN5 = GraphIsa("native", "native", "avx512 avx512_vnni", ZEN5.features, ZEN5.summary())
AVX2 = GraphIsa("avx2", "x86-64-v3", "avx2", X86_64_V3, ZEN5.summary())
# what `grep` would find of AVX-512 in a disassembly: zmm registers, the upper 16 xmm/ymm
# registers and the opmask registers only EVEX (AVX-512) encodings reach
AVX512_CODE = re.compile(r"%zmm\d|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[1-7]\b")


def _env(cpu: CpuFingerprint, device: str = "AMD EPYC (2 threads)") -> Environment:
    return Environment("2.13.0+cpu", None, device, cpu)


def _manifest(cpu: CpuFingerprint, isa: GraphIsa | None, recipe_identity: str = "c" * 64) -> Manifest:
    return Manifest({"name": "x", "device": "cpu"}, recipe_identity, {"target": {"name": "t", "sha256": "a" * 64}},
                    _env(cpu), ("target/decode_w1",), "float32", 1, (16,), created="2026-11-26", isa=isa)


def _write(tmp_path: Path, manifest: Manifest) -> Path:
    def fill(tmp):
        (tmp / "graphs").mkdir()
        (tmp / "graphs" / "decode_w1.pt2").write_bytes(b"\x01" * 100)

    write_bundle(tmp_path / "b", manifest, fill)
    return tmp_path / "b"


def test_bundles_that_differ_only_in_the_compiling_cpus_isa_have_different_ids():
    zen5, zen3 = _manifest(ZEN5, NATIVE_ZEN5), _manifest(ZEN3, replace(NATIVE_ZEN5, requires=ZEN3.features))
    assert zen5.environment.device == zen3.environment.device  # the old weak name is the same
    assert zen5.bundle_id != zen3.bundle_id
    assert _manifest(ZEN5, NATIVE_ZEN5).bundle_id == zen5.bundle_id
    assert _manifest(ZEN5, AVX2).bundle_id != zen5.bundle_id  # and the graphs' target ISA


def test_a_graph_feature_this_cpu_lacks_is_refused_in_one_line_naming_it_and_both_ways_out(tmp_path):
    bundle = _write(tmp_path, _manifest(ZEN5, NATIVE_ZEN5))
    with pytest.raises(BundleError) as info:
        check_bundle(bundle, _env(ZEN3), {}, REBUILD)
    message = str(info.value)
    assert "\n" not in message and "cannot run on this CPU" in message
    assert "avx512f, avx512cd, avx512bw, avx512dq, avx512vl, avx512_vnni, avx_vnni" in message
    assert "`yggdrasil compile recipes/x.yaml --out b --isa avx2`" in message  # a portable bundle
    assert f"rebuild it here with {REBUILD}" in message


def test_a_portable_bundle_runs_on_any_cpu_with_its_isa_and_warns_about_the_step_times(tmp_path):
    bundle = _write(tmp_path, _manifest(ZEN5, AVX2))
    manifest = check_bundle(bundle, _env(ZEN3), {}, REBUILD)  # Zen 3 has AVX2: no refusal
    warning = elsewhere_warning(bundle, manifest, _env(ZEN3), REBUILD)
    assert warning is not None and "\n" not in warning and "measured on another CPU" in warning
    assert "`yggdrasil compile recipes/x.yaml --out b --reprofile`" in warning and "keeps the graphs" in warning
    assert elsewhere_warning(bundle, manifest, _env(replace(ZEN5, threads=2)), REBUILD) is None


def test_another_thread_count_on_the_same_cpu_is_still_refused_with_the_flag(tmp_path):
    bundle = _write(tmp_path, _manifest(ZEN5, NATIVE_ZEN5))
    with pytest.raises(BundleError, match="built for 2 CPU thread.*pass --threads 2"):
        check_bundle(bundle, _env(replace(ZEN5, threads=1), "AMD EPYC (1 threads)"), {}, REBUILD)


def test_another_architecture_is_refused(tmp_path):
    bundle = _write(tmp_path, _manifest(ZEN5, AVX2))
    arm = CpuFingerprint("aarch64", "", "Neoverse-V2", None, None, None, (), 64, 64)
    with pytest.raises(BundleError, match="compiled for x86_64 CPUs but this machine is aarch64"):
        check_bundle(bundle, _env(arm), {}, REBUILD)


def test_a_manifest_from_before_fingerprints_is_checked_by_its_device_name(tmp_path):
    bundle = _write(tmp_path, replace(_manifest(ZEN5, None), environment=Environment("2.13.0+cpu", None,
                                                                                     "AMD EPYC (2 threads)")))
    raw = yaml.safe_load((bundle / "manifest.yaml").read_text())
    raw["schema"] = "yggdrasil-bundle/3"
    raw["integrity"] = integrity(raw)
    (bundle / "manifest.yaml").write_text(yaml.safe_dump(raw))
    manifest = check_bundle(bundle, _env(ZEN3), {}, REBUILD)  # same device name: opens, as before
    assert manifest.environment.cpu is None and "not recorded" in describe(manifest)
    with pytest.raises(BundleError, match="compiled for device 'AMD EPYC \\(2 threads\\)'"):
        check_bundle(bundle, _env(ZEN3, "Intel Xeon (2 threads)"), {}, REBUILD)


def test_inspect_shows_the_fingerprint_and_the_graph_isa(tmp_path):
    text = describe(read_manifest(_write(tmp_path, _manifest(ZEN5, AVX2)), REBUILD)[0])
    assert "AuthenticAMD family 26 model 2 stepping 1, 2 cores" in text and "measured with 2 thread(s)" in text
    assert "avx512_vnni avx_vnni" in text and "avx2 (-march=x86-64-v3, Inductor vector ISA avx2)" in text


ZEN3_CPUINFO = "\n\n".join(f"""processor\t: {i}
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
stepping\t: 1
physical id\t: 0
core id\t\t: {i // 2}
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 abm movbe adx sha_ni vaes""" for i in range(4))


def test_the_fingerprint_reads_cpuinfo():
    cpu = fingerprint_from_cpuinfo(ZEN3_CPUINFO, "x86_64", threads=4)
    assert (cpu.vendor, cpu.model_name, cpu.family, cpu.model, cpu.stepping) == ("AuthenticAMD", "AMD EPYC 7B13",
                                                                                   25, 1, 1)
    assert cpu.physical_cores == 2 and cpu.threads == 4  # 4 logical CPUs on 2 cores
    assert "sha_ni" not in cpu.features and "vaes" in cpu.features
    assert cpu.portable_isa() == "avx2" and cpu.lacks(X86_64_V4) == X86_64_V4[len(X86_64_V3):]
    assert CpuFingerprint.from_dict(cpu.as_dict()) == cpu


def test_isa_settings_patch_inductor_only_inside_the_block():
    from torch._inductor import config, cpu_vec_isa

    from yggdrasil.graphs.isa import IsaError, graph_isa, inductor_isa

    before = (config.cpp.march, config.cpp.simdlen, str(cpu_vec_isa.pick_vec_isa()))
    with inductor_isa("avx2"):
        assert (config.cpp.march, config.cpp.simdlen, str(cpu_vec_isa.pick_vec_isa())) == ("x86-64-v3", 256, "avx2")
    assert (config.cpp.march, config.cpp.simdlen, str(cpu_vec_isa.pick_vec_isa())) == before
    with pytest.raises(IsaError, match="--isa avx512 needs a CPU with avx512f.*--isa avx2"):
        graph_isa("avx512", ZEN3)
    here = cpu_mod.cpu_fingerprint()
    if here.portable_isa() is None:
        pytest.skip("this CPU has no AVX2")
    assert graph_isa("avx2", here).requires == X86_64_V3
    assert set(graph_isa("native", here).requires) == set(here.features)


def test_the_recipe_key_and_the_flag():
    from yggdrasil.cli import build_parser
    from yggdrasil.compile.recipe import RecipeError, parse_recipe

    from helpers import TINY_RECIPE

    raw = yaml.safe_load(TINY_RECIPE.read_text())
    native = parse_recipe(raw)
    assert native.isa == "native" and parse_recipe({**raw, "isa": "avx2"}).isa == "avx2"
    assert parse_recipe({**raw, "isa": "avx2"}).identity() != native.identity()
    assert parse_recipe({**raw, "isa": "native"}).identity() == native.identity()  # bundles built before stay current
    with pytest.raises(RecipeError, match="isa must be one of native, avx512, avx2"):
        parse_recipe({**raw, "isa": "sse"})
    assert build_parser().parse_args(["compile", "r.yaml", "--isa", "avx512"]).isa == "avx512"


# -- on compiled bundles ---------------------------------------------------------------------
def _package_code(pt2: Path, into: Path) -> tuple[set, set, list[Path]]:
    """(the CPU ISAs AOTInductor recorded, every -march its compile commands used, the shared
    objects) of one package."""
    with zipfile.ZipFile(pt2) as z:
        isas = {yaml.safe_load(z.read(n)).get("AOTI_CPU_ISA") for n in z.namelist() if n.endswith("_metadata.json")}
        marches = {m.decode() for n in z.namelist() if n.endswith(".cpp") for m in re.findall(rb"-march=\S+", z.read(n))}
        libraries = [Path(z.extract(n, into)) for n in z.namelist() if n.endswith(".so")]
    return isas, marches, libraries


def _avx512_instructions(library: Path) -> int:
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                             check=True).stdout
    return len(AVX512_CODE.findall(listing))


@pytest.fixture(scope="module")
def avx2_bundle(tmp_path_factory):
    """The tiny recipe compiled with --isa avx2 (fixed step times, as conftest's tiny bundle), on
    a smaller grid (one draft width, verify widths 1 and 2): still every kind of graph, in fewer
    shapes, since each avx2 graph is compiled apart from the native ones the suite shares."""
    from helpers import write_tiny_recipe_dir

    import yggdrasil.runtime.latency as latency
    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe

    if cpu_mod.cpu_fingerprint().portable_isa() is None:
        pytest.skip("this CPU has no AVX2 to compile --isa avx2 graphs on")
    root = tmp_path_factory.mktemp("avx2-bundle")
    recipe_path = write_tiny_recipe_dir(root)
    raw = yaml.safe_load(recipe_path.read_text())
    raw["buckets"].update(depths=[1, 2], draft_widths=[1], verify_widths=[1, 2])
    recipe_path.write_text(yaml.safe_dump(raw))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(latency, "measure_profile", lambda *args, **kwargs: tiny_profile())
        build_bundle(replace(load_recipe(recipe_path), isa="avx2"), root / "bundle")
    return root / "bundle"


@pytest.mark.slow
def test_an_avx2_bundle_holds_no_avx512_code(avx2_bundle, tmp_path):
    manifest = read_manifest(avx2_bundle, REBUILD)[0]
    assert (manifest.isa.target, manifest.isa.march, manifest.isa.vec_isa) == ("avx2", "x86-64-v3", "avx2")
    assert manifest.isa.requires == X86_64_V3 and manifest.recipe["isa"] == "avx2"
    packages = sorted(avx2_bundle.glob("graphs/*/*.pt2"))
    assert len(packages) == len(manifest.buckets)
    if shutil.which("objdump") is None:
        pytest.fail("objdump (binutils) is needed to scan the graphs' machine code")
    for i, pt2 in enumerate(packages):
        isas, marches, libraries = _package_code(pt2, tmp_path / str(i))
        assert isas == {"AVX2"} and marches == {"-march=x86-64-v3"}, pt2  # what Inductor compiled for
        assert libraries and all(_avx512_instructions(lib) == 0 for lib in libraries), pt2


@pytest.mark.slow
def test_the_scan_finds_avx512_in_a_native_bundle_on_an_avx512_cpu(tiny_bundle, tmp_path):
    """The scan above can see AVX-512: a native bundle compiled here holds it, where here has it."""
    if "avx512f" not in (cpu_mod.cpu_fingerprint().features or ()) or shutil.which("objdump") is None:
        pytest.skip("needs an AVX-512 CPU and objdump")
    from torch._inductor import cpu_vec_isa

    picked = str(cpu_vec_isa.pick_vec_isa())
    if not picked.startswith("avx512"):  # e.g. ATEN_CPU_CAPABILITY=avx2, which Inductor follows
        pytest.skip(f"Inductor compiles for {picked} here, not AVX-512")
    isas, marches, libraries = _package_code(tiny_bundle[1] / "graphs" / "target" / "verify_w4.pt2", tmp_path)
    assert marches == {"-march=native"} and any(i.startswith("AVX512") for i in isas)
    assert sum(_avx512_instructions(lib) for lib in libraries) > 0


@pytest.mark.slow
def test_an_avx2_bundle_runs_and_equals_its_own_autoregressive_greedy_output(avx2_bundle):
    from yggdrasil.bundle import open_bundle
    from yggdrasil.runtime.generate import greedy_tokens
    from yggdrasil.sampling import SamplingParams

    rt = open_bundle(avx2_bundle, quiet=True).generator()
    ids = rt.target.tokenizer.encode("alpha beta gamma tree")
    speculator = rt.speculator()
    plain = greedy_tokens(rt.runner, ids, 24)  # one token per step, on the bundle's own graphs
    assert speculator is not None
    assert speculator.generate(ids, 24, SamplingParams(temperature=0.0)).tokens == plain


def _copy_bundle(bundle: Path, into: Path) -> Path:
    """The bundle alone, as copied to another machine (its work cache stays behind)."""
    shutil.copytree(bundle, into / "bundle")
    return into / "bundle"


def _resign(bundle: Path, change) -> None:
    """Edit the manifest and write it back with its id and integrity hash recomputed (a bundle
    that was really built that way)."""
    raw = yaml.safe_load((bundle / "manifest.yaml").read_text())
    change(raw)
    (bundle / "manifest.yaml").write_text(yaml.safe_dump(parse_manifest(raw).to_dict(), sort_keys=False))


@pytest.mark.slow
def test_a_missing_feature_is_refused_before_any_graph_library_is_opened(tiny_bundle, tmp_path, monkeypatch):
    import yggdrasil.bundle as bundle_mod
    from yggdrasil import kernels
    from yggdrasil.bundle import open_bundle

    bundle = _copy_bundle(tiny_bundle[1], tmp_path)
    needed = read_manifest(bundle, REBUILD)[0].isa.requires
    here = cpu_mod.cpu_fingerprint()
    # this CPU less the last feature the graphs were compiled to use
    monkeypatch.setattr(cpu_mod, "cpu_fingerprint",
                        lambda threads=0: replace(here, threads=threads,
                                                  features=tuple(f for f in here.features if f != needed[-1])))
    opened = []
    monkeypatch.setattr(bundle_mod, "load_graph_set", lambda *a, **k: opened.append("graphs"))
    monkeypatch.setattr(kernels, "load", lambda *a, **k: opened.append("kernels"))
    with pytest.raises(BundleError, match=f"cannot run on this CPU.*may use {needed[-1]}, which this CPU"):
        open_bundle(bundle, quiet=True).generator()
    assert opened == []


@pytest.mark.slow
def test_generate_refuses_a_bundle_for_a_feature_this_cpu_lacks_in_one_line(tiny_bundle, tmp_path):
    here = cpu_mod.cpu_fingerprint()
    absent = next((f for f in cpu_mod.FEATURES if here.features is not None and f not in here.features), None)
    if absent is None:
        pytest.skip("this CPU has every feature yggdrasil knows")
    bundle = _copy_bundle(tiny_bundle[1], tmp_path)
    _resign(bundle, lambda raw: raw["isa"]["requires"].append(absent))
    run = subprocess.run([sys.executable, "-m", "yggdrasil", "generate", "--bundle", str(bundle), "--prompt", "alpha"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode > 0, run.stderr[-2000:]  # an error, not a crash (an illegal instruction is -4)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"may use {absent}, which this CPU" in lines[0]
    assert "--isa" in lines[0] and "rebuild it here" in lines[0]


@pytest.mark.slow
def test_same_isa_on_another_cpu_runs_warns_once_and_reprofile_keeps_the_graphs(tiny_bundle, tmp_path, monkeypatch,
                                                                                capsys):
    import yggdrasil.compile.compile_graphs as compile_graphs
    import yggdrasil.runtime.latency as latency
    from yggdrasil.bundle import open_bundle
    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe

    recipe_path, original = tiny_bundle
    bundle = _copy_bundle(original, tmp_path)
    built = read_manifest(bundle, REBUILD)[0]
    other = replace(built.environment.cpu, model_name="Other CPU", family=99, physical_cores=64)
    monkeypatch.setattr(cpu_mod, "cpu_fingerprint", lambda threads=0: replace(other, threads=threads))
    open_bundle(bundle, quiet=True).generator()
    open_bundle(bundle, quiet=True)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "measured on another CPU" in line]
    assert len(warnings) == 1 and "--reprofile" in warnings[0] and "keeps the graphs" in warnings[0]

    def no_compiling(*args, **kwargs):
        raise AssertionError("--reprofile compiled a graph")

    monkeypatch.setattr(compile_graphs, "_compile_here", no_compiling)
    monkeypatch.setattr(compile_graphs, "_compile_in_workers", no_compiling)
    monkeypatch.setattr(latency, "measure_profile", lambda *args, **kwargs: tiny_profile())
    result = build_bundle(load_recipe(recipe_path), bundle, reprofile=True)
    after = read_manifest(bundle, REBUILD)[0]
    assert not result.reused and after.environment.cpu.model_name == "Other CPU"
    assert after.environment.cpu.physical_cores == 64 and after.bundle_id != built.bundle_id
    assert after.isa == built.isa  # still compiled for (and on) the CPU that compiled them
    graphs = {rel: a["sha256"] for rel, a in built.artifacts.items() if rel.endswith(".pt2")}
    assert graphs and {rel: after.artifacts[rel]["sha256"] for rel in graphs} == graphs
    capsys.readouterr()
    open_bundle(bundle, quiet=True)  # measured here now: nothing to say
    assert "measured on another CPU" not in capsys.readouterr().err
