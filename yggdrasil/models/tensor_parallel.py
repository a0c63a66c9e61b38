"""Megatron-style tensor parallelism of the decoder (issue 55; docs/tensor-parallel.md).

Rank r of N keeps heads [r*H/N, (r+1)*H/N) (and the matching K/V heads) of every attention and
columns [r*F/N, (r+1)*F/N) of every MLP:

    wqkv, w13   column-parallel: the rank's output rows (its q, k, v heads; its gate and up columns)
    wo, w2      row-parallel: the rank's input columns, then one all-reduce (sum) per block
    output      the LM head's rows over the vocabulary, then one all-gather of the logits

The embedding, the norms and RoPE are replicated. Collectives are torch.distributed's functional
ones (`_functional_collectives`), which trace into torch.compile and AOTInductor graphs as
`_c10d_functional` ops; gloo on CPU, nccl on CUDA. Only the linears' weights are cut, so every
weight format that stores its rows and its input blocks independently shards with no
re-quantization: fp32, bf16, int8 (per-row scales), and q4's packed blocks (16-row groups along
the outputs, 32-blocks or 256-super-blocks along the inputs). ATen's packed int4 cannot: its
layout interleaves rows inside the kernel's own tiles, so it is refused by name.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed import _functional_collectives as fc

from yggdrasil.config import ModelConfig
from yggdrasil.errors import YggdrasilError
from yggdrasil.models.quant import BF16Linear, Int8Linear
from yggdrasil.models.quant_blocks import BLOCK_CLASSES, KINDS, BlockLinear, MixedLinear, block_module
from yggdrasil.kernels import COLS

ROW_GROUP = COLS  # q4's packed rows come in groups of 16 outputs


class TensorParallelError(YggdrasilError):
    """A model or weight format that cannot be split over this many ranks."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds: [start, stop) of heads, K/V heads, MLP columns, vocab."""

    rank: int
    world: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]

    def as_dict(self) -> dict:
        return {"rank": self.rank, "heads": list(self.heads), "kv_heads": list(self.kv_heads),
                "ffn_columns": list(self.ffn), "vocab": list(self.vocab)}


