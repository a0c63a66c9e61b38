"""`bench compare --llama-cpp DIR`: llama.cpp's output parsed from recorded samples, its rows built
through the same harness as ours, and rows skipped with a note when a tool or DIR is missing.
No llama.cpp binary is needed: the fake tools below print the recorded samples."""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from yggdrasil.bench import llama_cpp
from yggdrasil.bench.harness import BenchOptions, Prompt, Setup, measure, summary_row

DATA = Path(__file__).parent / "data" / "llama_cpp"
SAMPLES = {"ar": "completion", "draft": "speculative-simple", "lookup": "lookup"}


def sample(family: str) -> tuple[str, str]:
    stem = DATA / SAMPLES[family]
    return stem.with_suffix(".stdout").read_text(), stem.with_suffix(".stderr").read_text()


def prompt_of(family: str) -> str:
    return (DATA / f"{SAMPLES[family]}.prompt").read_text()


# ---------------------------------------------------------------- parsing recorded output

def test_completion_sample_gives_decode_time_per_token_without_prompt_eval():
    stdout, stderr = sample("ar")
    out = llama_cpp.parse_output("ar", stdout, stderr)
    expected = RECORDED["ar"]
    assert out.predicted == expected["runs"]  # the tokens after the first, as our TPOT counts them
    assert out.decode_s == pytest.approx(expected["eval_ms"] / 1e3)
    assert out.tpot == pytest.approx(expected["eval_ms"] / 1e3 / expected["runs"])
    assert out.prompt_tokens == expected["prompt_tokens"]
    assert out.drafted is None and out.accepted is None
    assert out.text.strip() and "llama_perf" not in out.text  # stdout holds the generation only


@pytest.mark.parametrize("family", ["draft", "lookup"])
def test_speculative_samples_give_tokens_time_and_acceptance(family):
    stdout, stderr = sample(family)
    out = llama_cpp.parse_output(family, stdout, stderr, prompt_of(family))
    expected = RECORDED[family]
    first_free = 1 if family == "lookup" else 0  # lookup's first token comes from the prompt's logits
    assert out.predicted == expected["decoded"] - first_free
    assert out.decode_s == pytest.approx(expected["seconds"])
    assert (out.drafted, out.accepted, out.prompt_tokens) == (expected["drafted"], expected["accepted"],
                                                              expected["encoded"])
    assert out.text.strip() and prompt_of(family) not in out.text  # the echoed prompt is cut off


def test_unreadable_output_is_an_error_that_shows_the_tool_log():
    with pytest.raises(llama_cpp.LlamaCppError, match="no 'eval time' line.*error: model not found"):
        llama_cpp.parse_output("ar", "", "main: loading\nerror: model not found\n")
    with pytest.raises(llama_cpp.LlamaCppError, match="llama-lookup printed no 'decoded"):
        llama_cpp.parse_output("lookup", "text", "nothing useful")


# ---------------------------------------------------------------- modes and missing tools

