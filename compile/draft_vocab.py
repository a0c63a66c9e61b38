"""Phase "draft vocab" (issue 51): how many of the target's tokens the draft's LM head keeps.

The head of a small draft is a large share of what a draft step reads (Qwen2.5-Coder-0.5B: 896 x
151,936 weights, a third of the step). The draft only proposes; the target verifies over its
whole vocabulary, so a draft whose head keeps only the K most frequent tokens loses nothing but
the proposals it can no longer make (FR-Spec, 2025). Which K pays is the latency objective's
call (docs/design.md §3.1), from measurements made here:

- the ranking: tokens counted in the calibration corpus (every calibration prompt and the
  target's own generation from it, which calibration records), then the tokenizer's BPE merge
  rank (an earlier merge joined a more frequent pair), the stop and special tokens always first
  (yggdrasil/models/vocab.py ranked_vocabulary);
- the draft's step time with each candidate head (K in CANDIDATES and the full head), measured
  interleaved on this machine with eager steps, the way calibration measures its own;
- the acceptance with each head, in hindsight from the calibration: the target's tokens after
  every iteration's root are recorded, and a draft that cannot propose a token cannot have
  accepted it or anything after it, so each drafted bucket's accepted length is cut at the first
  of the target's tokens outside the subset (`trimmed_run`). Where the full draft's best token
  was outside the subset and wrong anyway, the trimmed draft may propose the right one instead:
  the estimate leans, slightly, toward the full head.

With each head's step times and acceptance, the best constant bucket's expected time per token
(policy/select.py, as the formats phase weighs formats) picks the head. A trimmed head then
replaces the draft's (rows gathered from its packed blocks, bitwise) and calibration runs again
with it, so bucket selection, the depth predictor and the stage plans are measured on the draft
that ships; its calibration and graphs live in a work cache of their own inside the main one,
where the full head's calibration stays for the next compile to choose from again. The choice is
a function of that calibration and the recorded step times (`choose`, `replay`), kept in the work
cache and the manifest, so it can be reproduced from them.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from yggdrasil.device import device_sync, timed_runs
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.models.vocab import merge_ranks, ranked_vocabulary, trim_head, untrim_head
from yggdrasil.policy.auto import selector_for
from yggdrasil.policy.calibration import CalibrationRun, load_run
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.runtime.steps import StepRunner

from .context import BuildContext, work_key
from .work_cache import open_work_cache

CANDIDATES = (16384, 32768, 65536)  # K, each a multiple of the q4/q8 kernels' 16 columns
TIMES_FILE = "draft_vocab.yaml"  # in the work cache: the measured step times under their key
REPEATS = 5


@dataclass(frozen=True)
class VocabCandidate:
    """One head measured: K (the whole vocabulary for the full head), its draft step times,
    the acceptance the calibration gives it and the objective's verdict."""

    kept: int
    t_draft_ms: dict  # draft width -> ms per draft step (eager, this machine)
    depth_acceptance: float  # P(a drafted token is accepted | its parent was), the whole widest build
    bucket: str = ""  # the best constant bucket with this head
    speedup: float = 0.0  # its objective speedup over plain decoding
    expected_tpot_ms: float = 0.0  # T_verify(1) / speedup

    def as_dict(self) -> dict:
        return {"kept": self.kept, "t_draft_ms": {int(w): round(t, 4) for w, t in self.t_draft_ms.items()},
                "depth_acceptance": round(self.depth_acceptance, 4), "bucket": self.bucket,
                "speedup": round(self.speedup, 4), "expected_tpot_ms": round(self.expected_tpot_ms, 4)}


@dataclass(frozen=True)
class VocabChoice:
    """The head the bundle's draft keeps (kept None: the full head) and why."""

    kept: int | None
    reason: str
    vocab_size: int
    candidates: tuple[VocabCandidate, ...] = ()
    corpus_tokens: int = 0  # tokens of the calibration corpus counted
    ids_sha256: str | None = None  # of the kept token ids (int64, ascending)

    def as_dict(self) -> dict:
        return {"kept": self.kept, "vocab_size": self.vocab_size, "reason": self.reason,
                "ranking": "stop and special tokens, then calibration-corpus counts, then BPE merge rank",
                "corpus_tokens": self.corpus_tokens, "ids_sha256": self.ids_sha256,
                "candidates": [c.as_dict() for c in self.candidates]}


def vocabulary_order(run: CalibrationRun, tokenizer, vocab_size: int) -> torch.Tensor:
    """Every token id, best first (stop and special tokens, corpus counts, merge rank)."""
    counts = torch.bincount(run.sequence_tokens.long(), minlength=vocab_size)[:vocab_size]
    required = set(tokenizer.stop_ids) | {t for t in (tokenizer.token_id(s) for s in
                                                     (tokenizer.bos_token, tokenizer.eos_token) if s) if t is not None}
    required |= {t for t in tokenizer.inner.get_added_tokens_decoder()}
    return ranked_vocabulary(counts, merge_ranks(tokenizer, vocab_size), required)


