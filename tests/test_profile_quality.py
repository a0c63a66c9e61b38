"""Step times measured on a busy machine are noticed (issue 24, item 3): compile once profiled
while the cores were loaded, picked no-spec for every bucket and shipped a bundle that never
speculated, silently. Measurements are judged for interference (repeats that disagree, other
processes on the cores, a reference matmul that changes speed), warned about, retried, and their
quality is recorded in the profile and the manifest, where `inspect` shows it; `compile
--reprofile` measures again without recompiling graphs or recalibrating; `--threads N` pins
every command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import save_random_hf_model, write_tiny_recipe_dir
from yggdrasil.runtime import latency
from yggdrasil.device import CpuWindow, cpu_snapshot, cpu_window
from yggdrasil.runtime.drafters import LookupDrafter
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.steps import StepRunner

QUIET = CpuWindow(others_cores=0.0, steal=0.0, load=0.2, cpus=2)


class ScriptedClock:
    """Stands in for latency.timed_runs: runs the work once, then reports `repeats` timings of
    10 ms, or, while `busy`, with three timed runs in seven five times slower (what a core taken by
    another process does to some of them). The wait between attempts ends the interference
    after `busy_attempts` attempts, as a finished background job would."""

    def __init__(self, busy_attempts: int) -> None:
        self.busy_attempts, self.waits, self.timed = busy_attempts, [], 0  # timed: runs so far

    @property
    def busy(self) -> bool:
        return len(self.waits) < self.busy_attempts

    def timed_runs(self, fn, repeats, warmup=1, sync=lambda: None):
        fn()
        # three timed runs in every seven slow, counted across calls (a profile times its widths
        # a run a round): every width's runs and any five in a row hold some, never most
        times = [0.05 if self.busy and (self.timed + i) % 7 in (1, 3, 5) else 0.01 for i in range(repeats)]
        self.timed += repeats
        return times

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)


@pytest.fixture
def clock(monkeypatch):
    """A scripted clock on a quiet machine (no other load, steady reference matmul): only the
    repeats' spread can make a measurement noisy. Tests set busy_attempts."""
    scripted = ScriptedClock(busy_attempts=0)
    monkeypatch.setattr(latency, "timed_runs", scripted.timed_runs)
    monkeypatch.setattr(latency, "wait_quietly", scripted.wait)
    monkeypatch.setattr(latency, "cpu_window", lambda before, after: QUIET)
    monkeypatch.setattr(latency, "reference_seconds", lambda device: 0.001)
    return scripted


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_random_hf_model(directory, "llama", seed=5)
    return StepRunner(load_hf_model(directory, torch.float32), max_context=128, chunk_size=16)


def measure(runner, log, repeats: int = 5, limits=None):
    return latency.measure_checked(
        lambda: latency.measure_profile(runner, LookupDrafter(2, 1), (1, 2, 4), repeats=repeats, draft_widths=()),
        runner.device, log.append, limits=limits, what="step times", hint="; try again later")


# --- judging one measurement -------------------------------------------------------------------

def test_a_quiet_measurement_is_good_and_not_retried(runner, clock):
    log = []
    profile = measure(runner, log)
    assert profile.quality.verdict == "good" and profile.quality.attempts == 1
    assert profile.quality.spread == 0.0 and clock.waits == [] and log == []
    assert profile.verify == ((1, 0.01), (2, 0.01), (4, 0.01))


def test_interference_is_detected_warned_and_retried(runner, clock):
    clock.busy_attempts = 1  # the first attempt is disturbed, the retry is not
    log = []
    profile = measure(runner, log)
    assert profile.quality.verdict == "good" and profile.quality.attempts == 2
    assert clock.waits == [latency.NoiseLimits().wait_seconds]
    assert any(line.startswith("WARNING: the machine looks busy while measuring step times: repeated timings "
                               "of one step disagree by 400%") for line in log), log
    assert any("measuring again (retry 1 of 2)" in line for line in log), log
    assert profile.verify == ((1, 0.01), (2, 0.01), (4, 0.01))  # the retry's numbers, not the disturbed ones


def test_interference_that_lasts_is_recorded_as_noisy(runner, clock):
    clock.busy_attempts = 99
    log = []
    profile = measure(runner, log)
    quality = profile.quality
    assert quality.verdict == "noisy" and quality.attempts == 3 and len(clock.waits) == 2
    assert quality.reasons == ("repeated timings of one step disagree by 400%",)
    assert log[-1].startswith("WARNING: step times were still disturbed after 3 attempts") and "try again later" in log[-1]
    # recorded with the profile, and read back
    assert latency.LatencyProfile.from_dict(profile.as_dict()).quality == quality
    assert profile.as_dict()["quality"]["verdict"] == "noisy"


