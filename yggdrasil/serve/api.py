"""The HTTP face of `yggdrasil serve`: OpenAI-compatible routes over one Engine (FastAPI).

Each request becomes a GenerationRequest submitted to the engine; the engine thread pushes its
tokens into an asyncio queue through call_soon_threadsafe, and the route turns them into one JSON
response or an SSE stream of OpenAI chunks. A client that goes away cancels its request, which
frees its batch slot at the engine's next step.

One client must not stall the others, whose streams are written by this same event loop: a body
over max_body_bytes is refused (413) from its Content-Length before it is read, and parsing,
validation and tokenization run in a worker thread. Every error, 404 and 405 included, has
OpenAI's shape. With API keys, every /v1 route wants one (auth.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from yggdrasil.errors import InvalidRequestError
from yggdrasil.structured.tools import ToolStream
from .auth import check_key
from .engine import Engine, QueueFullError, ShuttingDownError
from .protocol import BadRequest, ParsedRequest, error_body, parse_request
from .requests import TokenLogprob, Usage
from .responses import Reply, call_deltas, chunk, full_response, logprobs_body, new_id

log = logging.getLogger("yggdrasil.serve")
DISCONNECT_POLL_SECONDS = 0.25
DEFAULT_MAX_BODY_BYTES = 2**20
ROUTES = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health and GET /metrics"


class QueueSink:
    """Engine events for one request, handed to the event loop thread-safely."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue = loop, asyncio.Queue()

    def _put(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
            pass

    def tokens(self, ids: list[int], text: str, logprobs: list[TokenLogprob] | None = None) -> None:
        self._put(("tokens", text, logprobs or []))

    def finish(self, reason: str, usage: Usage) -> None:
        self._put(("finish", reason, usage))

    def fail(self, message: str) -> None:
        self._put(("error", message))


class BodyTooLarge(Exception):
    """The request body is over the server's limit."""


def _error(status: int, message: str, kind: str, headers: dict | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code=code), status_code=status, headers=headers)


async def read_body(request: Request, limit: int | None) -> bytes:
    """The body, refused (BodyTooLarge) from its Content-Length before reading when that is over
    limit, else as soon as what arrived is (limit None: no limit)."""
    declared = request.headers.get("content-length", "")
    if limit is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if limit is not None and size > limit:
            raise BodyTooLarge
        chunks.append(piece)
    return b"".join(chunks)


