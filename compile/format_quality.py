"""The fp32 reference every weight format is compared with, and the two quality measures:
greedy next-token agreement along fp32's own greedy continuations, and held-out perplexity
(compile/formats.py measures each format with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from yggdrasil.predictor import prompts as prompt_sets
from yggdrasil.runtime.steps import StepRunner

from .context import BuildContext
from .greedy_path import greedy_paths

AGREEMENT_METHOD = ("teacher-forced on the fp32 model's greedy continuations of the calibration prompts (runs of "
                    "32 or more positions): the format's argmax vs fp32's at each continuation position; the "
                    "interval is Wilson's 95 % one over those positions")
MIN_RUN = 32  # positions continued per reference prompt, at least


def wilson(agreed: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95 % interval of a share agreed/total (positions treated as independent, which
    positions of one continuation are not quite: a stated, not a conservative, confidence)."""
    if total == 0:
        return 0.0, 1.0
    share = agreed / total
    centre = (share + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Reference:
    """What every format is compared with: fp32's argmax along its own greedy continuations,
    and the held-out token sequences perplexity is measured on."""

    sequences: tuple[tuple[int, ...], ...]  # prompt + fp32 greedy continuation
    starts: tuple[int, ...]  # where each continuation's predictions begin (last prompt position)
    heldout: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def argmax(self) -> tuple[tuple[int, ...], ...]:
        """fp32's argmax at each of those positions: the continuation's own next tokens (a
        teacher-forced recomputation in prefill chunks differed at 0 of 512 positions on SmolLM2
        and 0 of 256 on the Qwen 1.5B target, and cost 80 s there)."""
        return tuple(sequence[start + 1:] for sequence, start in zip(self.sequences, self.starts))


def sequence_logits(runner: StepRunner, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logits of every position, teacher-forced, in prefill chunks."""
    out, size = [], runner.chunk_size
    with torch.inference_mode():
        for offset in range(0, len(ids), size):
            piece = ids[offset:offset + size]
            inputs = replace(runner.prefill_inputs(piece, offset, size), logit_index=None)
            out.append(runner.run(inputs)[0, :len(piece)].float())
    return torch.cat(out)


def prompt_ids(ctx: BuildContext, part: str) -> list[list[int]]:
    recipe = ctx.recipe
    names = [recipe.resolve(p) if p.endswith(".jsonl") else p for p in recipe.calibration.prompts]
    texts = prompt_sets.select(names, part, recipe.calibration.num_prompts)
    return [prompt_sets.encode(p, ctx.target.tokenizer) for p in texts]


def reference_jobs(ctx: BuildContext) -> list[tuple[list[int], int]]:
    """(calibration prompt, tokens to continue it by) for the reference: the positions are shared
    out over the prompts, so a short calibration (few prompts, short replies) still measures
    quality.agreement_tokens positions, and a 0.97-0.98 floor needs them."""
    limit = ctx.recipe.max_context - 1
    prompts = prompt_ids(ctx, "calibration")
    # runs of at least MIN_RUN positions: the reference's cost is fp32's prefill of each prompt it
    # continues (on the Qwen pair most of its 100 s), not the positions
    per_prompt = max(MIN_RUN, -(-ctx.recipe.quality.agreement_tokens // max(len(prompts), 1)))
    jobs, budget = [], ctx.recipe.quality.agreement_tokens
    for prompt in prompts:
        if budget <= 0:
            break
        prompt = prompt[-(limit // 2):]
        n = min(per_prompt, budget, limit - len(prompt))
        jobs.append((prompt, n))
        budget -= n
    return jobs


def build_reference(ctx: BuildContext, runner: StepRunner) -> Reference:
    """fp32 greedy continuations of the calibration prompts (quality.agreement_tokens positions
    in all; decoded together, greedy_path.py), which are fp32's argmax along them; the held-out
    token sequences."""
    recipe, quality = ctx.recipe, ctx.recipe.quality
    limit = recipe.max_context - 1
    jobs = reference_jobs(ctx)
    continuations = greedy_paths(runner.model, [p for p, _ in jobs], [n for _, n in jobs], runner.chunk_size)
    sequences = tuple(tuple(prompt + continuation) for (prompt, _), continuation in zip(jobs, continuations))
    starts = tuple(len(prompt) - 1 for prompt, _ in jobs)
    heldout, budget = [], quality.heldout_tokens
    for ids in prompt_ids(ctx, "held-out"):
        if budget <= 0:
            break
        ids = ids[:min(limit, budget + 1)]
        if len(ids) >= 2:
            heldout.append(tuple(ids))
            budget -= len(ids) - 1
    return Reference(sequences, starts, tuple(heldout))


def agreement(runner: StepRunner, reference: Reference) -> tuple[float, int]:
    """(share of positions where the model's argmax is fp32's, positions)."""
    agreed = total = 0
    for sequence, start, expected in zip(reference.sequences, reference.starts, reference.argmax):
        picked = sequence_logits(runner, list(sequence[:-1]))[start:].argmax(-1)
        agreed += int((picked == torch.tensor(expected)).sum())
        total += len(expected)
    return (agreed / total if total else 1.0), total


def perplexity(runner: StepRunner, reference: Reference) -> float | None:
    """exp(mean negative log-likelihood) of the held-out tokens (None: no held-out text)."""
    nll = count = 0.0
    for ids in reference.heldout:
        logits = sequence_logits(runner, list(ids[:-1]))
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count) if count else None
