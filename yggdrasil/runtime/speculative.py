"""Speculative decoding: draft a tree, prune it to a verify width, verify it with one target
forward under the tree mask, walk it losslessly, compact the accepted K/V (docs/design.md §3.1–3.3)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from yggdrasil.buckets import Bucket
from yggdrasil.runtime.dispatcher import padded
from yggdrasil.errors import InvalidRequestError
from yggdrasil.runtime.generate import GenerationStats, TokenCallback, generate, reusable_prefix
from yggdrasil.host_reads import staged
from yggdrasil.runtime.drafters import move_slots
from yggdrasil.sampling import SamplingParams, argmax, draw_from, host_uniforms, sample, target_probs
from yggdrasil.runtime.steps import StepRunner, verify_inputs
from yggdrasil.runtime.latency import LatencyProfile, measure_profile
from yggdrasil.runtime.logits import LogitsControl
from yggdrasil.runtime.policy import BucketPolicy
from yggdrasil.runtime.stage_plan import SEQUENTIAL, PlanTable, SideStream, StagePlan, ahead_rows
from yggdrasil.trace import NO_TRACE
from yggdrasil.runtime.spec_stats import SpecStats
from yggdrasil.runtime.tree import TokenTree, WalkResult, walk, walk_on_device


class Drafter(Protocol):
    kind: str
    depth: int
    width: int

    @property
    def capacity(self) -> int: ...
    def start(self, prompt_ids: list[int], reuse: int = 0) -> None: ...
    def build(self, history: list[int]) -> TokenTree: ...
    def commit(self, accepted_nodes: list[int]) -> None: ...
    def rewind(self, history: list[int]) -> None: ...
    def truncate(self, valid: int) -> None: ...


class IterationHook(Protocol):
    """A way into the loop for calibration (predictor/calibrate.py), so it runs this very
    iteration instead of a copy: the hook builds each iteration's tree (all of it is verified)
    and sees every walk with the target's hidden state from before it."""

    def build(self, history: list[int]) -> TokenTree: ...
    def observe(self, base: int, hidden: torch.Tensor, tree: TokenTree, result: WalkResult) -> None: ...


def choose_verify_width(tree: TokenTree, widths: Sequence[int], profile: LatencyProfile,
                        draft_seconds: float, acceptance: torch.Tensor | None = None) -> int:
    """The allowed verify width maximising AAL(V) · T_verify(1) / (draft + T_verify(V)), with
    AAL(V) = 1 + Σ acceptance probabilities of the V - 1 non-root nodes pruning keeps first
    (docs/design.md §3.1). acceptance: [size] per node, from a calibrated draft confidence
    (predictor/confidence.py); None: the draft's own path probabilities."""
    order = tree.rank_scores().argsort(descending=True)[1:].cpu()  # pruning's order, root left out
    probs = (tree.logp[:tree.size].exp() if acceptance is None else acceptance).double().cpu()[order]
    cumulative = torch.cat([torch.zeros(1, dtype=torch.float64), probs.cumsum(0)])
    best, best_speedup = widths[0], -1.0
    for width in widths:
        aal = 1.0 + float(cumulative[min(width, tree.size) - 1])
        speedup = aal * profile.t_verify(1) / (draft_seconds + profile.t_verify(width))
        if speedup > best_speedup + 1e-12:
            best, best_speedup = width, speedup
    return best


@dataclass(frozen=True)
class SpecResult:
    tokens: list[int]
    stop_reason: str
    stats: GenerationStats
    spec: SpecStats
    cached_ids: list[int]  # the tokens whose K/V the target cache now holds (reusable next call)


