"""`yggdrasil serve BUNDLE`: the bundle's serving engine behind the HTTP server."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from yggdrasil.errors import InvalidRequestError
from .common import add_verify_bundle_arg

DEFAULT_PORT = 8000


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API",
                           description="Serve a bundle to a few concurrent clients: POST /v1/chat/completions "
                                       "and /v1/completions (streaming or not), GET /v1/models, /health and "
                                       "/metrics. Requests are batched per step with chunked prefill; "
                                       "speculation follows the load.")
    serve.add_argument("bundle", help="bundle directory from `yggdrasil compile`")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1, this machine only; 0.0.0.0 opens it to the LAN)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--max-batch", type=int, default=4, help="requests decoded together (default 4)")
    serve.add_argument("--max-queue", type=int, default=16,
                       help="requests that may wait for a batch slot; beyond it clients get 429 (default 16)")
    serve.add_argument("--speculation", default="goodput",
                       help="goodput (pick the speculation length per step for the load, default), "
                            "off, or fixed:K (always K draft tokens)")
    serve.add_argument("--kv-budget", default="auto",
                       help="bytes for the KV cache pool, e.g. 512MiB or 2GiB; past it requests are preempted "
                            "(auto: what the device has free, up to max-batch full contexts)")
    serve.add_argument("--swap-space", default="auto",
                       help="host bytes for the KV of preempted requests, e.g. 1GiB; 0 never swaps "
                            "(auto: a quarter of the free host memory)")
    serve.add_argument("--preemption", default="auto", choices=("auto", "swap", "recompute"),
                       help="how requests give up KV memory: auto picks the cheaper of swap and recompute "
                            "by measured cost (default auto)")
    serve.add_argument("--eager", action="store_true",
                       help="run eager forwards instead of the bundle's compiled serve graphs (for comparison)")
    serve.add_argument("--max-body-bytes", default="1MiB",
                       help="largest request body, e.g. 1MiB or 4MiB; larger ones get 413 unread; 0 sets no "
                            "limit (default 1MiB)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="a key clients must send (Authorization: Bearer KEY) on every /v1 route; repeat for "
                            "several (also --api-key-file, or YGGDRASIL_API_KEY with keys separated by commas)")
    serve.add_argument("--api-key-file", default=None, metavar="FILE", help="API keys, one per line")
    serve.add_argument("--api-key-all-routes", action="store_true",
                       help="with keys: /health and /metrics want one too (default: they stay open)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM or Ctrl-C before they are "
                            "cut with an error (default 30)")
    add_verify_bundle_arg(serve)
    serve.add_argument("--model-name", default=None, help="model id clients use (default: the recipe name)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="server log level (default info)")


@dataclass(frozen=True)
class ServeOptions:
    bundle: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_batch: int = 4
    max_queue: int = 16
    speculation: str = "goodput"  # goodput | off | fixed:K
    model_name: str | None = None
    log_level: str = "info"
    kv_budget: str = "auto"  # bytes for the KV pool, or auto
    swap_space: str = "auto"  # host bytes for swapped-out KV, or auto
    preemption: str = "auto"  # auto | swap | recompute
    eager: bool = False  # eager forwards instead of the bundle's serve graphs
    max_body_bytes: str = "1MiB"  # larger request bodies get 413
    shutdown_timeout: float = 30.0  # seconds running requests get after a signal
    verify_bundle: bool = False  # hash every artifact of the bundle at open
    api_keys: tuple[str, ...] = ()  # clients must send one (none: no authentication)
    api_key_file: str | None = None
    keys_for_all_routes: bool = False  # /health and /metrics want a key too

    @property
    def settings(self):
        from yggdrasil.serve.setup import ServeSettings

        return ServeSettings(self.max_batch, self.max_queue, self.speculation, self.kv_budget, self.swap_space,
                             self.preemption, self.eager)

    @classmethod
    def from_args(cls, args) -> "ServeOptions":
        return cls(args.bundle, args.host, args.port, args.max_batch, args.max_queue, args.speculation,
                   args.model_name, args.log_level, args.kv_budget, args.swap_space, args.preemption,
                   args.eager, args.max_body_bytes, args.shutdown_timeout, getattr(args, "verify_bundle", False),
                   tuple(getattr(args, "api_key", ())), getattr(args, "api_key_file", None),
                   getattr(args, "api_key_all_routes", False))


def run(opts: ServeOptions) -> int:
    from yggdrasil.bundle import open_bundle
    from yggdrasil.runtime.ranks import rank_from_environment
    from yggdrasil.serve.api import create_app
    from yggdrasil.serve.auth import is_loopback, load_keys
    from yggdrasil.serve.memory import parse_bytes
    from yggdrasil.serve.server import bind, serve, url

    logging.basicConfig(level=opts.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    for text, option in ((opts.kv_budget, "--kv-budget"), (opts.swap_space, "--swap-space")):
        parse_bytes(text, option)  # a typo fails before the weights load
    max_body = parse_bytes(opts.max_body_bytes, "--max-body-bytes")
    if max_body is None or not opts.shutdown_timeout >= 0:
        raise InvalidRequestError("--max-body-bytes must be a size (0: no limit) and --shutdown-timeout at least 0, "
                                  f"got {opts.max_body_bytes} and {opts.shutdown_timeout}")
    keys = load_keys(list(opts.api_keys), opts.api_key_file)
    if not keys and not is_loopback(opts.host):
        print(f"warning: --host {opts.host} is reachable from other machines and no --api-key is set: anyone "
              "who can reach it can use this server", file=sys.stderr, flush=True)
    launched = rank_from_environment()
    if launched is not None and launched[0] != 0:
        # a torchrun rank other than 0 of a tensor-parallel bundle binds nothing: it runs only the
        # target's steps that rank 0's server sends (loading the engine follows them, then exits)
        open_bundle(Path(opts.bundle), verify=opts.verify_bundle).engine(opts.settings)
        return 0
    sock = bind(opts.host, opts.port)  # a taken port fails now, not after the weights load
    bundle = None
    try:
        bundle = open_bundle(Path(opts.bundle), verify=opts.verify_bundle)
        world = int(bundle.recipe.get("tensor_parallel", 1) or 1)
        if world > 1:
            print(f"note: {opts.bundle} splits its target over {world} ranks (tensor_parallel), which run eager "
                  "sharded forwards over the server's KV pool, each rank holding its own K/V heads",
                  file=sys.stderr, flush=True)
        elif not opts.eager and bundle.manifest.steps == "eager":
            print(f"note: {opts.bundle} runs its models' eager steps (the torch that compiled it could not load "
                  "AOTInductor packages), so the server runs eager forwards", file=sys.stderr, flush=True)
        elif not opts.eager and bundle.recipe.get("serve_graphs") is False:
            print(f"note: {opts.bundle} was compiled without serve graphs (serve_graphs: false in its recipe), so the "
                  "server runs eager forwards; set serve_graphs: true (or leave it out) and recompile to serve on "
                  "compiled graphs", file=sys.stderr, flush=True)
        elif not opts.eager and "target" not in bundle.serve_graphs():
            print(f"note: {opts.bundle} has no serve graphs (compiled by an older yggdrasil), so the server runs "
                  f"eager forwards; recompile it ({bundle.rebuild}) "
                  "to serve on compiled graphs", file=sys.stderr, flush=True)
        engine = bundle.engine(opts.settings, report=lambda line: print(line, file=sys.stderr, flush=True))
        name = opts.model_name or bundle.recipe["name"]
        serving = (f"serving {name} from {opts.bundle} on {url(sock)}/v1 (batch <= {opts.max_batch}, queue <= "
                   f"{opts.max_queue}, speculation {engine.speculation.mode}"
                   f"{', ' + engine.proposer.kind if engine.proposer else ''})")
        app = create_app(engine, name, owns_engine=False, max_body_bytes=max_body or None, api_keys=keys,
                         keys_for_all_routes=opts.keys_for_all_routes)
        started = serve(app, engine, sock, opts.shutdown_timeout, opts.log_level,
                        on_started=lambda: print(serving, file=sys.stderr, flush=True))
    finally:
        sock.close()
        if bundle is not None and bundle.ranks is not None:
            bundle.ranks.close()  # a tensor-parallel target's other ranks stop with the server
    if not started:
        print(f"error: the server could not start on {url(sock)[7:]} (see the log above)", file=sys.stderr)
        return 1
    print("server stopped", file=sys.stderr)
    return 0


def main(args) -> int:
    return run(ServeOptions.from_args(args))
