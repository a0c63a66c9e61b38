"""Step-time profiles for the latency-aware objective (docs/design.md §3.1).

A LatencyProfile is a small table of measured step times. `measure_profile` takes one quickly at
start-up from the runners that will actually run (a few forwards per verify width); the profiler
writes fuller ones to disk. `measure_checked` is what compile measures with: it judges each
measurement for signs of a busy machine (repeats that disagree, other processes using the cores,
stolen CPU time, a reference matmul that changed speed), warns, waits and measures again, and
records the measurement's quality with the profile (issue 24: a profile taken while the cores
were loaded made a bundle that never speculated, silently).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from yggdrasil.device import CpuWindow, cpu_snapshot, cpu_window, device_sync, reference_seconds, relative_spread, timed_runs
from yggdrasil.runtime.steps import StepRunner, verify_inputs
from yggdrasil.runtime.tree import TokenTree


GOOD, NOISY, UNCHECKED = "good", "noisy", "unchecked"


@dataclass(frozen=True)
class NoiseLimits:
    """When a measurement counts as disturbed, and how often compile measures again."""

    spread: float = 0.3  # repeated timings of one step disagree by more than this, relatively
    idle_margin: float = 0.5  # other processes used more cores than ours left free, by this much
    steal: float = 0.05  # the hypervisor took more than this share of the CPUs' time
    drift: float = 0.3  # the reference matmul got this much slower (or faster) meanwhile
    retries: int = 2
    wait_seconds: float = 3.0


@dataclass(frozen=True)
class MeasurementQuality:
    """How much a profile's numbers can be trusted. verdict: good, noisy (signs of interference
    on every attempt) or unchecked (the profile carries no repeated timings to judge)."""

    verdict: str
    reasons: tuple[str, ...] = ()
    spread: float | None = None  # worst relative spread of one step's repeated timings
    others_cores: float | None = None  # cores' worth of CPU other processes used meanwhile
    steal: float | None = None
    load: float | None = None  # 1-minute load average at the end
    drift: float | None = None  # reference matmul after / before - 1
    reference_ms: float | None = None
    threads: int = 1
    cpus: int = 1
    attempts: int = 1

    def as_dict(self) -> dict:
        body = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}
        return {**body, "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, raw) -> "MeasurementQuality | None":
        """The recorded quality, or None when nothing (readable) was recorded."""
        if not isinstance(raw, dict) or raw.get("verdict") not in (GOOD, NOISY, UNCHECKED):
            return None
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**{**known, "reasons": tuple(raw.get("reasons") or ())})
        except TypeError:
            return None

    def summary(self) -> str:
        """One line: the verdict and what made it noisy, or the numbers a good one was judged on."""
        head = self.verdict if self.attempts == 1 else f"{self.verdict} after {self.attempts} attempts"
        if self.reasons:
            return f"{head}: {'; '.join(self.reasons)} ({self.threads} thread(s) on {self.cpus} CPU(s))"
        facts = [f"{self.threads} thread(s) on {self.cpus} CPU(s)"]
        for label, value, fmt in (("spread", self.spread, "{:.0%}"), ("other load", self.others_cores, "{:.1f} cores"),
                                  ("steal", self.steal, "{:.0%}"), ("reference drift", self.drift, "{:+.0%}")):
            if value is not None:
                facts.append(f"{label} {fmt.format(value)}")
        return f"{head} ({', '.join(facts)})"


@dataclass(frozen=True)
class LatencyProfile:
    """Step times T(n) in seconds for n new tokens, interpolated linearly between points.

    The default is flat (every size costs the same), under which the objective keeps the widest
    tree; the profiler fills in measured times. spread: the worst relative disagreement of one
    point's repeated timings (None: not measured here); quality: the judgement of a checked
    measurement. Neither takes part in comparisons: they describe how the numbers were got.
    """

    draft: tuple[tuple[int, float], ...] = ((1, 1.0),)
    verify: tuple[tuple[int, float], ...] = ((1, 1.0),)
    spread: float | None = field(default=None, compare=False)
    quality: MeasurementQuality | None = field(default=None, compare=False)

    @staticmethod
    def _interpolate(points: tuple[tuple[int, float], ...], n: int) -> float:
        sizes = [p[0] for p in points]
        i = bisect.bisect_left(sizes, n)
        if i < len(points) and sizes[i] == n:
            return points[i][1]
        if i == 0:
            return points[0][1]
        if i == len(points):
            (n0, t0), (n1, t1) = points[-2:] if len(points) > 1 else (points[-1], points[-1])
        else:
            (n0, t0), (n1, t1) = points[i - 1], points[i]
        return t0 if n1 == n0 else t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    def t_draft(self, n: int) -> float:
        return self._interpolate(self.draft, n)

    def t_verify(self, n: int) -> float:
        return self._interpolate(self.verify, n)

    def as_dict(self) -> dict:
        body = {"draft": [list(p) for p in self.draft], "verify": [list(p) for p in self.verify]}
        return body if self.quality is None else {**body, "quality": self.quality.as_dict()}

    @classmethod
    def from_dict(cls, raw: dict) -> "LatencyProfile":
        return cls(tuple((int(n), float(t)) for n, t in raw["draft"]),
                   tuple((int(n), float(t)) for n, t in raw["verify"]),
                   quality=MeasurementQuality.from_dict(raw.get("quality")))


def from_device_profile(profile, has_draft_model: bool) -> LatencyProfile:
    """The objective's table from a measured DeviceProfile (compiled numbers when present)."""
    verify = profile.target.curve()
    points = tuple(zip(verify.sizes, verify.seconds))
    if has_draft_model and profile.draft is not None:
        draft = profile.draft.curve()
        return LatencyProfile(draft=tuple(zip(draft.sizes, draft.seconds)), verify=points)
    return LatencyProfile(draft=((1, 0.0),), verify=points)  # lookup drafting costs ~nothing


