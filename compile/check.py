"""Phase "check": load the fresh packages as a bundle would and check them against eager: the
step graphs' greedy output (and, measured on them, the bundle's step-time profile), and each
serve graph's logits over a small KV pool.

Greedy output must equal eager output token for token, except at a tie: compiled kernels round
differently from eager ones (bf16 above all), so where the reference's two best logits are
within a few units in the last place of the model's dtype, either token is a correct argmax.
A divergence is accepted only there (`compare_greedy`); the logits stay in the model's dtype
(an fp32 head would not help: the hidden states that reach it already differ by rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from yggdrasil.runtime import latency as step_times  # by module: tests patch its measure_profile
from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.runtime.speculator import greedy_generator
from yggdrasil.errors import YggdrasilError
from yggdrasil.storage.cuda_graphs import capture
from yggdrasil.storage.registry import load_graph_set
from yggdrasil.models.model import KVCache
from yggdrasil.models.quant import matmul_dtype
from yggdrasil.serve.pool import Segment, SlotPool, run_segments
from yggdrasil.runtime.policy import BucketPolicy
from yggdrasil.runtime import prefill_plan  # by module: tests patch its measure_piece_seconds

from yggdrasil.graphs.aoti import full_span
from .calibrate import judge_on_graphs, reprofile_command
from .context import BuildContext
from . import pointwise
from .invariance import PROBES, Invariance, long_probe, measure_invariance, probe_ids


@dataclass
class Loaded:
    """The checked graphs, loaded: runners over them, the graph sets, the bucket policy on the
    measured step times, and those times (None when the bundle does not speculate)."""

    target: object  # StepRunner on the compiled graphs
    draft: object | None
    sets: dict
    policy: BucketPolicy | None
    latency: object | None
    calibration: Path  # what the bundle ships: the policies judged on these step times (judge_on_graphs)
    invariance: Invariance | None = None  # decode vs prefill vs verify steps of the target, measured
    # judged on these graphs the depth predictor ships, but they do not return the hidden states
    # it reads: nothing was checked, and compile redoes its graphs phase with graphs that do
    needs_hidden_graphs: bool = False
    # per role, each graph's forward seconds: the bundle prefills a prompt on the cheapest pieces
    piece_seconds: dict = field(default_factory=dict)


def warm_load_check(ctx: BuildContext, keys: list[GraphKey], selection) -> Loaded:
    """Load the fresh packages, check greedy output against eager on a probe prompt, and measure
    each verify graph's step time (the bundle's profile)."""

    sets = {}
    for role in ("target", "draft"):
        names = [k.name for k in keys if k.role == role and k.stage != SERVE_STAGE]
        if names:
            model = ctx.model(role)
            # the graphs bind to this cache (stacked: one-op compaction; torch.compile'd steps take separate buffers)
            model.setup_cache(1, ctx.recipe.max_context, stacked=ctx.steps != "inductor")
            # a split target runs eager here (its graphs are per rank: compile/rank_graphs.py checks them)
            sets[role] = load_graph_set(ctx.work.root, role, model, names, ctx.rebuild, ctx.hint, ctx.role_steps(role))
            if ctx.recipe.device.startswith("cuda"):  # captured as a bundle captures them, then timed
                captured = capture(sets[role], full_span(ctx.recipe.max_context), model.cache.scratch_slot,
                                   model.device)
                ctx.log(f"captured the {role}'s {len(names)} CUDA graph(s): {captured / 2**20:.1f} MiB")
    target, draft = ctx.runners(sets)
    piece_seconds = {runner.role: prefill_plan.measure_piece_seconds(runner) for runner in (target, draft)
                     if runner is not None and runner.graphs is not None}
    if piece_seconds:  # the runners prefill as the bundle will, and the checks below check that
        ctx.log("graph forwards (prefill pieces are chosen by these): " + "; ".join(
            f"{role} " + ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in times.items())
            for role, times in piece_seconds.items()))
        target, draft = ctx.runners(sets, piece_seconds)
    latency, calibration = None, ctx.work.calibration
    if selection.speculates:
        probe = ctx.policy(ctx.work.calibration, selection)
        # the run-time selection trusts these numbers: warm up and take the median of 7
        # (a fresh package's first calls are slow)
        # (a busy machine is noticed, warned about and measured again: yggdrasil/runtime/latency.py)
        drafter = probe.drafter(draft)
        widths = () if draft is None else selection.widths
        hidden = any(key.hidden for key in keys)  # time the verify graphs the bundle has
        latency = step_times.measure_checked(
            lambda: step_times.measure_profile(target, drafter, selection.verifies, repeats=7, warmup=4,
                                               draft_widths=widths, hidden=hidden),
            target.device, ctx.log, what="the compiled graphs' step times (the bundle's profile)",
            hint=f"; re-run {reprofile_command(ctx.recipe, ctx.out)} on a quiet machine")
        calibration = judge_on_graphs(ctx, selection, latency)
    policy = ctx.policy(calibration, selection, latency) if selection.speculates else None
    if policy is not None and policy.needs_hidden and not hidden:
        return Loaded(target, draft, sets, policy, latency, calibration, needs_hidden_graphs=True,
                      piece_seconds=piece_seconds)
    # measured first: whether greedy output must equal eager exactly follows from it
    invariance = measure_graph_invariance(ctx, target, selection.verifies)
    ctx.log(f"batch invariance of the {ctx.weights.get('target', 'fp32')} graphs: {invariance.summary()}")
    verdict = check_against_eager(ctx, (target, draft), policy, exact=invariance.bitwise)
    ctx.log(f"warm-load check: {len(keys)} graphs load in "
            f"{sum(s.load_seconds for s in sets.values()):.2f} s; {verdict}")
    return Loaded(target, draft, sets, policy, latency, calibration, invariance=invariance,
                  piece_seconds=piece_seconds)


def measure_graph_invariance(ctx: BuildContext, target, verify_widths) -> Invariance:
    """The deployed graphs' batch invariance where it is most likely to break: the probes and a
    prompt filling the context, at every compiled verify width; and, where nothing differed, the
    proof that nothing outside the fixed-order ops can (compile/pointwise.py)."""
    tokenizer = ctx.target.tokenizer
    prompts = probe_ids(tokenizer) + [long_probe(tokenizer, ctx.recipe.max_context, max(verify_widths, default=1))]
    measured = measure_invariance(target, prompts, verify_widths)
    if not measured.measured_bitwise:
        return measured
    return replace(measured, proof=pointwise.prove(ctx.target.model, ctx.recipe.max_context))


TIE_ULPS = 4  # a divergence is a tie when the reference's candidates are this many ulps apart
PROBE_TOKENS = 24


@dataclass(frozen=True)
class Agreement:
    """Compiled greedy tokens against the reference's. at: tokens equal before the first
    divergence (all of them when none); gap: the reference's logit gap between its best token
    and the worse of the two that diverged there; tolerance: TIE_ULPS of the model's dtype at
    the logits' magnitude."""

    same: bool
    at: int
    gap: float | None = None
    tolerance: float | None = None

    @property
    def tie(self) -> bool:
        return self.gap is not None and self.gap <= self.tolerance

    @property
    def ok(self) -> bool:
        return self.same or self.tie


