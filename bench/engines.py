"""The decoders the suites time, each as generate(prompt ids, n, sampling) -> result with .tokens:
ours (autoregressive or speculative, on eager, torch.compile'd or the bundle's AOT graphs) and HF
transformers' (greedy `generate` and assisted generation) on the same weights."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.errors import InvalidRequestError
from yggdrasil.runtime.generate import generate
from yggdrasil.runtime.hybrid import hybrid_speculator
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.models.loader import load, parse_dtype
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.static_tree import StaticTreeDrafter, load_shape
from yggdrasil.runtime.assembly import Runtime, assemble_runtime

from . import common

NO_STOP: frozenset[int] = frozenset()
# a flat latency profile: the verify-width objective then always keeps the whole tree (no pruning)
WHOLE_TREE = LatencyProfile()
# Weight formats torch.compile (Dynamo + Inductor, just in time) cannot lower in this torch: its int4
# lowering wants the group size as a Python scalar, while the packed linear passes it as a buffer
# (which the bundle's ahead-of-time graphs bind at load). Measured: warm-up raises
# "_weight_int4pack_mm_cpu_tensor: group size must be a scalar".
TORCH_COMPILE_CANNOT_LOWER = {
    "int4": "torch.compile cannot lower the int4 weight-only matmul (\"group size must be a scalar\")"}


def bundle_runners(runtime) -> Runtime:
    return Runtime(runtime.runner, runtime.draft_runner, "graphs")


def fresh_runners(runtime, compiled: bool) -> Runtime:
    """Runners over the bundle's models outside its graphs: eager (same context as the bundle, so
    they share the model's one KV cache), or torch.compile'd per shape at first use (gpt-fast
    style: fixed shapes, attention over the whole static cache) over a second copy of each model
    in the same format: torch.compile needs separate cache buffers, and the bundle's graphs are
    bound to the model's own cache, which must not be replaced under them."""
    context = int(runtime.manifest.recipe["max_context"])
    chunks = tuple(runtime.manifest.chunk_sizes)

    def model(role: str, loaded):
        if loaded is None:
            return None
        if not compiled:
            return loaded.model
        return load(runtime.manifest.models[role]["name"], dtype=loaded.model.dtype, device=runtime.device,
                    quiet=True, weights=runtime.manifest.weight_format(role)).model

    return assemble_runtime(model("target", runtime.target), model("draft", runtime.draft), context,
                            chunk_sizes=chunks, compile=compiled)


def deployed_format(runtime) -> str:
    """The weight format the bundle deploys its target in (the one its graphs were compiled for)."""
    return runtime.manifest.weight_format("target")


def torch_compile_blocker(runtime) -> str | None:
    """Why the bundle's models cannot run torch.compile'd (None: they can)."""
    for role in runtime.manifest.models:
        fmt = runtime.manifest.weight_format(role)
        if fmt in TORCH_COMPILE_CANNOT_LOWER:
            return f"the {role} is deployed in {fmt}: {TORCH_COMPILE_CANNOT_LOWER[fmt]}"
    return None


def autoregressive(runners: Runtime):
    if runners.kind == "torch.compile":
        common.log("torch.compile: compiling the prefill chunks and the decode step (not timed)")
        runners.runner.warm_up()
    return lambda ids, n, sampling: generate(runners.runner, list(ids), n, sampling, stop_ids=NO_STOP)


def drafter_for(runners: Runtime, depth: int, width: int, widths: tuple[int, ...] = ()):
    """An Equal-Growth Tree drafter of this shape (a chain when width is 1): the draft model's,
    or prompt lookup without one."""

    if runners.draft_runner is None:
        return LookupDrafter(depth, width)
    return ModelDrafter(runners.draft_runner, depth, width, widths or (width,))


def static_tree_drafter(runners: Runtime, tree_file):
    if runners.draft_runner is None:
        raise InvalidRequestError("a static (Sequoia) tree needs a draft model; this bundle drafts by lookup")
    return StaticTreeDrafter(runners.draft_runner, load_shape(tree_file))


def speculative(runners: Runtime, drafter, verify_widths=(), profile=WHOLE_TREE, policy=None, plans=None):
    """A speculative decoder; compiled runners compile every shape it can use now, not while timed."""
    spec = build_speculator(runners.runner, drafter, policy=policy, verify=verify_widths, latency=profile,
                            plans=plans)
    if runners.kind == "torch.compile":
        common.log("torch.compile: compiling every step shape this speculator can use (not timed)")
        spec.warm_up()
    return lambda ids, n, sampling: spec.generate(list(ids), n, sampling, NO_STOP)


