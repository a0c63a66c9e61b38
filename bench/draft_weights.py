"""Lighter draft weights, judged by acceptance (issue 51, part 2): the draft's quality is only how
often it proposes the target's token, so each variant of the draft's weights is measured by its
teacher-forced top-1 agreement with the target's own greedy output (the bundle's plain greedy
continuations of held-out prompts), beside its one-row step time. Variants, swapped into the
bundle's draft model in place (its eager forward; the bundle's graphs are untouched):

  * as deployed (head and 6+-bit tensors in 8-bit blocks, the body in 4-bit);
  * the head in 4-bit blocks (requantized from the deployed 8-bit rows);
  * the 6+-bit tensors of the body (the GGUF's Q6_K/Q8_0 ones) in 4-bit blocks too;
  * the full head, as loaded from the GGUF (when the bundle's head is trimmed).

Used by the draft-cost suite (bench/draft_cost.py). Issue 53's 6-bit path will be one more.
"""

from __future__ import annotations

import contextlib

import torch

from yggdrasil.compile.format_quality import sequence_logits
from yggdrasil.kernels import pack
from yggdrasil.models.quant_q4 import Q4Linear, Q8Linear
from yggdrasil.models.vocab import TrimmedHead, head_token_ids
from yggdrasil.runtime.steps import StepRunner


def agreement(runner: StepRunner, sequences: list[tuple[list[int], list[int]]]) -> float:
    """Share of generated positions where the draft's argmax, teacher-forced along prompt +
    output, is the target's next token."""
    ids_map = head_token_ids(runner.model)
    hits = total = 0
    for prompt, output in sequences:
        ids = prompt + output
        logits = sequence_logits(runner, ids[:-1])[len(prompt) - 1:]
        best = logits.argmax(-1)
        if ids_map is not None:
            best = ids_map[best]
        hits += int((best == torch.tensor(output)).sum())
        total += len(output)
    return hits / total if total else float("nan")


def _to_q4(module: Q8Linear) -> Q4Linear:
    return Q4Linear(pack.quantize_q4(module.dequantized_weight()), module.bias)


@contextlib.contextmanager
def swapped(model, names: list[str]):
    """The named Q8 linears of model as 4-bit blocks while inside; put back after."""
    saved = {}
    try:
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            saved[name] = (parent, attr, getattr(parent, attr))
            setattr(parent, attr, _to_q4(getattr(parent, attr)))
        yield
    finally:
        for parent, attr, module in saved.values():
            setattr(parent, attr, module)


def wide_body(model) -> list[str]:
    """The body's 8-bit linears (the GGUF's 6+-bit tensors), not the head."""
    return [n for n, m in model.named_modules() if isinstance(m, Q8Linear) and not n.startswith("output")]


def head_name(model) -> str | None:
    head = model.output
    inner, name = (head.inner, "output.inner") if isinstance(head, TrimmedHead) else (head, "output")
    return name if isinstance(inner, Q8Linear) else None


def variants(model) -> dict[str, list[str]]:
    """Variant name -> the 8-bit linears it stores in 4-bit."""
    out = {"as deployed": []}
    head = head_name(model)
    if head:
        out["head 4-bit"] = [head]
    body = wide_body(model)
    if body:
        out["head and 6+-bit body tensors 4-bit"] = ([head] if head else []) + body
    return out
