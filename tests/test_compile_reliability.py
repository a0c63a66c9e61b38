"""`yggdrasil compile` never loses data and builds bundles that can be repaired (issue 24): an
--out that is not a bundle is refused and left exactly as it was; a bundle is replaced in one
step with the usual permissions; cached work is checked against its recorded sha256 before
reuse; a damaged bundle is repaired by the command its error suggests; --force always works."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import write_tiny_recipe_dir

import yggdrasil.graphs.manifest as manifest_mod
from yggdrasil.compile import work_cache
from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.storage.manifest import BundleError, Environment, Manifest, check_bundle
from yggdrasil.graphs.manifest import OccupiedError, write_bundle

PROMPT = "alpha beta gamma tree"
ENV = Environment("2.13.0+cpu", None, "Test CPU (2 threads)")


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root: a file's sha256, a link's target, or 'dir'."""
    found = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(folder, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = "link " + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def umask_mode(mode: int = 0o777) -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory) -> Path:
    return write_tiny_recipe_dir(tmp_path_factory.mktemp("recipe"))


def occupied_directory(out: Path) -> None:
    (out / "notes").mkdir(parents=True)
    (out / "thesis.tex").write_text("years of work")
    (out / "notes" / "a.txt").write_text("a")
    (out / "notes" / "b.bin").write_bytes(os.urandom(64))


# --- refusing what is not a bundle -----------------------------------------------------------

def test_compile_into_a_directory_that_is_not_a_bundle_is_refused(recipe_dir, tmp_path):
    out = tmp_path / "bundles" / "x"
    occupied_directory(out)
    before = snapshot(tmp_path)
    with pytest.raises(OccupiedError, match=r"x is a directory with 3 files that is not a yggdrasil bundle; "
                                            r"choose another --out or remove it yourself"):
        build_bundle(load_recipe(recipe_dir), out)
    assert snapshot(tmp_path) == before  # nothing deleted, moved, or created beside it


def test_compile_onto_a_file_is_refused(recipe_dir, tmp_path):
    out = tmp_path / "x"
    out.write_text("not a bundle")
    before = snapshot(tmp_path)
    with pytest.raises(OccupiedError, match=r"x is a file of 12 bytes, not a yggdrasil bundle"):
        build_bundle(load_recipe(recipe_dir), out)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_the_cli_refuses_with_one_line_and_changes_nothing(recipe_dir, tmp_path, kind):
    out = tmp_path / "x"
    if kind == "directory":
        occupied_directory(out)
    else:
        out.write_bytes(b"\x00" * 100)
    before = snapshot(tmp_path)
    run = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "compile", str(recipe_dir), "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not a yggdrasil bundle" in lines[0], run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert snapshot(tmp_path) == before


def _fill(tmp: Path) -> None:
    (tmp / "graphs").mkdir()
    (tmp / "graphs" / "verify_w8.pt2").write_bytes(b"\x01" * 1000)
    (tmp / "profile.yaml").write_text("schema: x\n")


def _write(out: Path, fill=_fill) -> Manifest:
    return write_bundle(out, Manifest({"name": "x"}, "c" * 64, {}, ENV, ("verify_w8",), "float32", 1, (64,)), fill)


def test_a_bundle_with_someone_elses_file_in_it_is_refused(tmp_path):
    _write(tmp_path / "b")
    (tmp_path / "b" / "graphs" / "my-notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(OccupiedError, match=r"a yggdrasil bundle with 1 file of something else in it "
                                            r"\(graphs/my-notes.txt\)"):
        _write(tmp_path / "b")
    assert snapshot(tmp_path) == before


def test_a_symbolic_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "b").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OccupiedError, match="symbolic link"):
        _write(tmp_path / "b")
    assert (tmp_path / "b").is_symlink() and not any((tmp_path / "elsewhere").iterdir())


def test_an_empty_directory_and_a_damaged_bundle_are_replaced(tmp_path):
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty")
    check_bundle(tmp_path / "empty", ENV, {}, "rebuild")
    damaged = tmp_path / "damaged"
    _write(damaged)
    (damaged / "manifest.yaml").write_text("{{{ not yaml")
    (damaged / "recipe.yaml").write_text("name: x\n")  # every bundle has its recipe
    _write(damaged)  # recognised by its layout although its manifest is unreadable
    check_bundle(damaged, ENV, {}, "rebuild")


# --- replacing a bundle ----------------------------------------------------------------------

@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_bundle_is_replaced_whole_with_the_usual_permissions(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(manifest_mod, "_exchange", lambda a, b: False)
    _write(tmp_path / "b")
    (tmp_path / "b" / "graphs" / "verify_w8.pt2").write_bytes(b"damaged")

    def fill(tmp):
        _fill(tmp)
        (tmp / "selection.yaml").write_text("new: 1\n")

    written = _write(tmp_path / "b", fill)
    assert set(written.artifacts) == {"graphs/verify_w8.pt2", "profile.yaml", "selection.yaml"}
    check_bundle(tmp_path / "b", ENV, {}, "rebuild")  # the damaged file was replaced too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no partial or old copies left
    for directory in (tmp_path / "b", tmp_path / "b" / "graphs"):
        assert directory.stat().st_mode & 0o777 == umask_mode(), oct(directory.stat().st_mode)


def test_a_crash_while_replacing_keeps_the_old_bundle(tmp_path):
    _write(tmp_path / "b")
    before = snapshot(tmp_path)

    def crash(tmp):
        _fill(tmp)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path / "b", crash)
    assert snapshot(tmp_path) == before


