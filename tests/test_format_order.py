"""The order compile's formats phase measures weight formats in (issues 37, 50): after the fp32
reference its models are let go, the rest follow smallest first, a format whose weights alone take
longer to read than a passing format's every step is priced without being timed, one no faster at
any step than one that passes settled as dominated without its quality pass, and fp32 comes last
(reloaded) only if neither settles it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import format_profile, write_tiny_recipe_dir
from helpers import write_formats_recipe as _recipe

from yggdrasil.device import CpuWindow
from yggdrasil.runtime import latency
from yggdrasil.compile.context import load_context
from yggdrasil.compile.format_choice import choose_format, gate, prefer_by_objective
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.models.loader import load
from yggdrasil.models.quant import weight_format
from yggdrasil.runtime.steps import StepRunner

PROFILE = format_profile()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("format-order")
    write_tiny_recipe_dir(root)
    return root


def _profile_by_format(scale: dict[str, tuple[float, float]]):
    """A measure_profile whose T(1) and T(16) are scaled per weight format of the runner's model."""
    def measure(target, *args, **kwargs):
        one, sixteen = scale[weight_format(target.model)]
        return latency.LatencyProfile(draft=PROFILE.draft, verify=((1, one), (4, (one + sixteen) / 2), (16, sixteen)))
    return measure


def _patch_steps(monkeypatch, scale: dict[str, tuple[float, float]], probed: list | None = None) -> None:
    """Full profiles and the probe's single steps from the same scaled times; probed collects
    (format, width) of each step the probe times."""
    profile = _profile_by_format(scale)
    monkeypatch.setattr(latency, "measure_profile", profile)

    def step(target, width, repeats, *args, **kwargs):
        if probed is not None:
            probed.append((weight_format(target.model), width))
        return [profile(target).t_verify(width)] * repeats
    monkeypatch.setattr(latency, "verify_step_seconds", step)
    # a quiet machine: the probe's noise judgement (other load, the reference matmul's drift)
    # would otherwise re-probe a format whenever the test machine is busy
    monkeypatch.setattr(latency, "cpu_window", lambda before, after: CpuWindow(0.0, 0.0, 0.2, 2))
    monkeypatch.setattr(latency, "reference_seconds", lambda device: 0.001)


def test_a_format_slower_at_every_step_than_one_that_passes_is_settled_without_its_quality(tiny_dir, tiny_bundle,
                                                                                          monkeypatch):
    """Smallest first: int8 passes, so bf16 (slower at every step size) is recorded as dominated
    with its step times and no agreement, perplexity or invariance pass; fp32, slower at one row
    but faster at 16, is not dominated and is judged in full, last.
    The choice, and the objective's choice on a calibration, are what measuring everything gives."""
    from yggdrasil.compile import formats

    scale = {"int8": (1.0, 2.0), "bf16": (3.0, 4.0), "fp32": (2.0, 1.8)}
    probed: list = []
    _patch_steps(monkeypatch, scale, probed)
    recipe = load_recipe(_recipe(tiny_dir, "auto-dominated", "auto", min_agreement=0.5))
    measured_quality: list[str] = []
    real_agreement = formats.agreement

    def counted(runner, reference):
        measured_quality.append(weight_format(runner.model))
        return real_agreement(runner, reference)

    monkeypatch.setattr(formats, "agreement", counted)
    ctx = load_context(recipe, tiny_dir / "auto-dominated-bundle", log=lambda m: None)
    pruned = formats.measure_formats(ctx)
    verdicts = {m.format: m for m in pruned}
    assert [m.format for m in pruned] == ["fp32", "bf16", "int8"]  # shown in the recipe's order
    assert measured_quality == ["int8", "fp32"]  # smallest first, fp32 judged last; bf16 never teacher-forced
    bf16 = verdicts["bf16"]
    assert bf16.verdict == "dominated" and "int8" in bf16.note and not bf16.usable
    assert (bf16.agreement, bf16.perplexity, bf16.invariance) == (None, None, None)
    # probed at one row only: 3 s there, less the slack, is above every step of int8's
    assert bf16.probed and bf16.t_ms(1) == pytest.approx(3000.0) and bf16.t_ms(16) is None
    assert set(bf16.seconds) == {"load", "probe"} and "probed at 1 row(s)" in bf16.note
    assert verdicts["int8"].verdict == "passes" and verdicts["fp32"].verdict == "reference"
    # fp32, faster than int8 at 16 rows, is found so by the probe and then timed in full
    assert probed == [("bf16", 1), ("fp32", 1), ("fp32", 16)]
    assert set(verdicts["fp32"].seconds) == {"load", "probe", "step_times", "agreement", "perplexity", "invariance"}

    reference = formats.build_reference(ctx, StepRunner(ctx.target.model, recipe.max_context,
                                                        chunk_sizes=recipe.buckets.prefill_chunks))
    full = [formats.measure_format(ctx, m.format, reference) for m in pruned]  # nothing to be beaten by
    assert [m.verdict for m in full] == ["reference", "passes", "passes"]
    assert gate(ctx, pruned).chosen == gate(ctx, full).chosen == "int8"
    _, bundle = tiny_bundle
    by_objective = [prefer_by_objective(gate(ctx, m), bundle / "calibration").chosen for m in (pruned, full)]
    assert by_objective[0] == by_objective[1], by_objective


