"""Structured output in the decoders (yggdrasil/structured, runtime/logits.py) on the tiny pair with a
byte-level ChatML vocabulary: a grammar masks the target at every node the walk visits, so
constrained speculative greedy output equals constrained plain greedy output (EGT, chain and
lookup), replies validate against their schema, sampling stays the masked target's distribution,
and penalties hold under speculation. The tool-call readers and the prefix cache's bookkeeping too."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch
from helpers import EIGHT_LAYER_PAIR, JSON_CHAT_VOCAB, save_json_chat_tokenizer, save_tiny_pair

from yggdrasil.errors import InvalidRequestError
from yggdrasil.models.loader import load
from yggdrasil.models.tokenizer import Message
from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.runtime.generate import generate
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.runtime.logits import LogitsControl, Penalties, _masked
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.sampling import SamplingParams, target_probs
from yggdrasil.serve.prefix_cache import PrefixCache
from yggdrasil.serve.pool import SlotPool
from yggdrasil.structured.grammar import GrammarEngine
from yggdrasil.structured.tools import (Function, ToolSetup, ToolStream, grammar_for, parse_reply, parse_tool_choice,
                                        parse_tools)

CONTEXT = 512
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    "kind": {"enum": ["fruit", "vegetable"]},
    "size": {"type": "object", "properties": {"big": {"type": "boolean"}, "grade": {"enum": [1, 2, 3]}},
             "required": ["big", "grade"], "additionalProperties": False}},
    "required": ["name", "tags", "kind", "size"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}  # compact JSON: a random model would pad every gap
PROMPTS = [f"Describe thing {i} as JSON: " + " ".join(f"w{(i * 7 + k) % 13}" for k in range(3 + i % 5))
           for i in range(10)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-pair")
    save_tiny_pair(root, **EIGHT_LAYER_PAIR, vocab_size=JSON_CHAT_VOCAB)
    for model in ("tiny-random", "tiny-draft"):
        save_json_chat_tokenizer(root / model)
    target = load(str(root / "tiny-random"), dtype=torch.float32, quiet=True)
    draft = load(str(root / "tiny-draft"), dtype=torch.float32, quiet=True)
    return target, draft, GrammarEngine(target.tokenizer), root


def _prompt(pair, text):
    return pair[0].tokenizer.encode_chat([Message("user", text)])


def _control(pair, prompt, grammar=None, penalties=Penalties()):
    matcher = pair[2].matcher(grammar) if grammar is not None else None
    return LogitsControl(prompt, penalties, matcher)


def _plain(pair, prompt, n, control, sampling=SamplingParams()):
    runner = StepRunner(pair[0].model, CONTEXT, 16)
    return generate(runner, prompt, n, sampling, pair[0].tokenizer.stop_ids, control=control)


def _speculator(pair, mode):
    target, draft = pair[0], pair[1]
    runner = StepRunner(target.model, CONTEXT, 16)
    if mode == "lookup":
        drafter = LookupDrafter(4, 2)
    else:
        drafter = ModelDrafter(StepRunner(draft.model, CONTEXT, 16), 4, 1 if mode == "chain" else 2)
    # a flat profile verifies the whole tree: speculation really runs on every step
    return SpeculativeGenerator(runner, drafter, [drafter.capacity], profile=LatencyProfile())


@pytest.mark.parametrize("mode", ["egt", "chain", "lookup"])
def test_constrained_speculative_greedy_equals_constrained_plain_greedy(pair, mode):
    grammar = pair[2].json_schema(SCHEMA)
    speculator = _speculator(pair, mode)
    accepted = 0
    for text in PROMPTS:
        prompt = _prompt(pair, text)
        plain = _plain(pair, prompt, 400, _control(pair, prompt, grammar))
        control = _control(pair, prompt, grammar)
        spec = speculator.generate(prompt, 400, SamplingParams(), pair[0].tokenizer.stop_ids, control=control)
        assert spec.tokens == plain.tokens, (mode, text)
        assert spec.stop_reason == plain.stop_reason == "stop"
        jsonschema.validate(json.loads(pair[0].tokenizer.decode(spec.tokens)), SCHEMA)
        accepted += spec.spec.committed - spec.spec.iterations
        assert control.cost.masks >= len(spec.tokens) and control.finished
    if mode != "lookup":
        assert accepted > 0  # drafted tokens were accepted under the mask


def test_greedy_under_the_grammar_is_the_argmax_of_the_masked_logits(pair):
    """The reference, step by step: the whole mask, -inf elsewhere, argmax."""
    grammar = pair[2].json_schema(SCHEMA)
    prompt = _prompt(pair, PROMPTS[3])
    runner = StepRunner(pair[0].model, CONTEXT, 16)
    matcher, expected = pair[2].matcher(grammar), []
    logits = runner.prefill(prompt)
    while not matcher.finished:
        mask = np.empty((1, matcher.words), dtype=np.int32)
        matcher.fill(mask[0])
        token = int(_masked(logits[None], mask).argmax(-1))
        expected.append(token)
        assert matcher.consume(token)
        logits = runner.decode(token, len(prompt) + len(expected) - 1)
    assert _plain(pair, prompt, 400, _control(pair, prompt, grammar)).tokens == expected


def test_tree_masks_equal_masks_along_each_path(pair):
    grammar = pair[2].json_schema(SCHEMA)
    tokenizer = pair[0].tokenizer
    start = tokenizer.encode('{"name":"ab', add_special_tokens=False)
    matcher = pair[2].matcher(grammar)
    for token in start:
        assert matcher.consume(token)
    quote, comma, x = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ('"', ",", "x"))
    tokens, parents = [start[-1], quote, x, comma, x], [-1, 0, 0, 1, 3]
    masks = matcher.node_masks(tokens, parents)
    for node, path in ((0, []), (1, [quote]), (2, [x]), (3, [quote, comma])):
        fresh = pair[2].matcher(grammar)
        for token in start + path:
            assert fresh.consume(token)
        row = np.empty(fresh.words, dtype=np.int32)
        fresh.fill(row)
        assert np.array_equal(masks[node], row), node
    assert (masks[4] == -1).all()  # `x` after `",` is forbidden: its node is unreachable, left open


@pytest.mark.parametrize("mode", ["egt", "lookup"])
def test_penalties_change_the_output_and_speculation_keeps_them(pair, mode):
    prompt = _prompt(pair, "w1 w2 w3 w1 w2 w3 w1 w2")
    free = _plain(pair, prompt, 40, None).tokens
    for penalties in (Penalties(presence=1.5), Penalties(frequency=1.0), Penalties(repetition=1.8)):
        plain = _plain(pair, prompt, 40, _control(pair, prompt, penalties=penalties)).tokens
        assert plain != free, penalties
        spec = _speculator(pair, mode).generate(prompt, 40, SamplingParams(), pair[0].tokenizer.stop_ids,
                                                control=_control(pair, prompt, penalties=penalties))
        assert spec.tokens == plain, (mode, penalties)


def test_penalties_follow_their_definitions(pair):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    control = LogitsControl([1], Penalties(presence=0.5, frequency=0.25, repetition=2.0))
    control.counts = {0: 2, 3: 1}
    control.start([3, 2], [-1, 0])
    _, rows = control.choose(logits.repeat(2, 1), lambda rows, nodes: [2] * len(nodes), greedy=False)
    # node 0: token 0 seen twice, 3 once (generated), 1 in the prompt; node 1 also has token 2 on its path
    expected0 = torch.tensor([(2.0 - 0.5 - 0.5) / 2, -1.0 * 2, 0.5, (3.0 - 0.25 - 0.5) / 2])
    torch.testing.assert_close(rows[0], expected0)
    torch.testing.assert_close(rows[1], torch.tensor([expected0[0], expected0[1], (0.5 - 0.75) * 2, expected0[3]]))


def test_sampling_under_the_mask_draws_from_the_masked_target(pair):
    """The first constrained token, sampled through the speculator: its frequencies match the
    masked target distribution (and never hit a forbidden token)."""
    grammar = pair[2].json_schema({"enum": ["ab", "ba", "aa", "bb"]})
    prompt = _prompt(pair, "pick")
    runner = StepRunner(pair[0].model, CONTEXT, 16)
    matcher = pair[2].matcher(grammar)
    mask = np.empty((1, matcher.words), dtype=np.int32)
    matcher.fill(mask[0])
    params = SamplingParams(temperature=1.0)
    probs = target_probs(_masked(runner.prefill(prompt)[None], mask), params)[0]
    speculator, counts, n = _speculator(pair, "egt"), {}, 600
    for seed in range(n):
        out = speculator.generate(prompt, 4, SamplingParams(temperature=1.0, seed=seed), pair[0].tokenizer.stop_ids,
                                  control=_control(pair, prompt, grammar))
        counts[out.tokens[0]] = counts.get(out.tokens[0], 0) + 1
        assert pair[0].tokenizer.decode(out.tokens) in ('"ab"', '"ba"', '"aa"', '"bb"')
    allowed = [t for t in range(probs.numel()) if probs[t] > 0]
    assert set(counts) <= set(allowed)
    stat = sum((counts.get(t, 0) - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in allowed)
    assert stat < 20, (counts, probs[allowed])  # chi-square, df <= 1: p < 1e-5 past 20


def test_a_bad_schema_is_one_error_naming_the_field(pair):
    with pytest.raises(InvalidRequestError, match="response_format.*Invalid type: strin"):
        pair[2].json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}, "response_format")
    with pytest.raises(InvalidRequestError, match="unsatisfiable"):
        pair[2].json_schema({"type": "object", "required": ["x"], "properties": {}, "additionalProperties": False})


# ---- tools -----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("fmt", ["qwen", "llama3", "generic"])
def test_forced_tool_calls_always_parse_and_match_their_function(pair, choice, fmt):
    functions = parse_tools([WEATHER, TIME])
    # a random model adds calls to the generic format's array as long as it may: one call there
    setup = ToolSetup(functions, choice, "get_time" if choice == "named" else None, fmt != "generic", fmt)
    grammar = grammar_for(setup, pair[2])
    schemas = {f.name: f.parameters for f in functions}
    for text in PROMPTS[:4]:
        prompt = _prompt(pair, text)
        out = _plain(pair, prompt, 400, _control(pair, prompt, grammar))
        content, calls = parse_reply(pair[0].tokenizer.decode(out.tokens), fmt)
        assert calls and not content, (fmt, pair[0].tokenizer.decode(out.tokens))
        for call in calls:
            assert call.name in schemas and (choice != "named" or call.name == "get_time")
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


READERS = [
    ("qwen", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
             '{"name": "g", "arguments": {}}\n</tool_call>', "Sure.", ["f", "g"]),
    ("qwen", "no call <tool_ here", "no call <tool_ here", []),
    ("qwen", '<tool_call>\n{"name": "f", "arguments": {"a"', '<tool_call>\n{"name": "f", "arguments": {"a"', []),
    ("llama3", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x"}}', "", ["f", "g"]),
    ("llama3", "  Plain text {not a call}", "Plain text {not a call}", []),
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}', "", ["f"]),
    ("generic", '{"response": "hello there"}', "hello there", []),
]


@pytest.mark.parametrize("fmt,text,content,names", READERS)
def test_tool_replies_read_the_same_streamed_in_any_pieces(fmt, text, content, names):
    whole = parse_reply(text, fmt)
    assert whole[0] == content and [c.name for c in whole[1]] == names
    rng = random.Random(0)
    for _ in range(20):
        reader, events, at = ToolStream(fmt), [], 0
        while at < len(text):
            step = rng.randint(1, 7)
            events += reader.push(text[at:at + step])
            at += step
        events += reader.finish()
        streamed = "".join(v for k, v in events if k == "content")
        calls = [(v.name, v.arguments) for k, v in events if k == "call"]
        assert streamed == content and calls == [(c.name, c.arguments) for c in whole[1]]


def test_tool_choice_errors_name_the_problem():
    functions = parse_tools([WEATHER])
    with pytest.raises(InvalidRequestError, match="'nope', which is not in 'tools'"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, functions)
    with pytest.raises(InvalidRequestError, match="needs 'tools'"):
        parse_tool_choice("required", ())
    with pytest.raises(InvalidRequestError, match=r"tools\[0\].function.name"):
        parse_tools([{"type": "function", "function": {"name": "bad name"}}])
    assert parse_tool_choice(None, functions) == ("auto", None) and parse_tool_choice(None, ()) == ("none", None)
    assert isinstance(functions[0], Function)


# ---- the prefix cache's bookkeeping --------------------------------------------------------
def test_prefix_cache_shares_whole_blocks_and_evicts_idle_ones_least_recently_used():
    pool = SlotPool(4, 4)
    tokens = list(range(10))
    pool.reserve(1, 10)
    pool.remember(1, tokens)  # two whole blocks
    pool.release(1)
    assert pool.free_blocks == 4 and pool.cache.idle == 2
    assert pool.share_prefix(2, tokens[:9]) == 8 and pool.cache.idle == 0
    assert pool.share_prefix(3, tokens[:5] + [99]) == 4  # the first block only
    pool.reserve(3, 12)  # its own blocks after the shared one
    assert pool.free_blocks == 0
    pool.release(2)
    pool.release(3)
    assert pool.cache.idle == 2 and pool.free_blocks == 4
    pool.reserve(4, 16)  # every block: the idle cached ones are evicted
    assert pool.cache.evictions == 2 and len(pool.cache) == 0
    cache = PrefixCache(2)
    cache.insert([1, 2, 3, 4], [7, 8])
    assert cache.match([1, 2, 3, 4, 5]) == [7, 8] and cache.match([1, 2, 4, 4]) == [7] and cache.match([2]) == []


# ---- the command line ------------------------------------------------------------------------
def test_generate_json_schema_flag_writes_valid_json_and_its_cost(pair, tmp_path, capsys):
    from yggdrasil.cli import main as cli_main

    schema_file = tmp_path / "item.json"
    schema_file.write_text(json.dumps({"name": "item", "schema": SCHEMA, "strict": True}))
    args = ["generate", "--model", str(pair[3] / "tiny-random"), "--chat", "--prompt", PROMPTS[2],
            "--json-schema", str(schema_file), "--max-new-tokens", "400", "--max-context", "512"]
    for spec in ([], ["--spec", "egt", "--draft", str(pair[3] / "tiny-draft"), "--depth", "3", "--width", "2"]):
        assert cli_main(args + spec) == 0
        out, err = capsys.readouterr()
        jsonschema.validate(json.loads(out), SCHEMA)
        assert "[grammar: " in err and "per output token" in err
    (tmp_path / "bad.json").write_text("{not json")
    assert cli_main(args[:6] + ["--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_chat_shows_tool_calls_as_calls(pair, tmp_path):
    """A template without tools (the generic format): every reply is the grammar's JSON, shown as
    its answer or as [tool call] lines, and kept as the assistant's calls."""
    from types import SimpleNamespace

    from yggdrasil.chat import ChatSession, ChatSettings, describe_call
    from yggdrasil.models.tokenizer import tokenizer_from_hf_dir

    save_json_chat_tokenizer(tmp_path, template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                                               "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    target = SimpleNamespace(tokenizer=tokenizer_from_hf_dir(tmp_path), model=pair[0].model)
    # byte-level tokens make the tools' description long: a larger cache than the other tests'
    runtime = SimpleNamespace(target=target, runner=StepRunner(pair[0].model, 2048, 64), speculator=lambda: None)
    session = ChatSession(runtime, ChatSettings(max_new_tokens=300, tools=parse_tools([WEATHER, TIME])))
    assert session.tools.format == "generic"
    shown = []
    for text in ("weather in Oslo?", "and the time?"):
        reply = session.send(text, on_text=shown.append)
        expected = reply.text + "".join(f"\n{describe_call(c)}\n" for c in reply.calls)
        assert "".join(shown) == expected and session.turns[-1] == (text, reply.text)
        shown.clear()
        for call in reply.calls:
            assert call.name in ("get_weather", "get_time") and isinstance(json.loads(call.arguments), dict)
