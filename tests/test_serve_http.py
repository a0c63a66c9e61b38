"""`yggdrasil serve` over HTTP on a tiny bundle: the official openai client, 8 concurrent
clients, overload, bad input, a client that disconnects, /metrics, and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from helpers import write_tiny_chat_recipe_dir
from live_server import LiveApp, free_port

from yggdrasil.cli import main as cli_main
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.bundle import open_bundle
from yggdrasil.models.loader import load
from yggdrasil.serve.api import create_app
from yggdrasil.serve.setup import ServeSettings
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.models.tokenizer import Message

CONTEXT = 512
NAME = "tiny-serve-cpu"


def _words(start: int, n: int) -> str:
    return " ".join(f"w{5 + (start + 7 * i) % 200}" for i in range(n))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe

    root = tmp_path_factory.mktemp("tiny-serve")
    recipe_path = write_tiny_chat_recipe_dir(root, NAME, CONTEXT)
    build_bundle(load_recipe(recipe_path), root / "bundle", log=lambda _: None)
    return root, root / "bundle"


class LiveServer(LiveApp):
    """The real app under uvicorn in a thread, on a free loopback port."""

    def __init__(self, bundle_dir, **engine_options) -> None:
        self.engine = open_bundle(bundle_dir, quiet=True).engine(ServeSettings(**engine_options))
        super().__init__(create_app(self.engine, NAME))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def server(bundle):
    live = LiveServer(bundle[1], max_batch=4, max_queue=16)
    yield live
    live.close()


@pytest.fixture(scope="module")
def small_server(bundle):
    live = LiveServer(bundle[1], max_batch=1, max_queue=2)
    yield live
    live.close()


@pytest.fixture(scope="module")
def reference(bundle):
    """Plain eager greedy text for a prompt (token ids), the single-request answer."""
    loaded = load(str(bundle[0] / "tiny-random"), dtype=torch.float32, quiet=True)
    runner = StepRunner(loaded.model, CONTEXT, 16)

    def text(prompt_ids: list[int], n: int) -> str:
        return loaded.tokenizer.decode(greedy_tokens(runner, prompt_ids, n))

    text.tokenizer = loaded.tokenizer
    return text


def _generate_cli(capsys, model_dir, prompt: str, n: int, chat: bool) -> str:
    capsys.readouterr()
    args = ["generate", "--model", str(model_dir), "--prompt", prompt, "--max-new-tokens", str(n),
            "--max-context", str(CONTEXT), "--no-stats"]
    assert cli_main(args + (["--chat"] if chat else [])) == 0
    return capsys.readouterr().out.removesuffix("\n")


def test_openai_client_chat_and_completion_equal_generate(server, bundle, capsys):
    model_dir, user = bundle[0] / "tiny-random", _words(3, 9)
    chat_expected = _generate_cli(capsys, model_dir, user, 20, chat=True)
    completion_expected = _generate_cli(capsys, model_dir, _words(40, 6), 20, chat=False)
    messages = [{"role": "user", "content": user}]

    reply = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == chat_expected
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 20
    pieces = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(pieces)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20

    completion = server.client.completions.create(model=NAME, prompt=_words(40, 6), max_tokens=20, temperature=0)
    assert completion.choices[0].text == completion_expected
    streamed = server.client.completions.create(model=NAME, prompt=_words(40, 6), max_tokens=20, temperature=0,
                                                stream=True)
    assert "".join(c.choices[0].text for c in streamed) == completion_expected
    assert [m.id for m in server.client.models.list()] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_eight_concurrent_clients_each_get_their_single_request_reply(server, reference):
    prompts = [_words(11 * i, 3 + 9 * i) for i in range(8)]  # 3..66 tokens: several prefill chunks
    lengths = [12 + 5 * i for i in range(8)]

    def ask(i: int) -> str:
        reply = server.client.completions.create(model=NAME, prompt=prompts[i], max_tokens=lengths[i],
                                                 temperature=0, stream=i % 2 == 1)
        return reply.choices[0].text if i % 2 == 0 else "".join(c.choices[0].text for c in reply)

    before = server.engine.metrics.steps
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(8)))
    for i, reply in enumerate(replies):
        assert reply == reference(reference.tokenizer.encode(prompts[i]), lengths[i]), f"client {i}"
    records = [r for r in server.engine.records if r.index >= before]
    assert server.engine.compiled and server.engine.forward.graph.seconds > 0  # on the serve graphs
    assert max(len(r.decoding) for r in records) >= 3  # batched
    assert all(r.prefill is None or r.prefill[1] <= 16 for r in records)  # chunked
    metrics = httpx.get(server.url + "/metrics").text
    assert 'yggdrasil_requests_total{outcome="length"}' in metrics
    assert "yggdrasil_time_to_first_token_seconds_count" in metrics and "yggdrasil_kv_usage_ratio" in metrics


def test_a_small_kv_budget_preempts_and_refuses_what_cannot_fit(bundle, reference):
    """--kv-budget of 8 blocks (128 tokens): 6 clients all get their unpressured replies, and a
    prompt beyond the pool gets a 400 that names the budget."""
    from yggdrasil.serve.memory import kv_bytes_per_token

    loaded = open_bundle(bundle[1], quiet=True).models()
    models = [loaded.target.model] + ([loaded.draft.model] if loaded.draft is not None else [])
    budget = 8 * 16 * sum(kv_bytes_per_token(m) for m in models)
    live = LiveServer(bundle[1], max_batch=4, max_queue=16, kv_budget=str(budget), swap_space=str(budget // 4))
    try:
        assert live.engine.request_limit == 128 and live.engine.can_run_short
        prompts = [_words(13 * i, 10 + 4 * i) for i in range(6)]

        def ask(i: int) -> str:
            return live.client.completions.create(model=NAME, prompt=prompts[i], max_tokens=40,
                                                  temperature=0).choices[0].text

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(ask, range(6)))
        for i, reply in enumerate(replies):
            assert reply == reference(reference.tokenizer.encode(prompts[i]), 40), f"client {i}"
        assert live.engine.scheduler.preemptions
        metrics = httpx.get(live.url + "/metrics").text
        assert 'yggdrasil_preemptions_total{mode="swap"}' in metrics
        assert "yggdrasil_preemption_cost_error_ratio" in metrics
        response = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": _words(0, 200)})
        assert response.status_code == 400
        assert "KV budget (--kv-budget) holds 128 tokens per request" in response.json()["error"]["message"]
    finally:
        live.close()


@pytest.mark.parametrize("n_blocks", [4, 40])
def test_the_serve_graphs_equal_eager_forwards_over_any_pool(bundle, n_blocks):
    """One compiled graph per model serves any pool size, rows, logit rows and span: logits and
    the K/V it writes equal the eager forward's over a run of mixed steps."""
    from yggdrasil.buckets import SERVE_STAGE
    from yggdrasil.serve.pool import Segment, SlotPool, run_segments

    opened = open_bundle(bundle[1], quiet=True)
    graphs, models = opened.serve_graphs(), opened.models()
    assert set(graphs) == {"target", "draft"}
    for role, loaded in (("target", models.target), ("draft", models.draft)):
        graph, model = graphs[role].get(SERVE_STAGE), loaded.model
        pool = SlotPool(n_blocks, 16)
        ids = [5 + (7 * i) % 90 for i in range(40)]
        pool.reserve(1, 40)
        pool.reserve(2, 8)
        steps = [[Segment(1, tuple(ids[:16]), 0, "none")],
                 [Segment(1, tuple(ids[16:24]), 16, "last"), Segment(2, tuple(ids[:3]), 0, "all")],
                 [Segment(2, (ids[3],), 3, "all")],
                 [Segment(2, tuple(ids[4:7]), 4, "all"), Segment(1, tuple(ids[24:40]), 24, "last")]]
        eager_cache, compiled_cache = pool.new_cache(model), pool.new_cache(model)
        for segments in steps:
            eager = run_segments(model, eager_cache, pool, segments)
            compiled = run_segments(model, compiled_cache, pool, segments, graph)
            for a, b in zip(eager, compiled):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        for a, b in zip(eager_cache.keys + eager_cache.values, compiled_cache.keys + compiled_cache.values):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_bad_requests_get_openai_style_400s(server):
    url = server.url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "w5 w6"}]
    cases = [
        ("{not json", "not valid JSON"),
        ({"model": NAME}, "'messages' is required"),
        ({"model": NAME, "messages": [{"role": "robot", "content": "x"}]}, "needs a 'role'"),
        ({"model": NAME, "messages": messages, "temperature": 3}, "'temperature' must be between 0 and 2"),
        ({"model": NAME, "messages": messages, "max_tokens": "ten"}, "'max_tokens' must be an integer"),
        ({"model": NAME, "messages": messages, "top_p": 0}, "top_p must be in (0, 1]"),
        ({"model": NAME, "messages": messages, "n": 2}, "'n' must be 1"),
        ({"model": NAME, "messages": messages, "stop": ["a", "b", "c", "d", "e"]}, "up to 4 strings"),
        ({"model": NAME, "messages": messages, "max_tokens": CONTEXT}, "exceeds the limit: the context holds 512"),
        ({"model": NAME, "messages": [{"role": "user", "content": _words(0, 600)}]}, "context holds 512"),
    ]
    for body, phrase in cases:
        content = body if isinstance(body, str) else json.dumps(body)
        response = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert phrase in error["message"] and error["type"] == "invalid_request_error", error
    # an unknown model is a 404 model_not_found, as OpenAI answers it
    response = httpx.post(url, json={"model": "gpt-4", "messages": messages})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert "is not served here" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        server.client.chat.completions.create(model="other", messages=messages)