def _part(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's [start, stop) of `total` items split as evenly as they go (the first ranks take one
    more where world does not divide total)."""
    size, extra = divmod(total, world)
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


def plan_shards(cfg: ModelConfig, world: int) -> list[Shard]:
    """Every rank's shard, or one error naming what `world` cannot split. Heads go by K/V group
    (a rank keeps whole groups, so GQA stays local) and may split unevenly (SmolLM2's 3 K/V heads
    over 2 ranks: 2 and 1), as may MLP columns; the vocabulary must divide evenly (the logits'
    all-gather takes equal pieces)."""
    if world < 1:
        raise TensorParallelError(f"tensor_parallel must be >= 1, got {world}")
    misfits = ([f"K/V heads ({cfg.n_kv_heads}: fewer than the ranks)"] if cfg.n_kv_heads < world else []) + \
        ([f"MLP columns ({cfg.ffn_dim}: fewer than the ranks)"] if cfg.ffn_dim < world else []) + \
        ([f"vocabulary ({cfg.vocab_size}: not a multiple of the ranks)"] if cfg.vocab_size % world else [])
    if misfits:
        raise TensorParallelError(
            f"tensor_parallel: {world} cannot split the model's {', '.join(misfits)}; choose a world size of at most "
            f"{cfg.n_kv_heads} that divides its {cfg.vocab_size}-token vocabulary (e.g. {_divisors_hint(cfg)})")
    group = cfg.n_heads // cfg.n_kv_heads
    shards = []
    for r in range(world):
        kv = _part(cfg.n_kv_heads, r, world)
        shards.append(Shard(r, world, (kv[0] * group, kv[1] * group), kv, _part(cfg.ffn_dim, r, world),
                            _part(cfg.vocab_size, r, world)))
    return shards


def _divisors_hint(cfg: ModelConfig) -> str:
    common = [n for n in range(1, min(cfg.n_kv_heads, 16) + 1) if not cfg.vocab_size % n]
    return " or ".join(str(n) for n in common) or "1"


# -- cutting one linear -------------------------------------------------------------------------
def _refuse(module: nn.Module, name: str, why: str) -> TensorParallelError:
    fmt = getattr(module, "fmt", type(module).__name__)
    return TensorParallelError(f"tensor parallelism cannot shard {name} in weight format {fmt}: {why}; "
                               "compile the recipe with weights: q4, int8, bf16 or fp32")


def select_rows(module: nn.Module, ranges: list[tuple[int, int]], name: str) -> nn.Module:
    """The linear over only these output rows (concatenated in order): a column-parallel shard."""
    if isinstance(module, nn.Linear):
        index = torch.cat([torch.arange(a, b) for a, b in ranges])
        out = nn.Linear(module.in_features, len(index), bias=module.bias is not None,
                        device="meta", dtype=module.weight.dtype)
        out.weight = nn.Parameter(module.weight.detach()[index].contiguous(), requires_grad=False)
        if module.bias is not None:
            out.bias = nn.Parameter(module.bias.detach()[index].contiguous(), requires_grad=False)
        return out
    bias = None if module.bias is None else torch.cat([module.bias[a:b] for a, b in ranges])
    if isinstance(module, BF16Linear):
        return BF16Linear(torch.cat([module.weight[a:b] for a, b in ranges]), bias)
    if isinstance(module, Int8Linear):
        out = Int8Linear(torch.cat([module.weight[a:b] for a, b in ranges]),
                         torch.cat([module.scales[a:b] for a, b in ranges]), bias, module.scales.dtype)
        return out
    if isinstance(module, (BlockLinear, MixedLinear)):
        return block_module(_block_rows(module, ranges, name), bias)
    raise _refuse(module, name, "its packed layout does not keep rows apart")


def _block_parts(module: nn.Module) -> list[tuple[str, list[torch.Tensor]]]:
    """(kind, buffers) of each part in row order: one for a BlockLinear, several for a MixedLinear."""
    if isinstance(module, MixedLinear):
        return [(kind, module.part_tensors(i)) for i, kind in enumerate(module.kinds)]
    return [(module.fmt, module.tensors())]


def _block_rows(module: nn.Module, ranges: list[tuple[int, int]], name: str) -> list[tuple[str, object]]:
    """Each part's 16-row groups that fall inside the ranges, as (kind, packed weight) in order."""
    for a, b in ranges:
        if a % ROW_GROUP or b % ROW_GROUP:
            raise _refuse(module, name, f"its rows [{a}, {b}) are not whole groups of {ROW_GROUP} packed "
                                        "outputs (a head slice or MLP slice of this model is too narrow)")
    parts, offset = [], 0
    for kind, tensors in _block_parts(module):
        rows = tensors[0].shape[0] * ROW_GROUP
        for a, b in ranges:
            lo, hi = max(a, offset), min(b, offset + rows)
            if lo < hi:
                g0, g1 = (lo - offset) // ROW_GROUP, (hi - offset) // ROW_GROUP
                parts.append((kind, KINDS[kind][2](*(t[g0:g1].contiguous() for t in tensors))))
        offset += rows
    return parts


