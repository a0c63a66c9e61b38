"""Build the tests' tiny pair bundle with the code at sys.path[0] and print greedy speculative tokens."""
import json, sys
from pathlib import Path
root, out = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(root / "tests"))
import torch
from helpers import tiny_profile, write_tiny_recipe_dir
try:  # the code before the re-layering first (the editable finder would lend it the new modules)
    import yggdrasil.latency as latency
    from yggdrasil.bundle import policy_from_calibration
    from yggdrasil.latency import LatencyProfile
    from yggdrasil.speculator import build_speculator
    from yggdrasil.generate import greedy_tokens
except ImportError:
    import yggdrasil.runtime.latency as latency
    from yggdrasil.policy.auto import policy_from_calibration
    from yggdrasil.runtime.latency import LatencyProfile
    from yggdrasil.runtime.speculator import build_speculator
    from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.bundle import open_bundle
from yggdrasil.sampling import SamplingParams
latency.measure_profile = lambda *a, **k: tiny_profile()
out.mkdir(parents=True, exist_ok=True)
recipe = write_tiny_recipe_dir(out)
build_bundle(load_recipe(recipe), out / "bundle", log=lambda *a: None)
rt = open_bundle(out / "bundle").generator()
grid = rt.policy.grid
always = policy_from_calibration(rt.path / "calibration", grid.widths, grid.verifies,
                                 LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0),)),
                                 rt.target.model.config.dim, rt.manifest.models["target"]["sha256"])
results = {}
for name, policy in (("shipped", rt.policy), ("always", always)):
    spec = build_speculator(rt.runner, policy=policy, draft_runner=rt.draft_runner, plans=rt.plans)
    for seed in range(6):
        ids = torch.randint(0, 200, (5 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        results[f"{name}/{seed}"] = spec.generate(ids, 40, SamplingParams(temperature=0.0)).tokens
        results[f"plain/{seed}"] = greedy_tokens(rt.runner, ids, 40)
print(json.dumps(results))
