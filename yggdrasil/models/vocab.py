"""A trimmed draft vocabulary (issue 51, FR-Spec): the draft's LM head keeps only K rows, the
most frequent target tokens, so a draft step reads K x dim head weights instead of the whole
vocabulary's (Qwen2.5-Coder-0.5B: 136 M of its weights are the head).

The draft then proposes only tokens of that subset; the target verifies over its full vocabulary,
so the output stays exactly the target's. `TrimmedHead` replaces `model.output`: its logits are
over the K kept rows in `token_ids` order, each bitwise the full head's logit for that token (a
row's output depends only on that row's weights), and `head_token_ids(model)` tells a drafter
how to map a proposal's index back to a token id. The token embedding is not trimmed: a step
reads only its own tokens' rows, and every committed token, in the subset or not, is fed.

Trimming is exact per weight format: the kept rows are taken from the packed blocks as stored
(`trim_linear`), never requantized. Which K and which tokens: compile/draft_vocab.py.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from yggdrasil.kernels import pack
from yggdrasil.models.quant import BF16Linear, Int4Linear, Int8Linear, unpack_int4
from yggdrasil.models.quant_base import PackedLinear, WeightFormatError
from yggdrasil.models.quant_q4 import Q4Linear, Q8Linear


class TrimmedHead(nn.Module):
    """The LM head over a subset of the vocabulary: `inner` holds the kept rows (any linear
    format), `token_ids` [K] int64 the token id of each logit column."""

    def __init__(self, inner: nn.Module, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("token_ids", token_ids.to(torch.long).contiguous())
        self.vocab_size = vocab_size  # the full vocabulary the token ids index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    @property
    def kept(self) -> int:
        return self.token_ids.numel()

    def extra_repr(self) -> str:
        return f"kept={self.kept} of {self.vocab_size} tokens"


def head_token_ids(model: nn.Module) -> torch.Tensor | None:
    """The token id of each logit column of a model with a trimmed head (None: a full head,
    whose column is the token id)."""
    head = getattr(model, "output", None)
    return head.token_ids if isinstance(head, TrimmedHead) else None


def head_size(model: nn.Module) -> int:
    """How many tokens the model's head scores (K for a trimmed head, else the vocabulary)."""
    ids = head_token_ids(model)
    return model.config.vocab_size if ids is None else ids.numel()


def _rows_bias(module, ids: torch.Tensor) -> torch.Tensor | None:
    return None if module.bias is None else module.bias[ids].clone()


def _trim_q8(module: Q8Linear, ids: torch.Tensor) -> PackedLinear:
    q, d = pack.unpack_q8(pack.Q8Weight(module.weight, module.scales))
    return Q8Linear(pack.pack_q8(q[ids], d[ids]), _rows_bias(module, ids))


def _trim_q4(module: Q4Linear, ids: torch.Tensor) -> PackedLinear:
    q, d, m = pack.unpack_q4(pack.Q4Weight(module.weight, module.scales, module.mins))
    return Q4Linear(pack.pack_q4(q[ids], d[ids], m[ids]), _rows_bias(module, ids))


def _trim_int8(module: Int8Linear, ids: torch.Tensor) -> PackedLinear:
    trimmed = Int8Linear.__new__(Int8Linear)
    PackedLinear.__init__(trimmed, module.in_features, ids.numel(), _rows_bias(module, ids))
    trimmed.register_buffer("weight", module.weight[ids].contiguous())
    trimmed.register_buffer("scales", module.scales[ids].contiguous())
    return trimmed


def _trim_int4(module: Int4Linear, ids: torch.Tensor) -> PackedLinear:
    pairs = module.scales_and_zeros
    q = unpack_int4(module.weight, module.out_features, module.in_features)
    return Int4Linear(q[ids], pairs[..., 0].t()[ids], pairs[..., 1].t()[ids], _rows_bias(module, ids), pairs.dtype)


def _trim_bf16(module: BF16Linear, ids: torch.Tensor) -> PackedLinear:
    return BF16Linear(module.weight[ids], _rows_bias(module, ids))


# weight format -> the exact row gather of its packed layout (a new format adds its own here)
_TRIMMERS = {Q8Linear.fmt: _trim_q8, Q4Linear.fmt: _trim_q4, Int8Linear.fmt: _trim_int8,
             Int4Linear.fmt: _trim_int4, BF16Linear.fmt: _trim_bf16}


