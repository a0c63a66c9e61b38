"""Property tests on TokenTree, the walk and KV compaction."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yggdrasil.config import ModelConfig
from yggdrasil.runtime.drafters import LookupDrafter, move_slots
from yggdrasil.host_reads import HostReads, pack, unpack
from yggdrasil.models.model import Transformer
from yggdrasil.host_reads import staged
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.runtime.tree import TokenTree, walk, walk_on_device


@st.composite
def random_trees(draw, max_nodes: int = 24):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 50)) for _ in range(n)]
    step_logp = [math.log(draw(st.floats(0.01, 1.0))) for _ in range(n)]
    return parents, tokens, step_logp


def build(parents, tokens, step_logp) -> TokenTree:
    tree = TokenTree.with_root(len(parents), tokens[0])
    for i in range(1, len(parents)):
        logp = float(tree.logp[parents[i]]) + step_logp[i]
        tree.add(torch.tensor([parents[i]]), torch.tensor([tokens[i]]), torch.tensor([logp]))
    return tree


def ancestors_of(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@given(random_trees(), st.integers(0, 30))
def test_mask_is_the_ancestor_relation_and_positions_are_prefix_plus_depth(spec, base):
    parents, *_ = spec
    tree = build(*spec)
    nodes = torch.arange(tree.size)
    span = base + tree.size + 3
    mask = tree.mask_for(nodes, nodes, base, span)
    for i in range(tree.size):
        assert mask[i, :base].all() and not mask[i, base + tree.size:].any()
        row = {j for j in range(tree.size) if mask[i, base + j]}
        assert row == ancestors_of(parents, i)
        assert int(tree.positions(nodes, base)[i]) == base + len(ancestors_of(parents, i)) - 1


@given(random_trees(), st.integers(1, 24))
def test_top_nodes_form_a_connected_subtree(spec, count):
    parents, *_ = spec
    tree = build(*spec)
    kept = tree.top_nodes(count).tolist()
    assert kept[0] == 0 and len(kept) == min(count, tree.size)
    assert all(parents[i] in kept for i in kept[1:])
    local = tree.local_parents(torch.tensor(kept)).tolist()
    assert all(kept[local[j]] == parents[kept[j]] for j in range(1, len(kept)))


@given(random_trees(), st.integers(1, 24))
def test_kept_nodes_sit_in_path_order_and_anything_else_is_refused(spec, count):
    """Issue 53: the verify puts kept[j] at slot base + j and the attention sums its denominator
    in slot order, so every kept node's path must run in increasing slots (as a decode meets it).
    top_nodes' order passes the assertion; the same nodes with a parent after its child do not."""
    parents, *_ = spec
    tree = build(*spec)
    kept = tree.top_nodes(count)
    tree.check_slot_order(kept)
    local = tree.local_parents(kept).tolist()
    for j in range(1, kept.numel()):  # each path's slots increase from the root down
        assert 0 <= local[j] < j
    deep = [j for j in range(1, kept.numel()) if local[j] > 0]
    if deep:  # move a child in front of its parent: refused
        j = deep[0]
        order = list(range(kept.numel()))
        order.insert(local[j], order.pop(j))
        try:
            tree.check_slot_order(kept[order])
        except AssertionError as exc:
            assert "out of path order" in str(exc)
        else:
            raise AssertionError("a child before its parent was not refused")


def test_a_verify_refuses_kept_nodes_out_of_path_order():
    from yggdrasil.runtime.steps import verify_inputs

    tree = TokenTree.from_lists([5, 6, 7], [-1, 0, 1], [0.0, -0.1, -0.2])
    runner = StepRunner(Transformer(ModelConfig("llama", 64, 32, 1, 2, 2, 16, 64, 1e-5, 1e4, 64)).eval(), 32, 4)
    verify_inputs(runner, tree, torch.tensor([0, 1, 2]), 3, 4)  # in path order: fine
    try:
        verify_inputs(runner, tree, torch.tensor([0, 2, 1]), 3, 4)
    except AssertionError as exc:
        assert "out of path order" in str(exc)
    else:
        raise AssertionError("a verify over nodes out of path order was not refused")


@given(random_trees(), st.data())
def test_walk_follows_matching_children(spec, data):
    parents, tokens, _ = spec
    tree = build(*spec)
    nodes = torch.arange(tree.size)
    choices = torch.tensor([data.draw(st.integers(0, 50)) for _ in range(tree.size)])
    result = walk(tree.tokens, tree.local_parents(nodes), choices)
    path = result.path
    for a, b in zip(path, path[1:]):
        assert parents[b] == a and tokens[b] == int(choices[a])
    last = path[-1]
    assert not any(parents[c] == last and tokens[c] == int(choices[last]) for c in range(tree.size))
    assert result.bonus == int(choices[last])


