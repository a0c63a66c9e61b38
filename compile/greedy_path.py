"""The model's greedy continuations of many prompts at once (the formats phase's reference).

The agreement reference (formats.py) is fp32's greedy continuation of each calibration prompt,
whose tokens are fp32's argmax at every position of it. Decoding those continuations one prompt
and one token per forward was most of the phase's time (SmolLM2: 20 of 43 s on 2 cores).
Here every prompt decodes in the same forward: each has a range of slots of its own in one KV
cache, and each row attends only its own prompt's slots up to its position (packed sequences,
as the server packs requests). A forward of one row per prompt costs little more than one row,
so the continuations take about as many forwards as the longest one alone. Rows are computed
in different groupings than one-row decode steps, so a continuation equals plain greedy decoding
up to ties of the model's dtype (tests compare them).
"""

from __future__ import annotations

import torch

from yggdrasil.models.model import KVCache, Transformer


def greedy_paths(model: Transformer, prompts: list[list[int]], counts: list[int], chunk: int) -> list[list[int]]:
    """counts[i] greedy tokens after prompts[i] (stop tokens ignored), for every prompt at once."""
    lengths = [len(p) + n for p, n in zip(prompts, counts)]
    bases = [sum(lengths[:i]) for i in range(len(lengths))]
    span = sum(lengths)
    cache = KVCache(model.config, 1, span + 1, model.dtype, model.device)  # + the scratch slot
    out: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            if counts[i] > 0:
                out[i].append(_prefill(model, cache, prompt, bases[i], span, chunk))
        while True:
            active = [i for i, n in enumerate(counts) if len(out[i]) < n]
            if not active:
                return out
            positions = [len(prompts[i]) + len(out[i]) - 1 for i in active]
            tokens = [out[i][-1] for i in active]
            logits = _forward(model, cache, tokens, positions, [bases[i] for i in active], span)
            for i, token in zip(active, logits.argmax(-1).tolist()):
                out[i].append(token)


def _prefill(model, cache, prompt: list[int], base: int, span: int, chunk: int) -> int:
    """The prompt's K/V written at its slots, in chunks; returns the first greedy token."""
    for offset in range(0, len(prompt), chunk):
        piece = prompt[offset:offset + chunk]
        logits = _forward(model, cache, piece, list(range(offset, offset + len(piece))), [base] * len(piece), span,
                          last_only=True)
    return int(logits[-1].argmax())


def _forward(model, cache, tokens: list[int], positions: list[int], bases: list[int], span: int,
             last_only: bool = False) -> torch.Tensor:
    """Logits [rows, vocab] (last_only: of the last row): row r is token r at positions[r] of the
    sequence whose slots start at bases[r]."""
    device = model.device
    position = torch.tensor(positions, dtype=torch.long)
    base = torch.tensor(bases, dtype=torch.long)
    slot_ids = torch.arange(span)
    mask = (slot_ids[None, :] >= base[:, None]) & (slot_ids[None, :] <= (base + position)[:, None])
    logits = model(torch.tensor([tokens], device=device), position[None].to(device), (base + position)[None].to(device),
                   mask[None].to(device), cache=cache,
                   logit_index=torch.tensor([[len(tokens) - 1]], device=device) if last_only else None)
    return logits[0].float()