def test_a_narrow_step_slower_than_a_wider_one_is_disturbed_and_retimed(monkeypatch):
    """More rows are more work: a 1-row step timed above a 16-row one (a burst the window's counters
    averaged away) makes the attempt noisy, and the retry's numbers are kept."""
    profiles = iter([latency.LatencyProfile(verify=((1, 0.0615), (16, 0.0464)), spread=0.01),
                     latency.LatencyProfile(verify=((1, 0.0163), (16, 0.0420)), spread=0.01)])
    monkeypatch.setattr(latency, "cpu_window", lambda before, after: QUIET)
    monkeypatch.setattr(latency, "reference_seconds", lambda device: 0.001)
    monkeypatch.setattr(latency, "wait_quietly", lambda seconds: None)
    log = []
    profile = latency.measure_checked(lambda: next(profiles), "cpu", log.append)
    assert profile.verify == ((1, 0.0163), (16, 0.0420)) and profile.quality.attempts == 2
    assert any("a 1-row step took 61.50 ms, longer than the 16-row step's 46.40 ms" in line for line in log), log
    # within the slack (kernel choice, timer noise) a curve may dip
    assert latency.out_of_order(((1, 0.0105), (4, 0.010), (16, 0.03))) is None
    assert latency.out_of_order(((1, 0.0004), (2, 0.0002))) is None  # a tiny model's steps: too short to order


@pytest.mark.parametrize("window, reference, reason", [
    (CpuWindow(1.6, 0.0, 3.5, 2), (0.001, 0.001), "other processes kept 1.6 of 2 CPU(s) busy"),
    (CpuWindow(0.0, 0.2, 0.1, 2), (0.001, 0.001), "the hypervisor took 20% of the CPU time"),
    (CpuWindow(0.0, 0.0, 0.1, 2), (0.001, 0.060), "a reference matmul took 60x as long after"),
    (CpuWindow(None, None, 5.0, 2), (0.001, 0.001), "load average 5.0 on 2 CPU(s)"),
])
def test_each_sign_of_a_busy_machine_makes_a_measurement_noisy(window, reference, reason):
    quality = latency.judge(0.01, window, reference, threads=2, limits=latency.NoiseLimits())
    assert quality.verdict == "noisy" and len(quality.reasons) == 1 and quality.reasons[0].startswith(reason)
    assert latency.judge(0.01, QUIET, (0.001, 0.001), 2, latency.NoiseLimits()).verdict == "good"


def test_other_load_on_cores_our_threads_leave_free_is_not_interference():
    """Two other busy cores on a 16-CPU machine where we time on 4 threads take nothing from us."""
    window = CpuWindow(2.0, 0.0, 6.0, 16)
    assert latency.judge(0.01, window, (0.001, 0.001), threads=4, limits=latency.NoiseLimits()).verdict == "good"


def test_on_a_gpu_only_its_own_clock_judges_and_nothing_is_retried(monkeypatch):
    """Steps timed by CUDA events: busy CPUs (a GPU box compiles on its other cores) say nothing
    about them, and a noisy GPU measurement is kept, not waited on and repeated."""
    busy = CpuWindow(12.0, 0.2, 14.0, 16)
    assert latency.judge(0.01, busy, (0.001, 0.001), 4, latency.NoiseLimits(), gpu=True).verdict == "good"
    noisy = latency.judge(0.9, busy, (0.001, 0.001), 4, latency.NoiseLimits(), gpu=True)
    assert noisy.reasons == ("repeated timings of one step disagree by 90%",)
    attempts, waits = [], []
    monkeypatch.setattr(latency, "_attempt", lambda measure, device, limits: attempts.append(device) or
                        (latency.LatencyProfile(((1, 0.001),), ((1, 0.002),), spread=0.9), noisy))
    monkeypatch.setattr(latency, "wait_quietly", waits.append)
    profile = latency.measure_checked(lambda: None, "cuda", log=lambda line: None)
    assert len(attempts) == 1 and waits == [] and profile.quality.verdict == "noisy"


def test_a_busy_process_is_seen_in_the_cpu_counters():
    """The real counters (/proc/stat): CPU time that busy processes use while we wait shows as
    other load, not ours."""
    if not Path("/proc/stat").is_file():
        pytest.skip("no /proc/stat on this system")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        import time

        time.sleep(0.3)  # let them start spinning
        before = cpu_snapshot()
        time.sleep(1.0)
        window = cpu_window(before, cpu_snapshot())
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert window.others_cores is not None and window.others_cores >= 0.8, window  # at least most of one core
    quality = latency.judge(0.01, window, (0.001, 0.001), threads=window.cpus, limits=latency.NoiseLimits())
    assert quality.verdict == "noisy" and "other processes kept" in quality.reasons[0]


# --- compile: recorded in the manifest, shown by inspect, fixed by --reprofile --------------------