def test_choosing_lets_the_fp32_models_go_after_the_reference_and_loads_them_again_if_chosen(tiny_dir, monkeypatch):
    """choose_format frees the fp32 models compile loaded once the reference is built (one
    format's models at a time after that); fp32, measured last, is loaded again and, where it
    wins (here the fastest at every step), kept whole."""
    from yggdrasil.compile import formats

    _patch_steps(monkeypatch, {"fp32": (1.0, 1.5), "bf16": (1.2, 2.0), "int8": (1.1, 1.6)})
    recipe = load_recipe(_recipe(tiny_dir, "auto-fp32-wins", "auto", min_agreement=0.5))
    ctx = load_context(recipe, tiny_dir / "auto-fp32-wins-bundle", log=lambda m: None)
    chosen_ctx, choice = choose_format(ctx)
    assert choice.chosen == "fp32"
    assert {c.format: c.verdict for c in choice.candidates} == {"fp32": "reference", "int8": "passes",
                                                                "bf16": "dominated"}
    assert formats.released(ctx.target)  # the models measured first were let go
    assert not formats.released(chosen_ctx.target) and weight_format(chosen_ctx.target.model) == "fp32"
    ids = [1, 2, 3, 4]
    plain = load(recipe.resolve(recipe.target), dtype=torch.float32, quiet=True)
    assert greedy_tokens(StepRunner(chosen_ctx.target.model, 64, chunk_size=8), ids, 8) == \
        greedy_tokens(StepRunner(plain.model, 64, chunk_size=8), ids, 8)


def test_a_format_whose_weights_cannot_be_read_in_time_is_priced_not_timed(tiny_dir, monkeypatch):
    """With weights far beyond the cache (here: the cache taken as none) and a bandwidth at
    which reading bf16's or fp32's linear weights takes longer than every step of int8, which
    passes, those two are settled by their bytes: never loaded, timed or judged."""
    from dataclasses import replace

    from yggdrasil.compile import formats

    from yggdrasil.compile import format_pricing

    _patch_steps(monkeypatch, {"int8": (0.001, 0.002)})
    monkeypatch.setattr(format_pricing, "last_level_cache_bytes", lambda: 0)
    loaded = []
    real_load = formats.load_in
    monkeypatch.setattr(formats, "load_in", lambda ctx, role, fmt: loaded.append(fmt) or real_load(ctx, role, fmt))
    recipe = load_recipe(_recipe(tiny_dir, "auto-priced", "auto", min_agreement=0.5))
    ctx = load_context(recipe, tiny_dir / "auto-priced-bundle", log=lambda m: None)
    weights = format_pricing.linear_weights(ctx.target.model)
    ctx = replace(ctx, bandwidth=weights * 2 / 0.01)  # bf16's floor 10 ms, fp32's 20 ms
    measured = {m.format: m for m in formats.measure_formats(ctx, let_go=True)}
    assert measured["int8"].verdict == "passes"
    for fmt, floor_ms in (("bf16", 10.0), ("fp32", 20.0)):
        assert measured[fmt].verdict == "priced" and measured[fmt].profile is None, measured[fmt]
        assert f"at least {floor_ms:.1f} ms a step" in measured[fmt].note and "int8" in measured[fmt].note
    assert set(loaded) == {"int8"}  # nothing else loaded or converted
    assert gate(ctx, list(measured.values())).chosen == "int8"
    every = load_recipe(_recipe(tiny_dir, "auto-timed", "auto", min_agreement=0.5, time_every_format=True))
    assert format_pricing.step_floors(replace(load_context(every, tiny_dir / "auto-timed-bundle", log=lambda m: None),
                                       bandwidth=1.0), ("fp32", "bf16")) == {}  # timed, as before


def test_dominance_needs_every_step_no_slower_and_one_faster():
    from yggdrasil.compile.formats import dominates

    base = latency.LatencyProfile(draft=((1, 0.1), (2, 0.2)), verify=((1, 1.0), (16, 2.0)))
    slower_draft = latency.LatencyProfile(draft=((1, 0.1), (2, 0.3)), verify=base.verify)
    faster_wide = latency.LatencyProfile(draft=base.draft, verify=((1, 1.1), (16, 1.9)))
    assert dominates(base, slower_draft) and not dominates(slower_draft, base)
    assert not dominates(base, faster_wide) and not dominates(faster_wide, base)
    assert not dominates(base, base)  # a tie is the objective's to break


def test_the_probe_times_only_the_steps_that_could_still_be_faster():
    """Winner 1 / 1.2 / 2 s at 1 / 4 / 16 rows: a format taking 3 s at one row is slower at
    every width (one probe); one taking 1.5 s at one row is probed again at 16 rows (its
    floor, 1.35 s, does not cover the winner's 2 s there); one no slower at one row is not
    dominated; a tie at a width is not either (the objective breaks ties)."""
    from yggdrasil.compile.format_pricing import cover

    winner = ((1, 1.0), (4, 1.2), (16, 2.0))

    def probe(times: dict[int, float]):
        asked = []
        result = cover(winner, lambda n: asked.append(n) or times[n])
        return result, asked

    assert probe({1: 3.0}) == (((1, 3.0),), [1])
    assert probe({1: 1.5, 16: 2.5}) == (((1, 1.5), (16, 2.5)), [1, 16])
    assert probe({1: 1.5, 16: 1.9}) == (None, [1, 16])  # faster at 16 rows: timed in full
    assert probe({1: 0.9}) == (None, [1])
    assert probe({1: 1.0}) == (None, [1])
    assert probe({1: 1.1, 4: 1.3, 16: 2.1}) == (((1, 1.1), (4, 1.3), (16, 2.1)), [1, 4, 16])
