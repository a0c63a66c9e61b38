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

from yggdrasil.runtime.latency import LatencyProfile

from yggdrasil.predictor import depth as depth_mod
from yggdrasil.policy.calibration import load_run, restrict
from yggdrasil.predictor.confidence import JUDGED_ON, confidence_body, write_confidence
from yggdrasil.policy.files import PredictorError, atomic_write
from yggdrasil.predictor.pipeline import judge_policies, objective_dict, read_summary
from yggdrasil.policy.auto import decide_policy, shipped_policy

@dataclass(frozen=True)
class Verdict:
    """One adaptive policy against the best constant bucket, held out: its gain and whether it
    beat the constant by its margin, on the calibration's eager step times and on these."""

    gain_eager: float | None
    gain: float | None  # None: could not be judged on these step times
    won_eagerly: bool
    wins: bool

    def describe(self, name: str) -> str:
        before, after = (f"{g:+.1%}" if g is not None else "?" for g in (self.gain_eager, self.gain))
        return (f"{name} {after} over the best constant (eager step times: {before}; "
                f"{'beats' if self.wins else 'does not beat'} it by the margin)")


@dataclass(frozen=True)
class Rejudged:
    """Both verdicts (None: that policy was not calibrated) and what the judged copy runs
    (shipped_policy's choice)."""

    predictor: Verdict | None
    confidence: Verdict | None
    runs: str

    def describe(self) -> str:
        parts = [v.describe(name) for name, v in (("depth predictor", self.predictor),
                                                  ("draft confidence", self.confidence)) if v is not None]
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
    summary, predictor = _rejudge_predictor(out, run, small, latency, judged_on)
    report, confidence = _rejudge_confidence(out, small, latency, judged_on)
    return Rejudged(predictor, confidence, shipped_policy(summary, report))


def _rejudge_predictor(out: Path, run, small, latency: LatencyProfile,
                       judged_on: str) -> tuple[dict | None, Verdict | None]:
    """(the rewritten predictor summary, its verdict); (None, None) without a predictor."""
    if not (out / "predictor.yaml").is_file():
        return None, None
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
    return body, Verdict(before.get("gain"), decision.gain, before.get("shipped") == "predictor",
                         decision.shipped == "predictor")


def _rejudge_confidence(out: Path, small, latency: LatencyProfile,
                        judged_on: str) -> tuple[dict | None, Verdict | None]:
    """(the rewritten confidence report, its verdict); (None, None) when it was not judged."""
    path = out / "confidence.yaml"
    if not path.is_file():
        return None, None
    before = (yaml.safe_load(path.read_text()) or {}).get("report") or {}
    won_eagerly = before.get("shipped") == "confidence"
    try:
        body = confidence_body(small, latency)
    except PredictorError:  # too little data on the compiled widths: judged as not shipping
        path.unlink()
        return None, Verdict(before.get("gain"), None, won_eagerly, False)
    report = {**body["report"], JUDGED_ON: judged_on,
              "eager": {k: before.get(k) for k in ("shipped", "gain", "reason")}}
    write_confidence(out, {**body, "report": report})
    return report, Verdict(before.get("gain"), report["gain"], won_eagerly, report["shipped"] == "confidence")


__all__ = ["Rejudged", "Verdict", "rejudge"]
