"""yggdrasil.kernels: the batch-invariant float32 ops rms_norm and attention.

Tolerance against reference.py: none. The references spell out the kernels' fixed arithmetic order
in float32 PyTorch ops, so op == reference bit for bit (torch.equal) on every ISA path. Against
torch's own F.rms_norm / F.scaled_dot_product_attention, which sum in other orders: 1e-5 absolute
plus 1e-5 relative (rms_norm: a few ulp; attention: ~1e-6 on unit-scale values).
Batch invariance is checked bit for bit: a row's output must not depend on the call's other rows,
its position among them, the padded span (extra masked keys), or the number of threads.
The library builds once per source version (a minute on 2 cores); the module fixture pays that once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
import torch
import torch.nn.functional as F

import yggdrasil.kernels as K
from kernel_fixtures import built, isa  # noqa: F401 (pytest fixtures)

EPS = 1e-5
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("shape", [(3, 576), (2, 5, 64), (1, 1, 1536), (4, 7), (6, 33), (2, 1), (17, 2, 48)])
def test_rms_norm_equals_reference_bit_for_bit(isa, shape):
    g = _gen(shape[-1])
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    out = K.rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(out, K.rms_norm_reference(x, w, EPS)), (isa, shape)
    torch.testing.assert_close(out, F.rms_norm(x, (shape[-1],), w, EPS), **TOL)
    model = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))  # yggdrasil/models/model.py's RMSNorm
    torch.testing.assert_close(out, model, **TOL)


def test_rms_norm_takes_non_contiguous_rows(isa):
    x = torch.randn(576, 8, generator=_gen(1)).t()  # [8, 576], last dim strided
    w = torch.randn(576, generator=_gen(2))
    assert torch.equal(K.rms_norm(x, w, EPS), K.rms_norm_reference(x.contiguous(), w, EPS))


def test_rms_norm_rows_are_batch_invariant(isa, threads):
    x, w = torch.randn(300, 576, generator=_gen(3)), torch.randn(576, generator=_gen(4))
    alone = torch.cat([K.rms_norm(x[i:i + 1], w, EPS) for i in range(x.shape[0])])
    for rows in range(1, 65):
        assert torch.equal(K.rms_norm(x[:rows], w, EPS), alone[:rows]), (isa, rows)
    for n in (1, 2):  # 300 rows: split over 2 threads at 2, one chunk at 1
        torch.set_num_threads(n)
        assert torch.equal(K.rms_norm(x, w, EPS), alone)
        assert torch.equal(K.rms_norm(x.flip(0), w, EPS), alone.flip(0))


# ------------------------------------------------------------------------------------ attention

def _cache(batch: int, kv_heads: int, capacity: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(batch, kv_heads, capacity, dim, generator=g), torch.randn(batch, kv_heads, capacity, dim,
                                                                                   generator=g)


def _queries(batch: int, rows: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    """[B, H, T, D] as the model makes it: a transposed view of [B, T, H, D]."""
    return torch.randn(batch, rows, heads, dim, generator=_gen(seed)).transpose(1, 2)


def _tree_mask(rows: int, context: int, span: int, seed: int) -> torch.Tensor:
    """[1, 1, T, S]: every row sees the context 0..context-1 and its ancestors (and itself) among
    the T new tokens at slots context..context+T-1 (row 0 the root, a random tree); slots past
    them are span padding, masked for all."""
    g = _gen(seed)
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, rows)]
    mask = torch.zeros(rows, span, dtype=torch.bool)
    mask[:, :context] = True
    for t in range(rows):
        node = t
        while node >= 0:
            mask[t, context + node] = True
            node = parent[node]
    return mask[None, None]


def _causal_mask(rows: int, context: int, span: int) -> torch.Tensor:
    return (torch.arange(span)[None, :] < context + 1 + torch.arange(rows)[:, None])[None, None]


def _check_attention(q, k, v, mask, scale, garbage_from: int | None = None):
    """op == reference bit for bit, and close to SDPA (computed with finite values in the masked
    slots: SDPA would turn NaN garbage into NaN)."""
    out = K.attention(q, k, v, mask, scale)
    assert out.shape == q.shape and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(out, K.attention_reference(q, k, v, mask, scale))
    if garbage_from is not None:
        k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    torch.testing.assert_close(out, sdpa, **TOL)
    return out


@pytest.mark.parametrize("heads,kv_heads,dim,rows,context", [
    (9, 3, 64, 1, 37),      # SmolLM2 decode
    (9, 3, 64, 16, 100),    # SmolLM2 verify
    (12, 2, 128, 5, 70),    # Qwen2.5-1.5B
    (4, 4, 32, 7, 20),      # no GQA, odd sizes
    (6, 2, 80, 3, 50),      # 5 lane chunks per row
    (2, 1, 16, 64, 0),      # prefill from empty: causal only
    (2, 2, 256, 2, 33),     # the largest head dim
])
def test_attention_equals_reference_bit_for_bit(isa, heads, kv_heads, dim, rows, context):
    span = (context + rows + 63) // 64 * 64  # padded, as the model pads spans
    k_cache, v_cache = _cache(1, kv_heads, span + 40, dim, seed=dim + rows)
    k_cache[:, :, context + rows:] = float("nan")  # never-written slots: must never be read into a row
    v_cache[:, :, context + rows:] = float("nan")
    q = _queries(1, rows, heads, dim, seed=rows)
    k, v = k_cache[:, :, :span], v_cache[:, :, :span]  # views of the cache, not copies
    for mask in (_tree_mask(rows, context, span, seed=rows), _causal_mask(rows, context, span)):
        out = _check_attention(q, k, v, mask, dim ** -0.5, garbage_from=context + rows)
        assert torch.isfinite(out).all()


def test_attention_batches_broadcast_masks_and_strided_operands(isa):
    k_cache, v_cache = _cache(2, 2, 90, 64, seed=5)
    q = _queries(2, 6, 4, 64, seed=6)
    mask = torch.rand(2, 1, 6, 90, generator=_gen(7)) > 0.4
    mask[..., 3] = True
    # S = 75: a partial last key block; masks as views, broadcast over the batch or the rows
    for m in (mask[..., :75], mask[:1, :, :, :75], mask[:, :, :1, :75]):
        _check_attention(q, k_cache[:, :, :75], v_cache[:, :, :75], m, 0.1)
    kt = k_cache.transpose(2, 3).contiguous().transpose(2, 3)  # last dim strided: copied, same result
    _check_attention(q, kt[:, :, :75], v_cache[:, :, :75], mask[..., :75], 0.1)


def test_attention_rows_that_attend_nothing_are_zero(isa):
    k, v = _cache(1, 1, 20, 32, seed=8)
    q = _queries(1, 3, 2, 32, seed=9)
    mask = torch.ones(1, 1, 3, 20, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = K.attention(q, k, v, mask, 0.2)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 32)) and out[:, :, 0].abs().sum() > 0
    assert torch.equal(out, K.attention_reference(q, k, v, mask, 0.2))
    empty = K.attention(q, k[:, :, :0], v[:, :, :0], mask[..., :0], 0.2)
    assert torch.equal(empty, torch.zeros(1, 2, 3, 32))
    assert K.attention(q[:, :, :0], k, v, mask[:, :, :0], 0.2).shape == (1, 2, 0, 32)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (12, 2, 128)])
def test_attention_rows_are_batch_invariant(isa, threads, heads, kv_heads, dim):
    """Row t of a T-row call == row t alone (T = 1), for T = 1..64, at another position, in another
    batch element, at another padded span, and at 1 or 2 threads."""
    context, rows = 90, 64
    k_cache, v_cache = _cache(1, kv_heads, 320, dim, seed=dim)
    q = _queries(1, rows, heads, dim, seed=11)
    mask = _tree_mask(rows, context, 192, seed=12)
    k, v = k_cache[:, :, :192], v_cache[:, :, :192]
    alone = torch.cat([K.attention(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], 0.125) for t in range(rows)], 2)
    for t in range(1, rows + 1):
        assert torch.equal(K.attention(q[:, :, :t], k, v, mask[:, :, :t], 0.125), alone[:, :, :t]), (isa, t)
    flipped = K.attention(q.flip(2), k, v, mask.flip(2), 0.125)
    assert torch.equal(flipped, alone.flip(2))
    wider = torch.cat([mask, torch.zeros(1, 1, rows, 128, dtype=torch.bool)], -1)  # span 320: more padding
    assert torch.equal(K.attention(q, k_cache, v_cache, wider, 0.125), alone)
    exact = K.attention(q[:, :, :1], k[:, :, :context + 1], v[:, :, :context + 1], mask[:, :, :1, :context + 1], 0.125)
    assert torch.equal(exact, alone[:, :, :1])  # span = the context exactly (a partial key block)
    pair = K.attention(torch.cat([q.flip(2), q]), torch.cat([k, k]), torch.cat([v, v]),
                       torch.cat([mask.flip(2), mask]), 0.125)
    assert torch.equal(pair[1:], alone)
    for n in (1, 2):
        torch.set_num_threads(n)
        assert torch.equal(K.attention(q, k, v, mask, 0.125), alone), n
        assert torch.equal(K.attention(q[:, :, :1], k, v, mask[:, :, :1], 0.125), alone[:, :, :1]), n


def test_a_row_is_the_same_wherever_its_keys_sit(isa):
    """A decode reads a path's keys at consecutive slots; a tree verify reads the same keys at the
    slots of their tree nodes, with siblings' slots (masked) between them. The row must not
    change: the softmax denominator may not depend on a key's slot (say, its lane, slot mod 16)."""
    heads, kv_heads, dim, context, path = 12, 2, 128, 70, 9
    k_cache, v_cache = _cache(1, kv_heads, context + 64, dim, seed=21)
    q = _queries(1, 1, heads, dim, seed=22)
    scattered = [context + 3 * j + j // 2 for j in range(path)]  # gaps of 2 or 3 slots, not a multiple of 16
    k_tree, v_tree = k_cache.clone(), v_cache.clone()
    k_tree[:, :, scattered] = k_cache[:, :, context:context + path]
    v_tree[:, :, scattered] = v_cache[:, :, context:context + path]
    span = context + 64
    contiguous = torch.zeros(1, 1, 1, span, dtype=torch.bool)
    contiguous[..., :context + path] = True
    tree = torch.zeros(1, 1, 1, span, dtype=torch.bool)
    tree[..., :context] = True
    tree[..., scattered] = True
    decode = K.attention(q, k_cache, v_cache, contiguous, dim ** -0.5)
    assert torch.equal(K.attention(q, k_tree, v_tree, tree, dim ** -0.5), decode)
    assert torch.equal(K.attention_reference(q, k_tree, v_tree, tree, dim ** -0.5), decode)


# ------------------------------------------------------------------------------------ refusals

def test_shapes_and_dtypes_the_ops_cannot_take_are_refused(built):
    x, w = torch.randn(2, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="x must be Float, got Double"):
        K.rms_norm(x.double(), w, EPS)
    with pytest.raises(RuntimeError, match="weight must be Float, got BFloat16"):
        K.rms_norm(x, w.bfloat16(), EPS)
    with pytest.raises(RuntimeError, match=r"weight has shape \[32\]; expected \[64\]"):
        K.rms_norm(x, w[:32], EPS)
    with pytest.raises(RuntimeError, match="0-d"):
        K.rms_norm(torch.tensor(1.0), w[:1], EPS)
    q, (k, v) = _queries(1, 2, 4, 64, seed=1), _cache(1, 2, 8, 64, seed=2)
    mask = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    attention = torch.ops.yggdrasil.attention
    with pytest.raises(RuntimeError, match="head dim 72 is not supported.*multiples of 16 from 16 to 256"):
        attention(torch.randn(1, 4, 2, 72), torch.randn(1, 2, 8, 72), torch.randn(1, 2, 8, 72), mask, 0.1)
    with pytest.raises(RuntimeError, match="head dim 272 is not supported"):
        attention(torch.randn(1, 2, 2, 272), torch.randn(1, 2, 8, 272), torch.randn(1, 2, 8, 272), mask, 0.1)
    with pytest.raises(RuntimeError, match="4 heads, not a multiple of k's 3 kv heads"):
        attention(q, torch.randn(1, 3, 8, 64), torch.randn(1, 3, 8, 64), mask, 0.1)
    with pytest.raises(RuntimeError, match="mask must be Bool, got Float"):
        attention(q, k, v, mask.float(), 0.1)
    with pytest.raises(RuntimeError, match=r"mask has shape \[1, 1, 2, 7\]; expected \[B, 1, T, S\] = \[1, 1, 2, 8\]"):
        attention(q, k, v, mask[..., :7], 0.1)
    with pytest.raises(RuntimeError, match="must both be"):
        attention(q, k, v[:, :, :7], mask, 0.1)
    with pytest.raises(RuntimeError, match="must be 4-d"):
        attention(q[0], k, v, mask, 0.1)
    with pytest.raises(RuntimeError, match="q must be Float, got Half"):
        attention(q.half(), k, v, mask, 0.1)


# ----------------------------------------------------------------------- export and AOTInductor

class _Tiny(torch.nn.Module):
    """What a layer does with the ops: norm the input, attend a cache prefix the mask's width long."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(64, generator=_gen(20)))
        k, v = _cache(1, 2, 192, 64, seed=21)
        self.register_buffer("k_cache", k)
        self.register_buffer("v_cache", v)

    def forward(self, x, q, mask):
        span = mask.shape[-1]
        h = torch.ops.yggdrasil.rms_norm(x, self.w, 1e-5)
        o = torch.ops.yggdrasil.attention(q.transpose(1, 2), self.k_cache[:, :, :span], self.v_cache[:, :, :span],
                                          mask, 0.125)
        return h, o


def _tiny_inputs(rows: int, span: int):
    x = torch.randn(1, rows, 64, generator=_gen(rows))
    q = torch.randn(1, rows, 4, 64, generator=_gen(rows + 1))
    return x, q, _causal_mask(rows, span - rows, span)


def _export(model):
    rows, span = torch.export.Dim("rows", min=1, max=64), torch.export.Dim("span", min=2, max=128)
    return torch.export.export(model, _tiny_inputs(5, 64),
                               dynamic_shapes=({1: rows}, {1: rows}, {2: rows, 3: span}))


def test_torch_export_traces_the_ops(built):
    model = _Tiny()
    ep = _export(model)
    targets = {str(n.target) for n in ep.graph.nodes}
    assert {"yggdrasil.rms_norm.default", "yggdrasil.attention.default"} <= targets
    for rows, span in ((5, 64), (1, 40)):
        ours, eager = ep.module()(*_tiny_inputs(rows, span)), model(*_tiny_inputs(rows, span))
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))


def test_aoti_package_calls_the_c_shims_and_runs_in_a_fresh_process(built, tmp_path):
    model = _Tiny()
    with K.aoti_link_env():
        package = torch._inductor.aoti_compile_and_package(
            _export(model), package_path=str(tmp_path / "tiny.pt2"), inductor_configs=K.aoti_configs())
    with zipfile.ZipFile(package) as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert "aoti_torch_cpu_rms_norm(" in wrapper and "aoti_torch_cpu_attention(" in wrapper
    assert "aoti_torch_proxy_executor_call_function" not in wrapper
    cases = [(5, 64), (1, 40), (16, 128)]
    torch.save([_tiny_inputs(*c) for c in cases], tmp_path / "in.pt")
    code = (f"import torch\ntorch.ops.load_library({str(built)!r})\n"
            f"runner = torch._inductor.aoti_load_package({package!r})\n"
            f"cases = torch.load({str(tmp_path / 'in.pt')!r})\n"
            f"torch.save([runner(*c) for c in cases], {str(tmp_path / 'out.pt')!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    for got, case in zip(torch.load(tmp_path / "out.pt"), cases):
        want = model(*_tiny_inputs(*case))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), case


# --- silu_mul: the SwiGLU nonlinearity as an invariant op (issue 53) --------------------------------

def _gate_up(rows: int, f: int, seed: int = 0) -> torch.Tensor:
    """Random gates and ups, with the corners: zeros of both signs, values past exp's range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * f, generator=g) * 4
    x[0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    return x


@pytest.mark.parametrize("f", [16, 21, 64, 200])  # whole vectors, and tails of every length class
def test_silu_mul_equals_its_reference_bit_for_bit(isa, f):
    for rows in (1, 2, 3, 17):
        x = _gate_up(rows, f)
        assert torch.equal(K.silu_mul(x), K.silu_mul_reference(x)), (isa, f, rows)


def test_silu_mul_is_silu_times_up_within_float_rounding(built):
    x = _gate_up(5, 96)
    gate, up = x.chunk(2, -1)
    torch.testing.assert_close(K.silu_mul(x), F.silu(gate) * up, **TOL)
    assert K.silu_mul(x.reshape(5, 1, 192)).shape == (5, 1, 96)


def test_silu_mul_elements_do_not_depend_on_the_row_count_or_their_position(isa, threads):
    x = _gate_up(33, 37, seed=3)
    alone = torch.cat([K.silu_mul(x[i:i + 1]) for i in range(33)])
    for rows in (2, 5, 16, 17, 33):
        assert torch.equal(K.silu_mul(x[:rows]), alone[:rows]), (isa, rows)
    torch.set_num_threads(1)
    assert torch.equal(K.silu_mul(x), alone)


def test_silu_mul_refuses_an_odd_width(built):
    with pytest.raises(RuntimeError, match=r"expected \[..., 2F\]"):
        K.silu_mul(torch.randn(2, 7))
