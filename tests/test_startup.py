"""Start-up (issue 50): a bundle run imports only what running a bundle needs. Measured with
`python -X importtime` first: the CLI imported the bench layer for its parser, and the first
speculative step imported sympy through torch.unravel_index (0.7 s); neither does now."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# what a bundle run must never import: heavy optional dependencies, and the layers above the runtime
FORBIDDEN = ("transformers", "matplotlib", "fastapi", "uvicorn", "starlette", "sympy", "networkx",
             "yggdrasil.compile", "yggdrasil.bench", "yggdrasil.predictor", "yggdrasil.planner",
             "torch._inductor", "torch._dynamo")
RUN = """
import json, sys
from yggdrasil.cli import main
status = main(sys.argv[1:])
print(json.dumps({"status": status, "modules": sorted(sys.modules)}))
"""


@pytest.mark.slow
def test_a_bundle_run_imports_none_of_the_heavy_or_higher_layers(tiny_bundle):
    _, bundle = tiny_bundle
    done = subprocess.run([sys.executable, "-c", RUN, "generate", "--bundle", str(bundle), "--prompt", "alpha beta",
                           "--max-new-tokens", "6"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == 0
    imported = [m for m in report["modules"] if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not imported, imported


def test_only_the_bench_command_builds_the_suite_parsers():
    done = subprocess.run([sys.executable, "-c", "import sys\nfrom yggdrasil.cli import build_parser\n"
                           "build_parser('generate')\nprint(any(m.startswith('yggdrasil.bench') for m in sys.modules))"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
