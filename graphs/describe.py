"""What `yggdrasil inspect` prints of a bundle's manifest (and compile's closing summary):
the recipe, models, environment, buckets, what runs them, the CPU and graph ISA, the stats, the
phase times and the weight-format table."""

from __future__ import annotations

from typing import Any

from yggdrasil.storage.manifest import SCHEMA, Manifest


def describe_cpu(manifest: Manifest) -> list[str]:
    """The CPU fingerprint and what the graphs were compiled for, as `inspect` prints them."""
    cpu, isa = manifest.environment.cpu, manifest.isa
    if cpu is None:
        return [f"{'cpu':<10} not recorded (built by an older yggdrasil: checked by its device name only)"]
    features = " ".join(cpu.features) if cpu.features is not None else "unknown"
    lines = [f"{'cpu':<10} {cpu.summary()}, {cpu.machine}, measured with {cpu.threads} thread(s)",
             f"{'features':<10} {features}"]
    if isa is not None:
        lines += [f"{'graph isa':<10} {isa.describe()}, compiled on {isa.compiled_on}",
                  f"{'':<10} needs {' '.join(isa.requires) or 'nothing recorded'}"]
        if isa.kernel_paths:
            lines.append(f"{'':<10} kernel library: run-time dispatch to {', '.join(isa.kernel_paths)} "
                         "(built without -march: needs nothing more)")
    return lines


# what runs the buckets, by the manifest's `steps`
RUN_BY = {"aoti": "AOTInductor packages",
          "inductor": "Inductor's saved steps, restored at open (captured as CUDA graphs on CUDA): AOTInductor "
                      "packages could not be loaded here, or the recipe says steps: inductor",
          "eager": "the models' eager steps (captured as CUDA graphs on CUDA): the recipe says steps: eager"}


def describe_ranks(manifest: Manifest) -> list[str]:
    """A split target's ranks (docs/tensor-parallel.md): how many, what runs their steps, each one's heads."""
    if manifest.world_size == 1:
        return []
    shards = (manifest.stats.get("tensor_parallel") or {}).get("shards") or []
    heads = "; ".join(f"rank {s['rank']}: heads {s['heads'][0]}..{s['heads'][1] - 1}" for s in shards)
    steps = "one graph set per rank (graphs/rank-K/target/)" if manifest.rank_graphs else "eager sharded steps"
    return [f"{'ranks':<10} the target split over {manifest.world_size} ranks, {steps}" + (f"; {heads}" if heads else "")]


def describe(manifest: Manifest, raw: dict[str, Any] | None = None) -> str:
    """What `yggdrasil inspect` prints."""
    env = manifest.environment
    total = sum(a["bytes"] for a in manifest.artifacts.values())
    lines = [f"bundle {manifest.bundle_id} ({SCHEMA}), created {manifest.created}",
             f"recipe     {manifest.recipe.get('name')} ({manifest.recipe_identity[:12]})",
             *(f"{role:<10} {m.get('name')} sha256 {str(m.get('sha256'))[:12]}…" for role, m in manifest.models.items()),
             f"built for  {env.device}, torch {env.torch}, triton {env.triton or '-'}, {manifest.dtype}",
             "weights    " + ", ".join(f"{role} {manifest.weight_format(role)}" for role in manifest.models),
             f"tile       {manifest.tile}; prefill chunks {list(manifest.chunk_sizes)}",
             f"buckets    {len(manifest.buckets)}: {', '.join(manifest.buckets)}",
             f"run by     " + RUN_BY[manifest.steps], *describe_ranks(manifest),
             f"artifacts  {len(manifest.artifacts)} files, {total / 1e6:.1f} MB", *describe_cpu(manifest)]
    # nested records (the policy's per-bucket verdict) get their own sections in inspect
    lines += [f"{k:<10} {v}" for k, v in manifest.stats.items() if not isinstance(v, dict)]
    if manifest.stats.get("phase_seconds"):
        lines.append(f"{'phases':<10} {describe_phases(manifest.stats['phase_seconds'])} (this compile's wall time; "
                     "cached work counts as the time to reuse it)")
    return "\n".join(lines + describe_draft_vocab(manifest.stats.get("draft_vocab")) + describe_formats(manifest.formats))


def describe_draft_vocab(vocab: dict | None) -> list[str]:
    """The draft head's size, why, and each candidate the objective weighed (issue 51)."""
    if not vocab:
        return []
    kept = vocab.get("kept")
    head = "full head" if kept is None else f"{kept} of {vocab.get('vocab_size')} tokens"
    lines = [f"{'draft vocab':<10} {head}: {vocab.get('reason', '')}"]
    for c in vocab.get("candidates", []):
        steps = ", ".join(f"W{w} {t:.2f} ms" for w, t in sorted(c.get("t_draft_ms", {}).items()))
        lines.append(f"{'':<10} K={c['kept']:<7} draft step {steps}; acceptance {c['depth_acceptance']:.3f}; "
                     f"best {c['bucket']}, {c['expected_tpot_ms']:.2f} ms/token expected")
    return lines


def describe_phases(phases: dict) -> str:
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())


def _measuring_seconds(candidate: dict) -> str:
    """How long measuring the format took (manifests before issue 37's timings: "-")."""
    parts = candidate.get("seconds")
    return f"{sum(parts.values()):.0f}" if isinstance(parts, dict) and parts else "-"


def describe_formats(formats: dict) -> list[str]:
    """The weight-format choice and each measured alternative, as `inspect` prints them."""
    if not formats.get("candidates"):
        return []
    lines = [f"{'formats':<10} chose {formats.get('chosen')}: {formats.get('reason', '')}",
             f"{'':<10} {'format':<7} {'T(1) ms':>8} {'T(16) ms':>9} {'agree':>7} {'ppl':>8} {'weights MB':>10}  "
             f"{'steps':<24} {'secs':>5}  verdict"]
    for c in formats["candidates"]:
        def num(key, fmt, c=c):
            value = c.get(key)
            return format(value, fmt) if isinstance(value, (int, float)) else "-"
        weight_mb = c["weight_bytes"] / 1e6 if isinstance(c.get("weight_bytes"), int) else None
        lines.append(f"{'':<10} {c['format']:<7} {num('t1_ms', '.2f'):>8} {num('t16_ms', '.2f'):>9} "
                     f"{num('agreement', '.4f'):>7} {num('perplexity', '.3f'):>8} "
                     f"{format(weight_mb, '.1f') if weight_mb is not None else '-':>10}  "
                     f"{c.get('batch_invariance') or '-':<24} {_measuring_seconds(c):>5}  {c.get('verdict', '')}")
    for c in formats["candidates"]:
        cost = c.get("activation_cost")
        if cost:  # what int8 activations cost apart from the weights (compile/activation_cost.py)
            fa = cost["float_activations"]
            lines.append(f"{'':<10} {c['format']} weights with float activations: agreement {fa['agreement']:.4f}, "
                         f"ppl {fa['perplexity'] if fa['perplexity'] is not None else '-'} (int8 activations: "
                         f"{c.get('agreement')}, {c.get('perplexity')}); {cost['gguf_model']}")
    how = formats.get("agreement_method")
    if how:
        lines.append(f"{'':<10} agreement: {how}")
    lines.append(f"{'':<10} steps: batch invariance of the format's eager steps (a row by decode vs prefill vs "
                 "verify, bitwise); the deployed graphs' own: batch_invariance above")
    return lines