def subsets(run: CalibrationRun, tokenizer, vocab: int, sizes) -> tuple[dict, dict]:
    """Per K: the K best-ranked token ids (ascending) and the [vocab] bool mask of them."""
    order = vocabulary_order(run, tokenizer, vocab)
    ids, keeps = {}, {}
    for k in sizes:
        ids[k] = order[:k].sort().values
        keeps[k] = torch.zeros(vocab, dtype=torch.bool)
        keeps[k][ids[k]] = True
    return ids, keeps


def replay(calibration: Path, times_file: Path, tokenizer, vocab: int) -> tuple[int | None, tuple]:
    """The objective's choice again, from a full-head calibration and the step times recorded
    beside it (the work cache's draft_vocab.yaml): what `choose_draft_vocab` chose there."""
    run, _, calibrated = load_run(calibration)
    times = {int(k): {int(w): float(t) for w, t in v.items()}
             for k, v in yaml.safe_load(Path(times_file).read_text())["seconds"].items()}
    _, keeps = subsets(run, tokenizer, vocab, [k for k in times if k < vocab])
    return choose(run, calibrated, times, keeps, vocab)


def ids_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()


def trimmed_run(run: CalibrationRun, keep: torch.Tensor) -> CalibrationRun:
    """The calibration as a draft proposing only tokens where `keep` [vocab] is True would have
    had it: every accepted length cut at the first of the target's next tokens outside it."""
    follows = run.continuation.long()
    outside = ~keep[follows]
    depth = follows.shape[1]
    cut = torch.where(outside.any(1), outside.int().argmax(1), torch.full_like(follows[:, 0], depth))
    accepted = torch.minimum(run.accepted, cut[:, None, None, None].to(run.accepted.dtype))
    on_path = run.node_on_path
    if on_path is not None:  # a node at depth d is on the accepted path only if d <= cut
        on_path = on_path & (run.node_depth.long() <= cut[:, None, None])
    return replace(run, accepted=accepted, accepted_max=torch.minimum(run.accepted_max, cut.to(run.accepted_max.dtype)),
                   node_on_path=on_path)


def _depth_acceptance(run: CalibrationRun) -> float:
    """Accepted tokens over the drafted tokens the walk reached, the widest whole builds."""
    a = run.accepted_max.double()
    reached = (a + (a < run.grid.max_depth).double()).sum()
    return float(a.sum() / reached) if reached else 0.0


def choose(run: CalibrationRun, verify: LatencyProfile, times: dict[int, dict], keeps: dict[int, torch.Tensor],
           vocab_size: int) -> tuple[int | None, tuple[VocabCandidate, ...]]:
    """The head with the lowest expected time per token: each candidate's draft step times
    (times[K]: width -> seconds) with the verify times the calibration measured, and its
    trimmed acceptance. keeps[K]: [vocab] bool of the kept tokens. Returns K (None: full)."""
    rows = torch.ones(run.accepted.shape[0], dtype=torch.bool)
    scored = []
    for kept, draft in sorted(times.items()):
        trimmed = run if kept >= vocab_size else trimmed_run(run, keeps[kept])
        profile = LatencyProfile(draft=tuple(sorted(draft.items())), verify=verify.verify)
        bucket, speedup = selector_for(trimmed, rows, profile).constant()
        scored.append(VocabCandidate(kept, {w: t * 1e3 for w, t in draft.items()}, _depth_acceptance(trimmed),
                                     str(bucket), speedup, profile.t_verify(1) * 1e3 / speedup))
    best = min(scored, key=lambda c: (round(c.expected_tpot_ms, 6), -c.kept))  # a tie keeps more tokens
    return (None if best.kept >= vocab_size else best.kept), tuple(scored)


def _measure(model, max_context: int, heads: dict[int, torch.nn.Module], widths: tuple[int, ...],
             depth: int) -> dict[int, dict[int, float]]:
    """Median seconds per draft step of each head at each width (a whole Equal-Growth build of
    `depth` steps over dummy tokens, divided by depth), every head measured in turn per repeat
    so that a busier moment touches all of them alike."""
    full = model.output
    samples = {k: {w: [] for w in widths} for k in heads}
    history = [0] * 8
    sync = device_sync(model.device)
    try:
        for _ in range(REPEATS):
            for kept, head in heads.items():
                model.output = head
                drafter = ModelDrafter(StepRunner(model, max_context), depth, max(widths), widths)
                drafter.start(history[:-1])
                for width in widths:
                    def build(width=width):
                        drafter.rewind(history)
                        drafter.build_shaped(history, depth, width)
                    samples[kept][width] += timed_runs(build, 1, 1, sync)
    finally:
        model.output = full
    return {k: {w: statistics.median(ts) / depth for w, ts in by_width.items()} for k, by_width in samples.items()}