def measure_profile(target: StepRunner, drafter, verify_widths: Sequence[int],
                    repeats: int = 3, draft_widths: Sequence[int] | None = None,
                    hidden: bool = False, warmup: int = 1, kernel_time: bool = False) -> LatencyProfile:
    """T_verify(V) for each allowed width and T_draft(W) per draft step, measured in place.

    Verify times use a root-only tree padded to each width, which costs the same as a full one
    (the forward's shape is what matters), timed in rounds (interleaved_verify_seconds), at
    least VERIFY_ROUNDS of them by the clock, each width's the median. The draft time is one
    whole tree build over a dummy history, divided by the depth, so host-side drafting work is
    counted too: the drafter's own shape by default, or a deepest-depth Equal-Growth build per
    width in `draft_widths`; an empty `draft_widths` skips drafting (lookup, which costs ~nothing). hidden: time the verify
    graphs that also return hidden states (what --auto with a predictor runs). warmup: untimed
    runs before each measurement. kernel_time: each verify run's time is the summed self time of
    the operators it ran (kernel_timed_runs), not its wall time: what a compiled graph of the same
    step spends, less the eager Python and dispatch overhead it does not pay (compile's formats).
    Draft builds stay on the wall clock: a depth-8 build runs thousands of operators, and
    torch.profiler's Python side took longer to read them than the build itself (a Qwen format's
    step times went from 30 s to 150 s).
    """
    widths = sorted({1, *verify_widths})
    spreads = []

    def median(times: list[float]) -> float:
        spreads.append(relative_spread(times))
        return statistics.median(times)

    # by operator time, a run costs the profiler's reading of it too (about a second for the Qwen
    # 1.5B; 15 rounds took the formats phase's q4 step times from 15 to 126 s): those keep `repeats`
    rounds = repeats if kernel_time else max(repeats, VERIFY_ROUNDS)
    runs = interleaved_verify_seconds(target, widths, rounds, warmup, kernel_time, hidden)
    verify = tuple((w, median(runs[w])) for w in widths)
    if draft_widths is not None and not draft_widths:
        return LatencyProfile(draft=((1, 0.0),), verify=verify, spread=max(spreads))
    history = draft_history(drafter)
    if draft_widths is None:
        draft = ((drafter.width, median(draft_step_seconds(drafter, history, None, repeats, 1, target.device))),)
    else:
        draft = tuple((w, median(draft_step_seconds(drafter, history, w, repeats, 1, target.device)))
                      for w in draft_widths)
    return LatencyProfile(draft=draft, verify=verify, spread=max(spreads))


