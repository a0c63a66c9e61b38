"""Bundle manifest: atomic writes, and one specific error per way a bundle can be wrong."""

from __future__ import annotations

import pytest
import yaml

from yggdrasil.graphs.describe import describe
from yggdrasil.storage.manifest import BundleError, Environment, Manifest, check_bundle, read_manifest
from yggdrasil.graphs.manifest import write_bundle

ENV = Environment("2.13.0+cpu", None, "Test CPU (2 threads)")
MODELS = {"target": {"name": "t", "sha256": "a" * 64}, "draft": {"name": "d", "sha256": "b" * 64}}
REBUILD = "`yggdrasil compile recipes/x.yaml`"


def _fill(tmp):
    (tmp / "graphs").mkdir()
    (tmp / "graphs" / "verify_w8.bin").write_bytes(b"\x01" * 1000)
    (tmp / "profile.yaml").write_text("schema: x\n")


def _bundle(tmp_path):
    manifest = Manifest({"name": "x"}, "c" * 64, MODELS, ENV, ("verify_w8",), "float32", 1, (64,),
                        stats={"compile_seconds": 1.5}, created="2026-11-22")
    return write_bundle(tmp_path / "b", manifest, _fill)


def test_written_bundle_validates_and_describes(tmp_path):
    written = _bundle(tmp_path)
    assert set(written.artifacts) == {"graphs/verify_w8.bin", "profile.yaml"}
    checked = check_bundle(tmp_path / "b", ENV, {"target": "a" * 64, "draft": "b" * 64}, REBUILD)
    assert checked.bundle_id == written.bundle_id
    text = describe(checked)
    assert written.bundle_id in text and "verify_w8" in text and "compile_seconds" in text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_crash_while_writing_leaves_no_bundle(tmp_path):
    def crash(tmp):
        _fill(tmp)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_bundle(tmp_path / "b", Manifest({}, "c", MODELS, ENV, (), "float32", 1, (64,)), crash)
    assert list(tmp_path.iterdir()) == []


def test_rewriting_replaces_the_old_bundle_whole(tmp_path):
    first = _bundle(tmp_path)
    second = _bundle(tmp_path)
    assert first.bundle_id == second.bundle_id
    check_bundle(tmp_path / "b", ENV, {}, REBUILD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def _edit(path, change):
    raw = yaml.safe_load(path.read_text())
    change(raw)
    path.write_text(yaml.safe_dump(raw))


@pytest.mark.parametrize("damage, env, hashes, message", [
    (lambda b: (b / "graphs" / "verify_w8.bin").write_bytes(b"\x01" * 10), ENV, {}, "verify_w8.bin is corrupt"),
    (lambda b: (b / "graphs" / "verify_w8.bin").unlink(), ENV, {}, "missing its artifact"),
    (lambda b: _edit(b / "manifest.yaml", lambda r: r.update(tile=8)), ENV, {}, "edited after it was written"),
    (lambda b: None, ENV, {"target": "f" * 64}, "target model file changed"),
    (lambda b: None, Environment("2.11.0", None, ENV.device), {}, "torch version '2.13.0\\+cpu'.*'2.11.0'"),
    (lambda b: None, Environment(ENV.torch, None, "NVIDIA H100"), {}, "compiled for device"),
    (lambda b: _edit(b / "manifest.yaml", lambda r: r.update(schema="yggdrasil-bundle/7")), ENV, {},
     "newer than this yggdrasil"),
    (lambda b: (b / "manifest.yaml").unlink(), ENV, {}, "not a bundle"),
])
def test_every_mismatch_names_itself_and_the_rebuild_command(tmp_path, damage, env, hashes, message):
    _bundle(tmp_path)
    damage(tmp_path / "b")
    with pytest.raises(BundleError, match=message) as info:
        check_bundle(tmp_path / "b", env, hashes, REBUILD)
    assert REBUILD in str(info.value)


def test_manifest_round_trips(tmp_path):
    written = _bundle(tmp_path)
    manifest, raw = read_manifest(tmp_path / "b", REBUILD)
    assert manifest == written and raw["schema"] == "yggdrasil-bundle/5"
