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
class GenerateOptions:
    model: str
    prompt: str
    chat: bool
    system: str | None
    max_new_tokens: int
    sampling: SamplingParams
    runtime: RuntimeOptions
    show_stats: bool

    @classmethod
    def from_args(cls, args) -> "GenerateOptions":
        if args.max_new_tokens < 1:
            raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        return cls(args.model, prompt, args.chat, args.system, args.max_new_tokens, sampling,
                   RuntimeOptions.from_args(args), not args.no_stats)


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"--device {device} was asked for but CUDA is not available here")


def run_generate(opts: GenerateOptions) -> int:
    from .generate import generate
    from .loader import load, parse_dtype
    from .steps import StepRunner, context_bucket
    from .tokenizer import Message, TextStream

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
    if opts.runtime.compile:
        from .progress import Progress

        bar = Progress("compiling prefill and decode steps", 2)
        runner.warm_up()
        bar.close()
    stream = TextStream(tokenizer)

    first_token_at = 0.0

    def emit(ids) -> None:
        nonlocal first_token_at
        first_token_at = first_token_at or time.perf_counter()
        sys.stdout.write(stream.push(ids))
        sys.stdout.flush()

    result = generate(runner, prompt_ids, opts.max_new_tokens, opts.sampling,
                      tokenizer.stop_ids, on_tokens=emit)
    sys.stdout.write(stream.finish() + "\n")
    sys.stdout.flush()
    if opts.show_stats:
        print(f"[{result.stats.summary()} | stop: {result.stop_reason} | "
              f"load {loaded.load_seconds:.2f} s | first token {first_token_at - IMPORTED_AT:.2f} s "
              "after start]", file=sys.stderr)
    return 0


def run_models() -> int:
    from .catalog import format_model_table, model_statuses

    print(format_model_table(model_statuses()))
    return 0
