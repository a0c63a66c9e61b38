"""What int8 activations cost, apart from the weights (issue 53), for any GGUF model: agreement
with the GGUF's own dequantized model and held-out perplexity of

    the GGUF model      the file's blocks dequantized to float32 (the fp32 format): the reference
    q4, float acts      the q4 format's weights dequantized, multiplied in float32 (its float twin)
    q4, int8 acts       the q4 format as it runs

measured as compile's formats phase measures them (compile/format_quality.py, activation_cost.py),
on a recipe's calibration prompts (agreement) and held-out prompts (perplexity).

    yggdrasil bench activation-cost --model qwen2.5-coder-1.5b --recipe recipes/qwen-pair-cpu.yaml \
        [--threads N] [--out FILE]

The recipe gives only the prompts and the quality settings (agreement_tokens, heldout_tokens) and
the context; its models are not loaded. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from yggdrasil.compile import activation_cost
from yggdrasil.compile.format_quality import agreement, build_reference, perplexity
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.models.loader import load
from yggdrasil.models.quant import weight_bytes
from yggdrasil.runtime.steps import StepRunner

from . import common
from .provenance import Results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="catalog name or path of a GGUF model")
    parser.add_argument("--recipe", required=True, help="a recipe for the prompts and quality settings")
    parser.add_argument("--out", default=None, help="write the JSON here too")


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = common.set_threads(args.threads)
    recipe = load_recipe(args.recipe)
    chunks = recipe.buckets.prefill_chunks
    started = time.perf_counter()
    fp32 = load(args.model, quiet=True, weights="fp32")
    ctx = SimpleNamespace(recipe=recipe, target=fp32)
    runner = StepRunner(fp32.model, recipe.max_context, chunk_sizes=chunks)
    reference = build_reference(ctx, runner)
    rows = {"gguf model (fp32)": {"agreement": 1.0, "perplexity": perplexity(runner, reference),
                                  "weight_bytes": weight_bytes(fp32.model)}}
    del runner
    fp32.model.to("meta")  # let it go before the q4 model and its float twin
    common.log(f"{args.model}: reference and the GGUF model's perplexity in {time.perf_counter() - started:.0f} s")
    q4 = load(args.model, quiet=True, weights="q4")
    runner = StepRunner(q4.model, recipe.max_context, chunk_sizes=chunks)
    agreed, positions = agreement(runner, reference)
    rows["q4, int8 activations"] = {"agreement": agreed, "perplexity": perplexity(runner, reference),
                                    "weight_bytes": weight_bytes(q4.model)}
    cost = activation_cost.measure(q4.model, runner, reference)
    rows["q4, float activations"] = {**cost["float_activations"], "weight_bytes": None}
    for row in rows.values():
        row["agreement"] = round(row["agreement"], 6)
        row["perplexity"] = None if row["perplexity"] is None else round(row["perplexity"], 4)
    result = {"benchmark": "activation-cost", "model": args.model, "recipe": recipe.name, "positions": positions,
              "heldout_tokens": recipe.quality.heldout_tokens, "rows": rows,
              "weights_as_stored": cost["weights_as_stored"], "gguf_model": cost["gguf_model"],
              "environment": common.environment(threads=threads),
              "statistic": "agreement: share of the reference's greedy continuation positions where the model's "
                           "argmax is the reference's (teacher-forced); perplexity: exp(mean NLL) of held-out tokens"}
    print(f"{args.model} ({positions} positions, {recipe.quality.heldout_tokens} held-out tokens):")
    print(common.format_table(["model", "agreement", "held-out ppl"],
                              [[name, f"{r['agreement']:.4f}", common.fmt(r["perplexity"], 3)] for name, r in rows.items()]))
    record.write(result, args.out)
    return 0
