import sys
from pathlib import Path

import pytest
import torch

# tests import their shared helpers module directly
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """torch's intra-op thread count as each test found it: a test that changes it (rank 0 of a
    split model runs in the test's process with its ranks' count; a recipe's `threads`) must not
    hand it on, or a bundle a later test compiles records that count and a default run refuses it."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory):
    """The tiny recipe compiled once per session: (recipe path, bundle directory). Tests that
    break a bundle copy it first; tests that edit a model file put it back.

    Its step times are a fixed CPU-like profile (cheap drafting, verify cost growing with rows)
    instead of this machine's measurements, so whether speculation pays, and so what the bundle
    and the suites over it do, is the same on every machine: timing belongs to bench/. Its graphs'
    forward times (what prefill pieces are chosen by) are fixed likewise."""
    from helpers import tiny_piece_seconds, tiny_profile, write_tiny_recipe_dir

    import yggdrasil.runtime.latency as latency
    import yggdrasil.runtime.prefill_plan as prefill_plan
    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe

    profile = tiny_profile()
    root = tmp_path_factory.mktemp("tiny-bundle")
    recipe_path = write_tiny_recipe_dir(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(latency, "measure_profile", lambda *args, **kwargs: profile)
        patch.setattr(prefill_plan, "measure_piece_seconds", tiny_piece_seconds)
        result = build_bundle(load_recipe(recipe_path), root / "bundle")
    assert not result.reused
    return recipe_path, root / "bundle"
