"""compare: time per output token and AAL against peers on the same prompts, tokens and weights.

Rows (all in one run, interleaved):
  hf-greedy         HF transformers `generate`, greedy, eager
  hf-assisted       HF assisted generation with the same draft (assistant_model), or prompt
                    lookup (prompt_lookup_num_tokens) for a lookup bundle
  ar-eager          ours, autoregressive, eager
  ar-torch.compile  ours, autoregressive, torch.compile per shape (gpt-fast style)
  ar-compiled       ours, autoregressive, on the bundle's ahead-of-time graphs
  chain-D<d>        gpt-fast style speculation: a chain of d draft tokens verified whole,
                    torch.compile, d chosen by the objective from calibration
  sequoia-V<v>      Sequoia style: the calibration's best static tree for verify budget v,
                    torch.compile (needs a draft model)
  egt               EGT from the bundle: its graphs, depth predictor, bucket selection and plans
  egt-hybrid        the same policy with hybrid drafting (yggdrasil/runtime/hybrid.py)
  llama.cpp-*       with --llama-cpp DIR: llama.cpp's own tools on the same GGUF files (bench/llama_cpp.py)

Exactness (issue 22): speculative greedy output must equal the autoregressive greedy output of the
same deployed model. For an fp32 bundle every greedy row is checked against our eager
autoregressive greedy (the kernels agree). For a bundle whose weights are bf16, int8 or int4 the
deployed model is the bundle's graphs, and eager and torch.compile run other bf16 kernels that
round differently and split logit near-ties the other way, so: the bundle's rows (ar-compiled,
egt) and llama.cpp's text are checked against the bundle's own autoregressive graphs, and every
other row against its own backend's autoregressive greedy (eager rows vs ar-eager, torch.compile
rows vs ar-torch.compile, HF rows vs hf-greedy; HF runs the checkpoint unquantized), marked
"(own reference)" in the table. torch.compile cannot lower an int4 model (engines.py), so for
int4 the torch.compile rows are not run and the table says so.
"""

from __future__ import annotations

from . import common, engines, llama_cpp, plots, shapes
from .harness import (TIE_NOTE, Setup, clipped_note, deployed_reference, measure, own_reference, record, status,
                      summary_row, text_table, title, variant, write_outputs)

BASES = ("ar-compiled", "hf-greedy")
# each backend's autoregressive row: the reference of that backend's rows when the bundle's weights
# are not fp32 (the bundle's rows are then checked against the bundle's own autoregressive graphs)
OWN_AR = {"eager": "ar-eager", "torch.compile": "ar-torch.compile", "HF eager": "hf-greedy"}


def build_variants(setup: Setup) -> tuple[dict, dict, dict]:
    """name -> fn(prompt) -> Run, name -> description, and what the setup recorded."""
    rt, options = setup.runtime, setup.options
    bundle = engines.bundle_runners(rt)
    eager = engines.fresh_runners(rt, compiled=False)
    blocker = engines.torch_compile_blocker(rt)
    compiled = engines.fresh_runners(rt, compiled=True) if blocker is None else None
    full = shapes.full_selector(rt)
    chain = shapes.best_chain(full)
    fmt = engines.deployed_format(rt)
    own = fmt != "fp32"  # the deployed model is the bundle's graphs: they are the reference
    decoders: dict[str, object] = {}  # backend -> its autoregressive decoder, made once

    def ar(backend: str):
        if backend not in decoders:
            decoders[backend] = engines.autoregressive({"bundle": bundle, "eager": eager,
                                                        "torch.compile": compiled}[backend])
        return decoders[backend]

    # the suite's reference by the rule ablation and trees use; compare's own-reference rows follow
    deployed_reference(setup, fmt, ar("bundle"), ar("eager"), eager_rows=[])
    variants, described = {}, {}
    # deployed_reference left a tie model only where the deployed steps are not batch-invariant
    info = {"chain": str(chain), "weights": fmt, "reference": reference_note(fmt, setup.tie_model is not None)}

    def add(name: str, backend: str, what: str, make, reference=None) -> None:
        """reference: the backend's autoregressive greedy decoder (made only if the row runs)."""
        family = name.split("-D")[0].split("-V")[0]  # chain-D3 -> chain, sequoia-V8 -> sequoia
        if options.skipped(family) or options.skipped(name):
            common.log(f"skipping {name} (--skip)")
            return
        variants[name] = variant(setup, make())
        described[name] = {"backend": backend, "what": what}
        if own and backend in OWN_AR:
            own_reference(setup, name, OWN_AR[backend], reference())

    if not (options.skipped("hf-greedy") and options.skipped("hf-assisted")):
        hf_greedy, hf_assisted, info["hf"] = engines.hf_decoders(rt, chain.depth)
        add("hf-greedy", "HF eager", "transformers generate, greedy", lambda: hf_greedy, lambda: hf_greedy)
        add("hf-assisted", "HF eager", "transformers assisted generation " + str(info["hf"]["assisted"]),
            lambda: hf_assisted, lambda: hf_greedy)
    add("ar-eager", "eager", "autoregressive", lambda: ar("eager"), lambda: ar("eager"))
    if blocker is None:
        add("ar-torch.compile", "torch.compile", "autoregressive, whole-cache attention (gpt-fast style)",
            lambda: ar("torch.compile"), lambda: ar("torch.compile"))
    add("ar-compiled", "bundle", "autoregressive on the bundle's graphs", lambda: ar("bundle"))
    if blocker is None:
        add_gpt_fast_speculation(setup, add, compiled, full, chain, info, lambda: ar("torch.compile"))
    else:
        info.update(not_run_torch_compile(setup, chain, blocker))
    egt = engines.bundle_policy(rt)
    if egt is None:
        info["egt"] = "the bundle does not speculate (no bucket paid on calibration): egt = its autoregressive graphs"
    add("egt", "bundle", "EGT from the bundle (predictor, bucket selection, stage plans)",
        lambda: egt or ar("bundle"))
    hybrid = engines.bundle_hybrid(rt)
    if hybrid is not None:
        add("egt-hybrid", "bundle", "the bundle's policy with hybrid drafting: prompt lookup where the objective "
            "prices it above the draft model, the draft model elsewhere (sequential stages)", lambda: hybrid)
    return variants, described, info


