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
  llama.cpp-*       with --llama-cpp DIR: llama.cpp's own tools on the same GGUF files (bench/llama_cpp.py)
"""

from __future__ import annotations

from . import common, engines, llama_cpp, plots, shapes
from .harness import (Setup, compute_reference, measure, record, status, summary_row, text_table, title,
                      variant, write_outputs)

BASES = ("ar-compiled", "hf-greedy")


def build_variants(setup: Setup) -> tuple[dict, dict, dict]:
    """name -> fn(prompt) -> Run, name -> description, and what the setup recorded."""
    rt, options = setup.runtime, setup.options
    bundle = engines.bundle_runners(rt)
    eager = engines.fresh_runners(rt, compiled=False)
    compiled = engines.fresh_runners(rt, compiled=True)
    full = shapes.full_selector(rt)
    chain = shapes.best_chain(full)
    compute_reference(setup, engines.autoregressive(eager))
    variants, described, info = {}, {}, {"chain": str(chain)}

    def add(name: str, backend: str, what: str, make) -> None:
        family = name.split("-D")[0].split("-V")[0]  # chain-D3 -> chain, sequoia-V8 -> sequoia
        if options.skipped(family) or options.skipped(name):
            common.log(f"skipping {name} (--skip)")
            return
        variants[name] = variant(setup, make())
        described[name] = {"backend": backend, "what": what}

    if not (options.skipped("hf-greedy") and options.skipped("hf-assisted")):
        hf_greedy, hf_assisted, info["hf"] = engines.hf_decoders(rt, chain.depth)
        add("hf-greedy", "HF eager", "transformers generate, greedy", lambda: hf_greedy)
        add("hf-assisted", "HF eager", "transformers assisted generation " + str(info["hf"]["assisted"]),
            lambda: hf_assisted)
    add("ar-eager", "eager", "autoregressive", lambda: engines.autoregressive(eager))
    add("ar-torch.compile", "torch.compile", "autoregressive, whole-cache attention (gpt-fast style)",
        lambda: engines.autoregressive(compiled))
    add("ar-compiled", "bundle", "autoregressive on the bundle's graphs", lambda: engines.autoregressive(bundle))
    add(f"chain-D{chain.depth}", "torch.compile", f"chain of {chain.depth}, verified whole (gpt-fast style)",
        lambda: engines.speculative(compiled, engines.drafter_for(compiled, chain.depth, 1), [chain.verify]))
    sequoia = shapes.sequoia_file(rt, full) if rt.draft is not None else None
    if sequoia is not None:
        path, budget = sequoia
        info["sequoia"] = {"file": str(path), "budget": budget}

        def make_sequoia():
            drafter = engines.static_tree_drafter(compiled, path)
            return engines.speculative(compiled, drafter, [drafter.capacity])
        add(f"sequoia-V{budget}", "torch.compile", f"static tree {path.name} (Sequoia style)", make_sequoia)
    else:
        info["sequoia"] = "not run: " + ("lookup drafting has no draft model" if rt.draft is None
                                         else "the calibration wrote no Sequoia trees")
    egt = engines.bundle_policy(rt)
    if egt is None:
        info["egt"] = "the bundle does not speculate (no bucket paid on calibration): egt = its autoregressive graphs"
    add("egt", "bundle", "EGT from the bundle (predictor, bucket selection, stage plans)",
        lambda: egt or engines.autoregressive(bundle))
    return variants, described, info


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
              "this row's (> 1 is faster); tokens: greedy output vs our autoregressive greedy on every prompt")
    table += llama_cpp.table_notes(info["llama_cpp"])
    result = {**record(setup), "setup": info, "rows": rows}
    return write_outputs(setup, "compare", result, table, rows, lambda p: plots.compare(rows, heading, p))
