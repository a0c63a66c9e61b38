"""What the draft costs and what its trimmed vocabulary costs in acceptance (issue 51), on a bundle:

  * T_draft(n), n = 1..R rows, of the bundle's draft with its own head and with the full head
    (the draft model loaded again from its GGUF in the same weight format), and the target's
    T_verify(n): eager steps over the bundle's models (the same kernels its graphs call), every
    (n, model) timed in turn per repeat, medians; the bundle's own compiled step times beside
    them. One plot: `draft-cost.png`.
  * acceptance with and without the trimmed vocabulary: the bundle's policy, greedy, on the same
    held-out prompts, once with the bundle's draft and once with the full-head draft; per-token
    acceptance (accepted over offered drafted tokens, every depth), AAL, and whether each output
    equals the bundle's own plain greedy output.

    yggdrasil bench draft-cost --bundle B [--prompts 8] [--max-new-tokens 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from yggdrasil.bundle import open_bundle
from yggdrasil.device import device_sync, timed_runs
from yggdrasil.models.loader import load
from yggdrasil.models.vocab import head_size
from yggdrasil.plotting import pyplot, save
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.steps import StepRunner, verify_inputs
from yggdrasil.runtime.tree import TokenTree
from yggdrasil.sampling import SamplingParams

from . import draft_weights
from .common import environment, log
from .prompts import build_prompts
from .provenance import Results
from .startup import source_gguf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True, help="a compiled bundle with a draft model")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per prompt set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=16, help="T(n) for n = 1..ROWS")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="a directory for draft-cost.json and draft-cost.png")


def step_curves(runners: dict[str, StepRunner], rows: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median seconds of one n-row step (a tree verify's shape, root-only tree padded to n) of
    each runner, n = 1..rows, each (n, runner) timed once per repeat in turn."""
    tree, root = TokenTree.with_root(rows, 0), torch.zeros(1, dtype=torch.long)
    samples = {name: {n: [] for n in range(1, rows + 1)} for name in runners}
    for repeat in range(repeats + 1):  # the first pass warms up
        for n in range(1, rows + 1):
            for name, runner in runners.items():
                inputs = verify_inputs(runner, tree, root, 64, n)
                took = timed_runs(lambda: runner.run(inputs, key="verify"), 1, 0, device_sync(runner.device))
                if repeat:
                    samples[name][n] += took
    return {name: {n: statistics.median(ts) for n, ts in by_n.items()} for name, by_n in samples.items()}


def acceptance(generator, draft_runner: StepRunner, prompts, max_new_tokens: int, plain: list) -> dict:
    """The bundle's policy drafting with this draft runner over the prompts, greedy."""
    accepted = offered = iterations = committed = 0
    equal = 0
    for prompt, reference in zip(prompts, plain):
        policy = generator.policy
        speculator = build_speculator(generator.runner, policy.drafter(draft_runner), policy=policy)
        result = speculator.generate(prompt.ids, max_new_tokens, SamplingParams())
        spec = result.spec
        accepted += sum(spec.accepted_at_depth)
        offered += sum(spec.offered_at_depth)
        iterations += spec.iterations
        committed += spec.committed
        equal += result.tokens == reference
    return {"per_token_acceptance": round(accepted / offered, 4) if offered else None,
            "aal": round(committed / iterations, 4) if iterations else None, "iterations": iterations,
            "accepted": accepted, "offered": offered, "outputs_equal_plain": f"{equal} of {len(prompts)}"}


