"""Batch invariance of a bundle where it is most likely to break (issue 53), and whether its
speculative output equals its own plain output, for the claim the manifest makes (`bitwise` or
`up to ties`, compile/check.py measure_graph_invariance).

    yggdrasil bench invariance --bundle DIR [--prompts humaneval] [--n 16] [--max-new-tokens 256] \
        [--rows 17] [--threads N] [--out FILE]

Three measurements, each against the autoregressive loop's own step (compile/invariance.py):
  eager rows    the deployed model's eager steps at every verify width 1..--rows (odd row counts
                included: a vector loop's tail depends on them), on the probes and on a prompt that
                fills the recipe's context
  graphs        the bundle's compiled graphs at their verify widths, on the same prompts
  generation    --n held-out prompts x --max-new-tokens: the bundle's speculative greedy output
                against its own autoregressive greedy output on its graphs, token for token; a
                difference is reported with the deployed model's logit gap there (what the tie
                rule would say of it), never excused
Ends with one JSON line; the statistic is "equal" (bit for bit, token for token), not an average.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from yggdrasil.bundle import open_bundle
from yggdrasil.compile.check import compare_greedy
from yggdrasil.compile.invariance import long_probe, measure_invariance, probe_ids

from . import common, engines
from .harness import GREEDY, BenchOptions, load_prompts
from .provenance import Results


def compiled_verify_widths(buckets) -> tuple[int, ...]:
    """The target's verify graphs' row counts ("target/verify_w4", "target/verify_hidden_w8")."""
    found = {int(name.rsplit("_w", 1)[1].split("_")[0]) for name in buckets
             if name.startswith("target/verify") and "_w" in name}
    return tuple(sorted(found)) or (1,)


def generation(runtime, prompts, tokens: int) -> dict:
    """Speculative against autoregressive greedy on the bundle's graphs, prompt by prompt."""
    plain = engines.autoregressive(engines.bundle_runners(runtime))
    speculative = engines.bundle_policy(runtime)
    if speculative is None:
        return {"speculates": False, "note": "the bundle does not speculate: nothing to compare"}
    rows = []
    for prompt in prompts:
        want, got = plain(prompt.ids, tokens, GREEDY).tokens, speculative(prompt.ids, tokens, GREEDY).tokens
        row = {"prompt": f"{prompt.set}/{prompt.id}", "equal": want == got}
        if want != got:
            agreement = compare_greedy(runtime.runner.model, list(prompt.ids), want, got)
            row.update({"at": agreement.at, "logit_gap": agreement.gap, "tie_tolerance": agreement.tolerance})
        rows.append(row)
        common.log(f"{row['prompt']}: {'equal' if row['equal'] else 'DIFFERS at ' + str(row['at'])}")
    return {"speculates": True, "equal": sum(r["equal"] for r in rows), "of": len(rows), "rows": rows}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--rows", type=int, default=17, help="eager verify widths 1..ROWS (default 17)")
    parser.add_argument("--out", default=None, help="write the JSON here too")


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = common.set_threads(args.threads)
    bundle = Path(args.bundle)
    runtime = open_bundle(bundle, quiet=True).generator()
    manifest = runtime.manifest
    context = int(manifest.recipe["max_context"])
    tokenizer = runtime.tokenizer
    widths = compiled_verify_widths(manifest.buckets)
    prompts_ids = probe_ids(tokenizer) + [long_probe(tokenizer, context, max(args.rows, *widths))]
    eager = engines.fresh_runners(runtime, compiled=False).runner
    eager_rows = measure_invariance(eager, prompts_ids, tuple(range(1, args.rows + 1)))
    common.log(f"eager steps, rows 1..{args.rows}: {eager_rows.summary()}")
    graphs = measure_invariance(runtime.runner, prompts_ids, tuple(sorted({w for w in widths if w > 1})))
    common.log(f"the bundle's graphs: {graphs.summary()}")
    options = BenchOptions("compare", bundle, prompts=tuple(args.prompts.split(",")), n=args.n,
                           max_new_tokens=args.max_new_tokens)
    prompts, prompt_info = load_prompts(options, runtime)
    generated = generation(runtime, prompts, args.max_new_tokens)
    result = {"benchmark": "invariance", "claim": manifest.exactness(), "bitwise": manifest.bitwise,
              "weights": manifest.weight_format("target"), "eager_rows": eager_rows.as_dict(),
              "graphs": graphs.as_dict(), "generation": generated, "prompts": prompt_info,
              "max_new_tokens": args.max_new_tokens, "environment": common.environment(threads=threads),
              "statistic": "bitwise equality of logits (steps) and of tokens (generation): counts, no average"}
    verdict = (f"{generated['equal']}/{generated['of']} generations equal" if generated.get("speculates")
               else generated["note"])
    print(f"{manifest.recipe.get('name')}: claims {manifest.exactness()[:60]}; eager rows 1..{args.rows} "
          f"{eager_rows.verdict()}; graphs {graphs.verdict()}; {verdict}")
    record.write(result, args.out, bundle=bundle)
    return 0
