"""Calibration, the depth predictor, bucket selection and --spec egt --auto (issue 4)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace

import pytest
import torch
import yaml

from helpers import save_random_hf_model
from yggdrasil.cli import main
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.policy.depth_model import DepthMLP
from yggdrasil.predictor import depth as depth_mod
from yggdrasil.predictor import prompts as prompt_sets
from yggdrasil.buckets import Grid, chain_depths
from yggdrasil.predictor.calibrate import Calibrator
from yggdrasil.policy.calibration import CalibrationRun, drafted_mask
from yggdrasil.predictor.calibration_data import hindsight_best
from yggdrasil.policy.auto import AutoPolicy, selector_for
from yggdrasil.buckets import NO_SPEC, Bucket
from yggdrasil.policy.select import Selector
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.runtime.static_tree import load_shape
from yggdrasil.runtime.steps import StepRunner

GRID = Grid((1, 2, 3), (1, 2), (1, 2, 4, 8))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_random_hf_model(target_dir, "qwen2", seed=21)
    save_random_hf_model(draft_dir, "qwen2", seed=22, num_hidden_layers=1)
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def tiny_pair(tiny_dirs):
    return tuple(load_hf_model(d, torch.float32) for d in tiny_dirs)


@dataclass
class FixedPolicy:
    """Always the same bucket (to check calibration's hindsight against a real iteration)."""

    shape: Bucket
    grid: Grid = GRID
    needs_hidden: bool = False

    @property
    def profile(self):
        return LatencyProfile()

    def choose(self, hidden):
        return self.shape

    # the generator asks predict-then-select (AutoPolicy's split); route both through choose
    def predict(self, hidden):
        self._hidden = hidden
        return None

    def select(self, tail):
        return self.choose(self._hidden)

    def node_acceptance(self, tree):  # V is the bucket's (no draft confidence)
        return None


class CyclingPolicy(FixedPolicy):
    """Every bucket of the grid and no-spec in turn, reading hidden states like the real one."""

    def __init__(self) -> None:
        super().__init__(NO_SPEC, needs_hidden=True)
        self.order = [NO_SPEC] + [Bucket(d, w, v) for d in GRID.depths for w in GRID.widths
                                  for v in GRID.verifies]
        self.calls = 0

    def choose(self, hidden):
        assert hidden is not None and hidden.shape == (64,)
        self.calls += 1
        return self.order[(self.calls - 1) % len(self.order)]


def test_calibration_hindsight_equals_a_real_iteration_of_every_bucket(tiny_pair):
    target, draft = tiny_pair
    prompt = [7, 100, 3, 54, 200, 9]
    calibrator = Calibrator(StepRunner(target, 256, 8), ModelDrafter(StepRunner(draft, 256, 8), 3, 2, (1, 2)), GRID)
    run = calibrator.run([prompt], 24, frozenset(), show_progress=False)
    assert run.hidden.shape == (run.accepted_max.numel(), target.config.dim)
    first = run.accepted[0]
    for i, d in enumerate(GRID.depths):
        for j, w in enumerate(GRID.widths):
            for k, v in enumerate(GRID.verifies):
                gen = SpeculativeGenerator(StepRunner(target, 256, 8),
                                           ModelDrafter(StepRunner(draft, 256, 8), 3, 2, (1, 2)),
                                           policy=FixedPolicy(Bucket(d, w, v)))
                result = gen.generate(prompt, 2, SamplingParams())
                assert result.spec.iterations == 1
                # the walk's accepted tokens (AAL counts only the one token delivered here)
                assert sum(result.spec.accepted_at_depth) == int(first[i, j, k]), (d, w, v)
    # deeper and wider never accepts less
    assert (run.accepted[:, 1:] >= run.accepted[:, :-1]).all()
    assert (run.accepted[:, :, :, 1:] >= run.accepted[:, :, :, :-1]).all()


def test_calibration_runs_the_runtime_loop_through_its_hook(tiny_pair, monkeypatch):
    """No copy of the iteration: every calibration record is one SpeculativeGenerator.step."""
    target, draft = tiny_pair
    steps = []
    real_step = SpeculativeGenerator.step

    def counted(self, *args, **kwargs):
        steps.append(self.hook)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "step", counted)
    calibrator = Calibrator(StepRunner(target, 256, 8), ModelDrafter(StepRunner(draft, 256, 8), 3, 2, (1, 2)), GRID)
    run = calibrator.run([[7, 100, 3, 54, 200, 9]], 16, frozenset(), show_progress=False)
    assert steps and all(hook is not None for hook in steps)
    # every iteration is recorded; only the last few (not judgeable: too close to the end) are dropped
    assert len(steps) - GRID.max_depth <= run.accepted_max.numel() <= len(steps)