# rounds of verify steps a profile takes at least: on a 2-core Zen 4, the q4 Qwen 1.5B's T(4)/T(1)
# from the median of 5 ranged 0.82-1.55 over six profiles, from the median of 15 rounds 1.16-1.25
# (a round is one step of each width, about 0.4 s there)
VERIFY_ROUNDS = 15


def interleaved_verify_seconds(target: StepRunner, widths: Sequence[int], repeats: int, warmup: int = 1,
                               kernel_time: bool = False, hidden: bool = False) -> dict[int, list[float]]:
    """verify_step_seconds of every width, in rounds (each width once a round, after each one's
    warm-up): a burst of other work lands on several widths a little, not on one width's every
    run (timed one width after another, 5 runs each, two cold compiles' eager profiles of the same
    q4 steps on one machine put T(4)/T(1) at 1.09 and 1.59, and calibration chose a different
    bucket by it)."""
    for width in widths:
        verify_step_seconds(target, width, 0, warmup, kernel_time, hidden)
    runs: dict[int, list[float]] = {width: [] for width in widths}
    for _ in range(repeats):
        for width in widths:
            runs[width] += verify_step_seconds(target, width, 1, 0, kernel_time, hidden)
    return runs


def verify_step_seconds(target: StepRunner, width: int, repeats: int, warmup: int = 1,
                        kernel_time: bool = False, hidden: bool = False) -> list[float]:
    """Seconds of each of `repeats` verify steps `width` rows wide (a root-only tree padded to
    the width, which costs what a full one does: the forward's shape is what matters), by the
    clock or, kernel_time, by the operators' summed time (kernel_timed_runs)."""
    tree = TokenTree.with_root(width, 0)  # trees live on the host (verify_inputs stages them)
    root = torch.zeros(1, dtype=torch.long)

    def step():
        return target.run(verify_inputs(target, tree, root, 1, width), key="verify", hidden=hidden)

    if kernel_time:
        return kernel_timed_runs(step, repeats, warmup)
    return device_timed_runs(step, repeats, warmup, target.device)


def draft_history(drafter) -> list[int]:
    """A dummy history (any valid ids do: only the shapes matter), the drafter started on it."""
    history = [0] * 8
    drafter.start(history[:-1])
    return history


def draft_step_seconds(drafter, history: list[int], width: int | None, repeats: int, warmup: int,
                       device: torch.device) -> list[float]:
    """Seconds per draft step of each of `repeats` whole tree builds (the drafter's own shape
    when width is None, else a deepest-depth Equal-Growth build that wide), each over the same
    history as if it were new, divided by the depth: host-side drafting work counted too."""
    def build() -> None:
        drafter.rewind(history)  # as if the same tokens were new each time
        if width is None:
            drafter.build(history)
        else:
            drafter.build_shaped(history, drafter.depth, width)

    return [t / drafter.depth for t in device_timed_runs(build, repeats, warmup, device)]