def test_partial_bundles_of_killed_compiles_are_removed(tmp_path):
    abandoned = tmp_path / ".b.partial-999999999-0a1b2c3d"  # no such process
    running = tmp_path / f".b.partial-{os.getpid()}-0a1b2c3d"  # this one's, as if building now
    for path in (abandoned, running):
        path.mkdir()
        (path / "x.pt2").write_bytes(b"x")
    _write(tmp_path / "b")
    assert not abandoned.exists() and running.exists()


# --- the work cache's hashes -----------------------------------------------------------------

def test_cached_pieces_are_checked_against_their_recorded_hashes(tmp_path):
    logged = []
    graph = tmp_path / "graphs" / "target" / "decode_w1.pt2"
    graph.parent.mkdir(parents=True)
    graph.write_bytes(b"graph" * 100)
    graph.with_suffix(".key").write_text("k")
    assert not work_cache.reusable(graph, "k", "graph", logged.append)  # no hashes recorded: not trusted
    assert "no content hashes" in logged[-1] and not graph.exists() and not graph.with_suffix(".key").exists()
    graph.write_bytes(b"graph" * 100)
    work_cache.seal(graph)
    graph.with_suffix(".key").write_text("k")
    assert work_cache.reusable(graph, "k", "graph", logged.append)
    assert not work_cache.reusable(graph, "other", "graph", logged.append)  # another key: rebuilt, not damaged
    with open(graph, "r+b") as f:  # damaged in place, same size
        f.write(b"GRAPH")
    assert not work_cache.reusable(graph, "k", "graph", logged.append)
    assert "decode_w1.pt2 differs from what was cached" in logged[-1] and not graph.exists()


def test_a_damaged_calibration_is_dropped_and_an_unfinished_one_kept(tmp_path):
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    (calibration / "calibration.yaml").write_text("a: 1\n")
    (calibration / "arrays.npz").write_bytes(b"\x00" * 50)
    logged = []
    work_cache.check_calibration(calibration, logged.append)  # no key yet: unfinished, left for calibrate
    assert calibration.exists() and not logged
    work_cache.seal(calibration)
    (tmp_path / "calibration.key").write_text("k")
    work_cache.check_calibration(calibration, logged.append)
    assert calibration.exists() and not logged
    (calibration / "arrays.npz").write_bytes(b"\x00" * 49)
    work_cache.check_calibration(calibration, logged.append)
    assert "arrays.npz differs" in logged[-1]
    assert not calibration.exists() and not (tmp_path / "calibration.key").exists()


def test_force_refuses_to_clear_a_directory_that_is_not_a_work_cache(tmp_path):
    root = tmp_path / ".b.work"
    root.mkdir()
    (root / "mine.txt").write_text("mine")
    with pytest.raises(OccupiedError, match="not a yggdrasil work cache"):
        work_cache.clear_work_cache(root, print)
    assert (root / "mine.txt").read_text() == "mine"
    legacy = tmp_path / ".c.work"
    (legacy / "graphs").mkdir(parents=True)
    (legacy / "calibration.key").write_text("k")
    work_cache.clear_work_cache(legacy, print)
    assert sorted(p.name for p in legacy.iterdir()) == [work_cache.MARKER]


# --- repairing bundles (the tiny recipe, compiled once per session in conftest.py) -------------

@pytest.fixture
def private_copy(tiny_bundle, tmp_path):
    """The tiny bundle and its work cache, copied (no links) to break."""
    recipe_path, bundle = tiny_bundle
    out = tmp_path / "bundle"
    shutil.copytree(bundle, out)
    shutil.copytree(work_cache.work_root(bundle), work_cache.work_root(out))
    return recipe_path, out


def fixed_profile(monkeypatch):
    """The session bundle's eager profile, for the calibrations a repair redoes (conftest.py)."""
    from yggdrasil.runtime import latency

    profile = latency.LatencyProfile(draft=((1, 0.02), (2, 0.025), (4, 0.03)),
                                     verify=((1, 1.0), (2, 1.1), (4, 1.3)))
    monkeypatch.setattr(latency, "measure_profile", lambda *args, **kwargs: profile)