def _random_policy(dim: int, seed: int) -> AutoPolicy:
    torch.manual_seed(seed)
    model = DepthMLP(dim, GRID.max_depth).eval()
    with torch.no_grad():  # sharp, input-dependent tails, so the chosen bucket changes a lot
        model.heads.weight.mul_(40.0)
        model.std.fill_(0.1)
    table = torch.rand(len(GRID.depths), len(GRID.widths), len(GRID.verifies)).cumsum(0).cumsum(2)
    capped = table[:, -1, -1] + 0.1
    profile = LatencyProfile(draft=((1, 0.05), (2, 0.06)), verify=((1, 1.0), (8, 1.3)))
    return AutoPolicy(Selector(GRID, profile, table, capped), model)


def test_auto_mode_greedy_is_lossless_across_changing_buckets(tiny_pair):
    target, draft = tiny_pair
    seen: set[str] = set()
    for seed in range(3):
        prompt = torch.randint(0, 256, (6 + 5 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = greedy_tokens(StepRunner(target, 256, 8), prompt, 48)
        gen = SpeculativeGenerator(StepRunner(target, 256, 8),
                                   ModelDrafter(StepRunner(draft, 256, 8), 3, 2, (1, 2)),
                                   policy=_random_policy(target.config.dim, seed))
        result = gen.generate(prompt, 48, SamplingParams())
        assert result.tokens == expected
        assert sum(result.spec.shapes.values()) == result.spec.iterations
        seen |= set(result.spec.shapes)
    assert len(seen) >= 3, seen  # buckets really change (no-spec included) under a sharp predictor


def test_predictor_learns_a_known_function_of_the_hidden_state():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1500, 24, generator=gen)
    accepted = (3 + 1.6 * hidden[:, 0] - 1.0 * hidden[:, 1]).round().clamp(0, 6).long()
    prompt_index = torch.arange(1500) // 25
    train_mask, held_mask = depth_mod.split_by_prompt(prompt_index)
    assert not (set(prompt_index[train_mask].tolist()) & set(prompt_index[held_mask].tolist()))
    model = depth_mod.train(hidden, accepted, train_mask, 6)
    report = depth_mod.evaluate(model, hidden, accepted, train_mask, held_mask, 6)
    assert report.accuracy > report.majority_accuracy + 0.25, report
    assert report.within_one > 0.9 and report.useful


def test_predictor_says_when_calibration_data_is_too_small():
    with pytest.raises(depth_mod.PredictorError, match="--num-prompts"):
        depth_mod.check_enough(torch.zeros(50, dtype=torch.long))
    with pytest.raises(depth_mod.PredictorError, match="from 2 prompts"):
        depth_mod.check_enough(torch.arange(400) // 200)


def _selector(verify_times, table_scale=1.0):
    grid = Grid((1, 2, 4), (1, 2, 4), (1, 2, 4, 8, 16))
    # acceptance grows with every dimension, with diminishing returns
    d = torch.tensor(grid.depths, dtype=torch.double)[:, None, None]
    w = torch.tensor(grid.widths, dtype=torch.double)[None, :, None]
    v = torch.tensor(grid.verifies, dtype=torch.double)[None, None, :]
    table = table_scale * torch.minimum(d * (1 - 0.5 ** (w + 1)), torch.log2(v) * 0.9)
    profile = LatencyProfile(draft=((1, 0.02), (4, 0.025)), verify=tuple(verify_times))
    return grid, Selector(grid, profile, table, table.amax((1, 2)).clamp(min=1e-3))


def test_selection_picks_small_verify_on_steep_cost_and_large_on_flat():
    _, steep = _selector([(1, 1.0), (16, 8.5)])  # CPU-like: every token costs
    _, flat = _selector([(1, 1.0), (16, 1.02)])  # GPU-like: flat up to the largest bucket
    assert steep.constant()[0].verify <= 4
    assert flat.constant()[0].verify == 16
    sure = torch.ones(4)  # the predictor is sure the whole depth will be accepted
    assert flat.for_tail(sure)[0].depth == 4
    assert steep.for_tail(torch.zeros(4))[0] == NO_SPEC  # nothing will be accepted: do not speculate


def test_selection_never_returns_a_bucket_outside_the_grid():
    rng = random.Random(0)
    for _ in range(200):
        times = sorted(rng.uniform(0.5, 3.0) for _ in range(2))
        grid, selector = _selector([(1, times[0]), (16, times[1])], rng.uniform(0.0, 2.0))
        shape, speedup = selector.for_tail(torch.rand(4).sort(descending=True).values)
        assert shape == NO_SPEC or (shape.depth in grid.depths and shape.width in grid.widths
                                    and shape.verify in grid.verifies)
        assert speedup >= 1.0


def test_plain_python_selection_equals_the_tensor_reference():
    """The runtime's per-iteration selection (plain Python) picks exactly for_tail's bucket,
    ties included (tails with repeated values make equal-speedup buckets)."""
    rng = random.Random(1)
    for case in range(300):
        times = sorted(rng.uniform(0.5, 3.0) for _ in range(2))
        _, selector = _selector([(1, times[0]), (16, times[1])], rng.uniform(0.0, 2.0))
        tail = torch.rand(4).sort(descending=True).values
        if case % 3 == 0:
            tail = torch.tensor([rng.choice([0.0, 0.5, 1.0])] * 4)
        assert selector.for_tail_fast(tail.tolist()) == selector.for_tail(tail)[0]


def _jsonl(path, n):
    rows = [{"prompt": "def f%d(x):\n    return x * %d + f%d(x - 1)\n" % (i, i, i)} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_calibrate_command_end_to_end(tiny_dirs, tmp_path, capsys):
    target_dir, draft_dir = tiny_dirs
    prompts = _jsonl(tmp_path / "code.jsonl", 24)
    out = tmp_path / "cal"
    args = ["calibrate", "--model", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts),
            "--num-prompts", "18", "--max-new-tokens", "48", "--depths", "1,2,3", "--widths", "1,2",
            "--verify", "1,2,4,8", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "held-out iterations" in text and "oracle" in text
    for name in ("calibration.yaml", "calibration.safetensors", "predictor.yaml",
                 "predictor.safetensors", "calibration.png", "sequoia-v8.json"):
        assert (out / name).is_file(), name
    import yaml

    summary = yaml.safe_load((out / "calibration.yaml").read_text())
    assert len(summary["hindsight_best"]) == summary["iterations"]
    assert sum(summary["hindsight_best_counts"].values()) == summary["iterations"]
    assert len(load_shape(out / "sequoia-v8.json")) == 7
    common = ["generate", "--model", str(target_dir), "--prompt", "def g(x):", "--max-new-tokens", "40"]
    assert main(common + ["--no-stats"]) == 0
    plain = capsys.readouterr().out
    assert main(common + ["--spec", "egt", "--auto", "--calibration", str(out), "--draft", str(draft_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "[auto:" in captured.err and "buckets" in captured.err


def test_calibrate_with_too_few_prompts_keeps_the_data_and_says_why(tiny_dirs, tmp_path, capsys):
    target_dir, _ = tiny_dirs
    out = tmp_path / "cal"
    code = main(["calibrate", "--model", str(target_dir), "--prompts", str(_jsonl(tmp_path / "p.jsonl", 4)),
                 "--num-prompts", "2", "--max-new-tokens", "8", "--depths", "1,2", "--widths", "1",
                 "--verify", "1,2", "--out", str(out)])
    assert code == 2
    assert "needs at least" in capsys.readouterr().err
    assert (out / "calibration.yaml").is_file() and not (out / "predictor.yaml").exists()


def test_auto_needs_a_calibration_directory(tiny_dirs, tmp_path, capsys):
    target_dir, _ = tiny_dirs
    base = ["generate", "--model", str(target_dir), "--prompt", "x", "--max-new-tokens", "4"]
    assert main(base + ["--spec", "egt", "--auto"]) == 2
    assert "--calibration" in capsys.readouterr().err
    assert main(base + ["--spec", "egt", "--auto", "--calibration", str(tmp_path)]) == 2
    assert "not a calibration directory" in capsys.readouterr().err


def test_prompt_files_and_splits(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", 8)
    prompts = prompt_sets.load_set(str(path))
    calib, held = prompt_sets.split(prompts, "calibration"), prompt_sets.split(prompts, "held-out")
    assert len(calib) == 6 and len(held) == 2 and not ({p.id for p in calib} & {p.id for p in held})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": 3}\n')
    with pytest.raises(Exception, match=r"bad.jsonl:2: each line needs"):
        prompt_sets.load_set(str(bad))
    with pytest.raises(Exception, match="unknown prompt set"):
        prompt_sets.load_set("nope")


def test_reuse_keeps_the_iterations_and_checks_the_models(tiny_dirs, tmp_path, capsys):
    target_dir, draft_dir = tiny_dirs
    out = tmp_path / "cal"
    args = ["calibrate", "--model", str(target_dir), "--draft", str(draft_dir),
            "--prompts", str(_jsonl(tmp_path / "code.jsonl", 24)), "--num-prompts", "18",
            "--max-new-tokens", "48", "--depths", "1,2,3", "--widths", "1,2", "--verify", "1,2,4,8",
            "--out", str(out)]
    assert main(args) == 0
    before = (out / "calibration.safetensors").read_bytes()
    capsys.readouterr()
    assert main(args + ["--reuse"]) == 0
    assert "reusing" in capsys.readouterr().out
    assert (out / "calibration.safetensors").read_bytes() == before
    other = args[:]
    other[other.index("--widths") + 1] = "1"
    assert main(other + ["--reuse"]) == 2
    assert "calibrated for something else" in capsys.readouterr().err


@pytest.mark.slow
def test_auto_mode_compiled_never_recompiles_and_is_lossless(tiny_pair):
    """Every bucket the policy may pick is compiled in warm_up; generation then runs under
    fail_on_recompile (StepRunner) with buckets changing every iteration."""
    target, draft = tiny_pair
    prompt = [3, 17, 91, 4, 4, 250, 8]
    runner = StepRunner(target, 256, 8, compile=True)
    policy = CyclingPolicy()
    gen = SpeculativeGenerator(runner, ModelDrafter(StepRunner(draft, 256, 8, compile=True), 3, 2, (1, 2)),
                               policy=policy)
    gen.warm_up()
    compiled_before = set(runner._ran)
    result = gen.generate(prompt, 60, SamplingParams())
    assert result.tokens == greedy_tokens(StepRunner(target, 256, 8), prompt, 60)
    assert set(runner._ran) == compiled_before  # no shape outside the warmed-up set
    assert policy.calls >= len(policy.order)  # every bucket ran at least once


def test_costs_charge_only_the_rows_a_tree_fills():
    from yggdrasil.policy.select import record_costs, shape_costs

    grid = Grid((1, 2), (1, 2), (1, 2, 4, 8))
    profile = LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0), (2, 1.5), (4, 2.0), (8, 4.0)))
    sizes = torch.tensor([[[1, 1], [1, 1]], [[3, 5], [3, 5]]], dtype=torch.int16)  # [N=2, D, W]
    costs = record_costs(grid, profile, sizes, 2)
    assert costs[0].eq(1.0).all()  # nothing drafted: one plain step, whatever V
    assert costs[1, 0, 0].tolist() == [1.0, 1.5, 2.0, 2.0]  # 3 nodes fit V=4; V=8 pads to 4 only
    assert costs[1, 0, 1].tolist() == [1.0, 1.5, 2.0, 4.0]  # 5 nodes need the 8-row graph
    full = record_costs(grid, profile, None, 1)[0]  # a draft model's trees are full: 1 + D·W nodes
    assert full[0, 0].tolist() == [1.0, 1.5, 1.5, 1.5] and full[1, 1].tolist() == [1.0, 1.5, 2.0, 4.0]
    assert (full <= shape_costs(grid, profile) + 1e-12).all()
    bumpy = LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0), (2, 1.5), (4, 3.0), (8, 2.5)))
    assert record_costs(grid, bumpy, sizes, 2)[1, 0, 0, 2] == 2.5  # 3 nodes: the 8-row graph is cheaper


def test_bucket_names_parse_back():
    for shape in (NO_SPEC, Bucket(3, 2, 4), Bucket(12, 1, 32)):
        assert Bucket.parse(str(shape)) == shape
    with pytest.raises(ValueError, match="not a bucket name"):
        Bucket.parse("D3W2")


# ------------------------------------------- calibration drafts only what selection can use (issue 25)

CHAIN_GRID = Grid(chain_depths((1, 2, 3), (1, 2), (1, 2, 4, 8)), (1, 2), (1, 2, 4, 8))  # depths 1, 2, 3, 7


def _counted_calibration(tiny_pair, tree_depth, monkeypatch):
    """A calibration on the chain grid; returns it with the draft forwards per build depth."""
    target, draft = tiny_pair
    forwards: list[tuple[str, int]] = []
    drafter = ModelDrafter(StepRunner(draft, 256, 8), CHAIN_GRID.max_depth, 2, (1, 2))
    real_run = drafter.runner.run

    def counted(inputs, key=None, **kwargs):
        forwards.append((key, inputs.tokens.shape[1]))
        return real_run(inputs, key=key, **kwargs)

    monkeypatch.setattr(drafter.runner, "run", counted)
    calibrator = Calibrator(StepRunner(target, 256, 8), drafter, CHAIN_GRID, tree_depth)
    records, _ = calibrator.run_prompt([7, 100, 3, 54, 200, 9], 0, 24, frozenset())
    steps = [f for f in forwards if f[0] == "draft_step"]
    forwards.clear()
    run = calibrator.run([[7, 100, 3, 54, 200, 9]], 24, frozenset(), show_progress=False)
    return run, len(records), steps


def test_only_width_one_is_drafted_to_the_chain_depth(tiny_pair, monkeypatch):
    full, full_iterations, full_steps = _counted_calibration(tiny_pair, None, monkeypatch)
    lean, lean_iterations, lean_steps = _counted_calibration(tiny_pair, 3, monkeypatch)
    assert full.drafted_depths == (7, 7) and lean.drafted_depths == (7, 3)
    # a depth-d build feeds d - 1 draft steps after its head: width 1 to 7, width 2 to 7 or 3
    assert len(full_steps) == full_iterations * (6 + 6)
    assert len(lean_steps) == lean_iterations * (6 + 2)
    assert sum(rows for _, rows in lean_steps) == lean_iterations * (6 * 1 + 2 * 2)
    # the first iteration starts from the same history in both: every tree the lean run drafted
    # accepted exactly what the full run's did, and the rest is marked undrafted (and zero)
    drafted = drafted_mask(CHAIN_GRID, lean.drafted_depths)
    assert drafted.tolist() == [[True, True], [True, True], [True, True], [True, False]]
    assert torch.equal(lean.accepted[0][drafted], full.accepted[0][drafted])
    assert lean.accepted[:, ~drafted].eq(0).all()
    assert torch.equal(lean.hidden[0], full.hidden[0])


def _masked_copy(run: CalibrationRun, drafted_depths: tuple[int, ...]) -> CalibrationRun:
    mask = drafted_mask(run.grid, drafted_depths)
    return replace(run, accepted=run.accepted * mask[None, :, :, None], drafted_depths=drafted_depths)


def _synthetic_chain_run(seed: int) -> CalibrationRun:
    """Acceptance that grows with depth and width (wide trees saturate), random per record."""
    gen = torch.Generator().manual_seed(seed)
    grid, n = CHAIN_GRID, 120
    a = torch.randint(0, 8, (n,), generator=gen)
    d = torch.tensor(grid.depths)[None, :, None, None]
    v = torch.tensor(grid.verifies)[None, None, None, :]
    w = torch.tensor(grid.widths)[None, None, :, None]
    bonus = (torch.rand(n, 1, 1, 1, generator=gen) < 0.5).long() * (w - 1)  # width helps some records
    accepted = torch.minimum(torch.minimum(a[:, None, None, None] + bonus, d), v - 1).to(torch.int8)
    return CalibrationRun(grid, torch.randn(n, 8, generator=gen).half(), accepted.amax((1, 2, 3)).long(),
                          accepted, torch.arange(n) // 10, (0,), 0, n, 0)


@pytest.mark.parametrize("verify_times", [((1, 1.0), (8, 1.1)), ((1, 1.0), (2, 1.4), (8, 3.0))])
def test_selection_is_unchanged_where_calibration_drafted_and_never_picks_what_it_did_not(verify_times):
    profile = LatencyProfile(draft=((1, 0.02), (2, 0.025)), verify=verify_times)
    for seed in range(4):
        full = _synthetic_chain_run(seed)
        lean = _masked_copy(full, (7, 3))
        drafted = drafted_mask(CHAIN_GRID, lean.drafted_depths)
        every = torch.ones(full.accepted.shape[0], dtype=torch.bool)
        before, after = selector_for(full, every, profile), selector_for(lean, every, profile)
        assert torch.isinf(after.costs[~drafted]).all() and torch.isfinite(after.costs[drafted]).all()
        allowed = {str(NO_SPEC)} | {str(Bucket(d, w, v)) for i, d in enumerate(CHAIN_GRID.depths)
                                    for j, w in enumerate(CHAIN_GRID.widths) if drafted[i, j]
                                    for v in CHAIN_GRID.verifies}
        shape = before.constant()[0]
        if str(shape) in allowed:
            assert after.constant()[0] == shape
        assert str(after.constant()[0]) in allowed
        for v in CHAIN_GRID.verifies[1:]:
            chosen = after.best_at_verify(v)
            assert str(chosen) in allowed and chosen.verify == v
            if str(before.best_at_verify(v)) in allowed:
                assert chosen == before.best_at_verify(v)
        rng = random.Random(seed)
        for _ in range(50):
            tail = sorted((rng.random() for _ in range(CHAIN_GRID.max_depth)), reverse=True)
            picked = after.for_tail_fast(tail)
            assert str(picked) in allowed
            if str(before.for_tail_fast(tail)) in allowed:
                assert picked == before.for_tail_fast(tail)
        assert set(hindsight_best(lean, profile)) <= allowed


def test_undrafted_trees_are_saved_as_such(tmp_path):
    from yggdrasil.predictor.calibration_data import save_run
    from yggdrasil.policy.calibration import load_run, restrict

    profile = LatencyProfile(draft=((1, 0.02), (2, 0.025)), verify=((1, 1.0), (8, 1.1)))
    lean = _masked_copy(_synthetic_chain_run(0), (7, 3))
    save_run(lean, tmp_path, {"draft": "tiny-draft"}, profile)
    loaded, meta, _ = load_run(tmp_path)
    assert loaded.drafted_depths == (7, 3) and meta["drafted_depths"] == {"W1": 7, "W2": 3}
    assert meta["aal_table"]["D7"]["W2"] is None and meta["aal_table"]["D3"]["W2"] is not None
    assert restrict(loaded, (2,), (8,)).drafted_depths == (3,)
    # calibrations saved before widths stopped early were drafted everywhere
    del meta["drafted_depths"]
    (tmp_path / "calibration.yaml").write_text(yaml.safe_dump(meta))
    assert load_run(tmp_path)[0].drafted_depths is None


def test_a_no_spec_bucket_decodes_like_the_plain_loop(tiny_pair, monkeypatch):
    """A policy that never speculates runs the plain decode graph each step: the drafter builds
    no tree, the target runs no verify graph, and the tokens are plain greedy's."""
    target, draft = tiny_pair
    prompt = [5, 61, 9, 130, 2]
    drafter = ModelDrafter(StepRunner(draft, 256, 8), 3, 2, (1, 2))
    monkeypatch.setattr(drafter, "build_shaped", lambda *a: pytest.fail("a depth-0 bucket drafted a tree"))
    runner = StepRunner(target, 256, 8, compile=True)
    result = SpeculativeGenerator(runner, drafter, policy=FixedPolicy(NO_SPEC)).generate(prompt, 20, SamplingParams())
    assert result.tokens == greedy_tokens(StepRunner(target, 256, 8), prompt, 20)
    assert result.spec.shapes == {"no-spec": result.spec.iterations}
    assert not any(name.startswith("verify") for name in runner._ran), runner._ran
