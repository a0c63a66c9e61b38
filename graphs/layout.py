"""Where everything lives inside a bundle directory, in one place: every writer (compile) and
every reader (open_bundle, inspect, plan, bench) goes through a BundleLayout, so no other module
spells a bundle file name.

    manifest.yaml     schema, recipe, models, environment, artifacts with sha256 (manifest.py)
    selection.yaml    the buckets compile kept: draft and verify widths, what was picked/dropped
    stage_plans.yaml  each bucket's stage plan (ahead-of-time drafts, overlap), when planned
    profile.yaml      step times measured on the compiled graphs
    recipe.yaml       the recipe it was built from, verbatim
    calibration/      calibration run, depth predictor and its report
    graphs/ROLE/NAME.pt2  one AOTInductor package per graph (buckets.GraphKey.path)
"""

from __future__ import annotations

from pathlib import Path

import yaml

MANIFEST = "manifest.yaml"
SELECTION = "selection.yaml"
STAGE_PLANS = "stage_plans.yaml"
PROFILE = "profile.yaml"
RECIPE = "recipe.yaml"
CALIBRATION = "calibration"
PREDICTOR_SUMMARY = "predictor.yaml"  # inside calibration/


class BundleLayout:
    """Typed paths, reads and writes of one bundle directory (or of the directory a bundle is
    being written into)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # paths ---------------------------------------------------------------------------------
    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def selection(self) -> Path:
        return self.root / SELECTION

    @property
    def stage_plans(self) -> Path:
        return self.root / STAGE_PLANS

    @property
    def profile(self) -> Path:
        return self.root / PROFILE

    @property
    def recipe(self) -> Path:
        return self.root / RECIPE

    @property
    def calibration(self) -> Path:
        return self.root / CALIBRATION

    def graph(self, key) -> Path:
        """The package of a buckets.GraphKey (or anything with its .path)."""
        return self.root / key.path

    def graph_named(self, role: str, name: str) -> Path:
        return self.root / "graphs" / role / f"{name}.pt2"

    def exists(self) -> bool:
        return self.manifest.is_file()

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


def _read(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _write(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(body, sort_keys=False))