def fake_build(directory: Path, families=("ar", "draft", "lookup")) -> Path:
    """Tools that print the recorded samples, as a llama.cpp build would print them."""
    (directory / "bin").mkdir(parents=True)
    for family in families:
        stem = DATA / SAMPLES[family]
        tool = directory / "bin" / llama_cpp.TOOLS[family]
        tool.write_text(f"#!/bin/sh\ncat '{stem}.stdout'\ncat '{stem}.stderr' >&2\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return directory


def test_no_directory_or_a_missing_one_skips_every_row_with_a_note(tmp_path):
    modes, notes = llama_cpp.plan_modes(None, has_draft=True)
    assert modes == [] and "pass --llama-cpp DIR" in notes[0]
    modes, notes = llama_cpp.plan_modes(tmp_path / "absent", has_draft=True)
    assert modes == [] and "absent is not a directory" in notes[0] and "GGML_NATIVE" in notes[0]


def test_a_missing_tool_skips_its_rows_and_names_the_tool(tmp_path):
    build = fake_build(tmp_path / "llama", families=("ar",))
    modes, notes = llama_cpp.plan_modes(build, has_draft=True)
    assert [m.name for m in modes] == ["llama.cpp-ar"]
    assert any("llama-speculative-simple not found" in n for n in notes)
    assert any("llama-lookup not found" in n for n in notes)


def test_every_draft_length_is_planned_and_draft_rows_need_a_draft_model(tmp_path):
    build = fake_build(tmp_path / "llama")
    with_draft, _ = llama_cpp.plan_modes(build, has_draft=True)
    assert [m.name for m in with_draft] == (["llama.cpp-ar"] + [f"llama.cpp-draft-D{k}" for k in (2, 4, 8)]
                                             + [f"llama.cpp-lookup-D{k}" for k in (2, 4, 8)])
    lookup_only, notes = llama_cpp.plan_modes(build, has_draft=False)
    assert not any(m.family == "draft" for m in lookup_only) and "no draft model" in notes[0]


def test_commands_use_greedy_settings_threads_tokens_and_the_draft_model(tmp_path):
    job = llama_cpp.LlamaJob(Path("t.gguf"), Path("d.gguf"), threads=3, context=2048)
    ar = llama_cpp.Mode("llama.cpp-ar", "ar", Path("llama-completion")).command(job, Path("p.txt"), 64)
    draft = llama_cpp.Mode("llama.cpp-draft-D4", "draft", Path("s"), 4).command(job, Path("p.txt"), 64)
    for command in (ar, draft):
        pairs = dict(zip(command, command[1:]))
        assert (pairs["-m"], pairs["-n"], pairs["-t"], pairs["--temp"], pairs["--top-k"]) == ("t.gguf", "64", "3",
                                                                                             "0", "1")
        assert "--ignore-eos" in command
    assert "-no-cnv" in ar and "-md" not in ar
    pairs = dict(zip(draft, draft[1:]))
    assert (pairs["-md"], pairs["--spec-draft-n-max"], pairs["-td"]) == ("d.gguf", "4", "3")


# ---------------------------------------------------------------- rows

def fake_setup(tmp_path: Path, skip=()) -> Setup:
    options = BenchOptions("compare", tmp_path, n=1, max_new_tokens=RECORDED["ar"]["runs"] + 1, repeats=2,
                           out=tmp_path, skip=tuple(skip))
    return Setup(options, None, [Prompt("set", "a", (1, 2)), Prompt("set", "b", (3,))], {})


def test_rows_come_through_the_harness_with_acceptance_and_the_best_draft_length(tmp_path):
    setup = fake_setup(tmp_path)
    build = fake_build(tmp_path / "llama")
    modes, notes = llama_cpp.plan_modes(build, has_draft=True)
    job = llama_cpp.LlamaJob(Path("t.gguf"), Path("d.gguf"), threads=2, context=512)
    ours_text = sample("ar")[0]
    peer = llama_cpp.LlamaPeer(modes, job, [prompt_of("draft")] * 2, [ours_text, "something else"],
                               setup.options.max_new_tokens, notes)
    assert set(peer.variants) == {m.name for m in modes}  # every fake tool passed its probe
    samples = measure(setup, dict(peer.variants))
    rows = [peer.finish_row(summary_row(setup, samples, name, ("llama.cpp-ar",), greedy=False))
            for name in peer.variants]
    rows, info = llama_cpp.summarize(peer, rows, [115, 7])
    by_name = {r["variant"]: r for r in rows}
    assert len(rows) == 3 and {r["family"] for r in rows} == {"llama.cpp-ar", "llama.cpp-draft", "llama.cpp-lookup"}
    ar = by_name["llama.cpp-ar"]
    assert ar["backend"] == "llama.cpp" and ar["valid"] is None and ar["runs"] == 4
    assert ar["tpot_ms"] == pytest.approx(RECORDED["ar"]["eval_ms"] / RECORDED["ar"]["runs"], rel=1e-3)
    assert ar["check"] == {"same_text": 1, "of": 2, "differs_on": [1]} and ar["status"] == "text 1/2 same"
    draft = next(r for r in rows if r["family"] == "llama.cpp-draft")
    expected = RECORDED["draft"]
    assert draft["acceptance"] == pytest.approx(expected["accepted"] / expected["drafted"], abs=1e-3)
    assert draft["aal"] == pytest.approx(expected["decoded"] / (expected["decoded"] - expected["accepted"]), abs=1e-3)
    assert set(info["draft_lengths"]["llama.cpp-draft"]) == {2, 4, 8}
    assert info["threads"] == 2 and "--spec-draft-n-max 8" in info["commands"]["llama.cpp-draft-D8"]
    notes = llama_cpp.table_notes(info)
    assert "best of draft lengths 2/4/8" in notes
    first_tool = RECORDED["ar"]["prompt_tokens"]  # the fake tools print one sample for every prompt
    assert info["prompt_tokens"] == {"ours": [115, 7], "llama.cpp": [first_tool, first_tool]}
    assert "the same on 1/2 prompts" in notes


def test_a_tool_that_fails_its_probe_is_left_out_with_its_error(tmp_path):
    build = fake_build(tmp_path / "llama", families=("ar",))
    (build / "bin" / "llama-completion").write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    modes, notes = llama_cpp.plan_modes(build, has_draft=False)
    peer = llama_cpp.LlamaPeer(modes, llama_cpp.LlamaJob(Path("t.gguf"), None, 1, 512), ["p"], ["r"], 8, notes)
    assert peer.variants == {}
    assert any("llama.cpp-ar not run" in n and "status 1" in n and "failed to load model" in n for n in peer.notes)


def fake_runtime(target_name: str, tmp_path: Path):
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    manifest = SimpleNamespace(models={"target": {"name": target_name}}, recipe={"max_context": 256})
    return SimpleNamespace(target=SimpleNamespace(tokenizer=tokenizer), manifest=manifest)


def test_open_peer_without_a_directory_runs_nothing_and_says_so(tmp_path):
    setup = fake_setup(tmp_path)
    setup.runtime = fake_runtime("unused", tmp_path)
    setup.reference = [(5, 6), (7,)]
    peer = llama_cpp.open_peer(setup, None)
    assert peer.variants == {} and "pass --llama-cpp DIR" in peer.notes[0]
    rows, info = llama_cpp.summarize(peer, [{"variant": "ar-compiled", "backend": "bundle"}])
    assert rows == [{"variant": "ar-compiled", "backend": "bundle"}] and "pass --llama-cpp" in llama_cpp.table_notes(info)


def test_open_peer_skips_a_model_that_is_not_gguf(tmp_path, monkeypatch):
    setup = fake_setup(tmp_path)
    setup.runtime = fake_runtime("hf-model", tmp_path)
    setup.reference = [(5,), (7,)]
    monkeypatch.setattr(llama_cpp, "resolve_model", lambda name: SimpleNamespace(format="hf", path=tmp_path / name))
    peer = llama_cpp.open_peer(setup, fake_build(tmp_path / "llama"))
    assert peer.variants == {} and any("hf-model is not a GGUF file" in n for n in peer.notes)


def test_open_peer_passes_prompts_as_text_and_honours_skip(tmp_path, monkeypatch):
    setup = fake_setup(tmp_path, skip=("llama.cpp-lookup",))
    setup.runtime = fake_runtime("m", tmp_path)
    setup.reference = [(5,), (7,)]
    monkeypatch.setattr(llama_cpp, "resolve_model", lambda name: SimpleNamespace(format="gguf", path=tmp_path / "m.gguf"))
    peer = llama_cpp.open_peer(setup, fake_build(tmp_path / "llama"))
    assert set(peer.variants) == {"llama.cpp-ar"}  # no draft model in the manifest, lookup skipped
    variant = peer.variants["llama.cpp-ar"]
    # our ids, decoded, plus the newline the tools drop from a prompt file
    assert [p.read_text() for p in variant.prompt_files] == ["1 2\n", "3\n"]
    assert variant.job.target == tmp_path / "m.gguf" and variant.job.context == 256


def test_same_text_compares_over_the_shorter_text():
    assert llama_cpp.same_text("abc def", "abc def ghi") and llama_cpp.same_text("abc\n", "abc")
    assert not llama_cpp.same_text("abd", "abc") and not llama_cpp.same_text("", "abc")


# numbers read off the recorded samples in tests/data/llama_cpp (see README there)
RECORDED = {"ar": {"eval_ms": 1138.80, "runs": 15, "prompt_tokens": 115},
            "draft": {"decoded": 21, "seconds": 9.447, "drafted": 17, "accepted": 16, "encoded": 113},
            "lookup": {"decoded": 33, "seconds": 5.960, "drafted": 24, "accepted": 24, "encoded": 115}}
