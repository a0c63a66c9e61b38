"""The small bench tools of the q4 work: bench/invariance_cost.py toggles a q4 model between the
fixed-order ops and torch's own and back; bench/portable.py names its bundles; the step timer
runs decode and verify steps."""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import needs_kernels
from helpers import save_random_hf_model

from yggdrasil.bench import invariance_cost, portable
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.models.quant import apply_weight_format
from yggdrasil.runtime.steps import StepRunner



@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-tools") / "m"
    save_random_hf_model(path, "qwen2")
    model = load_hf_model(path, torch.float32)
    apply_weight_format(model, "q4")
    return model


def _logits(model, ids):
    runner = StepRunner(model, 64, chunk_sizes=(8,))
    with torch.inference_mode():
        return runner.prefill(ids).float()


@needs_kernels
def test_the_cost_bench_switches_the_ops_and_back_exactly(q4_model):
    ids = [5, 17, 99, 3, 42, 7, 11]
    assert q4_model.batch_invariant
    tables = (q4_model.rope_cos, q4_model.rope_sin)
    invariant = _logits(q4_model, ids)
    invariance_cost.set_invariant(q4_model, False, tables)
    assert not q4_model.batch_invariant and q4_model.rope_cos is None
    torch_ops = _logits(q4_model, ids)
    invariance_cost.set_invariant(q4_model, True, tables)
    assert q4_model.batch_invariant and q4_model.rope_cos is tables[0]
    assert torch.equal(_logits(q4_model, ids), invariant)  # back exactly
    assert not torch.equal(torch_ops, invariant)  # the toggle really changed the ops
    torch.testing.assert_close(torch_ops, invariant, atol=1e-2, rtol=1e-3)  # the same model, other rounding


@needs_kernels
@pytest.mark.parametrize("width", [1, 4])
def test_the_step_timer_runs_decode_and_verify_steps(q4_model, width):
    runner = StepRunner(q4_model, 64, chunk_sizes=(8,))
    seconds = invariance_cost.step_seconds(runner, list(range(20, 20 + 12 + width)), width, steps=2)
    assert 0 < seconds < 10


def test_the_portable_bench_names_its_bundles():
    assert portable._named("avx2=/tmp/b") == ("avx2", portable.Path("/tmp/b"))
    with pytest.raises(SystemExit, match="NAME=DIR"):
        portable._named("/tmp/b")


def test_the_kernels_table_labels_llama_bench_rows_as_llama_bench():
    """llama.cpp's curve is llama-bench's batched prompt path: its row must not read "step (AOTI)"."""
    from yggdrasil.bench.kernels import ROWS, table

    times = {n: [float(n), float(n)] for n in ROWS}
    curves = {"m": {"q4": {"weight_bytes": 1e6, "linears": {}, "step": times},
                    "llama.cpp": {"weight_bytes": 1e6, "linears": {}, "step": times}}}
    lines = table(curves).splitlines()
    assert any(line.startswith("q4") and "step (AOTI)" in line for line in lines)
    llama = [line for line in lines if line.startswith("llama.cpp")]
    assert len(llama) == 1 and "llama-bench -p n" in llama[0] and "AOTI" not in llama[0]