def run(args: argparse.Namespace, record: Results) -> int | None:
    bundle = open_bundle(Path(args.bundle), quiet=True)
    generator = bundle.generator()
    if generator.draft is None or generator.policy is None:
        raise SystemExit(f"{args.bundle} has no draft model that speculates: nothing to measure")
    draft, target = generator.draft.model, generator.target.model
    kept, vocab = head_size(draft), draft.config.vocab_size
    fmt = bundle.manifest.weight_format("draft")
    source = source_gguf(Path(args.bundle), "draft")
    log(f"loading the draft again from {source} in {fmt}, with its full head")
    full = load(str(source), dtype=draft.dtype, quiet=True, weights=fmt).model
    context, chunks = generator.runner.max_context, generator.runner.chunk_sizes
    eager = {f"draft, head {kept}": StepRunner(draft, context, chunk_sizes=chunks),
             f"draft, full head {vocab}": StepRunner(full, context, chunk_sizes=chunks),
             "target (verify)": StepRunner(target, context, chunk_sizes=chunks)}
    if kept == vocab:
        eager.pop(f"draft, head {kept}")
    log(f"T(n), n = 1..{args.rows}: {', '.join(eager)}")
    curves = step_curves(eager, args.rows, args.repeats)

    prompts, prompt_info = build_prompts(generator.tokenizer, args.prompts, "held-out")
    prompts = [p for p in prompts if len(p.ids) + args.max_new_tokens + 64 < context]
    log(f"acceptance over {len(prompts)} held-out prompts x {args.max_new_tokens} tokens")
    plain = [greedy_tokens(generator.runner, p.ids, args.max_new_tokens) for p in prompts]
    rows = {f"head {kept}": acceptance(generator, generator.draft_runner, prompts, args.max_new_tokens, plain),
            f"full head {vocab}": acceptance(generator, StepRunner(full, context, chunk_sizes=chunks), prompts,
                                             args.max_new_tokens, plain)}
    for name, row in rows.items():
        log(f"{name}: per-token acceptance {row['per_token_acceptance']}, AAL {row['aal']}, "
            f"outputs equal to plain greedy {row['outputs_equal_plain']}")
    weights = lighter_weights(draft, full, context, chunks, prompts, plain, args.repeats, kept < vocab)
    compiled = {"draft": [list(p) for p in generator.latency.draft], "verify": [list(p) for p in generator.latency.verify]}
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plot(curves, compiled, out / "draft-cost.png", bundle.manifest.environment.device)
    record.write({"benchmark": "draft_cost", "bundle": str(args.bundle), "draft_head": {"kept": kept, "vocab": vocab},
                  "weights": fmt, "t_ms": {name: {n: round(t * 1e3, 4) for n, t in c.items()} for name, c in curves.items()},
                  "bundle_profile_s": compiled, "acceptance": rows, "draft_weights": weights,
                  "prompts": {"count": len(prompts), "max_new_tokens": args.max_new_tokens, **prompt_info},
                  "policy": str(generator.policy.selector.constant()[0]), "environment": environment(),
                  "statistic": f"T(n): median of {args.repeats} interleaved repeats of one eager n-row step; "
                               "acceptance: sums over all prompts (accepted / offered drafted tokens); "
                               "draft weights: teacher-forced top-1 agreement with the plain greedy outputs, "
                               "eager T(1), T(4) medians"},
                 out / "draft-cost.json" if out is not None else None, bundle=Path(args.bundle))
    return 0


def lighter_weights(draft, full, context: int, chunks, prompts, plain, repeats: int, trimmed: bool) -> dict:
    """Each variant of the draft's weights (bench/draft_weights.py): its teacher-forced agreement
    with the target's greedy outputs and its eager step times at 1 and 4 rows."""
    sequences = [(p.ids, out) for p, out in zip(prompts, plain)]
    runner = StepRunner(draft, context, chunk_sizes=chunks)
    out = {}
    for name, names in draft_weights.variants(draft).items():
        with draft_weights.swapped(draft, names):
            times = step_curves({name: runner}, 4, repeats)[name]
            out[name] = {"agreement": round(draft_weights.agreement(runner, sequences), 4),
                         "t1_ms": round(times[1] * 1e3, 4), "t4_ms": round(times[4] * 1e3, 4), "as_4bit": names}
        log(f"draft weights {name}: agreement {out[name]['agreement']}, T(1) {out[name]['t1_ms']:.2f} ms")
    if trimmed:
        full_runner = StepRunner(full, context, chunk_sizes=chunks)
        times = step_curves({"full": full_runner}, 4, repeats)["full"]
        out["full head (8-bit)"] = {"agreement": round(draft_weights.agreement(full_runner, sequences), 4),
                                    "t1_ms": round(times[1] * 1e3, 4), "t4_ms": round(times[4] * 1e3, 4)}
    return out


def plot(curves: dict, compiled: dict, path: Path, device: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in curves.items():
        ax.plot(list(curve), [t * 1e3 for t in curve.values()], marker="o", markersize=3, label=f"{name} (eager)")
    for role, points in (("draft step", compiled["draft"]), ("verify", compiled["verify"])):
        if points:
            ax.scatter([n for n, _ in points], [t * 1e3 for _, t in points], marker="x", s=40,
                       label=f"bundle's compiled {role}")
    ax.set_xlabel("rows n")
    ax.set_ylabel("ms per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, path, f"T_draft(n) and T_verify(n), {device}")
