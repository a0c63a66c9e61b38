"""The format probe is judged for interference (issue 50): a burst of other work can only make a
probed format look slower, so a disturbed "dominated" is probed again, and a format whose every
probe was disturbed is timed in full rather than settled."""

from __future__ import annotations

from yggdrasil.compile import format_pricing
from yggdrasil.device import CpuWindow
from yggdrasil.runtime import latency
from yggdrasil.runtime.latency import LatencyProfile, NoiseLimits

QUIET = CpuWindow(others_cores=0.0, steal=0.0, load=0.2, cpus=2)
BUSY = CpuWindow(others_cores=1.8, steal=0.0, load=3.0, cpus=2)
WINNER = LatencyProfile(draft=((1, 0.001),), verify=((1, 0.010), (16, 0.030)), spread=0.0)
SLOWER = LatencyProfile(draft=WINNER.draft, verify=((1, 0.012),), spread=0.0)
LIMITS = NoiseLimits(retries=2, wait_seconds=0.0)


def _run(monkeypatch, windows: list[CpuWindow], probes: list[LatencyProfile | None]):
    """probe_checked over a sequence of CPU windows (one per probe) and probe answers; returns
    (its answer, how many probes ran, what it logged)."""
    windows, probes, ran, logged = iter(windows), iter(probes), [], []
    monkeypatch.setattr(latency, "reference_seconds", lambda device: 0.01)
    monkeypatch.setattr(latency, "cpu_window", lambda before, after: next(windows))

    def probe(winner, target, drafter, device):
        ran.append(1)
        return next(probes)

    answer = format_pricing.probe_checked(WINNER, None, None, "cpu", logged.append, LIMITS, probe=probe)
    return answer, len(ran), logged


def test_a_quiet_probe_settles_the_format_at_once(monkeypatch):
    answer, probes, logged = _run(monkeypatch, [QUIET], [SLOWER])
    assert answer == SLOWER and probes == 1 and not logged


def test_a_disturbed_probe_is_probed_again_and_a_quiet_one_then_counts(monkeypatch):
    answer, probes, logged = _run(monkeypatch, [BUSY, QUIET], [SLOWER, SLOWER])
    assert answer == SLOWER and probes == 2
    assert any("busy" in line for line in logged)


def test_a_format_whose_every_probe_was_disturbed_is_timed_in_full(monkeypatch):
    answer, probes, logged = _run(monkeypatch, [BUSY] * 3, [SLOWER] * 3)
    assert answer is None and probes == 3
    assert "timing the format in full" in logged[-1]


def test_a_format_no_slower_somewhere_is_timed_in_full_without_a_retry(monkeypatch):
    answer, probes, _ = _run(monkeypatch, [BUSY], [None])
    assert answer is None and probes == 1
