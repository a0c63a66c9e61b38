"""bench/report.py: docs/results.md is regenerated from the committed result files, and the
ablation rows say which steps ran where."""

from __future__ import annotations

from pathlib import Path

from bench import report

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
