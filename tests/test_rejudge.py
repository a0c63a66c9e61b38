"""The adaptive policies judged again on a bundle's own step times (predictor/rejudge.py, issue
25): calibration judges them on eager step times; compile judges them again on the compiled
graphs' profile over the compiled buckets, and that verdict is what the bundle runs, records and
shows. Synthetic calibrations: a learnable depth predictor and a learnable draft confidence win
on step times where verifying more rows costs more, and gain nothing where verifying is flat
and drafting free (then speculating every iteration at full depth is already the oracle)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import yaml
from test_confidence_policy import STEEP, synthetic_chains
from test_speculation_quality import DIM, calibrated

from yggdrasil.policy.auto import policy_from_calibration
from yggdrasil.compile.calibrate import JUDGED, judge_on_graphs
from yggdrasil.compile.write import predictor_stats
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.policy import confidence as runtime_conf
from yggdrasil.predictor import confidence as conf
from yggdrasil.predictor.calibration_data import save_run
from yggdrasil.predictor.pipeline import describe_policy, read_summary
from yggdrasil.policy.auto import shipped_policy
from yggdrasil.predictor.confidence import JUDGED_ON
from yggdrasil.predictor.rejudge import rejudge

# speculation costs nothing more than a plain step: no iteration is worth skipping
FLAT = LatencyProfile(draft=((1, 1e-9),), verify=tuple((v, 1.0) for v in (1, 2, 3, 4, 5)))
ALL_WIDTHS = (1,)


@pytest.fixture(scope="module")
def predictor_calibration(tmp_path_factory):
    summary, directory = calibrated(tmp_path_factory.mktemp("rejudge"), learnable=True)
    assert summary["policy"]["shipped"] == "predictor"  # on the calibration's own step times
    return directory


def test_a_predictor_that_won_eagerly_is_judged_again_on_the_graphs_and_dropped(predictor_calibration, tmp_path):
    source = predictor_calibration
    before = (source / "predictor.yaml").read_text()
    judged = rejudge(source, tmp_path / "judged", FLAT, ALL_WIDTHS, (2, 4, 5), "flat test step times")
    summary = read_summary(tmp_path / "judged")
    assert summary[JUDGED_ON] == "flat test step times"
    assert summary["policy_eager"]["shipped"] == "predictor" and summary["policy"]["shipped"] == "constant"
    assert abs(summary["policy"]["gain"]) < 0.05 and summary["objective_eager"]["predicted_speedup"] > 1.0
    assert (judged.predictor.won_eagerly, judged.predictor.wins) == (True, False) and judged.runs == "constant"
    assert "does not beat it" in judged.describe()
    # the copy is what runs: the bundle's policy reads no hidden states, the manifest and
    # inspect say the constant ships and what the eager times had said
    assert shipped_policy(summary, None) == "constant"
    assert not policy_from_calibration(tmp_path / "judged", ALL_WIDTHS, (2, 4, 5), FLAT, DIM, None).needs_hidden
    assert predictor_stats(tmp_path / "judged")["policy_shipped"] == "constant"
    lines = describe_policy(summary)
    assert "best constant bucket ships" in lines[0]
    assert "judged on flat test step times" in lines[1] and "enough to ship" in lines[1]
    # the calibration it was copied from (the work cache's) is untouched
    assert (source / "predictor.yaml").read_text() == before


def test_on_the_same_step_times_the_verdict_stands_and_the_weights_are_kept(predictor_calibration, tmp_path):
    from test_speculation_quality import LATENCY

    judged = rejudge(predictor_calibration, tmp_path / "judged", LATENCY, ALL_WIDTHS, (2, 4, 5), "the same")
    summary = read_summary(tmp_path / "judged")
    assert summary["policy"]["shipped"] == "predictor"
    assert (judged.predictor.won_eagerly, judged.predictor.wins) == (True, True)
    # the held-out model is retrained with the same split and seed: the same verdict, to the digit
    assert summary["policy"]["gain"] == summary["policy_eager"]["gain"]
    assert ((tmp_path / "judged" / "predictor.safetensors").read_bytes() ==
            (predictor_calibration / "predictor.safetensors").read_bytes())


def test_only_the_compiled_verify_widths_are_judged(predictor_calibration, tmp_path):
    from test_speculation_quality import LATENCY

    rejudge(predictor_calibration, tmp_path / "judged", LATENCY, ALL_WIDTHS, (2,), "two rows")
    objective = read_summary(tmp_path / "judged")["objective"]
    shapes = [objective["constant_shape"], *objective["predicted_shapes"]]
    assert all(s == "no-spec" or s.endswith(("/V1", "/V2")) for s in shapes), shapes


def test_draft_confidence_that_won_eagerly_is_judged_again(tmp_path):
    source = tmp_path / "calibration"
    save_run(synthetic_chains(learnable=True), source, {}, STEEP)
    assert conf.record_confidence(source)["report"]["shipped"] == "confidence"
    judged = rejudge(source, tmp_path / "judged", FLAT, ALL_WIDTHS, (2, 3, 4, 5), "flat")
    _, report = runtime_conf.load_confidence(tmp_path / "judged")
    assert report["shipped"] == "constant" and report["eager"]["shipped"] == "confidence"
    assert (judged.confidence.won_eagerly, judged.confidence.wins) == (True, False)
    assert policy_from_calibration(tmp_path / "judged", ALL_WIDTHS, (2, 3, 4, 5), FLAT, 8, None).confidence is None
    lines = conf.describe_confidence(report)
    assert "not shipped" in lines[0] and "judged on flat" in lines[1]


def test_compile_ships_the_judged_copy_and_logs_what_runs(predictor_calibration, tmp_path):
    root = tmp_path / "work"
    shutil.copytree(predictor_calibration, root / "calibration")
    lines: list[str] = []
    ctx = SimpleNamespace(log=lines.append, work=SimpleNamespace(root=root, calibration=root / "calibration"))
    selection = SimpleNamespace(widths=ALL_WIDTHS, verifies=(2, 4, 5))
    shipped = judge_on_graphs(ctx, selection, FLAT)
    assert shipped == root / JUDGED and read_summary(shipped)["policy"]["shipped"] == "constant"
    assert "on the compiled graphs' step times" in lines[-1] and "runs the best constant bucket" in lines[-1]
    # a calibration that cannot be judged again ships as it was calibrated, and the log says so
    (root / "calibration" / "calibration.yaml").write_text(yaml.safe_dump({"schema": "nothing/0"}))
    assert judge_on_graphs(ctx, selection, FLAT) == root / "calibration"
    assert "keeps the eager verdict" in lines[-1]
