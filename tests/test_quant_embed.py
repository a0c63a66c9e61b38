"""The compact token embedding (yggdrasil/models/quant_embed.py, issue 41): the GGUF's own block codes
with a scale and an offset per group give the float32 rows the model was loaded with, bit for
bit, in eager and in compiled code; where they would not, the float32 embedding stays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from yggdrasil.models.quant_embed import BLOCK_BYTES, BlockEmbedding, compact_embedding, decode_codes

gguf = pytest.importorskip("gguf")


def _random_blocks(qtype: int, rows: int = 6, blocks: int = 3) -> np.ndarray:
    _, size = BLOCK_BYTES[qtype]
    return np.random.default_rng(qtype).integers(0, 256, (rows, blocks * size), dtype=np.uint8)


@pytest.mark.parametrize("qtype", sorted(BLOCK_BYTES))
def test_codes_give_the_gguf_packages_own_values_bitwise(qtype):
    raw = _random_blocks(qtype)
    with np.errstate(all="ignore"):  # random bytes make some fp16 scales inf/nan
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).astype(np.float32)
        rows = BlockEmbedding(*(torch.from_numpy(a.copy()) for a in decode_codes(raw, qtype))).weight.numpy()
    finite = np.isfinite(want)
    assert finite.mean() > 0.5
    assert np.array_equal(rows.view(np.uint32)[finite], want.view(np.uint32)[finite])
    assert np.array_equal(np.isnan(rows), np.isnan(want))


def test_an_unknown_type_is_not_decoded():
    assert decode_codes(np.zeros((2, 64), dtype=np.uint8), 1) is None  # F16: kept as it is


def _embedding_with_offsets() -> BlockEmbedding:
    raw = _random_blocks(12, rows=64, blocks=2)  # Q4_K: nonzero offsets, where an FMA would round differently
    raw.reshape(64, 2, 144)[:, :, 0:4] = np.array([0x3C00, 0x3800], dtype=np.float16).view(np.uint8)  # d 1, dmin 0.5
    codes, scales, offsets = (torch.from_numpy(a.copy()) for a in decode_codes(raw, 12))
    scales = scales * torch.tensor(1.0001)  # scales whose products round
    return BlockEmbedding(codes, scales, offsets)


@pytest.mark.parametrize("count", [1, 3, 16, 64])
def test_compiled_rows_equal_eager_rows(count):
    embedding = _embedding_with_offsets()
    tokens = torch.randint(0, 64, (1, count), generator=torch.Generator().manual_seed(count))
    compiled = torch.compile(embedding, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(tokens), embedding(tokens))
    assert torch.equal(embedding(tokens), embedding.weight[tokens])


class _File:
    def __init__(self, raw: np.ndarray, qtype: int) -> None:
        self.tensors = [type("Info", (), {"name": "token_embd.weight", "qtype": gguf.GGMLQuantizationType(qtype)})()]
        self._raw = raw

    def raw(self, info):
        return self._raw


def test_compact_embedding_replaces_only_an_exact_one():
    raw = _random_blocks(8, rows=64, blocks=2)  # Q8_0
    raw.reshape(64, 2, 34)[:, :, 0:2] = np.array([0x2E66], dtype=np.float16).view(np.uint8)  # d = 0.1
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32))
    model = torch.nn.Module()
    model.tok_embeddings = torch.nn.Embedding(64, 64, _weight=dense.clone())
    assert "exact rows" in compact_embedding(model, _File(raw, 8))
    assert isinstance(model.tok_embeddings, BlockEmbedding) and torch.equal(model.tok_embeddings.weight, dense)
    assert model.tok_embeddings.offsets is None  # Q8_0 has none: not stored

    off = dense.clone()
    off[5, 7] = torch.nextafter(off[5, 7], torch.tensor(1e9))  # one value one ulp away: not the file's rows
    model.tok_embeddings = torch.nn.Embedding(64, 64, _weight=off)
    assert "do not reproduce" in compact_embedding(model, _File(raw, 8))
    assert isinstance(model.tok_embeddings, torch.nn.Embedding)


def test_smollm2_q4_keeps_its_embedding_as_q8_0_codes_with_the_same_rows():
    from yggdrasil.models.loader import load

    fp32 = load("smollm2-135m", quiet=True)
    q4 = load("smollm2-135m", quiet=True, weights="q4")
    assert isinstance(q4.model.tok_embeddings, BlockEmbedding)
    assert torch.equal(q4.model.tok_embeddings.weight, fp32.model.tok_embeddings.weight)