def logit_ulp(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """One unit in the last place of dtype at the magnitude of the largest logit."""
    scale = logits.abs().max().item()
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(scale)) if scale > 0 else torch.finfo(dtype).tiny


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """The eager model's next-token logits after ids (one causal forward over a cache of its
    own, so the model's cache, which compiled graphs are bound to, is left alone), as fp32."""
    n, device = len(ids), model.device
    cache = KVCache(model.config, 1, n + 1, model.dtype, device)
    positions = torch.arange(n, device=device)[None]
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    return model(tokens, positions, positions, mask, cache=cache)[0, -1].float()


def compare_greedy(model, prompt: list[int], reference: list[int], candidate: list[int],
                   ulps: int = TIE_ULPS) -> Agreement:
    """Whether candidate follows reference, or leaves it only at a tie of model's logits."""
    if reference == candidate:
        return Agreement(True, len(reference))
    at = next((i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b), None)
    if at is None:  # one is a prefix of the other: a length mismatch is never a tie
        return Agreement(False, min(len(reference), len(candidate)))
    logits = reference_logits(model, prompt + reference[:at])
    best = logits.max()
    gap = max((best - logits[reference[at]]).item(), (best - logits[candidate[at]]).item())
    return Agreement(False, at, gap, ulps * logit_ulp(logits, matmul_dtype(model)))


