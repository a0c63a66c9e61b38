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
    assert report.main(["--out", str(out)]) == 0
    committed = (ROOT / "docs" / "results.md").read_text()
    # links are relative to the page, so compare with the page written beside docs/
    regenerated = out.read_text()
    assert regenerated.count("\n## ") == committed.count("\n## ")
    assert "\n| const " not in regenerated and "(bundle graphs) |" in regenerated  # rows say where they ran


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

    shipped = load_recipe(report.SHIPPED_RECIPES / "smollm2-lookup-cpu.yaml").identity()
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
