"""Device profiles and cost models: round trips, clear rejections, fits that recover the truth."""

from __future__ import annotations

import random

import pytest
import yaml

from helpers import save_random_hf_model
from yggdrasil.cli import main
from yggdrasil.policy.costs import LinearStepModel, PreemptionCosts, StepCurve
from yggdrasil.policy.device_profile import DeviceProfile, ProfileError


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prof-model")
    save_random_hf_model(directory, "llama", seed=2)
    return directory


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory, tiny_model_dir):
    """A real `yggdrasil profile` run on a tiny random model (eager and compiled points)."""
    out = tmp_path_factory.mktemp("prof") / "tiny.yaml"
    code = main(["profile", "--model", str(tiny_model_dir), "--out", str(out), "--sizes", "1,2,4",
                 "--contexts", "16,48", "--chunks", "8", "--repeats", "2"])
    assert code == 0
    return out


def test_profile_round_trips_and_has_a_plot(tiny_profile):
    profile = DeviceProfile.load(tiny_profile)
    assert tiny_profile.with_suffix(".png").stat().st_size > 1000
    again = DeviceProfile.from_dict(yaml.safe_load(profile.to_yaml()))
    assert again == profile
    modes = {p.mode for p in profile.target.steps}
    assert modes == {"compiled", "eager"}
    assert len([p for p in profile.target.steps if p.mode == "eager"]) == 3 * 2
    assert profile.bandwidth["d2h_bytes_per_s"] is None and "not applicable" in profile.bandwidth["note"]
    curve = profile.target.curve()
    assert curve.sizes == (1, 2, 4) and all(t > 0 for t in curve.seconds)


def test_profile_for_something_else_is_refused(tiny_profile):
    profile = DeviceProfile.load(tiny_profile)
    profile.check_matches(profile.device, profile.dtype, profile.target.sha256)
    with pytest.raises(ProfileError, match="device: profile has"):
        profile.check_matches("NVIDIA H100", profile.dtype, None)
    with pytest.raises(ProfileError, match="dtype: profile has 'float32', this run has 'bfloat16'"):
        profile.check_matches(profile.device, "bfloat16", None)
    with pytest.raises(ProfileError, match="draft sha256"):
        profile.check_matches(profile.device, profile.dtype, None, draft_sha="abc")


@pytest.mark.parametrize("text, expected", [
    ("schema: yggdrasil-profile/9\n", "expected schema yggdrasil-profile/1"),
    ("[1, 2", "not valid YAML"),
    ("schema: yggdrasil-profile/1\ndevice: x\n", "malformed"),
])
def test_malformed_profiles(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=expected):
        DeviceProfile.load(path)
    with pytest.raises(ProfileError, match="does not exist"):
        DeviceProfile.load(tmp_path / "missing.yaml")


def test_linear_model_recovers_known_coefficients():
    rng = random.Random(0)
    alpha, gamma, delta = 2e-6, 3e-4, 0.02
    ctx = [rng.randint(16, 4096) for _ in range(40)]
    bat = [rng.randint(1, 64) for _ in range(40)]
    sec = [(alpha * c + gamma * b + delta) * (1 + rng.uniform(-0.005, 0.005)) for c, b in zip(ctx, bat)]
    model, report = LinearStepModel.fit(ctx, bat, sec)
    assert model.alpha == pytest.approx(alpha, rel=0.05)
    assert model.gamma == pytest.approx(gamma, rel=0.05)
    assert model.delta == pytest.approx(delta, rel=0.05)
    assert report.held_out == 10 and report.mean_abs_pct_error < 1.0


def test_step_curve_interpolates_monotonically():
    curve = StepCurve((1, 4, 16), (0.040, 0.050, 0.110))
    values = [curve(n) for n in range(1, 17)]
    assert values == sorted(values)
    assert curve(4) == 0.050 and curve(10) == pytest.approx(0.080)
    with pytest.raises(ValueError, match="strictly increasing"):
        StepCurve((4, 1), (0.1, 0.2))


