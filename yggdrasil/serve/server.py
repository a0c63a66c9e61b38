"""Running the server: the listening socket, uvicorn in a thread, and the graceful shutdown.

The socket is bound before the bundle loads, so a taken port or a bad --host fails at once with
one line, and "serving on" is printed only once uvicorn serves on it. Clients that connect while
the server starts are refused (the socket listens only when serving starts), not left hanging.

On SIGTERM or SIGINT the engine drains (engine.py: new requests get 503, queued ones are cancelled
with an error, running ones finish or are cut with an error at the timeout) while uvicorn stops
accepting and waits for the responses to end; a second signal cuts everything at once.
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
from typing import Callable

import uvicorn
from fastapi import FastAPI

from yggdrasil.errors import YggdrasilError
from .engine import Engine

BACKLOG = 128
# uvicorn's own limit on the shutdown, past the engine's: the engine ends every reply at its
# timeout, so this only catches a response that never ends
UVICORN_GRACE_SECONDS = 15


class BindError(YggdrasilError):
    """The server cannot listen on the address asked for."""


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet), or a BindError that says what to do."""
    if not 0 <= port <= 65535:
        raise BindError(f"--port must be between 0 and 65535 (0 picks a free port), got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise BindError(f"--host {host!r} is not an address ({exc}); use 127.0.0.1 (this machine only) "
                        "or 0.0.0.0 (the LAN)") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise BindError(_bind_failure(host, port, exc)) from None
    return sock


def _bind_failure(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use (another server?); stop it or choose another --port"
    if exc.errno == errno.EACCES:
        return f"binding {host}:{port} is not permitted (ports below 1024 need privileges); choose another --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host} is not an address of this machine; use 127.0.0.1 (this machine only) "
                "or 0.0.0.0 (the LAN)")
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def url(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (the port it got, for --port 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn, telling on_started once it serves."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_started = on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()


def serve(app: FastAPI, engine: Engine, sock: socket.socket, shutdown_timeout: float, log_level: str,
          on_started: Callable[[], None]) -> bool:
    """Serve app on sock until a signal (see the module doc); whether serving ever started.

    The engine steps on this (the main) thread, where the weights were loaded: PyTorch's OpenMP
    pool is fast only on the thread that used it first (see engine.py); uvicorn runs in a thread."""
    config = uvicorn.Config(app, log_level=log_level,
                            timeout_graceful_shutdown=int(shutdown_timeout) + UVICORN_GRACE_SECONDS)
    server = _Server(config, on_started)
    try:
        sock.listen(BACKLOG)
    except OSError as exc:  # another process bound the port meanwhile (SO_REUSEADDR)
        raise BindError(f"cannot listen on {url(sock)[7:]}: {exc.strerror or exc}; choose another --port") from None
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="yggdrasil-http", daemon=True)
    handler = _shutdown_handler(server, engine, shutdown_timeout)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        http.start()
        # the responses in flight after a signal need the engine, so it steps until uvicorn is done
        engine.run(should_stop=lambda: not http.is_alive())
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        server.should_exit = True
        http.join(5)
        engine.stop()
    return server.started


def _shutdown_handler(server: uvicorn.Server, engine: Engine, timeout: float):
    """A signal handler: drain the engine and let uvicorn finish; a second signal cuts the
    replies still running and stops at once."""

    def handler(signum, frame) -> None:
        if server.should_exit:
            engine.drain(0)
            server.force_exit = True
        engine.drain(timeout)
        server.should_exit = True

    return handler
