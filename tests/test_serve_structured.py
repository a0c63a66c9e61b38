"""`yggdrasil serve` with the official openai client on a tiny bundle whose byte-level ChatML
vocabulary can write any JSON: response_format, tools and tool_choice (streamed too), tool turns,
logprobs, penalties, the prefix cache, API keys and the bad inputs of each, with speculation on
and off giving the same replies. A slow test does the same on SmolLM2."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from helpers import write_tiny_json_recipe_dir
from live_server import LiveApp

from yggdrasil.bundle import open_bundle
from yggdrasil.models.tokenizer import Message
from yggdrasil.serve.api import create_app, read_body
from yggdrasil.serve.memory import parse_bytes
from yggdrasil.serve.setup import ServeSettings

NAME = "tiny-json-cpu"
CONTEXT = 1536  # byte-level tokens: tools described in a prompt take hundreds
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2},
    "kind": {"enum": ["fruit", "vegetable"]},
    "size": {"type": "object", "properties": {"big": {"type": "boolean"}}, "required": ["big"],
             "additionalProperties": False}},
    "required": ["name", "tags", "kind", "size"],
    "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}  # compact: a random model pads
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
QUESTIONS = [f"Record {i}: describe item w{i} w{i * 3 % 7} as JSON" for i in range(6)]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    import yaml

    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe

    root = tmp_path_factory.mktemp("tiny-json")
    recipe_path = write_tiny_json_recipe_dir(root, NAME, CONTEXT)
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["buckets"].update(depths=[1, 3], draft_widths=[1], verify_widths=[1, 4])  # few graphs
    recipe_path.write_text(yaml.safe_dump(recipe))
    build_bundle(load_recipe(recipe_path), root / "bundle", log=lambda _: None)
    return root / "bundle"


class Live(LiveApp):
    """The real app under uvicorn in a thread (the engine in its own), on a free loopback port."""

    def __init__(self, engine, api_keys=(), max_body_bytes=2**20) -> None:
        self.engine = engine
        super().__init__(create_app(engine, NAME, max_body_bytes=max_body_bytes, api_keys=api_keys))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=(api_keys or ("unused",))[0], max_retries=0)


@pytest.fixture(scope="module")
def servers(bundle):
    """Speculating (always 3 drafted tokens) and not: every reply must be the same on both."""
    live = {mode: Live(open_bundle(bundle, quiet=True).engine(ServeSettings(max_batch=4, speculation=mode)))
            for mode in ("fixed:3", "off")}
    yield live
    for server in live.values():
        server.close()


def _both(servers, call):
    """call(client) on the speculating and the plain server; their results must be equal."""
    spec, plain = call(servers["fixed:3"].client), call(servers["off"].client)
    assert spec == plain
    return spec


def _chat(client, content, max_tokens=200, **fields):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=max_tokens, **fields)


def test_json_schema_replies_validate_and_speculation_changes_nothing(servers):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    for question in QUESTIONS:
        reply = _both(servers, lambda c: _chat(c, question, response_format=fmt).choices[0].message.content)
        jsonschema.validate(json.loads(reply), SCHEMA)
        streamed = _chat(servers["fixed:3"].client, question, response_format=fmt, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply
    completion = _both(servers, lambda c: c.completions.create(
        model=NAME, prompt="item: ", max_tokens=200, temperature=0,
        extra_body={"response_format": fmt}).choices[0].text)
    jsonschema.validate(json.loads(completion), SCHEMA)
    assert servers["fixed:3"].engine.metrics.proposed > 0  # the speculating server did draft


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_validate_and_stream_the_same(servers, choice):
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for question in QUESTIONS[:4]:
        def ask(client):
            reply = _chat(client, question, tools=[WEATHER, TIME], tool_choice=choice)
            calls = reply.choices[0].message.tool_calls
            return reply.choices[0].finish_reason, [(c.function.name, c.function.arguments) for c in calls]

        reason, calls = _both(servers, ask)
        assert reason == "tool_calls" and calls
        for name, arguments in calls:
            assert isinstance(choice, str) or name == "get_time"
            jsonschema.validate(json.loads(arguments), schemas[name])
        chunks = list(_chat(servers["fixed:3"].client, question, tools=[WEATHER, TIME], tool_choice=choice,
                            stream=True))
        assembled: dict[int, list[str]] = {}
        for chunk in chunks:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = assembled.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
        assert [tuple(assembled[i]) for i in sorted(assembled)] == calls
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_renders_the_templates_tools_and_tool_turns_round_trip(servers, bundle):
    tokenizer = open_bundle(bundle, quiet=True).models().target.tokenizer
    client = servers["off"].client
    reply = _chat(client, QUESTIONS[0], tools=[WEATHER])
    rendered = tokenizer.encode_chat([Message("user", QUESTIONS[0])], tools=[WEATHER])
    assert reply.usage.prompt_tokens == len(rendered)
    assert reply.model_extra["tool_format"] == "qwen" and reply.choices[0].finish_reason in ("stop", "length")
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "7 degrees"}]
    answer = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=5, temperature=0)
    turns = [Message("user", "weather?"),
             Message("assistant", "", tool_calls=({"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}},)),
             Message("tool", "7 degrees", tool_call_id="call_1")]
    assert answer.usage.prompt_tokens == len(tokenizer.encode_chat(turns, tools=[WEATHER]))
    assert "<tool_response>\n7 degrees" in tokenizer.render_chat(turns, tools=[WEATHER])


def test_logprobs_are_the_targets_and_the_same_with_speculation_on_and_off(servers):
    def ask(client):
        reply = _chat(client, QUESTIONS[1], max_tokens=24, logprobs=True, top_logprobs=3)
        return reply.choices[0].message.content, reply.choices[0].logprobs.content

    (text, spec), (_, plain) = ask(servers["fixed:3"].client), ask(servers["off"].client)
    assert _chat(servers["off"].client, QUESTIONS[1], max_tokens=24).choices[0].message.content == text
    assert len(spec) == len(plain) == 24
    for a, b in zip(spec, plain):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.logprob <= 0
        assert len(a.top_logprobs) == 3 and a.top_logprobs[0].logprob >= a.logprob - 1e-6
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    assert sum(a.logprob for a in spec) <= 0
    completion = servers["fixed:3"].client.completions.create(model=NAME, prompt="w1 w2", max_tokens=8,
                                                              temperature=0, logprobs=2)
    legacy = completion.choices[0].logprobs
    assert len(legacy.tokens) == 8 and all(lp <= 0 for lp in legacy.token_logprobs)
    # the legacy shape keys alternatives by text: two byte tokens that decode alike share a key
    assert all(1 <= len(top) <= 2 for top in legacy.top_logprobs)
    streamed = _chat(servers["fixed:3"].client, QUESTIONS[1], max_tokens=24, logprobs=True, stream=True)
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in spec]


def test_penalties_change_the_reply_and_speculation_keeps_it(servers):
    prompt = "w1 w2 w1 w2 w1 w2 w1 w2 w1"
    free = _chat(servers["off"].client, prompt, max_tokens=40).choices[0].message.content
    for penalty in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.8}):
        body = {"extra_body": penalty} if "repetition_penalty" in penalty else penalty
        reply = _both(servers, lambda c: _chat(c, prompt, max_tokens=40, **body).choices[0].message.content)
        assert reply != free, penalty


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be text, json_object or json_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in 'tools'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "7"}]}, "messages[1].tool_call_id",
     "needs the 'tool_call_id'"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
]


def test_bad_structured_requests_get_400s_naming_the_field(servers):
    url = servers["off"].url + "/v1/chat/completions"
    for fields, param, phrase in BAD:
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["param"] == param and phrase in error["message"], error
    assert _chat(servers["off"].client, "still serving", max_tokens=3).choices[0].finish_reason == "length"


def test_a_shared_prefix_is_prefilled_once_and_changes_no_reply(bundle):
    system = " ".join(f"fact{i} w{i % 9}" for i in range(40))  # a long shared system prompt
    messages = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    cold = Live(open_bundle(bundle, quiet=True).engine(ServeSettings(max_batch=2, speculation="off")))
    warm = Live(open_bundle(bundle, quiet=True).engine(ServeSettings(max_batch=2, speculation="off")))
    try:
        ask = lambda live, q: live.client.chat.completions.create(  # noqa: E731
            model=NAME, messages=messages(q), max_tokens=12, temperature=0)
        first = ask(warm, "question one")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        before = [r.prefill for r in warm.engine.records if r.prefill]
        second = ask(warm, "question two")
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= 16 * (first.usage.prompt_tokens // 16 - 2) and cached % 16 == 0
        prefilled = sum(p[1] for p in [r.prefill for r in warm.engine.records if r.prefill][len(before):])
        assert prefilled == second.usage.prompt_tokens - cached  # only the rest was prefilled
        assert second.choices[0].message.content == ask(cold, "question two").choices[0].message.content
        assert "yggdrasil_prompt_tokens_cached_total" in httpx.get(warm.url + "/metrics").text
    finally:
        cold.close()
        warm.close()


def test_eviction_under_a_small_kv_budget_keeps_serving(bundle):
    from yggdrasil.serve.memory import kv_bytes_per_token

    models = open_bundle(bundle, quiet=True).models()
    per_token = sum(kv_bytes_per_token(m.model) for m in (models.target, models.draft))
    live = Live(open_bundle(bundle, quiet=True).engine(ServeSettings(
        max_batch=2, speculation="off", kv_budget=str(24 * 16 * per_token), swap_space="0")))
    try:
        prompts = [" ".join(f"p{k} w{(k * j) % 11}" for j in range(12)) for k in range(6)]  # ~9 blocks each
        for round_ in range(2):
            for prompt in prompts:
                reply = live.client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
                assert reply.usage.completion_tokens == 6
        assert live.engine.pool.cache.evictions > 0
    finally:
        live.close()


def test_api_keys_are_required_on_v1_routes_only(bundle):
    live = Live(open_bundle(bundle, quiet=True).engine(ServeSettings(max_batch=1, speculation="off")),
                api_keys=("key-one", "key-two"))
    try:
        assert _chat(live.client, "hi", max_tokens=2).usage.completion_tokens == 2
        other = openai.OpenAI(base_url=live.url + "/v1", api_key="key-two", max_retries=0)
        assert [m.id for m in other.models.list()] == [NAME]
        for key in ("wrong", ""):
            client = openai.OpenAI(base_url=live.url + "/v1", api_key=key or "x", max_retries=0)
            if not key:  # no Authorization header at all
                response = httpx.get(live.url + "/v1/models")
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
                continue
            with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
                _chat(client, "hi", max_tokens=2)
        assert httpx.get(live.url + "/health").status_code == 200  # probes stay open
        models = httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer key-one"}).json()["data"][0]
        assert models["context_length"] == CONTEXT and models["max_model_len"] == CONTEXT
    finally:
        live.close()


def test_max_body_bytes_zero_means_no_limit():
    import asyncio

    class Request:
        headers = {"content-length": str(3 * 2**20)}

        async def stream(self):
            for _ in range(3):
                yield b"x" * 2**20

    assert parse_bytes("0", "--max-body-bytes") == 0
    assert len(asyncio.run(read_body(Request(), None))) == 3 * 2**20


@pytest.mark.slow
def test_smollm2_json_schema_and_tools_through_the_official_client():
    """SmolLM2 (no tool template: the generic format) on an eager engine with prompt lookup:
    json_schema replies validate on held-out prompts; a required call parses and validates."""
    from yggdrasil.models.catalog import model_statuses
    from yggdrasil.models.loader import load
    from yggdrasil.serve.engine import Engine, EngineSettings
    from yggdrasil.serve.drafting import LookupProposer
    from yggdrasil.serve.goodput import SpeculationLength

    if not any(s.name == "smollm2-135m" and s.installed for s in model_statuses()):
        pytest.skip("smollm2-135m not installed")
    target = load("smollm2-135m", quiet=True)
    engines = {mode: Engine(target.model, target.tokenizer, EngineSettings(max_context=1024, max_batch=2),
                            SpeculationLength(mode, 4, None, 4 if mode == "fixed" else 0),
                            lambda pool: LookupProposer()) for mode in ("fixed", "off")}
    live = {("fixed:3" if mode == "fixed" else "off"): Live(engine) for mode, engine in engines.items()}
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "category": {"enum": ["fruit", "vegetable", "grain"]},
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3}},
        "required": ["name", "category", "colors"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "food", "schema": schema, "strict": True}}
    try:
        for food in ("a pear", "a leek", "barley", "a plum"):
            reply = _both(live, lambda c: _chat(c, f"Describe {food} as JSON.", response_format=fmt)
                          .choices[0].message.content)
            jsonschema.validate(json.loads(reply), schema)
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
        reply = _chat(live["off"].client, "What is the weather in Paris?", tools=[tool], tool_choice="required")
        assert reply.model_extra["tool_format"] == "generic" and reply.choices[0].finish_reason == "tool_calls"
        call = reply.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    finally:
        for server in live.values():
            server.close()


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path):
    from yggdrasil.errors import InvalidRequestError
    from yggdrasil.serve.auth import check_key, is_loopback, load_keys

    key_file = tmp_path / "keys"
    key_file.write_text("# the team's keys\nfile-key\n\n")
    keys = load_keys(["flag-key"], str(key_file), {"YGGDRASIL_API_KEY": "env-one, env-two"})
    assert keys == ("flag-key", "file-key", "env-one", "env-two")
    assert check_key("Bearer env-two", keys) is None and "incorrect" in check_key("Bearer nope", keys)
    assert "needs an API key" in check_key(None, keys) and "needs an API key" in check_key("Basic x", keys)
    with pytest.raises(InvalidRequestError, match="holds no key"):
        (tmp_path / "empty").write_text("# none\n")
        load_keys([], str(tmp_path / "empty"), {})
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
