"""Argument groups and value parsers several commands share (argparse only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from yggdrasil.errors import InvalidRequestError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MAX_CONTEXT = 2048


def int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InvalidRequestError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise InvalidRequestError(f"{flag} values must be >= 1, got {text!r}")
    return values


def check_seed(seed: int | None) -> int | None:
    """--seed: an integer a torch generator takes as it is (it would silently wrap a negative one)."""
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidRequestError(f"--seed must be an integer from 0 to 2**64-1, got {seed}")
    return seed


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """--threads, which every command takes (cli/__init__.py adds it to each)."""
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads torch may use (default: torch's choice, one per physical core; "
                             "for compile, the recipe's threads: if it has one). Step times and bundles "
                             "are measured for this count, so run a bundle with the count it was built with")


def add_verify_bundle_arg(parser: argparse.ArgumentParser, when: str = "") -> None:
    """--verify-bundle, which every command that opens a bundle takes (generate, chat, serve)."""
    parser.add_argument("--verify-bundle", action="store_true",
                        help=f"{when}hash every file of the bundle, the large weights too (by default a weights "
                             "file whose size, mtime and inode match its last good hash is not hashed again)")


def apply_threads(args: argparse.Namespace) -> None:
    """Pin torch to --threads before the command does any work."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if threads < 1:
        raise InvalidRequestError(f"--threads must be an integer >= 1, got {threads}")
    import torch  # here, not at the top: the CLI modules keep torch out of `--help`

    torch.set_num_threads(threads)


def numbers(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"{what} must be comma-separated numbers, got {text!r}") from None


def names(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def add_sampling_args(parser: argparse.ArgumentParser, top_k: bool = True) -> None:
    """--temperature, --top-p, (--top-k,) --seed and --json-schema; `sampling_params` reads them."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0 = greedy (default); > 0 samples from the softened distribution")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus cut in (0, 1] (default 1)")
    if top_k:
        group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    group.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    add_json_schema_arg(group)


def sampling_params(args: argparse.Namespace):
    """The SamplingParams that add_sampling_args' flags give (no --top-k: off)."""
    from yggdrasil.sampling import SamplingParams  # imports torch: only when a command runs

    return SamplingParams(args.temperature, args.top_p, getattr(args, "top_k", 0), check_seed(args.seed))


def add_trace_arg(parser: argparse.ArgumentParser, of_what: str) -> None:
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help=f"write a Chrome/Perfetto trace (JSON) of {of_what}")


def add_device_args(parser, dtype_default: str = "") -> None:
    """--device and --dtype: where a model runs and its activations' type."""
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--dtype", default=None, help=f"float32 | bfloat16 | float16{dtype_default}")


def add_json_schema_arg(parser) -> None:
    parser.add_argument("--json-schema", default=None, metavar="FILE",
                        help="constrain the reply to JSON matching this JSON Schema (a grammar masks the target "
                             "at every verified token, so speculation stays on and lossless)")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--spec", choices=("none", "chain", "static-tree", "egt"), default="none",
                       help="none (autoregressive, default), chain, static-tree (Sequoia-style) or "
                            "egt (Equal-Growth Tree)")
    group.add_argument("--draft", default="lookup",
                       help="draft model (catalog name, HF dir, .gguf) sharing the target's tokenizer, "
                            "or 'lookup' for model-free prompt lookup (default)")
    group.add_argument("--depth", type=int, default=4, help="draft tree depth D (default 4)")
    group.add_argument("--width", type=int, default=3, help="EGT draft width W (default 3)")
    group.add_argument("--verify", default=None,
                       help="allowed verify widths, e.g. 4,8 (default: the whole tree); the latency "
                            "objective picks one per iteration")
    group.add_argument("--tree-branching", default=None,
                       help="static tree: children per node at each depth, e.g. 3,2,1 (default W,2,1,...)")
    group.add_argument("--profile", default=None,
                       help="device profile from `yggdrasil profile` for the verify-width objective "
                            "(default: measure the allowed widths briefly at start)")
    group.add_argument("--auto", action="store_true",
                       help="egt: pick depth, width and verify width every iteration with the depth "
                            "predictor and the latency objective (needs --calibration)")
    group.add_argument("--calibration", default=None,
                       help="calibration directory from `yggdrasil calibrate` (for --auto)")
    group.add_argument("--tree-file", default=None,
                       help="static tree: JSON list of rank paths, e.g. [[0],[1],[0,0]]")


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("runtime")
    add_device_args(group, " (default: float32 on CPU, bfloat16 on CUDA)")
    group.add_argument("--max-context", type=int, default=None,  # None: not given (a bundle fixes it)
                       help=f"KV cache size in tokens, prompt + reply (default {DEFAULT_MAX_CONTEXT}; "
                            "a bundle fixes its own)")
    group.add_argument("--chunk-size", type=int, default=None,
                       help="prefill chunk in tokens (default 64 on CPU, 256 on CUDA; a bundle fixes its own)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the fixed-shape prefill and decode steps")
    add_weights_arg(group)


WEIGHTS = ("fp32", "bf16", "int8", "int4", "q4")  # yggdrasil.models.quant.WEIGHT_FORMATS (not imported: it imports torch)


def add_weights_arg(parser) -> None:
    """--weights: the weight format models are loaded in (without a bundle; a bundle fixes its own)."""
    parser.add_argument("--weights", choices=WEIGHTS, default=None,
                        help="weight format of the model(s): fp32 (default), bf16, int8, int4 (ATen's packed "
                             "CPU kernels) or q4 (4-bit x int8 on yggdrasil's own kernel; built once, needs a C++ "
                             "compiler). Activations keep --dtype. A bundle fixes its own (see `inspect`)")


def new_tracer(path: str | None, device: str):
    """A Tracer when --trace was given (checked writable now, not after the run)."""
    if path is None:
        return None
    from yggdrasil.trace import Tracer

    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise InvalidRequestError(f"--trace {path}: the folder {parent} does not exist")
    return Tracer(sync_cuda=device.startswith("cuda"))


def write_trace(tracer, path: str | None) -> None:
    if tracer is not None:
        written = tracer.write(path)
        print(f"[trace: {len(tracer.events)} spans written to {written}; open it in "
              "https://ui.perfetto.dev]", file=sys.stderr)