@pytest.fixture(scope="module")
def small_recipe(tmp_path_factory) -> Path:
    """The tiny target with lookup drafting and a four-graph grid (quick to compile)."""
    path = write_tiny_recipe_dir(tmp_path_factory.mktemp("recipe"))
    raw = yaml.safe_load(path.read_text())
    raw.update(draft="lookup", buckets={"depths": [1, 2], "draft_widths": [1], "verify_widths": [2],
                                        "prefill_chunks": [16]},
               calibration={"prompts": ["tiny-prompts.jsonl"], "num_prompts": 6, "max_new_tokens": 16})
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def one_thread():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.mark.slow
def test_compile_records_the_quality_and_reprofile_fixes_it(small_recipe, tmp_path, clock, one_thread, capsys):
    from yggdrasil.cli import main
    from yggdrasil.compile.work_cache import work_root

    out = tmp_path / "bundle"
    clock.busy_attempts = 99  # the whole first compile runs on a busy machine
    assert main(["compile", str(small_recipe), "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    manifest = yaml.safe_load((out / "manifest.yaml").read_text())
    stats = manifest["stats"]
    assert stats["measurement_quality"] == "noisy" and stats["threads"] == 1
    assert "selection (eager): noisy after 3 attempts" in stats["measurement"]
    assert "bundle (graphs): noisy after 3 attempts" in stats["measurement"]
    assert manifest["environment"]["device"].endswith("(1 threads)")
    assert yaml.safe_load((out / "profile.yaml").read_text())["latency"]["quality"]["verdict"] == "noisy"
    assert "WARNING: this bundle's step times were measured on a busy machine" in printed
    assert f"--out {out} --reprofile` on a quiet machine" in printed

    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "measured   noisy, 1 thread(s)" in shown
    assert f"re-run `yggdrasil compile {small_recipe.resolve()} --out {out} --reprofile` on a quiet machine" in shown

    # an unchanged recipe is "up to date", but says the step times are suspect
    assert main(["compile", str(small_recipe), "--out", str(out), "--threads", "1"]) == 0
    assert "is up to date" in (again := capsys.readouterr().out) and "measured on a busy machine" in again

    calibrated = load_file(str(work_root(out) / "calibration" / "calibration.safetensors"))
    clock.busy_attempts = len(clock.waits)  # the machine is quiet from now on
    assert main(["compile", str(small_recipe), "--out", str(out), "--threads", "1", "--reprofile"]) == 0
    printed = capsys.readouterr().out
    assert "--reprofile: measuring step times again; keeping the" in printed
    stats = yaml.safe_load((out / "manifest.yaml").read_text())["stats"]
    assert stats["measurement_quality"] == "good" and stats["graphs_compiled"] == 0  # no graph recompiled
    assert stats["graphs_reused"] > 0
    again = load_file(str(work_root(out) / "calibration" / "calibration.safetensors"))
    assert calibrated.keys() == again.keys() and all(torch.equal(calibrated[k], again[k]) for k in calibrated)
    assert yaml.safe_load((out / "calibration" / "calibration.yaml").read_text())["profile_quality"]["verdict"] == "good"
    assert main(["inspect", str(out)]) == 0
    assert "measured   good, 1 thread(s)" in (shown := capsys.readouterr().out) and "--reprofile" not in shown


# --- --threads -------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "chat", "serve", "compile", "profile", "calibrate", "bench", "plan"])
def test_every_command_takes_threads(command):
    from yggdrasil.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert "--threads" in sub.choices[command]._option_string_actions


def test_threads_zero_is_a_one_line_error():
    result = subprocess.run([sys.executable, "-m", "yggdrasil", "models", "--threads", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == ["error: --threads must be an integer >= 1, got 0"]


def test_threads_is_applied_before_the_command_runs(monkeypatch, one_thread):
    from yggdrasil.cli import main, models

    seen = []
    monkeypatch.setattr(models, "main", lambda args: seen.append(torch.get_num_threads()) or 0)
    torch.set_num_threads(2)
    assert main(["models", "--threads", "1"]) == 0
    assert seen == [1]


def test_a_recipe_names_its_threads(small_recipe, tmp_path):
    from yggdrasil.compile.recipe import RecipeError, load_recipe

    raw = yaml.safe_load(small_recipe.read_text())
    for value, expected in ((1, 1), (None, None)):
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({**raw, "threads": value} if value else raw))
        assert load_recipe(path).threads == expected
    assert load_recipe(path).identity() == load_recipe(small_recipe).identity()  # the device name records it
    path.write_text(yaml.safe_dump({**raw, "threads": 0}))
    with pytest.raises(RecipeError, match="threads must be an integer >= 1, got 0"):
        load_recipe(path)


def test_a_bundle_run_with_another_thread_count_says_which_flag_fixes_it(tmp_path):
    from yggdrasil.storage.manifest import BundleError, Environment, Manifest, check_bundle
    from yggdrasil.graphs.manifest import write_bundle

    built = Environment("2.13.0+cpu", None, "Test CPU (1 threads)")
    manifest = Manifest({"name": "x"}, "id", {}, built, (), "float32", 1, (16,))
    write_bundle(tmp_path / "b", manifest, lambda tmp: (tmp / "f").write_text("x"))
    with pytest.raises(BundleError, match=r"built for 1 CPU thread\(s\) but this run uses 2; pass --threads 1"):
        check_bundle(tmp_path / "b", Environment("2.13.0+cpu", None, "Test CPU (2 threads)"), {}, "`rebuild`")
    assert os.path.isdir(tmp_path / "b")
