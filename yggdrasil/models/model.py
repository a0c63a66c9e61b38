"""One decoder for the Llama and Qwen2 families, gpt-fast style, with a static KV cache.

Every forward takes fixed-shape tensors chosen by the caller:

    tokens    [B, T]  int64  token ids (padding rows: any valid id)
    positions [B, T]  int64  RoPE positions
    slots     [B, T]  int64  cache slot each row's K/V is written to (padding rows: scratch slot)
    mask      [B, T, S] bool  True where row t may attend cache slot s (S <= cache capacity)

The mask is the whole attention pattern, so causal prefill, chunked prefill and tree verification
(docs/design.md §3.2) are the same forward with different masks. Keys and values are written into the cache
before attention, so a row can attend to itself and to the other rows of the same forward.
Attention reads only the first S slots of the cache, so callers may pass a narrower mask when the
context is short (eager) or a fixed full-width one (compiled graphs).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from yggdrasil.config import ModelConfig
from yggdrasil.errors import YggdrasilError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.invariant = False  # use_batch_invariant_ops(): yggdrasil's fixed-order kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return torch.ops.yggdrasil.rms_norm(x, self.weight, self.eps)
        # variance in fp32, as the reference implementations do, then back to the input dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class KVCache(nn.Module):
    """Static K/V buffers, one pair per layer: k{i}, v{i} [batch, kv_heads, capacity, head_dim].

    The last slot is scratch: padding rows write there and no real row ever attends it. Each
    layer has buffers of its own, which the graphs index directly (a graph that indexed one
    stacked buffer would write through a view, and torch.export would copy the whole base back
    every step). With stacked=True their memory is one tensor, `storage` [2 * layers, ...]
    (k0.., then v0..), and the compaction after acceptance is one gather and one scatter for all
    layers. Eager runners and opened bundles ask for it (AOTInductor binds each layer's view like
    any buffer: tests/test_bundle.py); torch.compile'd ones cannot have it (nested_compile_region
    rejects aliased inputs), and export itself runs on separate buffers.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, stacked: bool = False) -> None:
        super().__init__()
        shape = (batch_size, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.n_layers = cfg.n_layers
        self.bound_by = ""  # what holds these buffers' addresses (a bundle's graphs), if anything
        self.swapped: dict[int, list[torch.Tensor]] = {}  # host copies by key (swap_out), until swap_in or drop
        self.storage = torch.zeros((2 * cfg.n_layers, *shape), dtype=dtype, device=device) if stacked else None
        for i in range(cfg.n_layers):
            k, v = ((self.storage[i], self.storage[cfg.n_layers + i]) if stacked else
                    (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)))
            self.register_buffer(f"k{i}", k, persistent=False)
            self.register_buffer(f"v{i}", v, persistent=False)

    @property
    def is_stacked(self) -> bool:
        """Whether every layer's buffers are still views of `storage` (module.to() would copy them)."""
        return self.storage is not None and self.k0.data_ptr() == self.storage.data_ptr()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    @property
    def keys(self) -> list[torch.Tensor]:
        return [getattr(self, f"k{i}") for i in range(self.n_layers)]

    @property
    def values(self) -> list[torch.Tensor]:
        return [getattr(self, f"v{i}") for i in range(self.n_layers)]

    @property
    def batch_size(self) -> int:
        return self.k0.shape[0]

    @property
    def capacity(self) -> int:
        return self.k0.shape[2]

    @property
    def scratch_slot(self) -> int:
        return self.capacity - 1

    @property
    def max_context(self) -> int:
        """Usable positions (all slots but the scratch one)."""
        return self.capacity - 1

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at slots src to slots dst (src is read before any write):
        one gather and one scatter over `storage`, fixed-shape for fixed-width index tensors
        (capturable in a CUDA graph when src and dst are static buffers)."""
        if not self.is_stacked:  # separate buffers: per layer
            for buffer in (*self.keys, *self.values):
                buffer[:, :, dst] = buffer[:, :, src]
            return
        self.storage.index_copy_(3, dst, self.storage.index_select(3, src))

    def swap_out(self, key: int, slots: torch.Tensor) -> None:
        """Copy every layer's K/V at these slots to host memory, kept under `key` until swap_in
        or drop (a server's preempted request). On CUDA the copies are asynchronous: synchronize
        before the slots are written again."""
        pin = self.k0.device.type == "cuda"
        self.swapped[key] = [t.index_select(2, slots).to("cpu", non_blocking=pin)
                             for i in range(self.n_layers) for t in self.layer(i)]

    def swap_in(self, key: int, slots: torch.Tensor) -> None:
        """Copy what swap_out kept under `key` back, to these slots (as many), and forget it."""
        host = iter(self.swapped.pop(key))
        for i in range(self.n_layers):
            for t in self.layer(i):
                t.index_copy_(2, slots, next(host).to(t.device, non_blocking=True))

    def drop(self, key: int) -> None:
        """Forget what swap_out kept under `key` (a swapped request that will not resume)."""
        self.swapped.pop(key, None)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of all layers' K and V as [layers, batch, kv_heads, capacity, head_dim]."""
        return torch.stack(self.keys), torch.stack(self.values)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, qkv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        self.invariant = False  # use_batch_invariant_ops(): yggdrasil's fixed-order kernel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                attn_mask: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q_size = self.n_heads * self.head_dim
        kv_size = self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        # write this step's K/V at the caller's slots, then attend over the cache prefix
        batch_index = torch.arange(bsz, device=x.device).unsqueeze(1)
        k_cache[batch_index, :, slots] = k.transpose(1, 2)
        v_cache[batch_index, :, slots] = v.transpose(1, 2)
        span = attn_mask.shape[-1]
        if self.invariant:  # a fixed order over keys, whatever the number of query rows
            out = torch.ops.yggdrasil.attention(q, k_cache[:, :, :span], v_cache[:, :, :span], attn_mask,
                                                self.head_dim ** -0.5)
        else:
            out = F.scaled_dot_product_attention(
                q, k_cache[:, :, :span], v_cache[:, :, :span],
                attn_mask=attn_mask, enable_gqa=self.n_heads != self.n_kv_heads,
            )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, q_size))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ffn_dim = cfg.ffn_dim
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        # use_batch_invariant_ops(): SiLU(gate) * up in yggdrasil's fixed-operation kernel, so the
        # step's one transcendental never runs in a vector body here and a scalar tail there
        self.invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return self.w2(torch.ops.yggdrasil.silu_mul(self.w13(x)))
        gate, up = self.w13(x).split(self.ffn_dim, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, slots, attn_mask, k_cache, v_cache):
        args = (x, cos, sin, slots, attn_mask, k_cache, v_cache)
        # export inlines every layer: some torch versions would leave the region in the exported
        # program as an invoke_subgraph, which AOTInductor may not compile
        return self.layer(*args) if _exporting() else self.region(*args)

    def layer(self, x, cos, sin, slots, attn_mask, k_cache, v_cache):
        x = x + self.attention(self.attention_norm(x), cos, sin, slots, attn_mask, k_cache, v_cache)
        return x + self.feed_forward(self.ffn_norm(x))

    # under torch.compile, compiled once and reused for every layer: ~4x faster cold compile
    region = torch.compiler.nested_compile_region(layer)


