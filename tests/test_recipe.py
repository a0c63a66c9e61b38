"""Compile recipes: the shipped ones parse, and every kind of mistake gets its own message."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from yggdrasil.compile.recipe import RecipeError, check_models, load_recipe, parse_recipe

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def _base(**changes) -> dict:
    raw = yaml.safe_load((RECIPES[0].parent / "smollm2-lookup-cpu.yaml").read_text())
    for key, value in changes.items():
        target = raw
        *path, last = key.split(".")
        for part in path:
            target = target[part]
        if value is None:
            target.pop(last)
        else:
            target[last] = value
    return raw


def test_shipped_recipes_parse_for_cpu_and_cuda():
    names = {p.stem for p in RECIPES}
    assert {"smollm2-lookup-cpu", "smollm2-lookup-cuda", "qwen-pair-cpu", "qwen-pair-cuda"} <= names
    identities = {load_recipe(p).identity() for p in RECIPES}
    assert len(identities) == len(RECIPES)


def test_the_bench_recipe_is_the_quick_start_one_with_every_bucket_compiled():
    """bench/recipes/smollm2-lookup-cpu-all.yaml times the speculative shapes the quick-start
    bundle does not keep (issue 25): it must differ from it in its name and selection only."""
    bench = load_recipe(RECIPES[0].parent.parent / "bench" / "recipes" / "smollm2-lookup-cpu-all.yaml")
    shipped = load_recipe(RECIPES[0].parent / "smollm2-lookup-cpu.yaml")
    assert bench.selection == "all" and shipped.selection == "objective"
    assert replace(bench, name=shipped.name, selection=shipped.selection, source=shipped.source,
                   measured_cold_compile=shipped.measured_cold_compile) == shipped


def test_identity_ignores_formatting_but_not_content(tmp_path):
    a = parse_recipe(_base(), "a")
    assert parse_recipe(_base(), "b").identity() == a.identity()
    assert parse_recipe(_base(max_context=4096), "c").identity() != a.identity()


def test_serve_graphs_defaults_to_true_and_false_is_another_recipe():
    """Leaving serve_graphs out or writing its default keeps the identity bundles were built with;
    false builds other graphs (none for the server), so it is another bundle."""
    plain = parse_recipe(_base(), "a")
    assert plain.serve_graphs is True
    assert parse_recipe(_base(serve_graphs=True), "a").identity() == plain.identity()
    without = parse_recipe(_base(serve_graphs=False), "a")
    assert without.serve_graphs is False and without.identity() != plain.identity()
    from yggdrasil.cli.chat import compile_work  # what a bare `chat` announces it will compile
    from yggdrasil.compile.select import BucketSelection, graph_keys

    grid = plain.buckets.grid
    widest = BucketSelection(grid.widths, grid.verifies, {}, (), ())
    served = {f"{k.role}/{k.name}" for k in graph_keys(plain, widest, needs_hidden=False)}
    assert "target/serve" in served
    assert {f"{k.role}/{k.name}" for k in graph_keys(without, widest, needs_hidden=False)} == served - {"target/serve"}
    assert compile_work(without)[0] == compile_work(plain)[0] - 1


def test_a_measured_cold_compile_is_what_compile_announces_and_not_part_of_the_identity():
    """The recipe's record of a cold compile (issue 37): phases in compile's order whatever the
    YAML's, the total, and the line compile logs before its long phases; changing the record
    leaves the recipe's identity (and so every bundle built from it) as it was."""
    from yggdrasil.compile.build import expected_time

    measured = {"cpu": "a 2-core Zen 5", "seconds": {"graphs": 60, "load": 5, "formats": 40.5},
                "result": "bench/results/x.json"}
    plain = parse_recipe(_base(measured_cold_compile=None), "r")
    recipe = parse_recipe(_base(measured_cold_compile=measured), "r")
    assert recipe.identity() == plain.identity()
    assert recipe.measured_cold_compile.seconds == (("load", 5.0), ("formats", 40.5), ("graphs", 60.0))
    assert recipe.measured_cold_compile.total == 105.5
    line = expected_time(recipe, "cpu (test)")
    assert line.startswith(f"a cold compile of {recipe.name} took 1m46s on a 2-core Zen 5 (load 5.0s, formats 40s,")
    assert "this machine: cpu (test)" in line
    assert "no measured compile time" in expected_time(plain, "cpu")
    shipped = [load_recipe(p) for p in RECIPES if p.stem in ("smollm2-lookup-cpu", "qwen-pair-cpu")]
    assert all(r.measured_cold_compile is not None and r.measured_cold_compile.result for r in shipped)


@pytest.mark.parametrize("changes, message", [
    ({"bucket": 3}, "unknown key 'bucket'"),
    ({"buckets.depth": [1]}, "unknown key 'depth'"),
    ({"target": None}, "missing key 'target'"),
    ({"schema": "yggdrasil-recipe/9"}, "expected schema"),
    ({"dtype": "fp8"}, "dtype must be one of"),
    ({"device": "tpu"}, "device must be cpu or cuda"),
    ({"buckets.depths": [2, 1]}, "strictly increasing"),
    ({"buckets.draft_widths": [0, 1]}, r"draft_widths\[0\] must be an integer >= 1"),
    ({"buckets.verify_widths": [1, 4096]}, "does not fit max_context"),
    ({"tile": 16, "buckets.verify_widths": [1, 24]}, "24 is not a multiple of tile 16.*32-row graph"),
    ({"max_context": 128, "buckets.prefill_chunks": [120]}, "largest tree"),
    ({"max_context": 1000}, "multiple of 64.*use 960 or 1024"),
    ({"calibration.prompts": "humaneval"}, "list of prompt sets"),
    ({"measured_cold_compile": "2 min"}, "measured_cold_compile must be a mapping"),
    ({"measured_cold_compile": {"cpu": "x", "seconds": {"formating": 3}}}, "unknown phase 'formating'"),
    ({"measured_cold_compile": {"cpu": "x", "seconds": {"graphs": -1}}}, r"seconds.graphs must be a number"),
    ({"measured_cold_compile": {"seconds": {"graphs": 1}}}, "missing key 'cpu'"),
    ({"serve_graphs": "no"}, "serve_graphs must be true .* or false"),
])
def test_recipe_mistakes_name_the_problem(changes, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(_base(**changes), "r.yaml")


def test_missing_files_and_models(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("schema: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")
    with pytest.raises(RecipeError, match="neither a catalog model"):
        check_models(parse_recipe(_base(target=str(tmp_path / "no-model")), "r.yaml"))
