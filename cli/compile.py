"""`yggdrasil compile RECIPE`: build a graph bundle ahead of time (the one command that imports
yggdrasil.compile)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from yggdrasil.cpu import ISAS


def add_parser(sub) -> None:
    comp = sub.add_parser("compile", help="compile a recipe ahead of time into a graph bundle")
    comp.add_argument("recipe", help="recipe YAML (shipped ones are in recipes/)")
    comp.add_argument("--out", default=None,
                      help="bundle directory (default: the user cache dir); an existing bundle there is "
                           "replaced, anything else is refused")
    comp.add_argument("--force", action="store_true",
                      help="rebuild from scratch, even if the bundle is up to date: clears the work cache "
                           "(compiled graphs, calibration) beside it")
    comp.add_argument("--reprofile", action="store_true",
                      help="measure the step times again (on a quiet machine, or on the machine a bundle was "
                           "copied to) and redo the bucket selection and stage plans that depend on them; keeps "
                           "the calibration and compiled graphs")
    comp.add_argument("--isa", choices=ISAS, default=None,
                      help="vector ISA to compile the graphs for (overrides the recipe's isa:): native (default, "
                           "this CPU's own), or avx512 / avx2 (x86-64-v4 / v3) for a bundle that runs on every "
                           "CPU with that ISA")


def default_bundle_dir(recipe_name: str) -> Path:
    from yggdrasil.user_dirs import cache_dir

    return cache_dir() / "bundles" / recipe_name


def run(recipe_path: str, out: str | None, force: bool, reprofile: bool = False, threads: int | None = None,
        isa: str | None = None) -> int:
    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe
    from yggdrasil.graphs.describe import describe

    recipe = load_recipe(Path(recipe_path))
    if threads is not None:  # --threads wins over the recipe's `threads:` key
        recipe = replace(recipe, threads=threads)
    if isa is not None:  # and --isa over its `isa:` key
        recipe = replace(recipe, isa=isa)
    target = Path(out) if out else default_bundle_dir(recipe.name)
    result = build_bundle(recipe, target, force=force, reprofile=reprofile)
    print(describe(result.manifest))
    print(f"bundle {'reused' if result.reused else 'written'}: {result.bundle}")
    print(f"run it: yggdrasil generate --bundle {result.bundle} --prompt '...'")
    return 0


def main(args) -> int:
    return run(args.recipe, args.out, args.force, args.reprofile, args.threads, args.isa)