def test_full_queue_answers_429_with_retry_after(small_server):
    engine = small_server.engine
    engine.hold()
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(small_server.client.completions.create, model=NAME, prompt="w5 w6",
                                   max_tokens=4, temperature=0) for _ in range(2)]
            deadline = time.time() + 20
            while engine.pending()[0] < 2:
                assert time.time() < deadline
                time.sleep(0.02)
            response = httpx.post(small_server.url + "/v1/completions",
                                  json={"model": NAME, "prompt": "w7", "max_tokens": 4})
            assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
            assert "--max-queue 2" in response.json()["error"]["message"]
            engine.hold(False)
            assert all(len(f.result(timeout=60).choices[0].text) > 0 for f in waiting)
    finally:
        engine.hold(False)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(small_server, reference):
    engine = small_server.engine
    cancelled = engine.metrics.requests.get("cancelled", 0)
    body = {"model": NAME, "prompt": "w9 w10 w11", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", small_server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        engine.hold()  # nothing more is generated until the cancel is in
    try:
        deadline = time.time() + 20
        while engine.pending()[1] < 1:
            assert time.time() < deadline, "the disconnect never reached the engine"
            time.sleep(0.02)
    finally:
        engine.hold(False)
    # max_batch is 1: the next request can only run once the abandoned one left
    reply = small_server.client.completions.create(model=NAME, prompt="w20 w21", max_tokens=8, temperature=0)
    assert reply.choices[0].text == reference(reference.tokenizer.encode("w20 w21"), 8)
    assert engine.metrics.requests.get("cancelled", 0) == cancelled + 1


def test_sigterm_finishes_the_stream_in_flight_then_exits(bundle):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "yggdrasil", "serve", str(bundle[1]), "--port", str(port),
                                "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=env, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None and time.time() < deadline, process.stdout.read() if process.poll() else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": NAME, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 60,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_taken_port_is_a_one_line_error(bundle):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "yggdrasil", "serve", str(bundle[1]), "--port", str(port),
                               "--log-level", "warning"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr == f"error: port {port} on 127.0.0.1 is in use (another server?); stop it or choose another --port\n"


def test_chat_template_prompt_matches_the_tokenizer(server, reference):
    """The chat route renders messages with the model's template, as `generate --chat` does."""
    messages = [Message("system", "w8"), Message("user", "w9 w10")]
    ids = reference.tokenizer.encode_chat(messages)
    reply = server.client.chat.completions.create(
        model=NAME, messages=[{"role": m.role, "content": m.content} for m in messages], max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == reference(ids, 10)
    assert reply.usage.prompt_tokens == len(ids)


def test_a_bundle_opened_for_serve_builds_no_single_request_runner_or_cache(bundle, monkeypatch):
    """open_bundle builds nothing; engine() loads the models and serve graphs only: no step
    runner and no max_context KV cache of the single-request path is made."""
    from yggdrasil.runtime import steps
    from yggdrasil.models.model import Transformer

    made, caches = [], []
    monkeypatch.setattr(steps.StepRunner, "__init__", lambda self, *a, **k: made.append(a))
    real_setup = Transformer.setup_cache
    monkeypatch.setattr(Transformer, "setup_cache",
                        lambda self, *a, **k: caches.append(a) or real_setup(self, *a, **k))
    opened = open_bundle(bundle[1], quiet=True)
    assert opened._models is None and opened._serve_graphs is None  # nothing loaded yet
    engine = opened.engine(ServeSettings(max_batch=2, kv_budget="4MiB", swap_space="0"))
    assert engine.compiled and made == [] and caches == []