def parse_body(raw: bytes, kind: str, engine: Engine, model_name: str) -> ParsedRequest:
    """JSON, validation and tokenization of a request (run in a worker thread)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body nests too deeply to be a chat or completion request") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise BadRequest(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    try:
        parsed = parse_request(kind, body, engine.tokenizer, model_name, engine.request_limit, engine.limit_text,
                               engine.grammars)
    except RecursionError:
        raise BadRequest("the request nests too deeply") from None
    if parsed.generation.logprobs is not None:
        engine.grammars.ll_tokenizer  # the tokens' bytes come from it: built here, off the event loop
    return parsed


def create_app(engine: Engine, model_name: str, owns_engine: bool = True,
               max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES, api_keys: tuple[str, ...] = (),
               keys_for_all_routes: bool = False) -> FastAPI:
    """The app; with owns_engine it starts the engine on startup and stops it on shutdown.
    Request bodies over max_body_bytes get a 413 (None: no limit). api_keys: the keys a client
    must send (Authorization: Bearer KEY) on every /v1 route, and with keys_for_all_routes on
    /health and /metrics too; none: no authentication."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if owns_engine:
            engine.start()
        yield
        if owns_engine:
            engine.stop()

    app = FastAPI(title="yggdrasil serve", lifespan=lifespan)
    started = int(time.time())

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_keys and (keys_for_all_routes or request.url.path.startswith("/v1")):
            refusal = check_key(request.headers.get("authorization"), api_keys)
            if refusal is not None:
                return _error(401, refusal, "invalid_request_error", {"WWW-Authenticate": "Bearer"},
                              code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """404, 405 and the like in OpenAI's shape."""
        where = f"{request.method} {request.url.path}"
        messages = {404: f"there is no {where}; this server has {ROUTES}",
                    405: f"{where} is not allowed; this server has {ROUTES}"}
        return _error(exc.status_code, messages.get(exc.status_code, f"{where}: {exc.detail}"),
                      "invalid_request_error", getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        if engine.draining:
            return _error(503, "the server is shutting down", "server_error", code="server_shutting_down")
        if not engine.alive:
            return _error(503, "the engine is not running", "server_error")
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "yggdrasil", "context_length": engine.settings.max_context,
                                            "max_model_len": engine.request_limit}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, "completion")

    async def _complete(request: Request, kind: str):
        try:
            raw = await read_body(request, max_body_bytes)
        except BodyTooLarge:
            # Connection: close, as the rest of the body may still be on its way
            return _error(413, f"the request body is over {max_body_bytes} bytes, this server's limit "
                               "(--max-body-bytes); send a shorter request", "invalid_request_error",
                          {"Connection": "close"}, code="request_too_large")
        except ClientDisconnect:
            return _error(499, "the client closed the request", "invalid_request_error")
        try:  # off the event loop, which meanwhile writes every other client's stream
            parsed = await asyncio.to_thread(parse_body, raw, kind, engine, model_name)
        except BadRequest as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        sink = QueueSink(asyncio.get_running_loop())
        try:
            rid = engine.submit(parsed.generation, sink, parsed.matcher)
        except QueueFullError as exc:
            return _error(429, str(exc), "rate_limit_error", {"Retry-After": str(exc.retry_after)})
        except ShuttingDownError as exc:
            return _error(503, str(exc), "server_error", code="server_shutting_down")
        except InvalidRequestError as exc:
            return _error(400, str(exc), "invalid_request_error")
        if parsed.stream:
            return StreamingResponse(_stream(engine, parsed, rid, sink), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(engine, request, parsed, rid, sink)

    return app


def _token_bytes(engine: Engine):
    return lambda token: engine.grammars.ll_tokenizer.decode_bytes([token])


async def _collect(engine: Engine, request: Request, parsed: ParsedRequest, rid: int, sink: QueueSink):
    """Wait for the whole reply, cancelling the request if the client disconnects meanwhile."""
    text, logprobs = [], []
    while True:
        try:
            event = await asyncio.wait_for(sink.queue.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                engine.cancel(rid)
                return _error(499, "the client closed the request", "invalid_request_error")
            continue
        if event[0] == "tokens":
            text.append(event[1])
            logprobs += event[2]
        elif event[0] == "error":
            return _error(500, event[1], "server_error")
        else:
            _, reason, usage = event
            if reason == "cancelled":
                return _error(503, _shutdown_message(usage), "server_error", code="server_shutting_down")
            reply = Reply("".join(text), reason, usage, logprobs)
            return JSONResponse(full_response(parsed, new_id(parsed.kind), reply, _token_bytes(engine)),
                                headers={"X-Yggdrasil-Tool-Format": parsed.tools.format} if parsed.tools else None)


def _shutdown_message(usage: Usage) -> str:
    """Why a request was cancelled by the engine (only drain and stop cancel on their own)."""
    if usage.completion_tokens == 0:
        return "the server is shutting down and cancelled this request before it started; retry it"
    return "the server is shutting down and cut this reply short (the graceful shutdown timeout passed)"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _stream(engine: Engine, parsed: ParsedRequest, rid: int, sink: QueueSink):
    """SSE chunks as tokens arrive; a client that goes away closes this generator, which cancels
    the request. With tools, the reply is read as it comes (ToolStream): text that may begin a
    call is held back, and each call is sent once complete (id and name, then its arguments)."""
    out = _Chunks(engine, parsed)
    finished = False
    try:
        while True:
            event = await sink.queue.get()
            if event[0] == "tokens":
                for piece in out.tokens(event[1], event[2]):
                    yield piece
            elif event[0] == "error":
                finished = True
                yield _sse(error_body(event[1], "server_error"))
                break
            else:
                finished = True
                _, reason, usage = event
                if reason == "cancelled":
                    yield _sse(error_body(_shutdown_message(usage), "server_error", code="server_shutting_down"))
                    break
                for piece in out.finish(reason, usage):
                    yield piece
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.cancel(rid)


class _Chunks:
    """One streamed reply's SSE chunks: text (through the tool reader, if tools are on) and each
    token's logprobs as they come, then the finish and usage chunks."""

    def __init__(self, engine: Engine, parsed: ParsedRequest) -> None:
        self.parsed, self.rid, self.first = parsed, new_id(parsed.kind), True
        self.reader = ToolStream(parsed.tools.format) if parsed.tools is not None else None
        self.token_bytes, self.offset, self.calls = _token_bytes(engine), 0, 0
        self.chat = parsed.kind == "chat"

    def _chunk(self, text: str | None, **fields) -> str:
        body = chunk(self.parsed, self.rid, text, None, first=self.first and self.chat, **fields)
        self.first = False
        return _sse(body)

    def _events(self, events: list, logprobs: dict | None) -> list[str]:
        out = []
        if logprobs is not None and not any(kind == "content" for kind, _ in events):
            events = [("content", "")] + events  # the logprobs ride on a chunk of their own
        for kind, value in events:
            if kind == "content" and (value or self.first or logprobs is not None):
                out.append(self._chunk(value, logprobs=logprobs))
                logprobs = None
            elif kind == "call":
                out += [self._chunk(None, tool_call=delta) for delta in call_deltas(self.calls, value)]
                self.calls += 1
        return out

    def tokens(self, text: str, logprobs: list) -> list[str]:
        lp = None
        if self.parsed.generation.logprobs is not None and logprobs:
            lp = logprobs_body(self.parsed.kind, logprobs, self.token_bytes, self.offset)
        self.offset += len(text)
        return self._events([("content", text)] if self.reader is None else self.reader.push(text), lp)

    def finish(self, reason: str, usage: Usage) -> list[str]:
        out = self._events(self.reader.finish(), None) if self.reader is not None else []
        if self.first and self.chat:
            out.append(self._chunk(""))
        if self.calls and reason == "stop":
            reason = "tool_calls"
        out.append(_sse(chunk(self.parsed, self.rid, None, reason)))
        if self.parsed.include_usage:
            out.append(_sse(chunk(self.parsed, self.rid, None, None, usage=usage)))
        return out
