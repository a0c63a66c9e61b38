"""`yggdrasil bench draft-placement` (issue 55): a split target's draft whole on rank 0 against
replicated on each rank, measured on 2 gloo ranks (tiny draft: the plumbing, not the numbers)."""

from __future__ import annotations

import json

from helpers import save_tiny_pair

from yggdrasil.bench import draft_placement
from yggdrasil.bench.run import run_measurement


def _round(alone, replicated, message, tree=(1, 2, 3)):
    return {"alone": alone, "replicated": replicated, "message": message, "tree": list(tree)}


def test_the_placements_are_priced_per_iteration_from_both_ranks():
    """whole = drafting alone + the verify's message; replicated = the slower rank's drafting."""
    zero = [_round(0.010, 0.012, 0.001), _round(0.011, 0.013, 0.001), _round(0.010, 0.011, 0.002)]
    one = [_round(0.0, 0.014, 0.001), _round(0.0, 0.012, 0.001), _round(0.0, 0.016, 0.002)]
    result = draft_placement.summarize([zero, one])
    ms = result["ms_per_iteration"]
    assert ms["draft_alone"] == 10.0 and ms["verify_message"] == 1.0
    assert ms["whole_on_rank_0"] == 12.0  # the median of 11, 12, 12
    assert ms["replicated"] == 14.0  # per round the slower rank: 14, 13, 16
    assert result["faster"] == "whole_on_rank_0" and result["replica_trees_equal"]
    cheap_replicas = draft_placement.summarize([[_round(0.010, 0.010, 0.005)], [_round(0.0, 0.010, 0.005)]])
    assert cheap_replicas["faster"] == "replicated"
    assert not draft_placement.summarize([[_round(0.01, 0.01, 0.0)], [_round(0.0, 0.01, 0.0, (1, 2, 4))]])[
        "replica_trees_equal"]


def test_the_suite_runs_two_ranks_and_their_trees_agree(tmp_path):
    save_tiny_pair(tmp_path)
    out = tmp_path / "placement.json"
    status = run_measurement("draft-placement", ["--draft", str(tmp_path / "tiny-draft"), "--weights", "fp32",
                                                 "--depth", "3", "--width", "2", "--verify", "4", "--trees", "2",
                                                 "--repeats", "2", "--out", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert result["replica_trees_equal"] and result["faster"] in ("whole_on_rank_0", "replicated")
    ms = result["ms_per_iteration"]
    assert ms["whole_on_rank_0"] >= ms["draft_alone"] > 0 and ms["verify_message"] > 0
    assert result["environment"]["ranks"] == "2 gloo ranks x 1 thread"
    assert result["provenance"]["command"].startswith("yggdrasil bench draft-placement")
