"""`yggdrasil chat [BUNDLE]`: the terminal loop around a ChatSession (the CLI is argparse only).

Interactive on a terminal (prompt, streaming, Ctrl-C stops a reply, Ctrl-D or /exit quits);
scripted otherwise: each stdin line is a turn or a command, replies go to stdout one per line
and everything else (banner, notices, /stats) to stderr.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from yggdrasil import IMPORTED_AT, PROCESS_STARTED_AT
from yggdrasil.errors import InvalidRequestError
from yggdrasil.progress import format_duration
from yggdrasil.recipes import shipped_recipe
from .common import add_sampling_args, add_trace_arg, add_verify_bundle_arg, new_tracer, sampling_params, write_trace

HELP = """commands:
  /stats         the last reply and the session: tokens, time per output token, AAL,
                 per-depth acceptance, predicted vs chosen depth
  /reset         forget the conversation (keeps the system message and settings)
  /system TEXT   set the system message and start over (/system alone shows it, /system off clears it)
  /temp X        sampling temperature, a number >= 0 (0 = greedy; /temp alone shows it)
  /help          this text
  /exit          quit (so does Ctrl-D); Ctrl-C stops the reply being written"""

DEFAULT_RECIPES = {"cpu": "smollm2-lookup-cpu", "cuda": "qwen-pair-cuda"}
BUSY_LOAD = 0.5  # load average per core above which compile's measurements and speed suffer


def add_parser(sub) -> None:
    chat = sub.add_parser("chat", help="chat with a bundle: streaming, multi-turn with KV reuse",
                          description="Chat with a bundle. On a terminal: type a message, Ctrl-C stops "
                                      "a reply, Ctrl-D or /exit quits, /help lists commands. Otherwise "
                                      "each stdin line is a turn (or command) and replies go to stdout.")
    chat.add_argument("bundle", nargs="?", default=None,
                      help="bundle directory from `yggdrasil compile` (default: this machine's default "
                           "bundle, compiled once into the user cache dir)")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--max-new-tokens", type=int, default=512, help="reply length limit (default 512)")
    add_sampling_args(chat, top_k=False)
    chat.add_argument("--tools", default=None, metavar="FILE",
                      help="functions the model may call: a JSON list of OpenAI tools ({type: function, function: "
                           "{name, description, parameters}}); calls in a reply are shown as [tool call] lines")
    add_verify_bundle_arg(chat)
    add_trace_arg(chat, "the session's stages on exit")


@dataclass(frozen=True)
class ChatOptions:
    bundle: str | None
    sampling: "SamplingParams"  # noqa: F821 (imported with torch, when run)
    max_new_tokens: int
    system: str | None
    trace: str | None = None
    verify_bundle: bool = False  # hash every artifact of the bundle at open
    json_schema: dict | None = None  # every reply is JSON matching it
    tools: tuple = ()  # structured.tools.Function: what the model may call

    @classmethod
    def from_args(cls, args) -> "ChatOptions":
        sampling = sampling_params(args)
        if args.max_new_tokens < 1:
            raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        from yggdrasil.structured.grammar import read_json_file, schema_of
        from yggdrasil.structured.tools import parse_tools

        schema = getattr(args, "json_schema", None)
        tools = getattr(args, "tools", None)
        return cls(args.bundle, sampling, args.max_new_tokens, args.system, getattr(args, "trace", None),
                   getattr(args, "verify_bundle", False),
                   schema_of(read_json_file(schema, "--json-schema")) if schema else None,
                   parse_tools(read_json_file(tools, "--tools")) if tools else ())


def compile_work(recipe) -> tuple[int, int]:
    """(graphs at most, calibration prompts) a compile of this recipe does: the graphs of its
    whole grid (selection keeps only some) and num_prompts from each prompt set."""
    from yggdrasil.compile.select import BucketSelection, graph_keys

    grid = recipe.buckets.grid
    widest = BucketSelection(grid.widths, grid.verifies, {}, (), ())
    prompts = len(recipe.calibration.prompts) * recipe.calibration.num_prompts
    return len(graph_keys(recipe, widest, needs_hidden=True)), prompts


def busy_note() -> str:
    """A warning when other work already loads this machine's cores (compile then takes longer)."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # no load average on this platform
        return ""
    if load < BUSY_LOAD * cores:
        return ""
    return f"this machine is busy (load {load:.1f} on {cores} cores): expect it to take several times longer"


def compile_announcement(recipe, out: Path) -> str:
    """What a bare `yggdrasil chat` is about to do, and how long it should take, before it starts."""
    graphs, prompts = compile_work(recipe)
    measured = recipe.measured_cold_compile  # the recipe's own record of a cold compile
    lines = [f"no current bundle for this machine: compiling {recipe.source} into {out} (once)",
             f"  it calibrates on {prompts} prompts and compiles up to {graphs} graphs; "
             + (f"expect about {format_duration(measured.total)} (measured cold on {measured.cpu})" if measured
                else "no measured time for this recipe yet: expect several minutes or more"),
             f"  {busy_note()}",
             "  the long phases show their progress and the time left; later runs open the bundle in seconds"]
    return "\n".join(line for line in lines if line.strip())


def check_prompt_sets(recipe) -> None:
    """The recipe's calibration prompts are installed (a clear error now, not minutes into compile)."""
    from yggdrasil.predictor import prompts as prompt_sets

    names = [recipe.resolve(p) if p.endswith(".jsonl") else p for p in recipe.calibration.prompts]
    prompt_sets.select(names, "calibration", recipe.calibration.num_prompts)


