"""`yggdrasil generate`: one prompt, streamed to stdout; from a bundle (--bundle) or from models
named here. Both run the same path: a Generator, its speculator, one streamed generation."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from yggdrasil import IMPORTED_AT, PROCESS_STARTED_AT
from yggdrasil.errors import InvalidRequestError
from .common import (DEFAULT_MAX_CONTEXT, DEFAULT_MODEL, add_runtime_args, add_sampling_args, add_spec_args,
                     add_trace_arg, add_verify_bundle_arg, int_list, new_tracer, sampling_params, write_trace)


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    gen.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"catalog name, HF directory or .gguf file (default {DEFAULT_MODEL})")
    gen.add_argument("--prompt", required=True, help="the prompt text ('-' reads it from stdin)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template as a user turn")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="reply length limit (default 128)")
    gen.add_argument("--no-stats", action="store_true", help="do not print the stats line on stderr")
    add_trace_arg(gen, "every stage of every iteration")
    gen.add_argument("--bundle", default=None,
                     help="run from a bundle made by `yggdrasil compile`: its models, graphs, predictor "
                          "and bucket selection (no compiling at run time)")
    gen.add_argument("--no-spec", action="store_true",
                     help="with --bundle: decode plainly on the bundle's own graphs (no speculation), to "
                          "see that speculation changes nothing in greedy output")
    add_verify_bundle_arg(gen, "with --bundle: ")
    gen.add_argument("--verbose", action="store_true",
                     help="with --bundle: also print the start-up phases (imports, open and hash checks, kernels, "
                          "weights mapping, graphs, first prefill)")
    add_spec_args(gen)
    add_sampling_args(gen)
    add_runtime_args(gen)


@dataclass(frozen=True)
class RuntimeOptions:
    device: str
    dtype: str | None
    max_context: int
    chunk_size: int
    compile: bool
    weights: str = "fp32"

    @classmethod
    def from_args(cls, args) -> "RuntimeOptions":
        max_context = DEFAULT_MAX_CONTEXT if args.max_context is None else args.max_context
        if max_context < 2:
            raise InvalidRequestError(f"--max-context must be >= 2, got {max_context}")
        if args.chunk_size is not None and args.chunk_size < 1:
            raise InvalidRequestError(f"--chunk-size must be >= 1, got {args.chunk_size}")
        chunk = args.chunk_size or (256 if args.device.startswith("cuda") else 64)
        return cls(args.device, args.dtype, max_context, chunk, args.compile, args.weights or "fp32")


@dataclass(frozen=True)
class SpecOptions:
    mode: str  # none, chain, static-tree, egt
    draft: str
    depth: int
    width: int
    verify: tuple[int, ...]
    branching: tuple[int, ...] | None
    tree_file: str | None
    profile: str | None
    auto: bool = False
    calibration: str | None = None

    @classmethod
    def from_args(cls, args) -> "SpecOptions":
        if args.depth < 1 or args.width < 1:
            raise InvalidRequestError(f"--depth and --width must be >= 1, got {args.depth} and {args.width}")
        if args.auto and (args.spec != "egt" or not args.calibration):
            raise InvalidRequestError("--auto needs --spec egt and --calibration DIR "
                                      "(made by `yggdrasil calibrate`)")
        verify = int_list(args.verify, "--verify") if args.verify else ()
        branching = int_list(args.tree_branching, "--tree-branching") if args.tree_branching else None
        return cls(args.spec, args.draft, args.depth, args.width, verify, branching, args.tree_file,
                   args.profile, args.auto, args.calibration)

    @property
    def shape(self):
        from yggdrasil.runtime.speculator import DraftShape  # imports torch: only when generating

        return DraftShape(self.mode, self.depth, self.width, self.verify, self.branching, self.tree_file)


@dataclass(frozen=True)
class GenerateOptions:
    model: str
    prompt: str
    chat: bool
    system: str | None
    max_new_tokens: int
    sampling: "SamplingParams"  # noqa: F821 (imported with torch, when run)
    runtime: RuntimeOptions
    show_stats: bool
    spec: SpecOptions
    bundle: str | None = None
    trace: str | None = None  # write a Chrome trace of every stage here
    no_spec: bool = False  # a bundle decodes plainly on its own graphs
    verify_bundle: bool = False  # hash every artifact of the bundle at open
    verbose: bool = False  # print the start-up phases
    json_schema: str | None = None  # a file: the reply is JSON matching its schema

    @classmethod
    def from_args(cls, args) -> "GenerateOptions":
        if args.max_new_tokens < 1:
            raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        sampling = sampling_params(args)
        options = cls(args.model, prompt, args.chat, args.system, args.max_new_tokens, sampling,
                      RuntimeOptions.from_args(args), not args.no_stats, SpecOptions.from_args(args),
                      getattr(args, "bundle", None), getattr(args, "trace", None), getattr(args, "no_spec", False),
                      getattr(args, "verify_bundle", False), getattr(args, "verbose", False),
                      getattr(args, "json_schema", None))
        if options.no_spec and not options.bundle:
            raise InvalidRequestError("--no-spec is for --bundle (a bundle speculates by its own policy); without "
                                      "a bundle, plain decoding is the default (--spec none)")
        if options.bundle and (options.spec.mode != "none" or options.runtime.compile):
            raise InvalidRequestError("--bundle runs the bundle's own graphs and speculation; drop --spec "
                                      "and --compile (the bundle's plan decides them)")
        fixed = [flag for flag, given in (("--max-context", args.max_context), ("--chunk-size", args.chunk_size),
                                          ("--weights", args.weights)) if given is not None]
        if options.bundle and fixed:
            raise InvalidRequestError(f"--bundle fixes the context, prefill chunks and weight format it was compiled "
                                      f"for (recipe max_context, prefill_chunks, weights); drop {' and '.join(fixed)}, or "
                                      "compile a recipe with the values you want")
        return options

    def model_settings(self):
        from yggdrasil.generator import ModelSettings

        rt, spec = self.runtime, self.spec
        return ModelSettings(self.model, spec.draft, rt.device, rt.dtype, rt.max_context, rt.chunk_size,
                             rt.compile, spec.shape, spec.auto, spec.calibration, spec.profile, rt.weights)


def _prompt_ids(opts: GenerateOptions, tokenizer) -> list[int]:
    from yggdrasil.models.tokenizer import Message

    if opts.chat:
        messages = ([Message("system", opts.system)] if opts.system else []) + [Message("user", opts.prompt)]
        return tokenizer.encode_chat(messages)
    return tokenizer.encode(opts.prompt)


def _open(opts: GenerateOptions):
    """The Generator and the prompt's ids: from the bundle, or from the models named."""
    from yggdrasil.generator import from_models, load_target

    if opts.bundle:
        from yggdrasil.bundle import open_bundle

        opening = time.perf_counter()
        generator = open_bundle(Path(opts.bundle), verify=opts.verify_bundle).generator()
        generator.startup["imports"] = opening - STARTED_AT
        prompt_ids = _prompt_ids(opts, generator.tokenizer)
        generator.runner.check_fits(len(prompt_ids))
        return generator, prompt_ids
    settings = opts.model_settings()
    target = load_target(settings)
    prompt_ids = _prompt_ids(opts, target.tokenizer)
    note = (lambda text: print(text, file=sys.stderr)) if opts.show_stats else (lambda text: None)
    return from_models(settings, target, len(prompt_ids), opts.max_new_tokens, note), prompt_ids


