"""compile/build.py runs its phases as one list: a phase that finds an earlier one must run again
(the depth predictor ships only once judged on the graphs, and needs graphs that return hidden
states; the objective prefers another weight format) says so by returning a Redo, and the list
goes back to that phase; asking for the same redo twice is an error, never a loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from yggdrasil.compile.build import PHASE_STEPS, PhaseClock, Redo, run_phases
from yggdrasil.compile.recipe import PHASES
from yggdrasil.errors import YggdrasilError


def _build(log: list[str]):
    return SimpleNamespace(ctx=SimpleNamespace(log=log.append), ran=[])


def _steps(redo_at: str, redo_to: str, times: int):
    asked = {"n": 0}

    def phase(name):
        def run(build):
            build.ran.append(name)
            if name == redo_at and asked["n"] < times:
                asked["n"] += 1
                return Redo(redo_to, f"{name} needs {redo_to} again")
            return None
        return run

    return tuple((name, phase(name)) for name in PHASES[1:])


def test_the_phase_list_is_the_manifests_phase_order():
    assert tuple(name for name, _ in PHASE_STEPS) == PHASES[1:]


def test_a_redo_goes_back_through_the_phase_list_and_says_why():
    log: list[str] = []
    clock = PhaseClock(0.0)
    build = run_phases(_build(log), _steps("check", "graphs", times=1), clock)
    assert build.ran == ["formats", "calibrate", "draft vocab", "select", "graphs", "check", "graphs", "check",
                         "stage plans"]
    assert log == ["check needs graphs again"]
    assert list(clock.phases) == list(PHASES[1:])  # a redone phase's time adds to its own


def test_a_phase_may_redo_itself_once():
    build = run_phases(_build([]), _steps("calibrate", "calibrate", times=1), PhaseClock(0.0))
    assert build.ran[:3] == ["formats", "calibrate", "calibrate"]


@pytest.mark.parametrize("redo_at, redo_to", [("check", "graphs"), ("select", "check")])
def test_the_same_redo_twice_or_a_redo_forwards_is_refused(redo_at, redo_to):
    times = 2 if redo_to == "graphs" else 1
    with pytest.raises(YggdrasilError, match=f"{redo_at} phase asked to redo {redo_to}"):
        run_phases(_build([]), _steps(redo_at, redo_to, times=times), PhaseClock(0.0))


def test_the_objective_weighs_the_formats_once_and_the_redo_calibrates_in_its_choice(monkeypatch):
    """Calibrated in its choice, the objective is not asked again (it could swing back: old
    compile kept its first preference, and so does the phase list)."""
    from yggdrasil.compile import build as build_module

    calibrated, deployed = [], []
    monkeypatch.setattr(build_module, "_calibrate", lambda ctx, reprofile: calibrated.append(ctx) or "cal")
    monkeypatch.setattr(build_module, "deploy", lambda ctx, fmt: deployed.append(fmt) or f"ctx-{fmt}")
    swing = iter(["q4", "int8", "q4"])  # an objective that would flip on every new calibration
    monkeypatch.setattr(build_module, "prefer_by_objective",
                        lambda formats, calibration: SimpleNamespace(chosen=next(swing), usable=formats.usable,
                                                                     reason="r"))
    formats = SimpleNamespace(chosen="int8", usable=("int8", "q4"))
    build = build_module.Build(ctx="ctx-int8", reprofile=False, formats=formats)
    redo = build_module.calibrate_phase(build)
    assert redo == Redo("calibrate", redo.reason) and "prefers weight format q4" in redo.reason
    assert build_module.calibrate_phase(build) is None
    assert calibrated == ["ctx-int8", "ctx-q4"] and deployed == ["q4"] and build.formats.chosen == "q4"