def add_gpt_fast_speculation(setup: Setup, add, compiled, full, chain, info: dict, reference) -> None:
    """The torch.compile'd speculative rows: a chain verified whole, and Sequoia's static tree."""
    rt = setup.runtime
    add(f"chain-D{chain.depth}", "torch.compile", f"chain of {chain.depth}, verified whole (gpt-fast style)",
        lambda: engines.speculative(compiled, engines.drafter_for(compiled, chain.depth, 1), [chain.verify]),
        reference)
    sequoia = shapes.sequoia_file(rt, full) if rt.draft is not None else None
    if sequoia is None:
        info["sequoia"] = "not run: " + ("lookup drafting has no draft model" if rt.draft is None
                                         else "the calibration wrote no Sequoia trees")
        return
    path, budget = sequoia
    info["sequoia"] = {"file": str(path), "budget": budget}

    def make_sequoia():
        drafter = engines.static_tree_drafter(compiled, path)
        return engines.speculative(compiled, drafter, [drafter.capacity])
    add(f"sequoia-V{budget}", "torch.compile", f"static tree {path.name} (Sequoia style)", make_sequoia, reference)


def not_run_torch_compile(setup: Setup, chain, blocker: str) -> dict:
    """The torch.compile rows this bundle's weights cannot run, and why: said under the table and in
    the JSON rather than left out silently (rows --skip leaves out are not listed)."""
    has_draft = setup.runtime.draft is not None
    rows = ["ar-torch.compile", f"chain-D{chain.depth}"] + (["sequoia"] if has_draft else [])
    rows = [r for r in rows if not (setup.options.skipped(r) or setup.options.skipped(r.split("-D")[0]))]
    if rows:
        common.log(f"not running {', '.join(rows)}: {blocker}")
    sequoia = blocker if has_draft else "lookup drafting has no draft model"
    return {"not_run": {"rows": rows, "why": blocker}, "sequoia": f"not run: {sequoia}"}


def reference_note(fmt: str, tie_rule: bool) -> str:
    """The table's footnote on what each row's tokens were checked against; the tie rule is
    described only where it applies (tie_rule: the deployed steps are not batch-invariant)."""
    if fmt == "fp32":
        return "tokens: greedy output vs our autoregressive greedy (eager) on every prompt"
    rule = TIE_NOTE if tie_rule else f"exact (the bundle's {fmt} steps were measured batch-invariant: no tie rule)"
    return (f"tokens: greedy output vs the deployed {fmt} model's autoregressive greedy, i.e. the bundle's own "
            "graphs (ar-compiled), on every prompt; \"(own reference)\": rows on other kernels, checked against "
            "their own backend's autoregressive greedy (eager rows vs ar-eager, torch.compile rows vs "
            f"ar-torch.compile, HF rows vs hf-greedy), since other {fmt} kernels round differently and split "
            f"logit near-ties the other way; the HF rows run the checkpoint's weights unquantized; {rule}")


def run(setup: Setup) -> dict:
    variants, described, info = build_variants(setup)
    peer = llama_cpp.open_peer(setup, setup.options.llama_cpp)
    for name, run_llama in peer.variants.items():
        variants[name], described[name] = run_llama, peer.described(name)
    samples = measure(setup, variants, label="compare ")
    rows = []
    for name in variants:
        if name in peer.variants:  # its tokens are its own: checked as text, never INVALID
            rows.append(peer.finish_row(summary_row(setup, samples, name, BASES, greedy=False)))
            continue
        row = summary_row(setup, samples, name, BASES)
        rows.append({**row, **described[name], "status": status(row)})
    rows, info["llama_cpp"] = llama_cpp.summarize(peer, rows, setup.prompt_info.get("prompt_tokens"))
    heading = title(setup, "compare")
    table = heading + "\n" + text_table(rows, [
        ("variant", "variant"), ("backend", "backend"), ("TPOT ms", "tpot_ms"), ("min", "tpot_min_ms"),
        ("max", "tpot_max_ms"), ("tok/s", "tok_per_s"), ("AAL", "aal"), ("x AR compiled", "x_ar-compiled"),
        ("x HF", "x_hf-greedy"), ("tokens", "status")])
    table += ("\nTPOT = (wall(N) - wall(1)) / (N-1); x = median per-prompt ratio of the base's TPOT to "
              "this row's (> 1 is faster); " + info["reference"])
    if info.get("not_run", {}).get("rows"):
        table += f"\nnot run: {', '.join(info['not_run']['rows'])} ({info['not_run']['why']})"
    table += llama_cpp.table_notes(info["llama_cpp"]) + clipped_note(rows)
    result = {**record(setup), "setup": info, "rows": rows}
    return write_outputs(setup, "compare", result, table, rows, lambda p: plots.compare(rows, heading, p))
