"""Progress lines: elapsed time and an estimate of the time left, and warnings that do not land
in the middle of a terminal bar."""

from __future__ import annotations

import io
import time
import warnings

import pytest

from yggdrasil.progress import Progress, estimate_left, format_duration, timing


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("seconds, text", [
    (0, "0.0s"), (4.24, "4.2s"), (9.96, "10.0s"), (10.4, "10s"), (59.4, "59s"), (59.6, "1m00s"),
    (65, "1m05s"), (3599, "59m59s"), (3600, "1h00m"), (7385, "2h03m"), (-3, "0.0s"),
])
def test_durations_are_short_and_fixed_form(seconds, text):
    assert format_duration(seconds) == text


def test_estimate_is_the_rate_so_far():
    assert estimate_left(0, 10, 5.0) is None  # nothing done: no rate yet
    assert estimate_left(2, 10, 10.0) == pytest.approx(40.0)
    assert estimate_left(10, 10, 10.0) == 0.0
    assert timing(0, 10, 3.0) == "3.0s elapsed"
    assert timing(2, 10, 10.0) == "10s elapsed, ~40s left"
    assert timing(10, 10, 75.0) == "1m15s elapsed"  # finished: nothing left to estimate


def test_log_lines_show_elapsed_and_time_left():
    stream = io.StringIO()
    bar = Progress("compiling graphs", 4, stream=stream)
    bar.started = time.perf_counter() - 30  # 30 s in, one graph of four done
    bar.update()
    bar.close("1 compiled")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "compiling graphs ..."
    assert lines[1].startswith("compiling graphs: 1/4 (30s elapsed, ~1m30s left)")
    assert lines[2].startswith("compiling graphs: done in 30s (1 compiled)")


def test_terminal_bar_fits_the_terminal_and_shows_the_estimate():
    bar = Progress("calibrating (prompts)", 24, stream=FakeTerminal())
    bar.done = 6
    text = bar.line(bar.started + 60, columns=80)
    assert text.startswith("calibrating (prompts) [") and "6/24 1m00s elapsed, ~3m00s left" in text
    assert len(text) < 80  # a wrapped line could not redraw in place
    assert len(bar.line(bar.started + 60, columns=50)) < 50
    bar.close()


def test_a_warning_during_a_terminal_bar_gets_its_own_line_and_the_bar_comes_back():
    stream = FakeTerminal()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = []

        def show(message, category, filename, lineno, file=None, line=None):
            shown.append(str(message))
            stream.write(f"{category.__name__}: {message}\n")

        warnings.showwarning = show
        bar = Progress("loading model", 3, stream=stream)
        bar.update()
        warnings.warn("TypedStorage is deprecated", UserWarning)
        bar.update()
        bar.close()
        assert warnings.showwarning is show  # put back when the bar closed
        warnings.warn("after the bar", UserWarning)
    assert shown == ["TypedStorage is deprecated", "after the bar"]
    lines = stream.getvalue().split("\n")
    warning_line = next(line for line in lines if "TypedStorage" in line)
    assert warning_line == "UserWarning: TypedStorage is deprecated"  # nothing of the bar on it
    before, after = stream.getvalue().split(warning_line)
    assert "loading model [" in before.splitlines()[-1]  # the bar, ended before the warning
    assert "loading model [" in after and "loading model: done in" in after  # redrawn, then closed
    assert "after the bar\n" in lines[-2] + "\n" and "loading model" not in lines[-2]


def test_a_failure_inside_a_bar_ends_its_line_and_stops_routing_warnings():
    stream = FakeTerminal()
    with warnings.catch_warnings():
        previous = warnings.showwarning
        with pytest.raises(RuntimeError), Progress("profiling", 5, stream=stream) as bar:
            bar.update()
            raise RuntimeError("boom")
        assert warnings.showwarning is previous
    assert stream.getvalue().endswith("\n") and "done in" not in stream.getvalue()


def test_a_bar_off_a_terminal_leaves_warnings_alone():
    with warnings.catch_warnings():
        previous = warnings.showwarning
        bar = Progress("joining", 2, stream=io.StringIO())
        assert warnings.showwarning is previous
        bar.close()