def select_columns(module: nn.Module, start: int, stop: int, keep_bias: bool, name: str) -> nn.Module:
    """The linear over only input features [start, stop): a row-parallel shard (its partial
    outputs sum to the whole); the bias is kept on one rank only (keep_bias), so it is added once."""
    bias = module.bias if keep_bias else None
    if isinstance(module, nn.Linear):
        out = nn.Linear(stop - start, module.out_features, bias=bias is not None, device="meta",
                        dtype=module.weight.dtype)
        out.weight = nn.Parameter(module.weight.detach()[:, start:stop].contiguous(), requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return out
    if isinstance(module, BF16Linear):
        return BF16Linear(module.weight[:, start:stop], bias)
    if isinstance(module, Int8Linear):  # per-row scales: a column slice keeps them as they are
        return Int8Linear(module.weight[:, start:stop], module.scales, bias, module.scales.dtype)
    if isinstance(module, (BlockLinear, MixedLinear)):
        parts = []
        for kind, tensors in _block_parts(module):
            cut = []
            for t in tensors:  # dim 1 counts input blocks (32) or super-blocks (256) of this buffer
                width = module.in_features // t.shape[1]
                if start % width or stop % width:
                    raise _refuse(module, name, f"input columns [{start}, {stop}) are not whole {width}-blocks "
                                                f"of its {kind} weights")
                cut.append(t[:, start // width:stop // width].contiguous())
            parts.append((kind, KINDS[kind][2](*cut)))
        return block_module(parts, bias)
    raise _refuse(module, name, "its packed layout does not keep input blocks apart")


# -- the collectives ------------------------------------------------------------------------------
class AllReduced(nn.Module):
    """A row-parallel linear whose partial outputs are summed over the group (one all-reduce)."""

    def __init__(self, linear: nn.Module, group) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fc.wait_tensor(fc.all_reduce(self.linear(x), "sum", self.group))


class Gathered(nn.Module):
    """The LM head's vocabulary shard; the whole logits gathered along the last dim on every rank
    (sampling and the host see [.., vocab] as without parallelism)."""

    def __init__(self, linear: nn.Module, group) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x)
        return fc.wait_tensor(fc.all_gather_single(local.contiguous(), local.dim() - 1, self.group))


# -- the whole model ------------------------------------------------------------------------------
def _head_rows(shard: Shard, cfg: ModelConfig) -> list[tuple[int, int]]:
    d, q = cfg.head_dim, cfg.n_heads * cfg.head_dim
    kv = cfg.n_kv_heads * cfg.head_dim
    (h0, h1), (k0, k1) = shard.heads, shard.kv_heads
    return [(h0 * d, h1 * d), (q + k0 * d, q + k1 * d), (q + kv + k0 * d, q + kv + k1 * d)]


def shard_model(model: nn.Module, shard: Shard, group) -> nn.Module:
    """Cut the Transformer in place to this rank's shard, with the collectives over `group`;
    its config then names the local head counts (its KV cache holds only this rank's heads)."""
    cfg = model.config
    if plan_shards(cfg, shard.world)[shard.rank] != shard:
        raise TensorParallelError(f"shard {shard} is not rank {shard.rank}'s of {shard.world} for this model")
    f0, f1 = shard.ffn
    for i, block in enumerate(model.layers):
        attention, mlp = block.attention, block.feed_forward
        attention.wqkv = select_rows(attention.wqkv, _head_rows(shard, cfg), f"layers.{i}.attention.wqkv")
        h0, h1 = shard.heads
        attention.wo = AllReduced(select_columns(attention.wo, h0 * cfg.head_dim, h1 * cfg.head_dim,
                                                 shard.rank == 0, f"layers.{i}.attention.wo"), group)
        attention.n_heads, attention.n_kv_heads = h1 - h0, shard.kv_heads[1] - shard.kv_heads[0]
        mlp.w13 = select_rows(mlp.w13, [(f0, f1), (cfg.ffn_dim + f0, cfg.ffn_dim + f1)], f"layers.{i}.feed_forward.w13")
        mlp.w2 = AllReduced(select_columns(mlp.w2, f0, f1, shard.rank == 0, f"layers.{i}.feed_forward.w2"), group)
        mlp.ffn_dim = f1 - f0
    model.output = Gathered(select_rows(model.output, [shard.vocab], "output"), group)
    model.whole_config = cfg
    model.config = dataclasses.replace(cfg, n_heads=shard.heads[1] - shard.heads[0],
                                       n_kv_heads=shard.kv_heads[1] - shard.kv_heads[0], ffn_dim=f1 - f0)
    model.cache = None
    model.tensor_parallel = shard
    return model


def unsharded_config(model: nn.Module) -> ModelConfig:
    """The whole model's config (a shard's own config names its local heads and columns)."""
    return getattr(model, "whole_config", model.config)


__all__ = ["Shard", "TensorParallelError", "plan_shards", "shard_model", "select_rows", "select_columns",
           "AllReduced", "Gathered", "unsharded_config", "BLOCK_CLASSES"]


def check_shardable(model: nn.Module, world: int) -> list[Shard]:
    """Every rank's shard, after checking that `world` divides the model and that its weight format
    cuts at these boundaries (tried on the first block and the head; blocks share their shapes)."""
    shards = plan_shards(model.config, world)
    if world == 1:
        return shards
    cfg, block = model.config, model.layers[0]
    for shard in shards:
        f0, f1 = shard.ffn
        h0, h1 = shard.heads
        select_rows(block.attention.wqkv, _head_rows(shard, cfg), "attention.wqkv")
        select_columns(block.attention.wo, h0 * cfg.head_dim, h1 * cfg.head_dim, False, "attention.wo")
        select_rows(block.feed_forward.w13, [(f0, f1), (cfg.ffn_dim + f0, cfg.ffn_dim + f1)], "feed_forward.w13")
        select_columns(block.feed_forward.w2, f0, f1, False, "feed_forward.w2")
        select_rows(model.output, [shard.vocab], "output")
    return shards