class SpeculativeGenerator:
    """Tree speculation over a target StepRunner with any Drafter."""

    def __init__(self, target: StepRunner, drafter: Drafter, verify_widths: Sequence[int] = (),
                 profile: LatencyProfile | str | None = "auto", policy: BucketPolicy | None = None,
                 plans: StagePlan | PlanTable = SEQUENTIAL, hook: IterationHook | None = None) -> None:
        """profile: measured step times for the verify-width objective; "auto" measures them on
        first use when there is more than one width to choose from.

        policy: a BucketPolicy (yggdrasil.policy.auto.AutoPolicy) that picks each iteration's (D, W, V) bucket
        from the target's last hidden state; its grid then fixes the verify widths.

        plans: the stage plan every iteration runs with, or a bundle's plan per bucket
        (yggdrasil/runtime/stage_plan.py); plans never change the tokens, only when work happens.

        hook: builds every tree and observes every walk (calibration); it needs hidden states.
        """
        self.target, self.drafter, self.policy, self.hook = target, drafter, policy, hook
        self.plans = plans if isinstance(plans, PlanTable) else PlanTable({}, default=plans)
        if self.plans.any_moves and not hasattr(drafter, "draft_ahead"):
            raise InvalidRequestError(f"stage plans that draft ahead of time need a draft model; this "
                                      f"speculator drafts by {drafter.kind}")
        self._side = SideStream(target.device)
        if policy is not None:
            verify_widths, profile = policy.grid.verifies, policy.profile
        self._hidden: torch.Tensor | None = None  # target's hidden state before the next iteration
        self._predicted = False  # this iteration's bucket came from the depth predictor
        self.tracer = NO_TRACE  # trace.tracing() swaps in a Tracer for a traced generation
        self._looping = False  # inside generate's loop, which holds step()'s thread and inference mode
        widths = sorted(set(verify_widths)) or [drafter.capacity]
        if widths[0] < 1:
            raise InvalidRequestError(f"verify widths must be >= 1, got {widths}")
        # width 1 is always allowed: a tree with nothing drafted costs one plain decode step.
        # A width beyond the whole tree is cut to the tree, except on a bundle's graphs, which
        # exist only at the compiled widths: there the verify pads the tree up to the width.
        fits = (lambda w: w) if target.graphs is not None else (lambda w: min(w, drafter.capacity))
        self.verify_widths = sorted({1, *(fits(w) for w in widths)})
        if policy is not None:  # exactly the buckets the policy can return, so warm-up covers them
            self.verify_widths = sorted({1, *policy.grid.verifies})
            # the target dispatcher's padding table for this policy, computed once: each verify
            # runs at the cheapest grid width that holds its nodes (measured times need not grow)
            self._verify_table = target.dispatcher.verify_table(policy.grid.verifies, policy.profile.t_verify)
        self.profile = profile if isinstance(profile, LatencyProfile) else None
        self._measure = profile == "auto"
        # an iteration's host work runs on one thread, each forward with all (runtime/threads.py)
        draft_runner = getattr(drafter, "runner", None)
        if draft_runner is not None:
            draft_runner.threads = target.threads

    def warm_up(self) -> None:
        """Run every shape once: target prefill/decode and verify widths, and the draft's steps,
        so that a compiled runtime compiles before generation and never during it."""
        drafter_warm_up = getattr(self.drafter, "warm_up", None)
        if drafter_warm_up is not None:
            drafter_warm_up()
        tree = TokenTree.with_root(self.drafter.capacity, 0)  # trees live on the host
        root_only = torch.zeros(1, dtype=torch.long)
        hidden = self._needs_hidden
        for width in self.verify_widths:
            self.target.run(verify_inputs(self.target, tree, root_only, 1, width), key="verify", hidden=hidden)
        self.target.warm_up()
        if hidden:  # the prefill's last chunk also returns the hidden state
            for size in self.target.chunk_sizes:
                self.target.run(self.target.prefill_inputs([0], 0, size), hidden=True)
        ahead = self._ahead_shapes()
        if ahead:
            self.drafter.warm_up_ahead(ahead)

    def _ahead_shapes(self) -> set[int]:
        """Rows of every ahead-of-time head forward the plans can run."""
        if self.policy is not None:
            grid = self.policy.grid
            return ahead_rows(self.plans, [(w, v) for w in grid.widths for v in grid.verifies])
        return ahead_rows(self.plans, [(self.drafter.width, v) for v in self.verify_widths])

    @property
    def _needs_hidden(self) -> bool:
        return self.hook is not None or (self.policy is not None and self.policy.needs_hidden)

    def _draft(self, history: list[int], stats: "SpecStats") -> tuple[TokenTree, int, int, StagePlan] | None:
        """This iteration's tree, how many of its nodes to verify, the verify width and the
        stage plan: the hook's tree whole, the policy's bucket, or the drafter's fixed shape pruned
        by the objective on the tree's own path probabilities. None: the policy chose not to
        speculate (a depth-0 bucket)."""
        if self.hook is not None:
            tree = self.hook.build(history)
            return tree, tree.size, tree.size, SEQUENTIAL
        if self.policy is not None:
            tail = self.policy.predict(self._hidden)
            shape = self.policy.select(tail)
            stats.note_choice(shape, tail)
            self._predicted = tail is not None
            if shape.depth == 0:  # speculation does not pay here: one plain decode step
                return None
            tree = self.drafter.build_shaped(history, shape.depth, shape.width)
            verify = shape.verify
            acceptance = self.policy.node_acceptance(tree)
            if acceptance is not None:  # calibrated draft confidence picks V for this very tree
                verify = choose_verify_width(tree, self.policy.grid.verifies, self.profile,
                                             shape.depth * self.profile.t_draft(shape.width), acceptance)
                stats.note_verify(verify)
            # a tree smaller than V (a lookup that found little) keeps all its nodes, verified
            # with the cheapest compiled width that holds them
            keep = min(verify, tree.size)
            width = padded(self._verify_table, keep, "verify", "verify_widths")
            return tree, keep, width, self.plans.for_bucket(str(shape))
        tree = self.drafter.build(history)
        host_start = time.perf_counter()
        width = choose_verify_width(tree, self.verify_widths, self.profile,
                                    self.drafter.depth * self.profile.t_draft(self.drafter.width))
        stats.host_seconds += time.perf_counter() - host_start
        return tree, width, width, self.plans.for_bucket(str(Bucket(self.drafter.depth, self.drafter.width, width)))

    def _choices(self, out: torch.Tensor, rows: int, sampling: SamplingParams, generator: torch.Generator,
                 control: LogitsControl | None = None) -> torch.Tensor:
        """The target's token at each of the first `rows` rows of a verify's logits [1, V, vocab]."""
        if sampling.greedy and control is None:
            return argmax(out, self.target.reads, rows)
        logits = out[0, :rows]
        # one uniform per node, drawn in one call on the host, staged to the logits' device
        uniforms = None if sampling.greedy else host_uniforms(rows, generator, logits.device)
        if control is None:
            return draw_from(target_probs(logits, sampling), uniforms)

        def pick(rows: torch.Tensor, nodes: list[int]) -> list[int]:
            if uniforms is None:
                return self.target.reads.tolist(rows.argmax(-1))
            return self.target.reads.tolist(draw_from(target_probs(rows, sampling), uniforms[nodes]))

        choices, _ = control.choose(logits, pick, sampling.greedy)
        return torch.tensor(choices, device=logits.device)

    def step(self, history: list[int], sampling: SamplingParams,
             generator: torch.Generator, stats: SpecStats, control: LogitsControl | None = None) -> WalkResult:
        """One iteration: draft, prune, verify, walk, compact. Returns the walk over kept nodes.
        control: penalties and a grammar applied to the target's logits at every kept node (the
        masks computed while the verify runs). Its host work runs on one intra-op thread, its
        model forwards on all, all of it in inference mode (entered once, not per forward;
        generate's loop enters both once for all its iterations)."""
        if self._looping:
            return self._step(history, sampling, generator, stats, control)
        with self.target.threads.host(), torch.inference_mode():
            return self._step(history, sampling, generator, stats, control)

    def _step(self, history: list[int], sampling: SamplingParams, generator: torch.Generator, stats: SpecStats,
              control: LogitsControl | None = None) -> WalkResult:
        base = len(history) - 1
        hidden_before = self._hidden
        trace = self.tracer
        trace.next_iteration()
        with trace.span("draft"):
            planned = self._draft(history, stats)
        if planned is None:
            return self._plain_step(history, sampling, generator, stats, control)
        tree, keep, width, plan = planned
        drafted = tree.size > 1  # a root-only step drafted nothing; the drafter catches up next time
        if plan.aot_tail and drafted:
            with trace.span("tail"), self._side.use(plan.side_stream):
                self.drafter.feed_last_level(tree)
        with trace.span("prune"):
            host_start = time.perf_counter()
            kept = tree.top_list(keep)  # host trees: lists, not tensor ops on a few nodes
            inputs = verify_inputs(self.target, tree, kept, base, width)
            if control is not None:
                control.start([tree.nodes().tokens[k] for k in kept], tree.local_parent_list(kept))
            stats.host_seconds += time.perf_counter() - host_start
        with trace.span("verify"):
            out = self.target.run(inputs, key="verify", hidden=self._needs_hidden)
            choices = self._choices(out[0] if self._needs_hidden else out, len(kept), sampling, generator, control)
        ahead = None
        if plan.aot_head and drafted:
            with trace.span("ahead"), self._side.use(plan.side_stream):
                ahead = self.drafter.draft_ahead(tree, torch.tensor(kept), choices, width)
        with trace.span("accept"):
            host_start = time.perf_counter()
            # the iteration's second (and last) read: the choices, with the kept rows' hidden
            # states when the predictor or a hook needs the accepted node's
            hidden_rows = (out[1][0, :len(kept)],) if self._needs_hidden else ()
            result, hidden_rows = self._walk(tree, kept, choices, plan, hidden_rows)
            accepted_nodes = [kept[j] for j in result.path[1:]]
            if self._needs_hidden:
                self._hidden = hidden_rows[0][result.path[-1]]
            stats.host_seconds += time.perf_counter() - host_start
        with trace.span("compact"):
            host_start = time.perf_counter()
            if plan.side_stream:
                self._side.join(*(() if ahead is None else (ahead,)))
            if ahead is not None:
                self.drafter.adopt_ahead(ahead, result.path[-1], len(history) + len(result.committed))
            move_slots(self.target, [base + j for j in result.path[1:]],
                       [base + 1 + k for k in range(len(result.path) - 1)], self.drafter.depth)
            stats.host_seconds += time.perf_counter() - host_start
            if drafted:
                self.drafter.commit(accepted_nodes)
        if self.hook is not None:
            self.hook.observe(base, hidden_before, tree, result)
        stats.record(len(result.accepted_tokens), max(tree.nodes().depth))
        if self._predicted:
            stats.accepted_when_predicted += len(result.accepted_tokens)
        return result

    def _plain_step(self, history: list[int], sampling: SamplingParams, generator: torch.Generator,
                    stats: SpecStats, control: LogitsControl | None = None) -> WalkResult:
        """A depth-0 bucket: the root alone, decoded as the plain loop decodes it, with no tree to
        build, prune, walk or compact (those cost 7 % per token on a 5 ms step). The hidden
        state the predictor reads next comes from the one-row verify graph that returns it."""
        base, hidden = len(history) - 1, self._needs_hidden
        if control is not None:
            control.start(history[-1:], [-1])
        with self.tracer.span("verify"):
            out = self.target.run(self.target.decode_inputs(history[-1], base, hidden),
                                  key="verify" if hidden else "decode", hidden=hidden)
            choices = self._choices(out[0] if hidden else out, 1, sampling, generator, control)
        with self.tracer.span("accept"):
            token, *rows = self.target.reads.packed(choices, *((out[1][0, :1],) if hidden else ()))
            if hidden:
                self._hidden = rows[0][0]
        stats.record(0, 0)
        return WalkResult([0], [], int(token[0]))

    def _walk(self, tree: TokenTree, kept: list[int], choices: torch.Tensor, plan: StagePlan,
              extra: tuple[torch.Tensor, ...]) -> tuple[WalkResult, list[torch.Tensor]]:
        """The walk over a host tree, with one read: of the choices (the walk then runs on the
        host), or of the walk's packed result computed on the device (accept_on_device)."""
        reads = self.target.reads
        if plan.accept_on_device:
            index = torch.tensor(kept)
            on_device = staged((tree.tokens[index], tree.local_parents(index), tree.ancestors[index][:, index]),
                               self.target.device)
            return walk_on_device(*on_device, choices, reads, extra)
        choices, *extra = reads.packed(choices, *extra)
        nodes = tree.nodes()
        return walk([nodes.tokens[k] for k in kept], tree.local_parent_list(kept), choices), extra

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                 stop_ids: frozenset[int] = frozenset(), on_tokens: TokenCallback | None = None,
                 reuse: int = 0, control: LogitsControl | None = None) -> SpecResult:
        """reuse: leading prompt tokens whose K/V both caches hold from this generator's last call
        (the common prefix of its cached_ids and this prompt); only the rest is prefilled.
        control: penalties and a grammar at every verified node; a completed grammar ends the reply."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token of text")
        if max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.target.check_fits(len(prompt_ids))
        if self._measure:
            self.profile = measure_profile(self.target, self.drafter, self.verify_widths)
            self._measure = False
        self.profile = self.profile or LatencyProfile()
        generator = sampling.generator()
        stats = SpecStats()
        reuse = reusable_prefix(reuse, prompt_ids)
        started = time.perf_counter()
        if control is not None:  # the first token's mask is computed while the prefill runs
            control.start([prompt_ids[-1]], [-1])
        with self.tracer.span("prefill"):
            if self._needs_hidden:
                logits, hidden = self.target.prefill(list(prompt_ids[reuse:]), start=reuse, hidden=True)
            else:
                logits, hidden = self.target.prefill(list(prompt_ids[reuse:]), start=reuse), None
            self.drafter.start(list(prompt_ids), reuse)  # the draft's prefill is part of prefill
        prefill_done = time.perf_counter()
        if control is None:
            drawn = sample(logits, sampling, generator)
        else:
            drawn = torch.tensor(control.choose(logits[None], lambda rows, nodes: self.target.reads.tolist(
                sample(rows, sampling, generator)), sampling.greedy)[0][0], device=logits.device)
        first, *hidden = self.target.reads.packed(drawn,
                                                  *(() if hidden is None else (hidden,)))
        self._hidden = hidden[0] if hidden else None
        history = list(prompt_ids) + [int(first)]
        first_token_at = time.perf_counter()
        out, stop_reason = [], "length"
        new = [history[-1]]
        finished = control is not None and control.commit(new) and control.finished
        # room for a whole tree beyond the committed tokens, within the cache
        ahead = max(self.verify_widths) if self.plans.any_ahead else 0  # candidates' K/V slots
        limit = self.target.max_context - max(self.drafter.capacity + ahead, max(self.verify_widths))
        counted = 0  # what the last iteration committed, as SpecStats counted it (the prefill's token: none)
        with self.target.threads.host(), torch.inference_mode():
            self._looping = True
            try:
                while True:
                    emitted, stop_reason = _emit(new, out, stop_ids, max_new_tokens)
                    if on_tokens is not None and emitted:
                        on_tokens(emitted)
                    stop_token = stop_reason == "stop"  # a stop token ended the reply: it was delivered
                    if stop_reason == "more" and finished:
                        stop_reason = "stop"  # the grammar is complete
                    if stop_reason != "more":
                        if counted:
                            stats.undelivered(counted - len(emitted) - stop_token)
                        break
                    if len(history) > limit:
                        stop_reason = "context"
                        break
                    new = self.step(history, sampling, generator, stats, control).committed
                    counted = len(new)
                    if control is not None:  # tokens past the grammar's end are not delivered
                        new = new[:control.commit(new)]
                        finished = control.finished
                    history.extend(new)
            finally:
                self._looping = False
        finished = time.perf_counter()
        gen_stats = GenerationStats(len(prompt_ids), len(out), prefill_done - started,
                                    first_token_at - started, finished - first_token_at,
                                    len(prompt_ids) - reuse)
        # the last committed token is the next root: its K/V is not written yet
        return SpecResult(out, stop_reason, gen_stats, stats, history[:-1])


def generate_with(runner: StepRunner, speculator: "SpeculativeGenerator | None", prompt_ids: Sequence[int],
                  max_new_tokens: int, sampling: SamplingParams, stop_ids: frozenset[int] = frozenset(),
                  on_tokens: TokenCallback | None = None, reuse: int = 0, control: LogitsControl | None = None):
    """Plain decoding on `runner` when there is no speculator, else the speculator (which owns
    the same target runner): a GenerationResult or a SpecResult. control: penalties and a grammar."""
    if speculator is None:
        return generate(runner, prompt_ids, max_new_tokens, sampling, stop_ids, on_tokens, reuse=reuse,
                        control=control)
    return speculator.generate(prompt_ids, max_new_tokens, sampling, stop_ids, on_tokens, reuse=reuse,
                               control=control)


def _emit(new: list[int], out: list[int], stop_ids: frozenset[int], limit: int) -> tuple[list[int], str]:
    """Append committed tokens up to a stop token or the length limit."""
    emitted = []
    for token in new:
        if token in stop_ids:
            return emitted, "stop"
        out.append(token)
        emitted.append(token)
        if len(out) >= limit:
            return emitted, "length"
    return emitted, "more"
