"""Verify step times are measured in rounds (yggdrasil/runtime/latency.py): every width once a
round, so a burst of other work as long as one width's runs moves no width's median, where
timing the widths one after another gave that width all of it."""

from __future__ import annotations

from yggdrasil.runtime import latency

WIDTHS = (1, 2, 4, 8)
COST = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6}


def _fake_steps(monkeypatch, burst: range):
    calls = []

    def fake(target, width, repeats, warmup=1, kernel_time=False, hidden=False):
        times = []
        for _ in range(repeats):
            slow = 1.5 if len([c for c in calls if c[1] > 0]) in burst else 1.0  # timed runs counted
            calls.append((width, repeats))
            times.append(COST[width] * slow)
        if not repeats:
            calls.append((width, 0))
        return times

    monkeypatch.setattr(latency, "verify_step_seconds", fake)
    return calls


def test_rounds_spread_a_burst_over_the_widths(monkeypatch):
    calls = _fake_steps(monkeypatch, burst=range(5, 10))  # five slow runs in a row
    runs = latency.interleaved_verify_seconds(None, WIDTHS, repeats=5)
    assert calls[:4] == [(w, 0) for w in WIDTHS]  # each width warmed up first
    assert [w for w, n in calls[4:]] == list(WIDTHS) * 5  # then one run of each, round after round
    medians = {w: sorted(t)[2] for w, t in runs.items()}
    assert medians == COST  # at most two of any width's five runs were slow


def test_one_width_after_another_would_have_given_one_width_the_burst(monkeypatch):
    _fake_steps(monkeypatch, burst=range(5, 10))
    sequential = {w: latency.verify_step_seconds(None, w, 5) for w in WIDTHS}
    assert sorted(sequential[2])[2] == COST[2] * 1.5  # the whole burst on T(2)


def test_a_profile_by_the_clock_takes_at_least_the_minimum_rounds_and_by_operator_time_its_repeats(monkeypatch):
    rounds = []
    monkeypatch.setattr(latency, "interleaved_verify_seconds",
                        lambda target, widths, repeats, *a: rounds.append(repeats) or {w: [0.01] for w in widths})
    for kernel_time in (False, True):
        latency.measure_profile(None, None, (1, 2), repeats=5, draft_widths=(), kernel_time=kernel_time)
    assert rounds == [latency.VERIFY_ROUNDS, 5]