def kernel_timed_runs(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Seconds each of `repeats` runs of fn spent inside operators (the sum of torch.profiler's
    self CPU times, so nested operators count once), after `warmup` untimed runs. CPU steps:
    an operator's self time is its wall time on the calling thread, intra-op threads included."""
    from torch.profiler import ProfilerActivity, profile  # its Python side: only this measurement

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        times.append(sum(event.self_cpu_time_total for event in prof.key_averages()) / 1e6)
    return times


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null inside the block: torch's profiler backend (kineto) writes
    two lines to it at every start and stop, whatever its log level, which would run through
    compile's output. Python errors raise rather than print, so nothing of ours is lost."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def device_timed_runs(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of `repeats` runs of fn after `warmup` untimed ones. On CUDA between two
    events recorded on the current stream around the call (a captured graph's replay returns
    before its kernels have run; the span covers the host's enqueueing too, as the stream
    waits for it), each run's end waited for; elsewhere by the wall clock."""
    if device.type != "cuda":
        return timed_runs(fn, repeats, warmup, device_sync(device))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def judge(spread: float | None, window: CpuWindow, reference: tuple[float, float], threads: int,
          limits: NoiseLimits, gpu: bool = False) -> MeasurementQuality:
    """The quality of one measurement from its repeats' spread, what else ran meanwhile, and
    the reference matmul timed before and after it. gpu: the steps ran on a GPU (timed by its
    events), where what other processes do with the CPUs says nothing about them."""
    reasons = []
    if spread is not None and spread > limits.spread:
        reasons.append(f"repeated timings of one step disagree by {spread:.0%}")
    if not gpu:
        reasons += _cpu_reasons(window, threads, limits)
    before, after = reference
    drift = after / before - 1 if before > 0 else 0.0
    if abs(drift) > limits.drift:
        reasons.append(f"a reference matmul took {after / before:.2g}x as long after the measurement "
                       "as before it")
    return MeasurementQuality(NOISY if reasons else GOOD, tuple(reasons), spread, window.others_cores,
                              window.steal, window.load, drift, before * 1e3, threads, window.cpus)


def _cpu_reasons(window: CpuWindow, threads: int, limits: NoiseLimits) -> list[str]:
    """Signs that other work on the CPUs disturbed steps timed on them."""
    reasons = []
    free = max(0, window.cpus - threads)
    if window.others_cores is not None:
        if window.others_cores > free + limits.idle_margin:
            reasons.append(f"other processes kept {window.others_cores:.1f} of {window.cpus} CPU(s) busy "
                           f"while {threads} thread(s) were being timed")
    elif window.load is not None and window.load > window.cpus + limits.idle_margin:
        reasons.append(f"load average {window.load:.1f} on {window.cpus} CPU(s)")  # no /proc/stat here
    if window.steal is not None and window.steal > limits.steal:
        reasons.append(f"the hypervisor took {window.steal:.0%} of the CPU time")
    return reasons


# how much faster a wider step may still be than a narrower one (kernel choice, timing noise),
# as a share and, for steps too short to order reliably (a tiny model's), in seconds
MONOTONE_SLACK = 0.1
MONOTONE_SLACK_SECONDS = 1e-3


def out_of_order(points: Sequence[tuple[int, float]]) -> str | None:
    """Why a verify curve cannot be right, if it cannot: a step slower than a wider one by more
    than the slack. More rows are more work, so the narrower step was disturbed (a burst of
    other work the whole window's counters averaged away: a 2-core Xeon once timed a 1-row step
    at 61 ms beside a 16-row one at 46, and compile chose the wrong format from it)."""
    ordered = sorted(points)
    for i, (rows, seconds) in enumerate(ordered):
        for wider, wider_seconds in ordered[i + 1:]:
            if seconds > wider_seconds * (1 + MONOTONE_SLACK) and seconds - wider_seconds > MONOTONE_SLACK_SECONDS:
                return (f"a {rows}-row step took {1e3 * seconds:.2f} ms, longer than the {wider}-row step's "
                        f"{1e3 * wider_seconds:.2f} ms")
    return None


def judged_run(run: Callable[[], Any], device: torch.device, limits: NoiseLimits,
               spread: Callable[[Any], float | None] = lambda result: None) -> tuple[Any, MeasurementQuality]:
    """run() between two timings of the reference matmul and two readings of the CPUs' counters,
    judged as a measured profile is (judge; spread: the result's own repeat spread, if any):
    (run's result, the MeasurementQuality)."""
    reference_before = reference_seconds(device)
    before = cpu_snapshot()
    result = run()
    window = cpu_window(before, cpu_snapshot())
    reference_after = reference_seconds(device)
    quality = judge(spread(result), window, (reference_before, reference_after),
                    torch.get_num_threads(), limits, gpu=device.type == "cuda")
    return result, quality


def retry_limits(limits: NoiseLimits, device: torch.device) -> NoiseLimits:
    """The limits a judged measurement retries under here: on a GPU none (its own clock judges;
    waiting does not quiet it)."""
    return replace(limits, retries=0) if torch.device(device).type == "cuda" else limits


def _attempt(measure: Callable[[], LatencyProfile], device: torch.device,
             limits: NoiseLimits) -> tuple[LatencyProfile, MeasurementQuality]:
    profile, quality = judged_run(measure, device, limits, spread=lambda measured: measured.spread)
    # on a GPU a wider step may take another, faster kernel: only a CPU's curve must rise
    disorder = out_of_order(profile.verify) if profile.spread is not None and device.type != "cuda" else None
    if disorder is not None:
        quality = replace(quality, verdict=NOISY, reasons=quality.reasons + (disorder,))
    return profile, quality


def fastest_points(profiles: Sequence[LatencyProfile]) -> LatencyProfile:
    """Each step's fastest time over several attempts: interference only ever slows work down,
    so the fastest is the least disturbed."""
    def best(tables):
        return tuple((n, min(t[i][1] for t in tables)) for i, (n, _) in enumerate(tables[0]))

    return LatencyProfile(best([p.draft for p in profiles]), best([p.verify for p in profiles]),
                          spread=min(p.spread for p in profiles))


def wait_quietly(seconds: float) -> None:
    """The pause between a disturbed measurement and its retry (tests replace it)."""
    time.sleep(seconds)


def measure_checked(measure: Callable[[], LatencyProfile], device: torch.device,
                    log: Callable[[str], None] = print, limits: NoiseLimits | None = None,
                    what: str = "step times", hint: str = "") -> LatencyProfile:
    """measure(), judged for interference; on signs of it, a loud warning, a short wait and a
    new measurement, up to limits.retries times (on a GPU none: its events time the steps). Returns the first good attempt, or (all noisy)
    each step's fastest time over the attempts, with its MeasurementQuality attached. A profile
    without repeated timings (spread None: not measured by measure_profile) is returned as
    unchecked, at once."""
    limits = retry_limits(limits or NoiseLimits(), device)
    attempts = []
    for attempt in range(1 + limits.retries):
        profile, quality = _attempt(measure, torch.device(device), limits)
        if profile.spread is None:
            return replace(profile, quality=replace(quality, verdict=UNCHECKED, reasons=()))
        attempts.append(profile)
        if quality.verdict == GOOD:
            return replace(profile, quality=replace(quality, attempts=len(attempts)))
        log(f"WARNING: the machine looks busy while measuring {what}: {'; '.join(quality.reasons)}")
        if attempt < limits.retries:
            log(f"WARNING: waiting {limits.wait_seconds:g} s, then measuring again "
                f"(retry {attempt + 1} of {limits.retries})")
            wait_quietly(limits.wait_seconds)
    log(f"WARNING: {what} were still disturbed after {len(attempts)} attempts; keeping each step's "
        f"fastest time, recorded as noisy. Decisions made from them may be wrong{hint}")
    return replace(fastest_points(attempts), quality=replace(quality, attempts=len(attempts)))
