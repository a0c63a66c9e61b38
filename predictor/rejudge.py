"""The adaptive policies judged again on the step times a bundle will run with (issue 25).

Calibration judges the depth predictor and draft confidence against the best constant bucket
with eager step times, over every calibrated bucket. A bundle runs compiled graphs: steps are
shorter, the draft-to-verify cost ratio differs, and only the selected widths and verify widths
exist. On the int4 Qwen pair the predictor won +18.6 % judged eagerly and +3.3 % when the
bundle was benchmarked held out. So compile copies the calibration and, in the copy, re-derives
each policy's held-out objective and verdict on the compiled graphs' profile over the compiled
buckets; that copy is what the bundle ships and what shipped_policy reads. The eager verdicts
are kept beside the new ones (inspect shows both).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from yggdrasil.latency import LatencyProfile

from . import depth as depth_mod
from .calibration_data import load_run, restrict
from .confidence import confidence_body, write_confidence
from .files import PredictorError, atomic_write
from .pipeline import decide_policy, judge_policies, objective_dict, read_summary

JUDGED_ON = "judged_on"  # the summary's record of whose step times judged it


@dataclass(frozen=True)
class Rejudged:
    """Each policy's held-out gain over the best constant bucket before (eager) and after
    (graphs), and whether it beat the constant by its margin then; None: not judged."""

    predictor: tuple[float | None, float | None] | None
    predictor_wins: tuple[bool, bool] | None
    confidence: tuple[float | None, float | None] | None
    confidence_wins: tuple[bool, bool] | None

    def describe(self) -> str:
        parts = []
        for name, gains, wins in (("depth predictor", self.predictor, self.predictor_wins),
                                  ("draft confidence", self.confidence, self.confidence_wins)):
            if gains is None:
                continue
            before, after = (f"{g:+.1%}" if g is not None else "?" for g in gains)
            parts.append(f"{name} {after} over the best constant (eager step times: {before}; "
                         f"{'beats' if wins[1] else 'does not beat'} it by the margin)")
        return "; ".join(parts) or "no adaptive policy to judge"


def rejudge(source: Path, out: Path, latency: LatencyProfile, widths: tuple[int, ...],
            verifies: tuple[int, ...], judged_on: str) -> Rejudged:
    """Copy the calibration directory `source` to `out` (replacing it) and, in the copy, judge
    the depth predictor and draft confidence again with `latency` over the buckets these draft
    widths and verify widths allow. The predictor's weights (trained on every iteration) are
    kept; its held-out judgement retrains it on the same training split with the same seed."""
    source, out = Path(source), Path(out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out)
    run, _, _ = load_run(out)
    small = restrict(run, widths, verifies)
    predictor = _rejudge_predictor(out, run, small, latency, judged_on)
    confidence = _rejudge_confidence(out, small, latency, judged_on)
    return Rejudged(predictor and predictor[0], predictor and predictor[1],
                    confidence and confidence[0], confidence and confidence[1])


def _rejudge_predictor(out: Path, run, small, latency: LatencyProfile, judged_on: str):
    if not (out / "predictor.yaml").is_file():
        return None
    body = read_summary(out)
    train, held = depth_mod.split_by_prompt(run.prompt_index)
    model = depth_mod.train(run.hidden, run.accepted_max, train, run.grid.max_depth)
    policy = judge_policies(small, model, train, held, latency)
    decision = decide_policy(bool(body.get("held_out", {}).get("useful")), policy.predicted_speedup,
                             policy.constant_speedup)
    before = body.get("policy") or {}
    body.update(objective_eager=body.get("objective"), policy_eager=before, objective=objective_dict(policy),
                policy=decision.as_dict(), **{JUDGED_ON: judged_on})  # the bundle's verdict, and the eager one
    atomic_write(out / "predictor.yaml", lambda p: p.write_text(yaml.safe_dump(body, sort_keys=False)))
    return (before.get("gain"), decision.gain), (before.get("shipped") == "predictor", decision.shipped == "predictor")


def _rejudge_confidence(out: Path, small, latency: LatencyProfile, judged_on: str):
    path = out / "confidence.yaml"
    if not path.is_file():
        return None
    before = (yaml.safe_load(path.read_text()) or {}).get("report") or {}
    try:
        body = confidence_body(small, latency)
    except PredictorError:  # too little data on the compiled widths: judged as not shipping
        path.unlink()
        return (before.get("gain"), None), (before.get("shipped") == "confidence", False)
    report = {**body["report"], JUDGED_ON: judged_on,
              "eager": {k: before.get(k) for k in ("shipped", "gain", "reason")}}
    write_confidence(out, {**body, "report": report})
    return (before.get("gain"), report["gain"]), (before.get("shipped") == "confidence",
                                                  report["shipped"] == "confidence")


__all__ = ["JUDGED_ON", "Rejudged", "rejudge"]