@given(random_trees(), st.data())
def test_device_walk_equals_host_walk(spec, data):
    """The device-accept stage plan's walk is the host walk (duplicate sibling tokens included)."""
    tree = build(*spec)
    kept = tree.top_nodes(data.draw(st.integers(1, tree.size)))
    # choices mostly hit the tree's tokens, so that walks go deep
    pool = tree.tokens[:tree.size].tolist() + [51]
    choices = torch.tensor([data.draw(st.sampled_from(pool)) for _ in range(kept.numel())])
    tokens, parents = tree.tokens[kept], tree.local_parents(kept)
    expected = walk(tokens, parents, choices)
    on_device, extra = walk_on_device(tokens, parents, tree.ancestors[kept][:, kept], choices)
    assert on_device == expected and extra == []


@given(random_trees())
def test_a_device_grown_tree_comes_to_the_host_whole_in_one_read(spec):
    tree = build(*spec)
    reads = HostReads()
    host = tree.to_host(reads)
    assert reads.count == 1 and host.size == host.capacity == tree.size and host.device.type == "cpu"
    n = tree.size
    for name in ("tokens", "parents", "depth", "logp"):
        assert torch.equal(getattr(host, name), getattr(tree, name)[:n]), name
    assert torch.equal(host.ancestors, tree.ancestors[:n, :n])
    assert torch.equal(host.top_nodes(n // 2 + 1), tree.top_nodes(n // 2 + 1))


def test_packed_reads_keep_dtypes_shapes_and_values():
    reads = HostReads()
    values = (torch.tensor([[3, 151_000], [7, -1]]), torch.tensor([0.1, -2.5e-8], dtype=torch.bfloat16),
              torch.tensor([True, False]), torch.randn(2, 3))
    assert reads.packed(*values)[0] is not values[0] and reads.count == 1
    # the CUDA path: packed in one float64 tensor on the device, copied once, split on the host
    for got, want in zip(unpack(pack(values), values), values):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_staged_inputs_are_views_of_one_copied_buffer():
    tokens, positions = torch.tensor([[5, 6, 7]]), torch.tensor([[9, 10, 11]])
    mask = torch.tensor([[[True, False, True, True, False]] * 3])  # 15 bytes: the next piece realigns
    index = torch.tensor([[2]])
    moved = staged((tokens, positions, mask, index), torch.device("meta"))
    assert [m.shape for m in moved] == [t.shape for t in (tokens, positions, mask, index)]
    assert [m.dtype for m in moved] == [t.dtype for t in (tokens, positions, mask, index)]
    assert len({m.untyped_storage().nbytes() for m in moved}) == 1  # one buffer


def _tiny_runner(capacity: int = 40) -> StepRunner:
    cfg = ModelConfig(arch="llama", vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      head_dim=8, ffn_dim=32, norm_eps=1e-5, rope_theta=1e4, max_position=128)
    return StepRunner(Transformer(cfg), capacity, chunk_size=4)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_compaction_moves_exactly_the_accepted_kv(data):
    runner = _tiny_runner()
    cache = runner.cache
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    for buffer in cache.buffers():
        buffer.normal_()
    base = data.draw(st.integers(0, 10))
    width = data.draw(st.integers(1, 6))
    # an accepted path: strictly increasing tree slots after the root
    n_moves = data.draw(st.integers(0, width))
    picks = sorted(data.draw(st.lists(st.integers(1, 20), min_size=n_moves, max_size=n_moves, unique=True)))
    src = [base + p for p in picks]
    dst = [base + 1 + k for k in range(n_moves)]
    before_k, before_v = cache.stacked()
    move_slots(runner, src, dst, width)
    after_k, after_v = cache.stacked()
    for s, d in zip(src, dst):
        assert torch.equal(after_k[:, :, :, d], before_k[:, :, :, s])
        assert torch.equal(after_v[:, :, :, d], before_v[:, :, :, s])
    untouched = [i for i in range(cache.capacity - 1) if i not in dst]
    assert torch.equal(after_k[:, :, :, untouched], before_k[:, :, :, untouched])


def _lookup_tree_node_by_node(drafter: LookupDrafter, history, depth, width) -> TokenTree:
    """The lookup trie as it was built before host trees (node by node with tensor ops)."""
    tree = TokenTree.with_root(1 + depth * width, history[-1])
    index = {}
    for follow, step_logp in drafter.continuations(history, depth, width):
        node = 0
        for token in follow:
            child = index.get((node, token))
            if child is None:
                logp = float(tree.logp[node]) + step_logp
                child = int(tree.add(torch.tensor([node]), torch.tensor([token]), torch.tensor([logp]))[0])
                index[(node, token)] = child
            node = child
    return tree


@given(st.lists(st.integers(0, 5), min_size=2, max_size=60), st.integers(1, 5), st.integers(1, 4))
def test_lookup_trees_built_from_lists_equal_the_node_by_node_build(history, depth, width):
    drafter = LookupDrafter(depth, width)
    old, new = _lookup_tree_node_by_node(drafter, history, depth, width), drafter.build_shaped(history, depth, width)
    n = old.size
    assert new.size == n
    for name in ("tokens", "parents", "depth", "logp"):
        assert torch.equal(getattr(old, name)[:n], getattr(new, name)), name
    assert torch.equal(old.ancestors[:n, :n], new.ancestors)
