"""A bundle's deployed weights (yggdrasil/runtime/deployed.py, issue 41): saved as the kernels consume
them, mapped back without conversion, the same model bit for bit; shared tensors stored once."""

from __future__ import annotations

import pytest
import torch
from helpers import save_random_hf_model

from yggdrasil.runtime.deployed import DeployedWeights, save_deployed
from yggdrasil.errors import ModelFileError
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.models.loader import load
from yggdrasil.runtime.steps import StepRunner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deployed") / "m"
    save_random_hf_model(path, "qwen2")
    return path


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4", "q4"])
def test_mapped_model_is_the_saved_one(model_dir, tmp_path, fmt):
    from yggdrasil.models import quant

    if fmt == "q4" and quant.kernels_available() is not None:
        pytest.skip(quant.kernels_available())
    loaded = load(str(model_dir), quiet=True, weights=fmt)
    save_deployed(tmp_path / "weights", {"target": loaded})
    mapped = DeployedWeights(tmp_path / "weights").load("target", "cpu")
    want, got = loaded.model.state_dict(), mapped.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert type(mapped.model.output) is type(loaded.model.output)
    assert mapped.model.batch_invariant == loaded.model.batch_invariant
    ids = loaded.tokenizer.encode("alpha beta")
    assert greedy_tokens(StepRunner(mapped.model, 64, 8), ids, 8) == greedy_tokens(StepRunner(loaded.model, 64, 8), ids, 8)
    assert mapped.tokenizer.encode("alpha beta") == ids and mapped.source.name == loaded.source.name


def test_a_self_draft_sharing_the_targets_tensors_is_stored_once(model_dir, tmp_path):
    target = load(str(model_dir), quiet=True, weights="int8")
    draft = type(target)(target.source, target.model.truncated(1), target.tokenizer, 0.0)
    save_deployed(tmp_path / "alone", {"target": target})
    save_deployed(tmp_path / "pair", {"target": target, "draft": draft})
    alone, pair = ((tmp_path / d / "models.pt").stat().st_size for d in ("alone", "pair"))
    assert pair < alone * 1.05  # the draft's layers are the target's: no second copy
    opened = DeployedWeights(tmp_path / "pair")
    mapped_target, mapped_draft = opened.load("target", "cpu"), opened.load("draft", "cpu")
    assert mapped_draft.model.layers[0].attention.wqkv.weight.data_ptr() == \
        mapped_target.model.layers[0].attention.wqkv.weight.data_ptr()
    assert mapped_draft.tokenizer is mapped_target.tokenizer  # the same tokenizer: written and parsed once
    assert not (tmp_path / "pair" / "tokenizer-draft").exists()


def test_a_damaged_or_mismatched_weights_file_is_a_clear_error(model_dir, tmp_path):
    loaded = load(str(model_dir), quiet=True)
    save_deployed(tmp_path / "weights", {"target": loaded})
    with pytest.raises(ModelFileError, match="hold no draft model"):
        DeployedWeights(tmp_path / "weights").load("draft", "cpu")
    path = tmp_path / "weights" / "models.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    with pytest.raises(ModelFileError, match="deployed weights in .* cannot be read"):
        DeployedWeights(tmp_path / "weights")