def check_against_eager(ctx: BuildContext, runners, policy, plans=None, exact: bool = False) -> str:
    """Compiled greedy output against eager on a probe prompt (the next probes too while the
    previous one ended in a tie, so that a tie early on does not leave the graphs unchecked);
    returns what was found, raises on a real divergence. exact: the graphs were measured (and
    proven) bitwise (measure_graph_invariance), so no tie rule applies."""
    compiled = greedy_generator(*runners, policy, plans)
    eager = greedy_generator(*ctx.runners(), policy)
    model = ctx.target.model
    ties = []
    for text in PROBES:
        prompt = ctx.target.tokenizer.encode(text)
        outputs = [g(prompt, PROBE_TOKENS) for g in (compiled, eager)]
        agreement = compare_greedy(model, prompt, outputs[1], outputs[0])
        if exact and not agreement.same:
            raise YggdrasilError(f"warm-load check failed: the compiled graphs' greedy output differs from eager "
                                 f"at token {agreement.at}{' with stage plans' if plans else ''}, though the "
                                 f"graphs were measured batch-invariant (no tie rule applies); please report this "
                                 "with the recipe")
        if not agreement.ok:
            gap = "" if agreement.gap is None else (f" (the reference's logit gap there, {agreement.gap:.3g}, "
                                                     f"is no tie: over {TIE_ULPS} ulps, {agreement.tolerance:.3g})")
            raise YggdrasilError(f"warm-load check failed: the compiled graphs' greedy output "
                                 f"{outputs[0][:12]}… differs from eager {outputs[1][:12]}… at token "
                                 f"{agreement.at}{gap}{' with stage plans' if plans else ''}; "
                                 "please report this with the recipe")
        if agreement.same:
            break
        ties.append(f"{agreement.at} tokens, then a tie (logit gap {agreement.gap:.3g} <= {agreement.tolerance:.3g})")
    if not ties:
        return "greedy output equals eager"
    return f"greedy output equals eager up to ties of {str(matmul_dtype(model)).replace('torch.', '')} logits: " + "; ".join(ties)


def check_serve_graphs(ctx: BuildContext, keys: list[GraphKey]) -> None:
    """Run each serve graph and the eager forward over a small pool, two requests at once (a
    prompt chunk beside another's decode rows), and compare their logits."""

    prompt = (ctx.target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n") * 16)[:16]
    steps = [[Segment(1, tuple(prompt[:8]), 0, "last"), Segment(2, tuple(prompt[:5]), 0, "all")],
             [Segment(1, tuple(prompt[8:12]), 8, "all"), Segment(2, tuple(prompt[5:]), 5, "last")]]
    for key in keys:
        model = ctx.model(key.role)
        graph = load_graph_set(ctx.work.root, key.role, model, [key.name], ctx.rebuild, ctx.hint,
                               ctx.steps).get(key.name)
        pool = SlotPool(4, 16)
        for owner in (1, 2):
            pool.reserve(owner, 32)
        caches = [pool.new_cache(model) for _ in range(2)]
        for segments in steps:
            eager = torch.cat(run_segments(model, caches[0], pool, segments))
            compiled = torch.cat(run_segments(model, caches[1], pool, segments, graph))
            scale = eager.abs().max().item() or 1.0
            error = (eager - compiled).abs().max().item() / scale
            if error > (1e-3 if matmul_dtype(model) == torch.float32 else 5e-2):  # fused kernels round differently
                raise YggdrasilError(f"warm-load check failed: the {key.role}'s serve graph differs from "
                                     f"the eager forward over the KV pool (relative error {error:.2g}); "
                                     "please report this with the recipe")
    if keys:  # a bundle of inductor or eager steps has none: its server runs the eager pool step
        ctx.log(f"warm-load check: {len(keys)} serve graph(s) agree with eager over the KV pool")
