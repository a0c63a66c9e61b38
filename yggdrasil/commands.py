"""The logic behind each CLI subcommand (the CLI itself only parses arguments)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from . import IMPORTED_AT
from .errors import InvalidRequestError
from .sampling import SamplingParams



@dataclass(frozen=True)
class RuntimeOptions:
    device: str
    dtype: str | None
    max_context: int
    chunk_size: int
    compile: bool

    @classmethod
    def from_args(cls, args) -> "RuntimeOptions":
        if args.max_context < 2:
            raise InvalidRequestError(f"--max-context must be >= 2, got {args.max_context}")
        chunk = args.chunk_size or (256 if args.device.startswith("cuda") else 64)
        if chunk < 1:
            raise InvalidRequestError(f"--chunk-size must be >= 1, got {chunk}")
        return cls(args.device, args.dtype, args.max_context, chunk, args.compile)


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
        verify = _int_list(args.verify, "--verify") if args.verify else ()
        branching = _int_list(args.tree_branching, "--tree-branching") if args.tree_branching else None
        return cls(args.spec, args.draft, args.depth, args.width, verify, branching, args.tree_file,
                   args.profile, args.auto, args.calibration)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InvalidRequestError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise InvalidRequestError(f"{flag} values must be >= 1, got {text!r}")
    return values


@dataclass(frozen=True)
class GenerateOptions:
    model: str
    prompt: str
    chat: bool
    system: str | None
    max_new_tokens: int
    sampling: SamplingParams
    runtime: RuntimeOptions
    show_stats: bool
    spec: SpecOptions
    bundle: str | None = None
    trace: str | None = None  # write a Chrome trace of every stage here

    @classmethod
    def from_args(cls, args) -> "GenerateOptions":
        if args.max_new_tokens < 1:
            raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        return cls(args.model, prompt, args.chat, args.system, args.max_new_tokens, sampling,
                   RuntimeOptions.from_args(args), not args.no_stats, SpecOptions.from_args(args),
                   getattr(args, "bundle", None), getattr(args, "trace", None))


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"--device {device} was asked for but CUDA is not available here")


def run_generate(opts: GenerateOptions) -> int:
    from .speculative import generate_with
    from .loader import load, parse_dtype
    from .steps import StepRunner, context_bucket
    from .tokenizer import Message, TextStream
    from .trace import tracing

    if opts.bundle:
        from .bundle_cmd import run_generate_bundle

        return run_generate_bundle(opts, IMPORTED_AT)
    _check_device(opts.runtime.device)
    dtype = parse_dtype(opts.runtime.dtype) if opts.runtime.dtype else None
    loaded = load(opts.model, dtype=dtype, device=opts.runtime.device)
    tokenizer = loaded.tokenizer
    if opts.chat:
        messages = ([Message("system", opts.system)] if opts.system else []) + [Message("user", opts.prompt)]
        prompt_ids = tokenizer.encode_chat(messages)
    else:
        prompt_ids = tokenizer.encode(opts.prompt)
    # size the cache for this request: compiled steps attend over all of it
    context = context_bucket(len(prompt_ids) + opts.max_new_tokens + 1, opts.runtime.max_context)
    runner = StepRunner(loaded.model, context, opts.runtime.chunk_size, compile=opts.runtime.compile)
    runner.check_fits(len(prompt_ids))
    speculator = build_speculator(opts, loaded, runner, context, dtype)
    if opts.runtime.compile:
        from .progress import Progress

        bar = Progress("compiling fixed-shape steps", 1)
        (speculator or runner).warm_up()
        bar.close()
    stream = TextStream(tokenizer)

    first_token_at = 0.0

    def emit(ids) -> None:
        nonlocal first_token_at
        first_token_at = first_token_at or time.perf_counter()
        sys.stdout.write(stream.push(ids))
        sys.stdout.flush()

    tracer = new_tracer(opts.trace, opts.runtime.device)
    with tracing(tracer, runner, speculator):
        result = generate_with(runner, speculator, prompt_ids, opts.max_new_tokens, opts.sampling,
                               tokenizer.stop_ids, on_tokens=emit)
    write_trace(tracer, opts.trace)
    sys.stdout.write(stream.finish() + "\n")
    sys.stdout.flush()
    if opts.show_stats:
        print(f"[{result.stats.summary()} | stop: {result.stop_reason} | "
              f"load {loaded.load_seconds:.2f} s | first token {first_token_at - IMPORTED_AT:.2f} s "
              "after start]", file=sys.stderr)
        if speculator is not None:
            print(f"[{opts.spec.mode} with {opts.spec.draft} draft: {result.spec.summary()} | "
                  f"host tree work {result.spec.host_seconds / max(result.stats.decode_seconds, 1e-9):.1%} "
                  "of decode]", file=sys.stderr)
    return 0


def new_tracer(path: str | None, device: str):
    """A Tracer when --trace was given (checked writable now, not after the run)."""
    if path is None:
        return None
    from pathlib import Path

    from .trace import Tracer

    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise InvalidRequestError(f"--trace {path}: the folder {parent} does not exist")
    return Tracer(sync_cuda=device.startswith("cuda"))


def write_trace(tracer, path: str | None) -> None:
    if tracer is not None:
        written = tracer.write(path)
        print(f"[trace: {len(tracer.events)} spans written to {written}; open it in "
              "https://ui.perfetto.dev]", file=sys.stderr)


def build_speculator(opts: GenerateOptions, loaded, runner, context: int, dtype):
    """The SpeculativeGenerator the options ask for, or None for plain decoding."""
    spec = opts.spec
    if spec.mode == "none":
        return None
    from .drafters import LookupDrafter, ModelDrafter
    from .speculative import SpeculativeGenerator
    from .steps import StepRunner

    if spec.auto:
        return _auto_speculator(opts, loaded, runner, context, dtype)
    width = 1 if spec.mode == "chain" else spec.width
    if spec.draft == "lookup":
        if spec.mode == "static-tree":
            raise InvalidRequestError("--spec static-tree needs a draft model (--draft NAME_OR_PATH)")
        drafter = LookupDrafter(spec.depth, width)
    else:
        from .loader import load

        draft = load(spec.draft, dtype=dtype or loaded.model.dtype, device=opts.runtime.device)
        check_same_vocabulary(loaded, draft)
        draft_runner = StepRunner(draft.model, context, opts.runtime.chunk_size, compile=opts.runtime.compile)
        if spec.mode == "static-tree":
            from .static_tree import StaticTreeDrafter, branching_shape, load_shape

            shape = (load_shape(spec.tree_file) if spec.tree_file else
                     branching_shape(list(spec.branching or [width, 2] + [1] * (spec.depth - 2))[:spec.depth]))
            drafter = StaticTreeDrafter(draft_runner, shape)
        else:
            drafter = ModelDrafter(draft_runner, spec.depth, width)
    return SpeculativeGenerator(runner, drafter, spec.verify, _latency_profile(spec, loaded, drafter))


def _auto_speculator(opts: GenerateOptions, loaded, runner, context: int, dtype):
    """EGT whose (D, W, V) bucket is picked per iteration by the calibrated policy."""
    from .predictor.calibration_data import load_run
    from .predictor.pipeline import check_draft, load_policy
    from .speculative import SpeculativeGenerator
    from .steps import StepRunner

    spec = opts.spec
    calibration = load_run(spec.calibration)
    check_draft(spec.calibration, calibration[1], spec.draft)
    draft = draft_runner = None
    if spec.draft != "lookup":
        from .loader import load

        draft = load(spec.draft, dtype=dtype or loaded.model.dtype, device=opts.runtime.device)
        check_same_vocabulary(loaded, draft)
        check_draft(spec.calibration, calibration[1], spec.draft, draft.source.sha256)
        draft_runner = StepRunner(draft.model, context, opts.runtime.chunk_size, compile=opts.runtime.compile)
    kind = "model" if draft is not None else "lookup"
    latency = _latency_profile_from_file(spec.profile, loaded, kind, draft) if spec.profile else None
    policy, note = load_policy(spec.calibration, calibration, latency, loaded.config.dim,
                               loaded.source.sha256)
    if opts.show_stats:
        print(f"[auto: {note}; latency from {spec.profile or 'the calibration run'}]", file=sys.stderr)
    return SpeculativeGenerator(runner, policy.drafter(draft_runner), policy=policy)


def _latency_profile(spec: SpecOptions, loaded, drafter):
    """A profile file checked against this device, dtype and models; else measure at start."""
    if spec.profile is None:
        return "auto"
    return _latency_profile_from_file(spec.profile, loaded, drafter.kind)


def _latency_profile_from_file(path: str, loaded, draft_kind: str, draft=None):
    from .latency import from_device_profile
    from .predictor.profile import DeviceProfile, device_name

    profile = DeviceProfile.load(path)
    device = "cuda" if loaded.model.device.type == "cuda" else "cpu"
    profile.check_matches(device_name(device), str(loaded.model.dtype).replace("torch.", ""),
                          loaded.source.sha256, draft.source.sha256 if draft is not None else None)
    return from_device_profile(profile, draft_kind != "lookup")


def check_same_vocabulary(target, draft) -> None:
    """Draft and target must share token ids, or the tree means nothing to the target."""
    if target.tokenizer.fingerprint() != draft.tokenizer.fingerprint() or \
            target.config.vocab_size != draft.config.vocab_size:
        raise InvalidRequestError(
            f"draft {draft.source.name} and target {target.source.name} do not share a tokenizer "
            f"(vocabularies of {draft.tokenizer.vocab_size} and {target.tokenizer.vocab_size} tokens "
            "differ); pick a draft from the same model family, or use --draft lookup")


def run_models() -> int:
    from .catalog import format_model_table, model_statuses

    print(format_model_table(model_statuses()))
    return 0


@dataclass(frozen=True)
class ProfileOptions:
    model: str
    draft: str | None
    out: str
    sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]
    repeats: int
    compile: bool
    device: str
    dtype: str | None

    @classmethod
    def from_args(cls, args) -> "ProfileOptions":
        if args.repeats < 1:
            raise InvalidRequestError(f"--repeats must be >= 1, got {args.repeats}")
        return cls(args.model, args.draft, args.out, _int_list(args.sizes, "--sizes"),
                   _int_list(args.contexts, "--contexts"), _int_list(args.chunks, "--chunks"),
                   args.repeats, not args.no_compile, args.device, args.dtype)


def run_profile(opts: ProfileOptions) -> int:
    from pathlib import Path

    from .loader import load, parse_dtype
    from .predictor.profile_run import profile_device

    _check_device(opts.device)
    dtype = parse_dtype(opts.dtype) if opts.dtype else None
    target = load(opts.model, dtype=dtype, device=opts.device)
    draft = load(opts.draft, dtype=target.model.dtype, device=opts.device) if opts.draft else None
    if draft is not None:
        check_same_vocabulary(target, draft)
    out = Path(opts.out)
    profile, png = profile_device(target, draft, opts, out)
    print(f"wrote {out} and {png}")
    curve = profile.target.curve()
    print(f"{profile.target.name}: T(1) {curve(1) * 1e3:.1f} ms, T({curve.sizes[-1]}) "
          f"{curve(curve.sizes[-1]) * 1e3:.1f} ms")
    from .predictor.cost import leave_one_out

    for model_profile in filter(None, (profile.target, profile.draft)):
        loo = leave_one_out(model_profile.curve())
        print(f"{model_profile.name}: interpolated T(n) error, each interior point left out: mean "
              f"{loo.mean_abs_pct_error:.1f}% max {loo.max_abs_pct_error:.1f}% over {loo.held_out} points")
    model, report = profile.target.linear_model()
    print(f"linear model T = {model.alpha * 1e6:.2f} us/context token + {model.gamma * 1e3:.3f} ms/new "
          f"token + {model.delta * 1e3:.2f} ms; held-out error mean {report.mean_abs_pct_error:.1f}% "
          f"max {report.max_abs_pct_error:.1f}% over {report.held_out} points")
    return 0
