"""The host fast paths of a speculative iteration (issue 51, item 5) agree with their references:
the Equal-Growth tree grown in numpy with the device path's tree (bit for bit), the list
prune and walk helpers with the tensor ones, the numpy argmax with torch's, the numpy-built
step inputs with the tensor formulas they replaced."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import save_random_hf_model
from yggdrasil.host_reads import HostReads
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.runtime.steps import StepRunner, verify_inputs
from yggdrasil.runtime.tree import TokenTree
from yggdrasil.sampling import argmax


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    save_random_hf_model(path, "qwen2", seed=12, num_hidden_layers=1)
    return load_hf_model(path, torch.float32)


def _builds(model, depth: int, width: int, widths: tuple[int, ...], shapes, steps: int = 6):
    """Trees of a drafter over a deterministic history: after each build the first child chain
    is accepted (its tokens plus a bonus token committed), so equal trees mean equal histories."""
    drafter = ModelDrafter(StepRunner(model, 256, 8), depth, width, widths)
    history = list(range(3, 20))
    drafter.start(history)
    history.append(21)  # the prefill's token: the first root
    out = []
    for step in range(steps):
        d, w = shapes[step % len(shapes)]
        tree = drafter.build_shaped(history, d, w)
        pool = drafter.last_pool
        out.append((tree, sorted(drafter._fed), {n: pool.children_of(n) for n in range(tree.size)}))
        nodes, path = tree.nodes(), [0]
        while (kids := [j for j in range(1, tree.size) if nodes.parents[j] == path[-1]]) and len(path) <= step % 3:
            path.append(kids[0])
        drafter.commit(path[1:])
        history += [nodes.tokens[j] for j in path[1:]] + [(step * 7) % 50]
    return out


@pytest.mark.parametrize("depth, width, widths, shapes", [(4, 1, (), [(4, 1)]), (3, 2, (1, 2), [(3, 2), (2, 1), (1, 2)]),
                                                         (3, 3, (), [(3, 3)])])
def test_host_growth_builds_the_device_paths_trees(draft_model, monkeypatch, depth, width, widths, shapes):
    host = _builds(draft_model, depth, width, widths, shapes)
    with monkeypatch.context() as patch:
        patch.setattr(HostReads, "on_host", False)  # the device path, run on the CPU
        device = _builds(draft_model, depth, width, widths, shapes)
    for (got, got_fed, got_children), (want, want_fed, want_children) in zip(host, device):
        assert got.size == got.capacity == want.size
        for name in ("tokens", "parents", "depth", "logp", "ancestors"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert got_fed == want_fed and got_children == want_children


def _reference_verify_inputs(runner, tree, kept: torch.Tensor, base: int, width: int):
    """verify_inputs as tensor ops (the formulas before the numpy build)."""
    v, span = kept.numel(), runner.span(base + width)
    tokens, positions = torch.zeros(width, dtype=torch.long), torch.zeros(width, dtype=torch.long)
    slots, mask = torch.full((width,), runner.cache.scratch_slot), torch.zeros(width, span, dtype=torch.bool)
    tokens[:v], positions[:v], slots[:v] = tree.tokens[kept], tree.positions(kept, base), base + torch.arange(v)
    mask[:v] = tree.mask_for(kept, kept, base, span)
    mask[v:, base] = True
    return tokens[None], positions[None], slots[None], mask[None]


@st.composite
def trees(draw, max_nodes: int = 20):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 50)) for _ in range(n)]
    # few distinct step scores and some -inf: exact ties happen, and the fallback must hold them
    steps = [draw(st.sampled_from([math.log(0.5), math.log(0.25), -1.0, float("-inf")])) for _ in range(n)]
    logp = [0.0]
    for i in range(1, n):
        logp.append(float(np.float32(logp[parents[i]] + steps[i])))
    return TokenTree.from_lists(tokens, parents, logp)


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(1, 24), st.integers(0, 40), st.integers(0, 4))
def test_list_prune_and_verify_inputs_equal_the_tensor_ones(tree, count, base, pad):
    kept = tree.top_list(count)
    assert kept == tree.top_nodes(count).tolist()
    index = torch.tensor(kept)
    assert tree.local_parent_list(kept) == tree.local_parents(index).tolist()
    if any(p < 0 for p in tree.local_parent_list(kept)[1:]):
        return  # -inf ties can keep a node without its parent: no verify runs such a set
    runner = StepRunner(_tiny_model(), 128, 4)
    width = len(kept) + pad
    got = verify_inputs(runner, tree, kept, base, width)
    want = _reference_verify_inputs(runner, tree, index, base, width)
    for name, value in zip(("tokens", "positions", "slots", "mask"), want):
        assert torch.equal(getattr(got, name), value), name


def _tiny_model():
    from yggdrasil.config import ModelConfig
    from yggdrasil.models.model import Transformer

    return Transformer(ModelConfig("llama", 64, 32, 1, 2, 2, 16, 64, 1e-5, 1e4, 64)).eval()


def test_head_inputs_equal_the_tensor_formulas(draft_model):
    drafter = ModelDrafter(StepRunner(draft_model, 256, 8), 3, 2, (1, 2))
    runner = drafter.runner
    for pending, base in (([5], 10), ([5, 6], 10), ([7, 8], 2)):
        got = drafter._head_inputs(pending, base)
        n, size = len(pending), got.tokens.shape[1]
        real = torch.arange(size) < n
        positions = torch.where(real, torch.arange(base - n + 1, base - n + 1 + size), 0)
        slots = torch.where(real, positions, runner.cache.scratch_slot)
        tokens = torch.zeros(size, dtype=torch.long)
        tokens[:n] = torch.tensor(pending)
        slot_ids = torch.arange(runner.span(base + drafter.capacity))
        mask = torch.where(real[:, None], slot_ids[None, :] <= positions[:, None], (slot_ids == base - n + 1)[None, :])
        for name, value in zip(("tokens", "positions", "slots", "mask"), (tokens, positions, slots, mask)):
            assert torch.equal(getattr(got, name), value[None]), name


def test_host_argmax_is_torch_argmax_ties_nans_and_infinities_included():
    logits = torch.randn(5, 3000)
    logits[1, [7, 2999]] = 50.0  # a tie: the first wins
    logits[2, [11, 900]] = float("nan")  # NaN counts as the maximum, the first one
    logits[3] = float("-inf")
    logits[4, [4, 5]] = float("inf")
    for rows in (logits, logits[:, 1000:], logits.double()):
        got = argmax(rows, HostReads(on_host=True))
        assert got.dtype == torch.long and torch.equal(got, rows.argmax(-1))
    assert torch.equal(argmax(logits, HostReads()), logits.argmax(-1))  # the device path: torch's
    for reads in (HostReads(on_host=True), HostReads()):  # a forward's [1, N, vocab], its first rows
        assert torch.equal(argmax(logits[None], reads, 3), logits[:3].argmax(-1))


@pytest.mark.parametrize("rows", ["random", "tied"])
def test_host_pool_takes_what_the_device_pool_takes(rows):
    """Candidates, order and float32 scores as _CandidatePool's, also where scores tie (then
    torch.topk's own pick decides, in both)."""
    from yggdrasil.runtime.drafters import _CandidatePool
    from yggdrasil.runtime.host_growth import HostCandidatePool

    torch.manual_seed(0)
    width, depth = 3, 3
    make = (lambda n: torch.randn(n, 40)) if rows == "random" else (lambda n: torch.zeros(n, 40))
    token_ids = torch.arange(100, 140)
    device, host = _CandidatePool(width, depth, token_ids=token_ids), HostCandidatePool(width, token_ids.tolist())
    parents, logp = torch.tensor([0]), torch.tensor([0.0])
    for _ in range(depth):
        logits = make(parents.numel())
        device.extend(parents, logp, logits)
        host.extend(parents.tolist(), logp.tolist(), logits)
        want = device.take(width)
        got = host.take(width)
        assert [g[0] for g in got] == want[0].tolist() and [g[1] for g in got] == want[1].tolist()
        assert torch.equal(torch.tensor([g[2] for g in got], dtype=torch.float32), want[2])
        parents, logp = torch.arange(width) + parents.max() + 1, want[2]
    assert torch.equal(torch.from_numpy(host.parents), device.parents[:device.used])
    assert all(host.children_of(n) == device.children_of(n) for n in range(8))


def test_slot_copies_keep_the_gather_scatter_semantics_when_a_move_reads_a_written_slot():
    runner = StepRunner(_tiny_model(), 32, 4)
    storage = runner.cache.storage
    storage.normal_()
    before = storage.clone()
    runner.move_slots([5, 3], [3, 4], 2)  # the second move reads slot 3, which the first writes
    assert torch.equal(storage[:, :, :, 3], before[:, :, :, 5]) and torch.equal(storage[:, :, :, 4], before[:, :, :, 3])
    runner.move_slots([9], [7], 2)  # one move: a slot copy
    assert torch.equal(storage[:, :, :, 7], before[:, :, :, 9])
