"""`yggdrasil compile`, `yggdrasil inspect` and `generate --bundle`: the bundle commands' logic
(the CLI is argparse only). Compiling is the one place that imports yggdrasil.compile."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .errors import InvalidRequestError


def default_bundle_dir(recipe_name: str) -> Path:
    from .catalog import cache_dir

    return cache_dir() / "bundles" / recipe_name


def run_compile(recipe_path: str, out: str | None, force: bool) -> int:
    from .compile.build import build_bundle
    from .compile.recipe import load_recipe
    from .graphs.manifest import describe

    recipe = load_recipe(Path(recipe_path))
    target = Path(out) if out else default_bundle_dir(recipe.name)
    result = build_bundle(recipe, target, force=force)
    print(describe(result.manifest))
    print(f"bundle {'reused' if result.reused else 'written'}: {result.bundle}")
    print(f"run it: yggdrasil generate --bundle {result.bundle} --prompt '...'")
    return 0


def run_inspect(bundle: str) -> int:
    from .graphs.manifest import describe, read_manifest

    manifest, raw = read_manifest(Path(bundle), "`yggdrasil compile RECIPE --out BUNDLE`")
    print(describe(manifest, raw))
    plan = Path(bundle) / "plan.yaml"
    if plan.is_file():
        import yaml

        body = yaml.safe_load(plan.read_text())
        print(f"{'plan':<10} draft widths {body['draft_widths'] or 'none (plain decoding)'}, "
              f"verify widths {body['verify_widths']}")
        print(f"{'picked':<10} " + ", ".join(f"{k} x{v}" for k, v in list(body["picked"].items())[:8]))
        print(f"{'dropped':<10} draft widths {body['dropped_draft_widths'] or '-'}, "
              f"verify widths {body['dropped_verify_widths'] or '-'}")
    _print_stage_plans(Path(bundle))
    return 0


def _print_stage_plans(bundle: Path) -> None:
    from .stage_plan import PLANS_FILE

    path = bundle / PLANS_FILE
    if not path.is_file():
        return
    import yaml

    body = yaml.safe_load(path.read_text())
    costs = body["costs"]
    print(f"{'stages':<10} {body['source']}; contention {costs['contention']:.2f}, {costs['streams']} stream(s); "
          f"other buckets: {body['default']}")
    for bucket, entry in list(body["buckets"].items())[:8]:
        print(f"{'':<10} {bucket:<12} {entry['plan']:<34} predicted {entry['predicted_ms']:.2f} ms "
              f"(sequential {entry['sequential_ms']:.2f} ms)")


def dynamo_compilations() -> int:
    """Graphs dynamo has compiled in this process (0 is the only right answer for a bundle)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]) + int(sum(counters["inductor"].values()) > 0)


def run_generate_bundle(opts, started_at: float) -> int:
    """generate --bundle: the bundle's graphs, predictor and bucket selection; nothing compiles."""
    from .graphs.runtime import RecompileError, open_bundle
    from .commands import new_tracer, write_trace
    from .speculative import generate_with
    from .tokenizer import Message, TextStream
    from .trace import tracing

    if opts.spec.mode != "none" or opts.runtime.compile:
        raise InvalidRequestError("--bundle runs the bundle's own graphs and speculation; drop --spec "
                                  "and --compile (the bundle's plan decides them)")
    runtime = open_bundle(Path(opts.bundle))
    tokenizer = runtime.target.tokenizer
    if opts.chat:
        messages = ([Message("system", opts.system)] if opts.system else []) + [Message("user", opts.prompt)]
        prompt_ids = tokenizer.encode_chat(messages)
    else:
        prompt_ids = tokenizer.encode(opts.prompt)
    runtime.runner.check_fits(len(prompt_ids))
    speculator = runtime.speculator()
    stream, first_token_at, graph_at_first = TextStream(tokenizer), 0.0, 0.0

    def emit(ids) -> None:
        nonlocal first_token_at, graph_at_first
        if not first_token_at:
            first_token_at, graph_at_first = time.perf_counter(), runtime.graph_seconds()
        sys.stdout.write(stream.push(ids))
        sys.stdout.flush()

    compiled_before = dynamo_compilations()
    tracer = new_tracer(opts.trace, runtime.manifest.recipe["device"])
    with tracing(tracer, runtime.runner, speculator):
        result = generate_with(runtime.runner, speculator, prompt_ids, opts.max_new_tokens, opts.sampling,
                               tokenizer.stop_ids, on_tokens=emit)
    iterations = max(result.stats.new_tokens - 1, 0) if speculator is None else result.spec.iterations
    write_trace(tracer, opts.trace)
    if dynamo_compilations() != compiled_before:
        raise RecompileError("something was compiled while generating from a bundle; that is a bug, "
                             "please report it with the bundle's manifest")
    sys.stdout.write(stream.finish() + "\n")
    sys.stdout.flush()
    if opts.show_stats:
        stats = result.stats
        print(f"[{stats.summary()} | stop: {result.stop_reason} | bundle load {runtime.load_seconds:.2f} s | "
              f"first token {first_token_at - started_at:.2f} s after start | 0 compilations]", file=sys.stderr)
        if speculator is not None and iterations:
            outside = stats.decode_seconds - (runtime.graph_seconds() - graph_at_first)
            print(f"[{result.spec.summary()} | host time outside the graphs "
                  f"{outside / iterations * 1e3:.2f} ms per iteration "
                  f"({outside / max(stats.decode_seconds, 1e-9):.1%} of decode)]", file=sys.stderr)
    return 0

