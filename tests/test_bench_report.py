"""bench/report.py: docs/results.md is regenerated from the committed result files, and the
ablation rows say which steps ran where."""

from __future__ import annotations

from pathlib import Path

from yggdrasil.bench import report

ROOT = Path(__file__).resolve().parent.parent


def test_ablation_rows_name_where_they_ran():
    assert report._ablation_label("O1 EGT D3xW1") == "O1 EGT D3xW1, eager"
    assert report._ablation_label("const D3xW1/V4") == "best constant bucket D3xW1/V4 (bundle graphs)"
    assert "bundle graphs" in report._ablation_label("ar-compiled")


def test_the_committed_results_page_is_what_the_committed_results_give(tmp_path):
    out = tmp_path / "docs" / "results.md"
    assert report.main(["--out", str(out)]) == 0  # the command runs; its links are relative to its page
    committed = (ROOT / "docs" / "results.md").read_text()
    regenerated = report.render([report.RESULTS], ROOT / "docs")
    assert regenerated == committed, "docs/results.md is stale: run python -m yggdrasil.bench.report"
    assert "\n| const " not in regenerated and "(bundle graphs) |" in regenerated  # rows say where they ran


def test_the_readme_results_table_is_what_the_committed_results_give():
    from yggdrasil.bench.report_headline import README_BEGIN, README_END, readme_table, replace_readme_block

    readme = (ROOT / "README.md").read_text()
    suite_dirs = sorted(d for d in report.RESULTS.iterdir() if d.is_dir() and report._is_suite_dir(d))
    assert replace_readme_block(readme, readme_table(suite_dirs)) == readme, \
        "README's results table is stale: run python -m yggdrasil.bench.report --readme README.md"
    block = readme.split(README_BEGIN)[1].split(README_END)[0]
    assert "llama.cpp plain" in block and "STALE" not in block and "INVALID" not in block


def _compare_result(egt_valid: bool) -> dict:
    rows = [{"variant": "ar-compiled", "backend": "bundle", "tpot_ms": 10.0, "aal": 1.0, "status": "ok", "valid": True},
            {"variant": "egt", "backend": "bundle", "tpot_ms": 5.0, "aal": 3.0, "status": "ok" if egt_valid else
             "INVALID", "valid": egt_valid, "x_ar-compiled": 2.0, "x_hf-greedy": 3.0}]
    return {"rows": rows, "models": {"target": {"name": "t"}}, "environment": {"cpu": "test CPU", "cores": 2},
            "bundle": {"recipe": "a-bench-only-recipe", "recipe_identity": "0123"}}


def test_an_invalid_row_is_never_the_fastest_or_the_headline(tmp_path, monkeypatch):
    """A row whose greedy output differs from autoregressive greedy is reported as INVALID, not
    ranked fastest, and its bundle's headline row carries no speed-up."""
    import json

    assert report._fastest_line(_compare_result(True)).startswith("- Fastest valid row: ")
    line = report._fastest_line(_compare_result(False))
    assert "5.0 ms" not in line and "10.0 ms" in line and "INVALID rows not ranked" in line
    for valid in (True, False):
        directory = tmp_path / f"valid-{valid}"
        directory.mkdir()
        (directory / "compare.json").write_text(json.dumps(_compare_result(valid)))
        monkeypatch.setattr(report.rs, "device_line", lambda env: "test CPU")
        monkeypatch.setattr(report.report_headline, "bench_only", lambda result, recipes=None: False)
        table = "\n".join(report.headline([directory]))
        assert ("**2.00x**" in table) is valid and ("INVALID" in table) is not valid


def test_the_trees_report_says_whether_egt_differs_from_the_chain_and_by_how_much():
    """EGT's grid contains the chain, so 'EGT >= chain' is no finding: the report says per verify
    width whether EGT chose another shape and the measured margin, which may be below 1."""
    same = {"chain": {"shape": "D3xW1", "aal": 2.0, "objective_speedup": 1.2},
            "egt": {"shape": "D3xW1", "aal": 2.0, "objective_speedup": 1.2}}
    assert "picks the chain itself (D3xW1)" in report._egt_against_chain(4, same)
    other = {"chain": same["chain"], "egt": {"shape": "D2xW2", "aal": 1.9, "objective_speedup": 1.08}}
    line = report._egt_against_chain(4, other)
    assert "D2xW2 differs from the chain's D3xW1" in line and "0.90x the chain's objective" in line


def test_an_old_never_slower_note_says_what_was_really_tested():
    note = ("shipped policy (O5) over the best constant bucket (D1xW1/V2): x0.989, 95 % interval 0.970-1.004 "
            "over 8 paired runs (never slower: the interval reaches 1.0)")
    said = report._honest_note(note)
    assert "never slower: the interval" not in said and "not a test of \"never slower\"" in said
    assert report._honest_note("a note") == "a note"


