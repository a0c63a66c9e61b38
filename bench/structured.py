"""Structured output and prefix reuse on a bundle (issue 52).

    yggdrasil bench structured --bundle DIR [--prompts 8] [--max-tokens 160] [--repeats 2]
                               [--prefix-tokens 1000] [--pairs 3] [--out FILE.json]

1. JSON schema. Chat prompts asking for a record as JSON, each generated greedily four ways,
   interleaved prompt by prompt: the bundle's policy (speculation) and the bundle's own plain
   decoding, each with the schema below (a nested object with an array and an enum) and without
   it. The unconstrained runs generate exactly as many tokens as the constrained run of that
   prompt (stop tokens ignored), so each pair times the same number of steps. Reported: median
   TPOT per variant, the median of paired per-prompt ratios (constrained / unconstrained, for
   speculation and for plain decoding), speculation's speed-up over plain decoding with and
   without the schema, the grammar's host cost per output token (masks computed, waited for,
   applied), whether constrained speculative output equals constrained plain output token for
   token, and how many replies are complete (the grammar reached its end) and parse.
2. Prefix reuse. The serving engine (the bundle's serve graphs, the main thread stepping it as
   `serve` does): per pair, a request whose prompt is a --prefix-tokens shared text plus a
   question, then a second request with the same prefix and another question. Time to first
   token of each from its submission (the engine idle before each), the prompt tokens the second
   took from the prefix cache, and whether its reply equals the one a fresh engine gives.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from yggdrasil.bundle import open_bundle
from yggdrasil.models.tokenizer import Message
from yggdrasil.runtime.logits import LogitsControl, mask_worker
from yggdrasil.runtime.speculative import generate_with
from yggdrasil.sampling import SamplingParams
from yggdrasil.serve.requests import GenerationRequest
from yggdrasil.serve.setup import ServeSettings
from yggdrasil.structured.grammar import GrammarEngine

from .common import environment, fmt, format_table, log, summarize
from .provenance import Results

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "category": {"enum": ["fruit", "vegetable", "grain", "dairy", "meat", "other"]},
    "colors": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "nutrition": {"type": "object", "properties": {"calories": {"type": "integer"}, "vegan": {"type": "boolean"}},
                  "required": ["calories", "vegan"], "additionalProperties": False}},
    "required": ["name", "category", "colors", "nutrition"], "additionalProperties": False}
FOODS = ["a banana", "a carrot", "brown rice", "cheddar cheese", "an apple", "spinach", "oatmeal", "a chicken breast",
         "a mango", "broccoli", "yogurt", "a potato"]
QUESTIONS = ["Summarize the text above in two sentences.", "What is the main point of the text above?",
             "List three facts from the text above.", "Who would find the text above useful?"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--prompts", type=int, default=8, help="JSON prompts (default 8)")
    parser.add_argument("--max-tokens", type=int, default=160, help="reply limit of a constrained run (default 160)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts (default 2)")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="shared prefix length (default 1000)")
    parser.add_argument("--pairs", type=int, default=3, help="prefix-reuse pairs (default 3)")
    parser.add_argument("--out", default=None, help="write the JSON here too")


def _schema_runs(bundle: Path, args) -> dict:
    generator = open_bundle(bundle, quiet=True).generator()
    speculator = generator.speculator()
    tokenizer, grammars = generator.tokenizer, GrammarEngine(generator.tokenizer)
    grammar = grammars.json_schema(SCHEMA)
    worker = mask_worker()
    greedy = SamplingParams()
    rows, equal, valid = [], 0, 0
    for repeat in range(args.repeats + 1):  # pass 0 warms every shape up and is not timed
        for i, food in enumerate(FOODS[:args.prompts]):
            prompt = tokenizer.encode_chat([Message("user", f"Describe {food} as a JSON object with its name, "
                                                            "category, colors and nutrition.")])
            row: dict = {"prompt": i}
            for name, spec in (("spec", speculator), ("plain", None)):
                control = LogitsControl(prompt, matcher=grammars.matcher(grammar), executor=worker)
                constrained = generate_with(generator.runner, spec, prompt, args.max_tokens, greedy,
                                            tokenizer.stop_ids, control=control)
                n = len(constrained.tokens)
                free = generate_with(generator.runner, spec, prompt, n, greedy, frozenset())
                row[name] = {"tokens": n, "json_tpot": constrained.stats.time_per_output_token,
                             "complete": constrained.stop_reason == "stop",
                             "free_tpot": free.stats.time_per_output_token, "cost": vars(control.cost).copy(),
                             "out": constrained.tokens}
            if repeat == 0:
                continue
            equal += row["spec"]["out"] == row["plain"]["out"]
            try:  # a reply the grammar saw complete is in the schema's language; it must also parse
                json.loads(tokenizer.decode(row["spec"]["out"]))
                valid += row["spec"]["complete"]
            except ValueError:
                pass
            rows.append(row)
            log(f"prompt {i}: {row['spec']['tokens']} tokens | TPOT spec {row['spec']['json_tpot'] * 1e3:.2f} ms JSON vs "
                f"{row['spec']['free_tpot'] * 1e3:.2f} free | plain {row['plain']['json_tpot'] * 1e3:.2f} vs "
                f"{row['plain']['free_tpot'] * 1e3:.2f}")
    ratio = lambda mode: summarize([r[mode]["json_tpot"] / r[mode]["free_tpot"] for r in rows])  # noqa: E731
    speedup = lambda key: summarize([r["plain"][key] / r["spec"][key] for r in rows])  # noqa: E731
    tokens = sum(r[m]["tokens"] for r in rows for m in ("spec", "plain"))
    cost = {k: sum(r[m]["cost"][k] for r in rows for m in ("spec", "plain")) for k in rows[0]["spec"]["cost"]}
    return {
        "speculates": speculator is not None,
        "tpot_ms": {f"{mode} {kind}": round(statistics.median(r[mode][f"{kind}_tpot"] for r in rows) * 1e3, 3)
                    for mode in ("spec", "plain") for kind in ("json", "free")},
        "json_over_free": {"spec": ratio("spec"), "plain": ratio("plain")},
        "spec_speedup": {"json": speedup("json_tpot"), "free": speedup("free_tpot")},
        "grammar_us_per_token": {k.removesuffix("_seconds"): round(cost[k] / tokens * 1e6, 1)
                                 for k in ("compute_seconds", "wait_seconds", "apply_seconds")},
        "masks_per_token": round(cost["masks"] / tokens, 3), "mask_worker": worker is not None,
        "spec_equals_plain": f"{equal}/{len(rows)}", "valid_json": f"{valid}/{len(rows)}",
        "tokens_per_run": [r["spec"]["tokens"] for r in rows],
    }


def _prefix_text(tokenizer, tokens: int, seed: int) -> str:
    """About `tokens` tokens of plain prose (numbered sentences, different per seed)."""
    words = ["the", "river", "city", "bridge", "market", "winter", "garden", "library", "train", "harbor",
             "museum", "festival", "mountain", "village", "engineer", "baker"]
    sentences, text = [], ""
    i = 0
    while len(tokenizer.encode(text)) < tokens:
        pick = [words[(seed * 7 + i * k) % len(words)] for k in range(1, 9)]
        sentences.append(f"Note {i}: the {pick[0]} near the {pick[1]} opened after the {pick[2]} and the {pick[3]}.")
        text = " ".join(sentences)
        i += 1
    return text


def _ttft(engine, request: GenerationRequest) -> tuple[float, int, list[int]]:
    """(seconds from submission to the first token, cached prompt tokens, the reply) with the
    engine stepped on this thread until the reply ends."""
    class Sink:
        def __init__(self) -> None:
            self.ids, self.first, self.usage = [], None, None

        def tokens(self, ids, text, logprobs=None) -> None:
            self.first = self.first or time.perf_counter()
            self.ids += ids

        def finish(self, reason, usage) -> None:
            self.usage = usage

        def fail(self, message) -> None:
            raise RuntimeError(message)

    sink = Sink()
    started = time.perf_counter()
    engine.submit(request, sink)
    while sink.usage is None:
        engine.step()
    return sink.first - started, sink.usage.cached_tokens, sink.ids


def _prefix_runs(bundle: Path, args) -> dict:
    opened = open_bundle(bundle, quiet=True)
    engine = opened.engine(ServeSettings(max_batch=2, speculation="off"))
    tokenizer = engine.tokenizer
    pairs = []
    for pair in range(args.pairs + 1):  # pair 0 warms the engine up and is not reported
        prefix = _prefix_text(tokenizer, args.prefix_tokens, pair)
        prompts = [tokenizer.encode_chat([Message("system", prefix), Message("user", q)])
                   for q in QUESTIONS[pair % 2 * 2:pair % 2 * 2 + 2]]
        first, second = (_ttft(engine, GenerationRequest(tuple(p), 16)) for p in prompts)
        if pair == 0:
            continue
        fresh = opened.engine(ServeSettings(max_batch=2, speculation="off"))
        unchanged = _ttft(fresh, GenerationRequest(tuple(prompts[1]), 16))[2] == second[2]
        fresh.stop()
        pairs.append({"prompt_tokens": [len(p) for p in prompts], "first_ttft_s": round(first[0], 4),
                      "second_ttft_s": round(second[0], 4), "second_cached_tokens": second[1],
                      "speedup": round(first[0] / second[0], 2), "second_reply_unchanged": unchanged})
        log(f"pair {pair}: first token {first[0] * 1e3:.0f} ms, then {second[0] * 1e3:.0f} ms with {second[1]} of "
            f"{len(prompts[1])} prompt tokens cached ({first[0] / second[0]:.1f}x); reply unchanged: {unchanged}")
    engine.stop()
    return {"pairs": pairs, "ttft_speedup": summarize([p["speedup"] for p in pairs])}


def run(args: argparse.Namespace, record: Results) -> int | None:
    bundle = Path(args.bundle)
    schema = _schema_runs(bundle, args)
    prefix = _prefix_runs(bundle, args)
    result = {"bundle": str(bundle), "schema": SCHEMA,
              "statistic": "TPOT: median over prompts; ratios: median of paired per-prompt ratios (json/free, "
                           "plain/spec); prefix: per pair first-request TTFT / second-request TTFT, median over pairs",
              "json": schema, "prefix": prefix, "environment": environment()}
    table = [[mode, fmt(schema["tpot_ms"][f"{mode} free"]), fmt(schema["tpot_ms"][f"{mode} json"]),
              fmt(schema["json_over_free"][mode]["median"], 3)] for mode in ("spec", "plain")]
    print(format_table(["decoding", "TPOT free (ms)", "TPOT JSON (ms)", "JSON / free"], table))
    print(f"speculation's speed-up: free {fmt(schema['spec_speedup']['free']['median'], 3)}x, JSON "
          f"{fmt(schema['spec_speedup']['json']['median'], 3)}x | grammar per token {schema['grammar_us_per_token']} us"
          f" | spec == plain {schema['spec_equals_plain']} | valid {schema['valid_json']} | prefix reuse "
          f"{fmt(prefix['ttft_speedup']['median'])}x sooner first token")
    record.write(result, args.out, bundle=bundle)
    return 0