def run(opts: GenerateOptions) -> int:
    from yggdrasil.bundle import RecompileError, dynamo_compilations
    from yggdrasil.generator import generate_tokens
    from yggdrasil.models.tokenizer import TextStream
    from yggdrasil.trace import tracing

    schema = _schema(opts)  # a bad file fails before the model loads
    generator, prompt_ids = _open(opts)
    control = _control(schema, generator.tokenizer, prompt_ids, opts.sampling.greedy)
    ready_at = time.perf_counter()
    speculator = None if opts.no_spec else generator.speculator()
    if opts.runtime.compile:
        from yggdrasil.progress import Progress

        bar = Progress("compiling fixed-shape steps", 1)
        (speculator or generator.runner).warm_up()
        bar.close()
    stream, first_token_at, graph_at_first = TextStream(generator.tokenizer), 0.0, 0.0
    arrivals: list[tuple[int, float]] = []  # (tokens so far, seconds after STARTED_AT) at each emit

    def emit(ids) -> None:
        nonlocal first_token_at, graph_at_first
        if not first_token_at:
            first_token_at, graph_at_first = time.perf_counter(), generator.graph_seconds()
        arrivals.append(((arrivals[-1][0] if arrivals else 0) + len(ids), time.perf_counter() - STARTED_AT))
        sys.stdout.write(stream.push(ids))
        sys.stdout.flush()

    compiled_before = dynamo_compilations()
    tracer = new_tracer(opts.trace, generator.device)
    with tracing(tracer, generator.runner, speculator):
        result = generate_tokens(generator, speculator, prompt_ids, opts.max_new_tokens, opts.sampling, emit,
                                 control=control)
    write_trace(tracer, opts.trace)
    if opts.bundle and dynamo_compilations() != compiled_before:
        raise RecompileError("something was compiled while generating from a bundle; that is a bug, "
                             "please report it with the bundle's manifest")
    sys.stdout.write(stream.finish() + "\n")
    sys.stdout.flush()
    if opts.show_stats:
        _print_stats(opts, generator, speculator, result, first_token_at, graph_at_first)
    if control is not None and opts.show_stats:
        print(f"[grammar: {describe_mask_cost(control.cost, stats_tokens(result))}]", file=sys.stderr)
    if opts.verbose and opts.bundle:
        phases = {**generator.startup, "first prefill": first_token_at - ready_at}
        print("[start-up: " + " | ".join(f"{name} {phases[name]:.2f} s" for name in STARTUP_ORDER if name in phases)
              + "]", file=sys.stderr)
        # when each token arrived (a speculative iteration brings several at once): the first
        # tokens' pace against the steady one (issue 50; bench startup reads this line)
        print("[tokens at: " + ", ".join(f"{n} {t:.3f} s" for n, t in arrivals[:12]) + "]", file=sys.stderr)
        if generator.manifest is not None:  # whether speculation must equal plain decoding bit for bit
            print(f"[steps: {generator.manifest.exactness()}]", file=sys.stderr)
    return 0