def generates_like_eager(bundle: Path, recipe_path: Path, n: int = 16) -> bool:
    """Load the bundle as `generate --bundle` does: its greedy output equals plain eager greedy."""
    import torch

    from yggdrasil.bundle import open_bundle
    from yggdrasil.runtime.generate import greedy_tokens
    from yggdrasil.models.hf_loader import load_hf_model
    from yggdrasil.sampling import SamplingParams
    from yggdrasil.runtime.steps import StepRunner

    rt = open_bundle(bundle, quiet=True).generator()
    ids = rt.target.tokenizer.encode(PROMPT)
    spec = rt.speculator()
    tokens = spec.generate(ids, n, SamplingParams(temperature=0.0)).tokens if spec else greedy_tokens(rt.runner, ids, n)
    eager = StepRunner(load_hf_model(recipe_path.parent / "tiny-random", torch.float32), 256, 16)
    return len(tokens) == n and tokens == greedy_tokens(eager, ids, n)


def suggested_command(message: str) -> list[str]:
    """The `yggdrasil ...` command an error message suggests, as arguments after `yggdrasil`."""
    found = re.search(r"`yggdrasil ([^`]+)`", message)
    assert found, message
    return found.group(1).split()


def run_cli(argv: list[str]) -> int:
    from yggdrasil.cli import main

    return main(argv)


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:  # in place: the inode (and any hard link to it) is what changes
        f.truncate(path.stat().st_size // 3)


@pytest.mark.slow
def test_a_damaged_bundle_is_repaired_by_the_command_its_error_suggests(private_copy, monkeypatch, capsys):
    from yggdrasil.bundle import open_bundle

    recipe_path, out = private_copy
    fixed_profile(monkeypatch)
    graph = out / "graphs" / "target" / "decode_w1.pt2"
    truncate(graph)
    (out / "calibration" / "calibration.yaml").write_text("garbage: [")
    cached = work_cache.work_root(out) / "graphs" / "target" / "decode_w1.pt2"
    assert cached.stat().st_size > graph.stat().st_size  # copies, not links: the cache is untouched
    with pytest.raises(BundleError) as error:
        open_bundle(out, quiet=True)
    argv = suggested_command(str(error.value))
    assert argv[:1] == ["compile"] and "--out" in argv
    assert run_cli(argv) == 0
    printed = capsys.readouterr().out
    assert "existing bundle is stale" in printed and "reusing calibration" in printed
    manifest = yaml.safe_load((out / "manifest.yaml").read_text())
    assert manifest["stats"]["graphs_compiled"] == 0  # repaired from the intact cache
    assert generates_like_eager(out, recipe_path)
    assert out.stat().st_mode & 0o777 == umask_mode()


@pytest.mark.slow
def test_damage_that_reached_the_cache_is_rebuilt(private_copy, monkeypatch):
    """Older versions hard-linked bundle graphs into the cache, so damage to one reached the
    other; the cache's hashes catch it, and a plain re-run rebuilds what is damaged."""
    recipe_path, out = private_copy
    fixed_profile(monkeypatch)
    work = work_cache.work_root(out)
    graph, cached = out / "graphs" / "target" / "decode_w1.pt2", work / "graphs" / "target" / "decode_w1.pt2"
    cached.unlink()
    os.link(graph, cached)  # the old layout
    truncate(graph)
    assert cached.stat().st_size == graph.stat().st_size
    truncate(work / "calibration" / "calibration.yaml")
    others = {p: p.stat().st_mtime_ns for p in (work / "graphs").rglob("*.pt2") if p != cached}
    logged = []
    build_bundle(load_recipe(recipe_path), out, log=logged.append)
    text = "\n".join(logged)
    assert "cached graph decode_w1.pt2 is damaged" in text and "cached calibration is damaged" in text
    # only the damaged graph was compiled again (stage plans, measured here, may add others)
    assert {p: p.stat().st_mtime_ns for p in others} == others
    assert work_cache.damage(cached) is None and work_cache.damage(work / "calibration") is None
    assert not cached.samefile(graph)
    assert generates_like_eager(out, recipe_path)


@pytest.mark.slow
def test_force_rebuilds_from_scratch_whatever_the_cache_holds(private_copy, monkeypatch):
    """Damage the hashes cannot see (the graph's record rewritten to match it): the plain re-run
    fails loading it, and the command that error suggests (--force) rebuilds everything."""
    recipe_path, out = private_copy
    fixed_profile(monkeypatch)
    work = work_cache.work_root(out)
    cached = work / "graphs" / "target" / "decode_w1.pt2"
    truncate(cached)
    work_cache.seal(cached)
    truncate(out / "graphs" / "target" / "decode_w1.pt2")
    with pytest.raises(BundleError) as error:
        build_bundle(load_recipe(recipe_path), out, log=lambda line: None)
    argv = suggested_command(str(error.value))
    assert "--force" in argv
    (work / "calibration.sha256").write_text(yaml.safe_dump({"not": "a record"}))  # and more damage
    (work / "graphs" / "draft").rename(work / "graphs" / "draft-moved")
    assert run_cli(argv) == 0
    manifest = yaml.safe_load((out / "manifest.yaml").read_text())
    assert manifest["stats"]["graphs_reused"] == 0
    assert not (work / "graphs" / "draft-moved").exists()  # cleared
    assert generates_like_eager(out, recipe_path)