def choose_draft_vocab(ctx: BuildContext, calibration: Path) -> tuple[VocabChoice, torch.Tensor | None]:
    """Measure (or read the work cache's measurement of) every candidate head and choose;
    returns the choice and the kept token ids (None: the full head)."""
    model, tokenizer = ctx.draft.model, ctx.draft.tokenizer
    vocab = model.config.vocab_size
    run, meta, calibrated = load_run(calibration)
    if run.continuation is None or run.sequence_tokens is None:
        return VocabChoice(None, "the calibration predates recorded target tokens; recalibrate (--force) to "
                                 "choose a trimmed vocabulary", vocab), None
    setting = ctx.recipe.draft_vocab
    sizes = [k for k in (CANDIDATES if setting == "auto" else (int(setting),)) if k < vocab]
    ids, keeps = subsets(run, tokenizer, vocab, sizes)
    widths = run.grid.widths
    key = work_key((calibration / "calibration.safetensors").stat().st_size, meta.get("prompt_ids"),
                   ctx.model_hashes(), *ctx.weight_key("draft"), sizes, widths, ctx.env.device, ctx.env.torch,
                   {k: ids_digest(v) for k, v in ids.items()})
    times = _cached_times(ctx, key)
    if times is None:
        ctx.log(f"draft vocabulary: measuring the draft's step time with heads of {', '.join(map(str, sizes))} "
                f"and all {vocab} tokens")
        heads = {vocab: model.output}
        for k, chosen in ids.items():
            trim_head(model, chosen)
            heads[k] = model.output
            untrim_head(model)
        times = _measure(model, ctx.recipe.max_context, heads, widths, run.grid.max_depth)
        (ctx.work.root / TIMES_FILE).write_text(yaml.safe_dump({"key": key, "seconds": times}))
    kept, candidates = choose(run, calibrated, times, keeps, vocab)
    named = setting != "auto" and bool(sizes)
    kept = sizes[0] if named else kept  # a K the recipe names is kept whatever the objective says
    full = next(c for c in candidates if c.kept >= vocab)
    best = next(c for c in candidates if c.kept == (kept or vocab))
    if named:
        reason = (f"K={kept} of {vocab}, named by the recipe: {best.expected_tpot_ms:.2f} ms per token expected "
                  f"({best.bucket}, acceptance {best.depth_acceptance:.3f}) against the full head's "
                  f"{full.expected_tpot_ms:.2f} ms ({full.bucket}, {full.depth_acceptance:.3f})")
    elif kept is None:
        reason = (f"the full head: {full.expected_tpot_ms:.2f} ms per token expected, no trimmed head does better "
                  f"({', '.join(f'K={c.kept} {c.expected_tpot_ms:.2f} ms' for c in candidates if c.kept < vocab)})")
    else:
        reason = (f"K={kept} of {vocab}: {best.expected_tpot_ms:.2f} ms per token expected ({best.bucket}, draft step "
                  f"{min(best.t_draft_ms.values()):.2f} ms, acceptance {best.depth_acceptance:.3f}) against the full "
                  f"head's {full.expected_tpot_ms:.2f} ms ({full.bucket}, {min(full.t_draft_ms.values()):.2f} ms, "
                  f"{full.depth_acceptance:.3f})")
    return VocabChoice(kept, reason, vocab, candidates, int(run.sequence_tokens.numel()),
                       ids_digest(ids[kept]) if kept is not None else None), (ids[kept] if kept is not None else None)


def _cached_times(ctx: BuildContext, key: str) -> dict | None:
    path = ctx.work.root / TIMES_FILE
    try:
        cached = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(cached, dict) or cached.get("key") != key:
        return None
    return {int(k): {int(w): float(t) for w, t in v.items()} for k, v in cached["seconds"].items()}


def deploy_vocab(ctx: BuildContext, ids: torch.Tensor) -> BuildContext:
    """The context with the draft's head over these token ids, working in a cache of its own
    inside the main one (the full head's calibration stays where the next compile finds it, and
    the trimmed draft's calibration and graphs are kept beside it)."""
    model = ctx.draft.model
    untrim_head(model)
    trim_head(model, ids)
    digest = ids_digest(ids)[:16]
    root = ctx.work.root / f"draft-vocab-{ids.numel()}-{digest}"
    open_work_cache(root)
    return replace(ctx, draft_vocab=f"{ids.numel()} {digest}", work=BundleLayout(root))


def choose_phase(build) -> str | None:
    """compile/build.py's phase: choose once, from the full head's calibration; a trimmed head
    sends compile back to calibrate with it (returns the reason to, or None)."""
    ctx = build.ctx
    if ctx.draft is None or ctx.recipe.draft_vocab == "full" or build.draft_vocab is not None:
        return None
    choice, ids = choose_draft_vocab(ctx, build.calibration)
    build.draft_vocab = choice
    ctx.log(f"draft vocabulary: {choice.reason}")
    if ids is None:
        return None
    build.ctx = deploy_vocab(ctx, ids)
    return (f"the draft's head keeps {choice.kept} tokens: calibrating again with it (work cache "
            f"{build.ctx.work.root})")