def bundle_policy(runtime):
    """The bundle's own speculation (its predictor, bucket selection and stage plans on its
    graphs), or None when the bundle does not speculate."""
    spec = runtime.speculator()
    if spec is None:
        return None
    return lambda ids, n, sampling: spec.generate(list(ids), n, sampling, NO_STOP)


def bundle_hybrid(runtime):
    """The bundle's policy drafting with the hybrid drafter (yggdrasil/runtime/hybrid.py: prompt
    lookup where the objective prices it above the draft model, the model, or for a lookup
    bundle a plain step, elsewhere), a fresh drafter per generation; None without a policy
    (a bundle that compiled no verify graphs)."""
    if runtime.policy is None:
        return None

    def run(ids, n, sampling):
        spec = hybrid_speculator(runtime.runner, runtime.draft_runner, runtime.policy)
        return spec.generate(list(ids), n, sampling, NO_STOP)
    return run


# ---------------------------------------------------------------- HF transformers

@dataclass(frozen=True)
class HFResult:
    tokens: list[int]
    target_calls: int  # target forwards (each commits >= 1 token): AAL = tokens / calls


def load_hf_model(source, dtype: torch.dtype):
    """transformers' own loader on the same file ours loaded: a GGUF through its GGUF support, an
    HF directory as is. Eager attention as shipped (no torch.compile)."""
    # optional and slow to import: only the HF reference baseline needs it
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # its generation warnings would bury the progress lines
    logging.disable_progress_bar()
    path = source.path
    if source.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    # ours runs with no stop ids; with an eos id HF's min_new_tokens would mask eos out of the
    # logits and change the greedy choice wherever eos is the argmax
    model.generation_config.eos_token_id = None
    return model


class HFDecoder:
    """HF `generate`: greedy, or assisted by a draft model (assistant_model) or by prompt lookup
    (prompt_lookup_num_tokens); counts the target's forwards."""

    def __init__(self, model, assistant=None, lookup_tokens: int | None = None) -> None:
        self.model, self.assistant, self.lookup_tokens = model, assistant, lookup_tokens
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_) -> None:
        self.calls += 1

    def settings(self) -> dict:
        """The assisted-generation settings in force (HF's defaults unless set here)."""
        if self.assistant is not None:
            cfg = self.assistant.generation_config
            chosen = {k: getattr(cfg, k, None) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                                         "assistant_confidence_threshold")}
            return {"assistant_model": "the bundle's draft", **{k: v for k, v in chosen.items() if v is not None},
                    "other settings": "transformers defaults"}
        if self.lookup_tokens is not None:
            return {"prompt_lookup_num_tokens": self.lookup_tokens}
        return {}

    def __call__(self, ids, n: int, sampling) -> HFResult:
        x = torch.tensor([list(ids)])
        kwargs = {"do_sample": not sampling.greedy}
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
            torch.manual_seed(sampling.seed or 0)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        elif self.lookup_tokens is not None:
            kwargs["prompt_lookup_num_tokens"] = self.lookup_tokens
        self.calls = 0
        with torch.inference_mode():  # ours runs under inference_mode too
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                      eos_token_id=None, pad_token_id=0, **kwargs)
        return HFResult(out[0, len(ids):].tolist(), self.calls)


def hf_decoders(runtime, lookup_depth: int) -> tuple[HFDecoder, HFDecoder, dict]:
    """HF greedy and HF assisted generation (the bundle's draft, or prompt lookup of lookup_depth
    tokens for a lookup bundle) on the bundle's model files, and how they were loaded."""

    if importlib.util.find_spec("transformers") is None:
        raise InvalidRequestError("the HF rows of `bench compare` need transformers: pip install -e \".[bench]\" "
                                  "(or leave them out with --skip hf-greedy,hf-assisted)")
    dtype = parse_dtype(runtime.manifest.dtype)
    common.log("loading the target with HF transformers (same file)")
    target, seconds = common.timed(load_hf_model, runtime.target.source, dtype)
    info = {"target_load_seconds": round(seconds, 2), "attn_implementation": target.config._attn_implementation}
    if runtime.draft is not None:
        common.log("loading the draft with HF transformers (same file)")
        assistant = load_hf_model(runtime.draft.source, dtype)
        assisted = HFDecoder(target, assistant=assistant)
    else:
        assisted = HFDecoder(target, lookup_tokens=lookup_depth)
    greedy = HFDecoder(target)
    info["assisted"] = assisted.settings()
    return greedy, assisted, info