# what start-up figures count from: the process's start where the system says when that was
# (Python's own start included), else the package's import
STARTED_AT = IMPORTED_AT if PROCESS_STARTED_AT is None else PROCESS_STARTED_AT
STARTED_FROM = "import" if PROCESS_STARTED_AT is None else "process start"


def _schema(opts: GenerateOptions):
    from yggdrasil.structured.grammar import read_json_file, schema_of

    return schema_of(read_json_file(opts.json_schema, "--json-schema")) if opts.json_schema else None


def _control(schema, tokenizer, prompt_ids, greedy: bool):
    """The grammar's per-token control for a --json-schema reply (None without one)."""
    if schema is None:
        return None
    from yggdrasil.runtime.logits import LogitsControl, mask_worker
    from yggdrasil.structured.grammar import GrammarEngine

    grammars = GrammarEngine(tokenizer)
    matcher = grammars.matcher(grammars.json_schema(schema, "--json-schema"))
    return LogitsControl(prompt_ids, matcher=matcher, executor=mask_worker())


def stats_tokens(result) -> int:
    return max(result.stats.new_tokens, 1)


def describe_mask_cost(cost, tokens: int) -> str:
    """The grammar's host cost per output token: computing masks (in the worker, mostly during
    the forwards), the wait for them after a forward, and applying them."""
    per = 1e6 / tokens
    return (f"{cost.steps} steps, {cost.masks} masks, {cost.masked_rows} rows masked | per output token: computed "
            f"{cost.compute_seconds * per:.0f} us, waited {cost.wait_seconds * per:.0f} us, applied "
            f"{cost.apply_seconds * per:.0f} us")


# Bundle.startup's phases and the first prefill, in the order they happen
STARTUP_ORDER = ("imports", "open", "kernels", "weights", "graphs", "first prefill")


def _print_stats(opts: GenerateOptions, generator, speculator, result, first_token_at: float,
                 graph_at_first: float) -> None:
    stats = result.stats
    load = f"bundle load {generator.load_seconds:.2f} s" if opts.bundle else f"load {generator.load_seconds:.2f} s"
    print(f"[{stats.summary()} | stop: {result.stop_reason} | {load} | first token "
          f"{first_token_at - STARTED_AT:.2f} s after {STARTED_FROM}" + (" | 0 compilations]" if opts.bundle else "]"),
          file=sys.stderr)
    if speculator is None:
        return
    if not opts.bundle:
        print(f"[{opts.spec.mode} with {opts.spec.draft} draft: {result.spec.summary()} | "
              f"host tree work {result.spec.host_seconds / max(stats.decode_seconds, 1e-9):.1%} "
              "of decode]", file=sys.stderr)
    elif result.spec.iterations:
        outside = stats.decode_seconds - (generator.graph_seconds() - graph_at_first)
        print(f"[{result.spec.summary()} | host time outside the graphs "
              f"{outside / result.spec.iterations * 1e3:.2f} ms per iteration "
              f"({outside / max(stats.decode_seconds, 1e-9):.1%} of decode)]", file=sys.stderr)


def main(args) -> int:
    return run(GenerateOptions.from_args(args))
