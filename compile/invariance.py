"""Batch invariance, measured (issue 40): does the deployed model compute a token the same way
in every step shape the bundle holds?

Speculation is lossless only if the target's verify step computes each row as its plain decode
step would: otherwise a near-tie of the logits can go one way in a 16-row verify and the other
way in a 1-row decode, and speculative greedy output leaves the bundle's own autoregressive
output. Whether that can happen is a property of the compiled graphs (their kernels' blocking
and reduction orders may depend on the number of rows), so it is measured, not assumed.

For each prompt, the logits that follow the whole prompt are computed three ways on the same
runner, each with the KV of earlier positions written by that way's own steps:

  prefill   the prompt in prefill chunks; the last row of the last chunk
  decode    the prompt minus its last token in prefill chunks, then one decode step
  verify V  the prompt minus its last k tokens in prefill chunks, then one verify step of width
            V over those k tokens as a chain (k = min(V, ...)); its last real row
  tree V    the same, the chain's nodes interleaved with a sibling each (a tree of 2k - 1 nodes):
            the path's keys sit at slots with gaps between them, as in a real tree verify

and every way is compared bitwise with decode, the autoregressive loop's own step.

Where it is most likely to break (issue 53), the deployed graphs are measured at every compiled
verify width and on a prompt that fills the recipe's context (`long_probe`: the longest span the
attention reduces over); `yggdrasil bench invariance` adds every row count 1..17 on eager steps
and 16 prompts x 256 tokens of speculative against autoregressive output. The bundle says
`bitwise` only when the measurement found no difference and the graphs hold nothing but our
fixed-order ops and exact elementwise arithmetic (compile/pointwise.py); otherwise `up to ties`,
with the largest logit difference seen, and the tie rule applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from yggdrasil.runtime.steps import StepRunner, verify_inputs
from yggdrasil.runtime.tree import TokenTree


PROBES = ("def fibonacci(n):", "The quick brown fox", "import numpy as np\n")  # code and prose


def probe_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in PROBES]


def long_probe(tokenizer, max_context: int, widest: int) -> list[int]:
    """A prompt as long as a step can attend: the probes repeated up to the context, less room
    for the widest verify (the longest reduction the attention does in a bundle's life)."""
    ids = [i for ids in probe_ids(tokenizer) for i in ids]
    room = max(2, max_context - widest - 1)
    return (ids * (room // len(ids) + 1))[:room]


@dataclass(frozen=True)
class Invariance:
    """measured_bitwise: every way gave decode's logits bit for bit. max_abs_diff: the largest
    logit difference seen (0.0 when none); argmax_changed: prompts where a way picked another
    token than decode did; ways: per way, its largest difference; longest: the longest prompt
    measured (tokens). proof: compile/pointwise.py's verdict on the deployed graphs (None: eager
    steps, not exported). bitwise, the claim: measured and, where there is a proof, proven."""

    measured_bitwise: bool
    max_abs_diff: float
    argmax_changed: int
    prompts: int
    ways: dict = field(default_factory=dict)
    longest: int = 0
    proof: dict | None = None

    @property
    def bitwise(self) -> bool:
        return self.measured_bitwise and (self.proof is None or bool(self.proof.get("exact")))

    @classmethod
    def from_dict(cls, body: dict) -> "Invariance":
        """A recorded measurement (older records name the measured flag `bitwise`)."""
        body = dict(body)
        measured = body.pop("measured_bitwise", body.get("bitwise"))
        body.pop("bitwise", None)
        return cls(measured, **body)

    def as_dict(self) -> dict:
        return {"bitwise": self.bitwise, "measured_bitwise": self.measured_bitwise, "max_abs_diff": self.max_abs_diff,
                "argmax_changed": self.argmax_changed, "prompts": self.prompts, "ways": self.ways,
                "longest": self.longest, "proof": self.proof}

    def verdict(self) -> str:
        """One word or phrase for a table: "bitwise" or "up to ties (max gap ...)"."""
        return "bitwise" if self.bitwise else f"up to ties (max gap {self.max_abs_diff:.2g})"

    def summary(self) -> str:
        if self.bitwise:
            proven = "; the graphs hold only fixed-order ops and exact elementwise arithmetic" if self.proof else ""
            return (f"bitwise: decode, prefill and verify steps give the same logits ({self.prompts} prompts, up to "
                    f"{self.longest} tokens){proven}")
        if self.measured_bitwise:  # measured the same, not proven to be: the tie rule still applies
            unproven = ", ".join((self.proof or {}).get("unproven_ops", []) + (self.proof or {}).get("inductor", []))
            return (f"up to ties (max gap {self.max_abs_diff:.2g}): no difference measured over {self.prompts} prompts, "
                    f"but the graphs compute outside the fixed-order ops ({unproven[:200]})")
        worst = max(self.ways, key=self.ways.get)
        return (f"up to ties (max gap {self.max_abs_diff:.3g}): steps differ by up to {self.max_abs_diff:.3g} in a "
                f"logit (worst: {worst}); {self.argmax_changed} argmax change(s) over {self.prompts} prompts")


def _decode_logits(runner: StepRunner, ids: list[int]) -> torch.Tensor:
    runner.prefill(ids[:-1])
    return runner.decode(ids[-1], len(ids) - 1).float()


def _verified_row(runner: StepRunner, ids: list[int], base: int, tokens: list[int], parents: list[int],
                  width: int, row: int) -> torch.Tensor:
    """ids[:base] prefilled, then the tree (tokens, parents; its root at position base, whose K/V
    the verify writes) verified in one step of `width` rows; the logits of node `row`."""
    runner.prefill(ids[:base])
    tree = TokenTree.from_lists(tokens, parents, [0.0] * len(tokens))
    inputs = verify_inputs(runner, tree, torch.arange(len(tokens)), base, width)
    with torch.inference_mode():
        logits = runner.run(inputs, key="verify")
    return logits[0, row].float()


def _verify_logits(runner: StepRunner, ids: list[int], width: int) -> torch.Tensor:
    """The chain of the prompt's last k tokens (k <= width) verified in one step of `width` rows."""
    k = min(width, len(ids) - 1)
    base = len(ids) - k
    return _verified_row(runner, ids, base, ids[base:], [-1] + list(range(k - 1)), width, k - 1)


def _tree_logits(runner: StepRunner, ids: list[int], width: int) -> torch.Tensor:
    """The prompt's last k tokens as the path of a tree whose every level below the root also
    holds a sibling (node order: root, sibling 1, chain 1, sibling 2, chain 2, ...), verified in
    one step of `width` rows; the last chain node's row."""
    k = min((width + 1) // 2, len(ids) - 1)
    base = len(ids) - k
    chain = ids[base:]
    tokens, parents, last = [chain[0]], [-1], 0
    for token in chain[1:]:
        tokens += [ids[0], token]  # the sibling: any token, it is never on the path
        parents += [last, last]
        last = len(tokens) - 1
    return _verified_row(runner, ids, base, tokens, parents, width, last)


def measure_invariance(runner: StepRunner, prompts: list[list[int]], verify_widths: tuple[int, ...],
                       proof: dict | None = None) -> Invariance:
    """Compare every way with decode on each prompt (each at least 2 tokens, within the context).
    proof: compile/pointwise.py's verdict on the graphs these steps run, recorded with it."""
    ways: dict[str, float] = {}
    changed = 0
    for ids in prompts:
        with torch.inference_mode():
            reference = _decode_logits(runner, ids)
            results = {"prefill": runner.prefill(ids).float()}
        for width in verify_widths:
            if width > 1:
                results[f"verify{width}"] = _verify_logits(runner, ids, width)
            if width > 2 and len(ids) > 2:
                results[f"tree{width}"] = _tree_logits(runner, ids, width)
        for way, logits in results.items():
            diff = float((logits - reference).abs().max())
            ways[way] = max(ways.get(way, 0.0), diff)
            changed += int(logits.argmax() != reference.argmax())
    worst = max(ways.values(), default=0.0)
    return Invariance(worst == 0.0, worst, changed, len(prompts), ways, max(map(len, prompts), default=0), proof)
