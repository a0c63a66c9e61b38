"""How close our q4 model stays to llama.cpp on the same GGUF file (issue 53): greedy text agreement
with `llama-completion` on the same prompts, and the weight bytes each side reads per decoded token.

    yggdrasil bench llama-agreement --model qwen2.5-coder-1.5b --llama-cpp DIR [--n 16] \
        [--max-new-tokens 128] [--threads N] [--out FILE]

Ours: the model loaded from its GGUF in the q4 format, greedy on eager steps with the kernels'
batch-invariant ops (a q4 bundle's graphs compute the same tokens: compile measures that). Theirs:
`llama-completion` greedy (--temp 0 --top-k 1 --ignore-eos) on the same prompt text, threads and
token count (bench/llama_cpp.py runs it as `compare` does). A prompt agrees when the two texts are
equal over the shorter one; the first token where they part is recorded too (llama.cpp's text
encoded by our tokenizer).

Bytes per token: what one decode step reads of the weights: every big linear's packed blocks and
the LM head (the embedding's one row is left out), beside the same tensors' bytes in the GGUF file,
which is what llama.cpp reads. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from yggdrasil.models.catalog import resolve_model
from yggdrasil.models.gguf_file import GGUFFile
from yggdrasil.models.loader import load
from yggdrasil.models.quant_base import PackedLinear
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.steps import StepRunner

from . import common
from .harness import BenchOptions, load_prompts
from .llama_cpp import LlamaJob, LlamaVariant, Mode, find_tool, same_text, write_prompts
from .provenance import Results

CONTEXT = 2048
# the GGUF tensors a decode step reads in full (the embedding: one row; norms: negligible)
_LINEAR_TENSORS = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.")


def decode_bytes(model) -> int:
    """Bytes of weights one decode step reads: the packed linears (and the head) whole."""
    total = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def gguf_decode_bytes(path: Path, tied: bool) -> int:
    """The same for llama.cpp: the GGUF's linear tensors and its output head, as stored."""
    gguf = GGUFFile(path)
    head = "token_embd.weight" if tied else "output.weight"
    return sum(t.nbytes for t in gguf.tensors
               if (t.name.startswith("blk.") and any(k in t.name for k in _LINEAR_TENSORS)) or t.name == head)


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """Index of the first token where two continuations part (None: one is a prefix of the other)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def run_llama(directory: Path, gguf: Path, texts: list[str], tokens: int, threads: int) -> list[str]:
    tool = find_tool(directory, "llama-completion")
    if tool is None:
        raise SystemExit(f"llama-completion not found in {directory}: build it (docs/cpu.md)")
    mode, job = Mode("llama.cpp-ar", "ar", tool), LlamaJob(gguf, None, threads, CONTEXT)
    with tempfile.TemporaryDirectory(prefix="yggdrasil-llama-") as folder:
        files = write_prompts(Path(folder), texts)
        variant = LlamaVariant(mode, job, files, texts, tokens)
        return [variant.generate(i, tokens).text for i in range(len(texts))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="catalog name of a GGUF model")
    parser.add_argument("--llama-cpp", required=True, metavar="DIR", help="llama.cpp build directory")
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="write the JSON here too")


def run(args: argparse.Namespace, record: Results) -> int | None:
    threads = common.set_threads(args.threads)
    source = resolve_model(args.model)
    if source.format != "gguf":
        raise SystemExit(f"{args.model} is not a GGUF model: llama.cpp needs one")
    loaded = load(args.model, quiet=True, weights="q4")
    model, tokenizer = loaded.model, loaded.tokenizer
    options = BenchOptions("compare", Path("."), prompts=tuple(args.prompts.split(",")), n=args.n,
                           max_new_tokens=args.max_new_tokens)
    runtime = SimpleNamespace(target=SimpleNamespace(tokenizer=tokenizer),
                              manifest=SimpleNamespace(recipe={"max_context": CONTEXT}))
    prompts, prompt_info = load_prompts(options, runtime)
    runner = StepRunner(model, CONTEXT, 64)
    ours = [greedy_tokens(runner, list(p.ids), args.max_new_tokens) for p in prompts]
    common.log(f"ours: {len(prompts)} prompts x {args.max_new_tokens} tokens")
    texts = [tokenizer.decode(list(p.ids), skip_special_tokens=False) for p in prompts]
    theirs = run_llama(Path(args.llama_cpp).expanduser(), source.path, texts, args.max_new_tokens, threads)
    rows = []
    for prompt, tokens, text in zip(prompts, ours, theirs):
        our_text = tokenizer.decode(tokens, skip_special_tokens=False)
        parted = first_difference(tokens, tokenizer.encode(text))
        rows.append({"prompt": f"{prompt.set}/{prompt.id}", "same_text": same_text(text, our_text),
                     "first_different_token": parted})
    same = sum(r["same_text"] for r in rows)
    ours_bytes = decode_bytes(model)
    theirs_bytes = gguf_decode_bytes(source.path, model.config.tie_embeddings)
    formats = sorted({m.fmt for m in model.modules() if isinstance(m, PackedLinear)})
    result = {"benchmark": "llama-agreement", "model": args.model, "gguf": str(source.path),
              "weights": "q4", "linear_formats": formats, "max_new_tokens": args.max_new_tokens,
              "prompts": prompt_info, "same_text": same, "of": len(rows), "rows": rows,
              "decode_bytes": {"ours": ours_bytes, "llama.cpp": theirs_bytes,
                               "ratio": round(ours_bytes / theirs_bytes, 4)},
              "environment": common.environment(threads=threads),
              "statistic": "same_text: prompts whose llama-completion greedy text equals ours over the shorter "
                           "text; decode_bytes: weight bytes one decode step reads (linears and LM head)"}
    print(f"{args.model}: llama.cpp's greedy text equals ours on {same}/{len(rows)} prompts; weights read per "
          f"token: ours {ours_bytes / 1e6:.1f} MB, llama.cpp {theirs_bytes / 1e6:.1f} MB ({formats})")
    record.write(result, args.out)
    return 0