def trim_linear(module: nn.Module, ids: torch.Tensor) -> nn.Module:
    """The linear holding only output rows `ids` of `module`, in the same format, bitwise."""
    if isinstance(module, nn.Linear):
        trimmed = nn.Linear(module.in_features, ids.numel(), bias=module.bias is not None,
                            device="meta", dtype=module.weight.dtype)
        trimmed.weight = nn.Parameter(module.weight.detach()[ids].clone(), requires_grad=False)
        if module.bias is not None:
            trimmed.bias = nn.Parameter(module.bias.detach()[ids].clone(), requires_grad=False)
        return trimmed
    trim = _TRIMMERS.get(getattr(module, "fmt", None))
    if trim is None:
        raise WeightFormatError(f"a trimmed draft vocabulary has no row gather for a {type(module).__name__} "
                                "head; use draft_vocab: full in the recipe")
    return trim(module, ids)


def trim_head(model: nn.Module, token_ids: torch.Tensor) -> None:
    """Replace model's LM head (full or trimmed) by one over `token_ids` (ascending, unique), in
    place. The kept rows come from the full head, so trimming twice is trimming once."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    vocab = model.config.vocab_size
    if ids.dim() != 1 or not ids.numel() or ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != ids.numel():
        raise WeightFormatError(f"a trimmed vocabulary needs distinct token ids in 0..{vocab - 1}")
    head = model.output
    if isinstance(head, TrimmedHead):
        raise WeightFormatError("the draft's head is trimmed already; trim the full head (untrim_head first)")
    object.__setattr__(model, "_full_head", head)  # not a submodule: undone without reloading, never saved
    model.output = TrimmedHead(trim_linear(head, ids), ids, vocab)


def untrim_head(model: nn.Module) -> None:
    """Put back the full head trim_head replaced (no-op for a full head)."""
    full = model.__dict__.pop("_full_head", None)
    if isinstance(model.output, TrimmedHead) and full is not None:
        model.output = full


def merge_ranks(tokenizer, vocab_size: int) -> torch.Tensor:
    """[vocab_size] each token's BPE merge rank, a frequency order from the tokenizer's own
    training (earlier merges joined more frequent pairs): base symbols 0, the token made by
    merge r at r + 1; tokens no merge makes (added tokens, ids past the tokenizer) last. A
    tokenizer without merges ranks tokens by id."""
    ranks = torch.full((vocab_size,), vocab_size + 1, dtype=torch.long)
    model = json.loads(tokenizer.inner.to_str()).get("model", {})
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not merges:
        n = min(vocab_size, tokenizer.vocab_size)
        ranks[:n] = torch.arange(n)
        return ranks
    made = set()
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        token = vocab.get(left + right)
        if token is not None and token < vocab_size and token not in made:
            made.add(token)
            ranks[token] = rank + 1
    for text, token in vocab.items():
        if token < vocab_size and token not in made and len(text) == 1:
            ranks[token] = 0  # a base byte symbol
    return ranks


def ranked_vocabulary(counts: torch.Tensor, ranks: torch.Tensor, required: set[int]) -> torch.Tensor:
    """All token ids, best first: `required` ones (stop and special tokens), then by count
    (the calibration corpus) descending, then by merge rank, then by id."""
    vocab = counts.numel()
    ids = torch.arange(vocab)
    must = torch.zeros(vocab, dtype=torch.bool)
    must[[t for t in required if 0 <= t < vocab]] = True
    # a lexicographic sort: stable sorts from the least significant key up
    order = torch.argsort(ranks[ids], stable=True)
    order = order[torch.argsort(-counts[order], stable=True)]
    return order[torch.argsort((~must[order]).to(torch.int8), stable=True)]


def describe_head(model: nn.Module) -> dict:
    """What a bundle's weights index records of the head: {} for a full one."""
    ids = head_token_ids(model)
    return {} if ids is None else {"trimmed_head": {"kept": ids.numel(), "vocab_size": model.config.vocab_size}}


def prepare_trimmed_head(model: nn.Module, entry: dict) -> None:
    """Before a bundle's mapped tensors are assigned to a model built on the meta device: a
    trimmed head's shell, which they then fill (output.inner.*, output.token_ids)."""
    trimmed = entry.get("trimmed_head")
    if not trimmed:
        return
    kept, dim = int(trimmed["kept"]), model.config.dim
    with torch.device("meta"):
        model.output = TrimmedHead(nn.Linear(dim, kept, bias=False), torch.empty(kept, dtype=torch.long),
                                   model.config.vocab_size)