def default_bundle(log=lambda text: print(text, file=sys.stderr)) -> Path:
    """This machine's default bundle: reused when it is current, compiled (with progress) when
    it is missing or stale."""
    import torch

    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe
    from yggdrasil.storage.layout import BundleLayout
    from yggdrasil.storage.manifest import BundleError, read_manifest
    from .compile import default_bundle_dir

    recipe = load_recipe(shipped_recipe(DEFAULT_RECIPES["cuda" if torch.cuda.is_available() else "cpu"]))
    out = default_bundle_dir(recipe.name)
    if BundleLayout(out).exists():
        try:
            manifest, _ = read_manifest(out, "")
            if manifest.recipe_identity == recipe.identity():
                return out  # opening it checks models, versions and artifacts
        except BundleError:
            pass
    check_prompt_sets(recipe)
    log(compile_announcement(recipe, out))
    build_bundle(recipe, out, log=log)
    return out


def enable_line_editing() -> bool:
    """Arrow keys, Ctrl-A/Ctrl-E and in-session history (up/down) for input() on a terminal:
    importing the standard library's readline is what turns them on for input(). Some platforms
    (Windows) have no readline: input() then reads plain lines."""
    try:
        import readline  # noqa: F401 (imported for its effect on input(); only on a terminal)
    except ImportError:
        return False
    return True


class ChatLoop:
    """Reads turns and commands, prints replies; one instance per `yggdrasil chat`."""

    def __init__(self, session, interactive: bool) -> None:
        self.session, self.interactive = session, interactive
        # a pipe is read line by line as it is; a terminal gets line editing and history
        self.line_editing = interactive and enable_line_editing()

    def note(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def read(self) -> str | None:
        """The next line, or None at end of input (Ctrl-D)."""
        if not self.interactive:
            line = sys.stdin.readline()
            return None if line == "" else line.rstrip("\n")
        while True:
            try:
                return input("> ")
            except EOFError:
                print()
                return None
            except KeyboardInterrupt:  # at the prompt: a fresh line, not an exit
                print("\n(/exit or Ctrl-D quits)")

    def run(self) -> int:
        while True:
            line = self.read()
            if line is None:
                return 0
            if line.strip().startswith("/"):
                if self.command(line.strip()) == "exit":
                    return 0
                continue
            self.reply(line)

    def reply(self, line: str) -> None:
        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        try:
            reply = self.session.send(line, on_text=write, on_notice=self.note)
        except InvalidRequestError as exc:
            self.note(f"error: {exc}")
            return
        except KeyboardInterrupt:
            write("\n")
            self.note("[stopped]")
            return
        write("\n")
        if reply.stats.stop_reason == "context":
            self.note("[the reply filled the context; the oldest turns will be dropped next turn]")

    def command(self, line: str) -> str | None:
        from yggdrasil.chat import describe_stats

        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return "exit"
        if name == "/help":
            self.note(HELP)
        elif name == "/stats":
            self.note(describe_stats(self.session))
        elif name == "/reset":
            self.session.reset()
            self.note("conversation cleared")
        elif name == "/system":
            self.system(arg)
        elif name == "/temp":
            self.temperature(arg)
        else:
            self.note(f"unknown command {name}; /help lists the commands")
        return None

    def system(self, arg: str) -> None:
        if not arg:
            current = self.session.settings.system
            self.note(f"system message: {current!r}" if current else "no system message")
            return
        self.session.set_system(None if arg == "off" else arg)
        self.note("system message cleared; conversation restarted" if arg == "off"
                  else "system message set; conversation restarted")

    def temperature(self, arg: str) -> None:
        current = self.session.settings.sampling.temperature
        if not arg:
            self.note(f"temperature {current:g}" + (" (greedy)" if current == 0 else ""))
            return
        try:
            value = float(arg)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value < 0:
            self.note(f"error: /temp needs a number >= 0 (0 = greedy), got {arg!r}; temperature stays {current:g}")
            return
        self.session.set_temperature(value)
        self.note(f"temperature {value:g}" + (" (greedy)" if value == 0 else ""))


def run(opts: ChatOptions, started_at: float) -> int:
    from yggdrasil.bundle import open_bundle
    from yggdrasil.chat import ChatSession, ChatSettings
    from yggdrasil.trace import tracing

    bundle = open_bundle(Path(opts.bundle) if opts.bundle else default_bundle(), verify=opts.verify_bundle)
    runtime = bundle.generator()
    session = ChatSession(runtime, ChatSettings(opts.sampling, opts.max_new_tokens, opts.system, opts.json_schema,
                                                opts.tools))
    interactive = sys.stdin.isatty()
    mode = "speculative" if session.speculator is not None else "plain decoding"
    name = bundle.name
    print(f"yggdrasil chat: {name} ({mode}) | ready in {time.perf_counter() - started_at:.2f} s "
          f"(bundle load {runtime.load_seconds:.2f} s, 0 compilations)"
          + (" | /help for commands, Ctrl-D quits" if interactive else ""), file=sys.stderr, flush=True)
    tracer = new_tracer(opts.trace, bundle.device)
    try:
        with tracing(tracer, session.runner, session.speculator):
            return ChatLoop(session, interactive).run()
    finally:
        write_trace(tracer, opts.trace)


def main(args) -> int:
    return run(ChatOptions.from_args(args), IMPORTED_AT if PROCESS_STARTED_AT is None else PROCESS_STARTED_AT)