def test_preemption_costs():
    costs = PreemptionCosts(swap=LinearStepModel(0.0, 1e-9, 0.001),
                            prefill=LinearStepModel(alpha=1e-5, gamma=1e-3, delta=0.01))
    assert costs.swap_seconds(10**9) == pytest.approx(1.001)
    # 130 tokens in chunks of 64: rows 64, 64, 2 with spans 64, 128, 130
    expected = sum(0.01 + 1e-3 * rows + 1e-5 * span for rows, span in ((64, 64), (64, 128), (2, 130)))
    assert costs.recompute_seconds(130, 64) == pytest.approx(expected)
    # a resumed request's blocks land among the others': its span is at least theirs
    floor = sum(0.01 + 1e-3 * rows + 1e-5 * 500 for rows in (64, 64, 2))
    assert costs.recompute_seconds(130, 64, span_floor=500) == pytest.approx(floor)


def test_step_cost_fits_over_rows_stay_non_negative():
    line = LinearStepModel.fit_rows([(1, 0.02), (2, 0.022), (4, 0.026), (8, 0.034)])
    assert line.gamma == pytest.approx(0.002) and line.delta == pytest.approx(0.018) and line.alpha == 0
    noisy = LinearStepModel.fit_rows([(1, 0.03), (8, 0.02)])  # timing noise: more rows, less time
    assert noisy.gamma == 0 and noisy.delta > 0


def test_generate_uses_a_matching_profile_and_refuses_another(capsys, tiny_model_dir, tiny_profile, tmp_path):
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "abcabc", "--max-new-tokens", "12",
            "--spec", "egt", "--draft", "lookup", "--verify", "2,4"]
    assert main(args + ["--profile", str(tiny_profile)]) == 0
    other = tmp_path / "other.yaml"
    other.write_text(tiny_profile.read_text().replace("dtype: float32", "dtype: bfloat16"))
    capsys.readouterr()
    assert main(args + ["--profile", str(other)]) == 2
    assert "dtype: profile has 'bfloat16', this run has 'float32'" in capsys.readouterr().err



# ---- Sequoia's static tree -------------------------------------------------------------------

def _all_shapes(budget, max_depth, ranks):
    """Every tree of at most `budget` nodes, any subset of child ranks (brute force)."""
    def trees(n, depth):
        if n == 0:
            yield ()
            return
        if depth > 0:
            yield from children(0, n, depth)

    def children(rank, m, depth):
        if m == 0:
            yield ()
            return
        if rank >= ranks:
            return
        yield from children(rank + 1, m, depth)  # rank unused
        for size in range(1, m + 1):
            for sub in trees(size - 1, depth - 1):
                for rest in children(rank + 1, m - size, depth):
                    yield ((rank,),) + tuple((rank,) + p for p in sub) + rest

    for n in range(1, budget + 1):
        yield from trees(n, max_depth)


@pytest.mark.parametrize("acceptance", [(0.8, 0.15, 0.05), (0.5, 0.3, 0.2), (0.95, 0.02)])
@pytest.mark.parametrize("budget, depth", [(1, 3), (4, 2), (5, 3), (6, 4)])
def test_sequoia_dp_finds_the_brute_force_optimum(acceptance, budget, depth):
    from yggdrasil.predictor.sequoia import best_tree, tree_value
    from yggdrasil.runtime.static_tree import validate_shape

    shape, value = best_tree(acceptance, budget, depth)
    validate_shape(shape)  # a shape StaticTreeDrafter accepts
    assert len(shape) <= budget and max(len(p) for p in shape) <= depth
    assert value == pytest.approx(tree_value(shape, acceptance))
    brute = max(tree_value(s, acceptance) for s in _all_shapes(budget, depth, len(acceptance)))
    assert value == pytest.approx(brute)


def test_sequoia_prefers_depth_when_acceptance_is_high_and_width_when_low():
    from yggdrasil.predictor.sequoia import best_tree

    deep, _ = best_tree((0.95, 0.03, 0.02), 6, 6)
    wide, _ = best_tree((0.35, 0.3, 0.25), 6, 6)
    assert max(len(p) for p in deep) > max(len(p) for p in wide)


def test_interpolation_error_is_measured_on_left_out_points():
    from yggdrasil.policy.costs import leave_one_out

    linear = StepCurve((1, 2, 4, 8, 16), tuple(0.01 + 0.002 * n for n in (1, 2, 4, 8, 16)))
    assert leave_one_out(linear).mean_abs_pct_error < 1e-9 and leave_one_out(linear).held_out == 3
    kinked = StepCurve((1, 2, 4), (1.0, 3.0, 3.0))  # the middle point is far off its neighbours' line
    assert leave_one_out(kinked).max_abs_pct_error == pytest.approx(100 * (3.0 - 5 / 3) / 3.0)
