"""KV compaction (issue 23): one gather/scatter over the stacked cache storage equals the eager
per-layer move, on random accepted paths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yggdrasil.config import ModelConfig
from yggdrasil.models.model import Transformer
from yggdrasil.runtime.steps import StepRunner

CFG = ModelConfig(arch="llama", vocab_size=32, dim=16, n_layers=3, n_heads=2, n_kv_heads=1,
                  head_dim=8, ffn_dim=32, norm_eps=1e-5, rope_theta=1e4, max_position=128)


def _runner(capacity: int = 48) -> StepRunner:
    model = Transformer(CFG)
    for param in model.parameters():
        param.data.normal_()
    return StepRunner(model, capacity, chunk_size=4)


def eager_move(buffers: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """The per-layer move the runtime made before (2 ops per buffer)."""
    for buffer in buffers:
        buffer[:, :, torch.tensor(dst, dtype=torch.long)] = buffer[:, :, torch.tensor(src, dtype=torch.long)]


@st.composite
def accepted_paths(draw):
    """A tree of `width` levels after the root at slot `base`; the accepted path's nodes sit at
    increasing tree slots and move to base + 1, base + 2, ..."""
    base = draw(st.integers(0, 20))
    width = draw(st.integers(1, 8))
    n = draw(st.integers(0, width))
    picks = sorted(draw(st.lists(st.integers(1, 3 * width), min_size=n, max_size=n, unique=True)))
    return base, width, [base + p for p in picks], [base + 1 + k for k in range(n)]


@settings(max_examples=60, deadline=None)
@given(accepted_paths(), st.integers(0, 10_000))
def test_one_op_compaction_equals_the_eager_per_layer_move(path, seed):
    base, width, src, dst = path
    runner = _runner()
    cache = runner.cache
    torch.manual_seed(seed)
    cache.storage.normal_()
    reference = [b.clone() for b in (*cache.keys, *cache.values)]
    eager_move(reference, src, dst)
    runner.move_slots(src, dst, width)
    for got, want in zip((*cache.keys, *cache.values), reference):
        assert torch.equal(got[:, :, :cache.scratch_slot], want[:, :, :cache.scratch_slot])


def test_layer_buffers_are_views_of_the_one_storage_the_forward_writes():
    runner = _runner()
    cache = runner.cache
    assert all(b.data_ptr() == cache.storage[i].data_ptr()
               for i, b in enumerate((*cache.keys, *cache.values)))
    runner.decode(5, 0)  # writes slot 0 of every layer through the per-layer buffers
    assert cache.storage[:, :, :, 0].abs().sum(-1).gt(0).all()
    assert cache.storage[:, :, :, 1:cache.scratch_slot].eq(0).all()
    runner.move_slots([0], [3], 2)
    assert torch.equal(cache.storage[:, :, :, 3], cache.storage[:, :, :, 0])
    assert cache.nbytes() == cache.storage.numel() * cache.storage.element_size()


@pytest.mark.parametrize("layout", ["replaced", "separate"])
def test_unstacked_caches_still_move_per_layer(layout):
    runner = _runner()
    cache = runner.cache
    assert cache.is_stacked
    if layout == "replaced":  # what module.to() would do: new tensors, storage left behind
        for i in range(CFG.n_layers):
            setattr(cache, f"k{i}", cache.keys[i].clone().normal_())
            setattr(cache, f"v{i}", cache.values[i].clone().normal_())
    else:  # torch.compile'd runners and bundles keep separate buffers
        cache = runner.cache = runner.model.setup_cache(1, cache.max_context, stacked=False)
        cache.k0.normal_()
    assert not cache.is_stacked
    reference = [b.clone() for b in (*cache.keys, *cache.values)]
    eager_move(reference, [4, 6], [2, 3])
    runner.move_slots([4, 6], [2, 3], 4)
    assert all(torch.equal(a, b) for a, b in zip((*cache.keys, *cache.values), reference))