def _exporting() -> bool:
    """torch.export is tracing (strict or not); False on a torch without the flag."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # no init: weights always come from a checkpoint (and random init on meta is slow)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim,
                                           _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq(), dtype=torch.float32),
                             persistent=False)
        # use_batch_invariant_ops(): cos and sin per position [max_position, head_dim]
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.cache: KVCache | None = None

    def use_batch_invariant_ops(self) -> None:
        """RMSNorm, attention and SiLU(gate) * up on yggdrasil's fixed-order kernels
        (yggdrasil.kernels; loaded by the caller): every row is then computed the same in a
        decode, verify or prefill step. What stays outside them is exact elementwise arithmetic
        (RoPE's multiply-adds, residual and bias adds: one correctly rounded IEEE operation per
        element, the same in any loop; compile/pointwise.py checks the graphs hold nothing else).
        The linears must be invariant too (the q4 format's are); see compile/invariance.py."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, FeedForward)):
                module.invariant = True
        # cos/sin looked up per position, computed once in float64: compiled graphs compute
        # torch's cos/sin with other code than eager does (1-ulp differences, which q4's int8
        # activations amplify), while a gather is exact in both
        positions = torch.arange(self.config.max_position, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).double()
        # two tables, two gathers: cos and sin as views of one tensor would alias, which
        # torch.compile's nested_compile_region refuses
        self.rope_cos, self.rope_sin = emb.cos().float(), emb.sin().float()

    @property
    def batch_invariant(self) -> bool:
        return self.norm.invariant

    def truncated(self, n_layers: int) -> "Transformer":
        """A model that shares this one's weights but runs only its first n_layers blocks and
        has its own cache: a cheap (weak) self-draft for tests and experiments."""
        cfg = dataclasses.replace(self.config, n_layers=n_layers)
        with torch.device("meta"):
            small = Transformer(cfg)
        small.tok_embeddings = self.tok_embeddings
        small.layers = nn.ModuleList(self.layers[:n_layers])
        small.norm, small.output = self.norm, self.output
        small.inv_freq, small.rope_cos, small.rope_sin = self.inv_freq, self.rope_cos, self.rope_sin
        return small.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """Another static cache of this model's K/V beside its own (capacity slots, the last one
        scratch), which forward(cache=...) reads and writes: a server's KV pool."""
        return KVCache(self.config, batch_size, capacity, self.dtype, self.device)

    def setup_cache(self, batch_size: int, max_context: int, stacked: bool | None = None) -> KVCache:
        """A static cache for max_context positions (+1 scratch slot).

        An existing cache of the same shape is kept, so several step runners over one model share
        it (and compiled graphs, which guard on the buffers, stay valid). stacked: the layout
        (KVCache); None keeps an existing cache's, or makes separate buffers.
        """
        cache = self.cache
        if cache is None or (cache.batch_size, cache.max_context) != (batch_size, max_context) \
                or (stacked is not None and cache.is_stacked != stacked):
            if cache is not None and cache.bound_by:
                # the graphs hold this cache's addresses (captured CUDA graphs replay into them):
                # a new cache would leave them writing to freed memory
                raise YggdrasilError(
                    f"this model's KV cache ({cache.max_context} positions) is bound to {cache.bound_by}; "
                    f"a runner needing another cache ({max_context} positions"
                    f"{', separate buffers for torch.compile' if stacked is False else ''}) cannot replace "
                    "it. Run the bundle's own runners, or load the model again for this one")
            self.cache = KVCache(self.config, batch_size, max_context + 1, self.dtype, self.device, bool(stacked))
        return self.cache

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, head_dim], computed in fp32 like the reference."""
        if self.rope_cos is not None:
            return self.rope_cos[positions].unsqueeze(1).to(self.dtype), self.rope_sin[positions].unsqueeze(1).to(self.dtype)
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, logit_index: torch.Tensor | None = None,
                return_hidden: bool = False, cache: KVCache | None = None):
        """Logits [B, T or K, vocab]; with logit_index [B, K] only those rows reach the head.

        With return_hidden, also returns the final-norm hidden states of the same rows
        (what the depth predictor reads). cache: another static cache to read and write instead
        of the model's own (the server's shared slot pool, yggdrasil/serve/pool.py).
        """
        cache = cache if cache is not None else self.cache
        assert cache is not None, "call setup_cache() before forward()"
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope(positions)
        attn_mask = mask.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, slots, attn_mask, *cache.layer(i))
        if logit_index is not None:
            x = x.gather(1, logit_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        hidden = self.norm(x)
        logits = self.output(hidden)
        return (logits, hidden) if return_hidden else logits
