"""Where everything lives inside a bundle directory, in one place: every writer (compile) and
every reader (open_bundle, inspect, plan, bench) goes through a BundleLayout, so no other module
spells a bundle file name.

    manifest.yaml     schema, recipe, models, environment, artifacts with sha256 (manifest.py)
    selection.yaml    the buckets compile kept: draft and verify widths, what was picked/dropped
    stage_plans.yaml  each bucket's stage plan (ahead-of-time drafts, overlap), when planned
    profile.yaml      step times measured on the compiled graphs
    recipe.yaml       the recipe it was built from, verbatim
    calibration/      calibration run, depth predictor and its report
    graphs/ROLE/NAME.pt2  one AOTInductor package per graph (steps: aoti)
    graphs/ROLE/NAME.inductor  or Inductor's saved compiled code per graph (steps: inductor;
                      yggdrasil/storage/inductor_steps.py); a bundle of eager steps has no graph files
    graphs/rank-K/target/NAME.pt2  a tensor-parallel target's graphs: one set per rank K, each over
                      that rank's shard with the collectives inside (docs/tensor-parallel.md);
                      the draft, whole on rank 0, keeps graphs/draft/
    kernels/yggdrasil_kernels.so  our CPU kernels (yggdrasil.kernels), when the graphs call them:
                      loaded before the models and graphs, so a bundle runs with no compiler
    weights/models.pt     the deployed models' tensors exactly as the kernels consume them (both
                          roles in one file: a tensor they share is stored once), memory-mapped
    weights/models.yaml   per role: config, dtype, packed linears' formats, invariant ops
    weights/tokenizer-ROLE/  the role's tokenizer, one the roles share written once (yggdrasil/runtime/deployed.py)
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from yggdrasil.yaml_files import parse_yaml

MANIFEST = "manifest.yaml"
SELECTION = "selection.yaml"
STAGE_PLANS = "stage_plans.yaml"
PROFILE = "profile.yaml"
RECIPE = "recipe.yaml"
CALIBRATION = "calibration"
PREDICTOR_SUMMARY = "predictor.yaml"  # inside calibration/
GRAPHS = "graphs"
KERNELS = "kernels"
KERNEL_LIBRARY = "yggdrasil_kernels.so"  # inside kernels/
WEIGHTS = "weights"
BUNDLE_NAMES = frozenset({MANIFEST, SELECTION, STAGE_PLANS, PROFILE, RECIPE, CALIBRATION, GRAPHS, KERNELS, WEIGHTS})
BUNDLE_SCHEMA_PREFIX = "yggdrasil-bundle/"
# a graph file's suffix by what runs the bundle's buckets (manifest `steps`)
GRAPH_SUFFIX = {"aoti": ".pt2", "inductor": ".inductor"}
RANK_PREFIX = "rank-"  # graphs/rank-K/: rank K's graph set of a tensor-parallel target
COUNT_LIMIT = 10_000  # files counted when describing a directory that is not a bundle


def _inside(*parts: str) -> property:
    """A path inside the bundle directory, as a read-only attribute of its layout."""
    return property(lambda layout: layout.root.joinpath(*parts))


class BundleLayout:
    """Typed paths, reads and writes of one bundle directory (or of the directory a bundle is
    being written into)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # paths ---------------------------------------------------------------------------------
    manifest = _inside(MANIFEST)
    selection = _inside(SELECTION)
    stage_plans = _inside(STAGE_PLANS)
    profile = _inside(PROFILE)
    recipe = _inside(RECIPE)
    calibration = _inside(CALIBRATION)
    kernel_library = _inside(KERNELS, KERNEL_LIBRARY)
    # the deployed weights (yggdrasil/runtime/deployed.py); absent in bundles compiled before it,
    # which load their models from the source files
    weights = _inside(WEIGHTS)

    def graph(self, key, steps: str = "aoti", rank: int | None = None) -> Path:
        """The graph file of a buckets.GraphKey, for a bundle whose buckets run `steps` (rank:
        of that rank's graph set, for a tensor-parallel target)."""
        return self.graph_named(key.role, key.name, steps, rank)

    def graph_named(self, role: str, name: str, steps: str = "aoti", rank: int | None = None) -> Path:
        folder = self.root / GRAPHS if rank is None else self.rank_graphs(rank)
        return folder / role / f"{name}{GRAPH_SUFFIX[steps]}"

    def rank_graphs(self, rank: int) -> Path:
        """The folder of rank `rank`'s graph set (a tensor-parallel target's)."""
        return self.root / GRAPHS / f"{RANK_PREFIX}{rank}"

    def graph_set_ranks(self) -> list[int]:
        """The ranks whose graph sets this bundle holds (graphs/rank-K/ folders), in order."""
        folder = self.root / GRAPHS
        names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
        return sorted(int(n[len(RANK_PREFIX):]) for n in names
                      if n.startswith(RANK_PREFIX) and n[len(RANK_PREFIX):].isdigit())

    def exists(self) -> bool:
        return self.manifest.is_file()

    def occupant(self) -> str | None:
        """What is at this path that a new bundle must not replace, in words; None when writing
        a bundle here loses nothing: the path is free, an empty directory, or a bundle (a damaged
        one included, so that rebuilding repairs it) holding nothing but its own files."""
        root = self.root
        if root.is_symlink():
            return f"{root} is a symbolic link (to {os.readlink(root)}), not a yggdrasil bundle"
        if not root.exists():
            return None
        if not root.is_dir():
            what = f"a file of {root.stat().st_size} bytes" if root.is_file() else "not a directory"
            return f"{root} is {what}, not a yggdrasil bundle"
        if not any(root.iterdir()):
            return None  # an empty directory holds nothing to lose
        files = _files(root)
        if not self._is_bundle():
            return f"{root} is a directory with {_count(files, 'file')} that is not a yggdrasil bundle"
        foreign = [f for f in files if f not in self._own_files()]
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            return f"{root} is a yggdrasil bundle with {_count(foreign, 'file')} of something else in it ({shown})"
        return None

    def _manifest_raw(self) -> dict | None:
        try:
            raw = parse_yaml(self.manifest.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return None
        return raw if isinstance(raw, dict) else None

    def _is_bundle(self) -> bool:
        """A manifest naming a bundle schema, or (manifest damaged or gone) nothing but bundle
        names at the top, with the recipe and graphs every bundle has."""
        raw = self._manifest_raw()
        if raw is not None and str(raw.get("schema", "")).startswith(BUNDLE_SCHEMA_PREFIX):
            return True
        names = {p.name for p in self.root.iterdir()}
        return names <= BUNDLE_NAMES and {RECIPE, GRAPHS} <= names

    def _own_files(self) -> set[str]:
        """The files a bundle writes: its manifest's artifacts (all of them under a bundle
        name when the manifest cannot be read)."""
        raw = self._manifest_raw() or {}
        artifacts = raw.get("artifacts")
        if isinstance(artifacts, dict):
            return {MANIFEST, *map(str, artifacts)}
        return {f for f in _files(self.root) if f.split("/", 1)[0] in BUNDLE_NAMES}

    # reads ---------------------------------------------------------------------------------
    def read_selection(self) -> dict:
        """draft_widths, verify_widths, picked, dropped_draft_widths, dropped_verify_widths."""
        return _read(self.selection)

    def read_stage_plans(self) -> dict | None:
        return _read(self.stage_plans) if self.stage_plans.is_file() else None

    def read_profile(self) -> dict:
        return _read(self.profile)

    # writes (into a bundle being built) ----------------------------------------------------
    def write_selection(self, body: dict) -> None:
        _write(self.selection, body)

    def write_stage_plans(self, body: dict) -> None:
        _write(self.stage_plans, body)

    def write_profile(self, body: dict) -> None:
        _write(self.profile, body)

    def write_recipe(self, text: str) -> None:
        self.recipe.write_text(text)


def _files(root: Path) -> list[str]:
    """Paths (relative, '/'-separated) of everything under root that is not a directory, the
    first COUNT_LIMIT of them; symbolic links are listed, never followed."""
    found = []
    for folder, dirs, names in os.walk(root):  # links to directories are listed, not entered
        for name in names + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            found.append(Path(folder, name).relative_to(root).as_posix())
            if len(found) >= COUNT_LIMIT:
                return found
    return found


def _count(items: list, noun: str) -> str:
    more = "at least " if len(items) >= COUNT_LIMIT else ""
    return f"{more}{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _read(path: Path) -> dict:
    return parse_yaml(path.read_text())


def _write(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(body, sort_keys=False))