def test_a_result_of_another_recipe_than_the_shipped_one_is_marked_stale_not_headlined(tmp_path, monkeypatch):
    import json

    from yggdrasil.compile.recipe import load_recipe

    shipped = load_recipe(report.report_headline.SHIPPED_RECIPES / "smollm2-lookup-cpu.yaml").identity()
    monkeypatch.setattr(report.rs, "device_line", lambda env: "test CPU")
    cases = {"current": ({"recipe": "smollm2-lookup-cpu", "recipe_identity": shipped}, None),
             "changed": ({"recipe": "smollm2-lookup-cpu", "recipe_identity": "old"}, "has changed since"),
             "unknown": ({"recipe": "smollm2-lookup-cpu"}, "recorded before results kept")}
    for name, (bundle, why) in cases.items():
        result = {**_compare_result(True), "bundle": bundle}
        assert (report.stale(result) is None) if why is None else why in report.stale(result)
        directory = tmp_path / name
        directory.mkdir()
        (directory / "compare.json").write_text(json.dumps(result))
        table = "\n".join(report.headline([directory]))
        assert ("**2.00x**" in table) is (why is None) and ("STALE" in table) is (why is not None), table


def _on(result: dict, cpu: str, date: str, threads: int = 2) -> dict:
    prov = {"date": date, "cpu": {"model": cpu, "isa_flags": ["avx2"], "cores": 2, "threads": threads}}
    return {**result, "provenance": prov, "statistic": {"speedup": "median of paired ratios"}}


def test_results_from_two_machines_are_never_set_side_by_side(tmp_path, monkeypatch):
    """Two current results measured on different CPUs: the newer one is headlined, the other is
    listed without its numbers; a third with another statistic likewise."""
    import json

    monkeypatch.setattr(report.rs, "device_line", lambda env: "test CPU")
    monkeypatch.setattr(report.report_headline, "bench_only", lambda result, recipes=None: False)
    fast = _compare_result(True)
    fast["rows"][1] = {**fast["rows"][1], "x_ar-compiled": 3.0}
    results = {"a-newer": _on(_compare_result(True), "CPU one", "2026-11-27"),
               "b-older": _on(fast, "CPU two", "2026-11-20"),
               "c-other-statistic": {**_on(fast, "CPU one", "2026-11-21"), "statistic": {"speedup": "ratio of means"}},
               "d-more-threads": _on(fast, "CPU one", "2026-11-22", threads=4)}
    dirs = []
    for name, result in results.items():
        result["bundle"] = {**result["bundle"], "recipe": f"recipe-{name}"}  # four recipes: none supersedes
        (tmp_path / name).mkdir()
        (tmp_path / name / "compare.json").write_text(json.dumps(result))
        dirs.append(tmp_path / name)
    table = "\n".join(report.headline(dirs))
    assert "**2.00x**" in table and "**3.00x**" not in table, table
    assert table.count("another machine") == 2 and "another statistic" in table


def test_a_newer_result_of_the_same_recipe_supersedes_the_older(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(report.rs, "device_line", lambda env: "test CPU")
    monkeypatch.setattr(report.report_headline, "bench_only", lambda result, recipes=None: False)
    old, new = _on(_compare_result(True), "CPU one", "2026-11-20"), _on(_compare_result(True), "CPU one", "2026-11-27")
    new["rows"][1] = {**new["rows"][1], "x_ar-compiled": 3.0}
    for name, result in (("old", old), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "compare.json").write_text(json.dumps(result))
    table = "\n".join(report.headline([tmp_path / "old", tmp_path / "new"]))
    assert "**3.00x**" in table and "**2.00x**" not in table and "superseded by new" in table


def test_a_bench_only_recipe_never_enters_the_shipped_headline(tmp_path, monkeypatch):
    """bench/recipes/qwen-pair-cpu-q4.yaml is the shipped pair with `weights: q4` named: valid and
    current, yet not what ships, so neither the headline nor the README's table carries it."""
    import json

    from yggdrasil.bench import report_headline

    monkeypatch.setattr(report.rs, "device_line", lambda env: "test CPU")
    result = _on({**_compare_result(True), "bundle": {"recipe": "qwen-pair-cpu-q4", "recipe_identity": "0123"}},
                 "CPU one", "2026-11-27")
    assert report_headline.bench_only(result) and (ROOT / "bench" / "recipes" / "qwen-pair-cpu-q4.yaml").is_file()
    assert not report_headline.bench_only({"bundle": {"recipe": "qwen-pair-cpu"}})
    (tmp_path / "q4").mkdir()
    (tmp_path / "q4" / "compare.json").write_text(json.dumps(result))
    table = "\n".join(report.headline([tmp_path / "q4"]))
    assert "**2.00x**" not in table and "bench-only recipe" in table, table
    assert "No current result" in "\n".join(report_headline.readme_table([tmp_path / "q4"]))
