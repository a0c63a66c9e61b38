"""`yggdrasil inspect BUNDLE`: what a bundle holds (manifest, kept buckets, stage plans, how its
step times were measured, the CPU it was built on and whether this one runs it)."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    insp = sub.add_parser("inspect", help="print what a bundle holds")
    insp.add_argument("bundle", help="bundle directory")


def run(bundle: str) -> int:
    from yggdrasil.storage.layout import BundleLayout
    from yggdrasil.graphs.describe import describe
    from yggdrasil.storage.manifest import read_manifest

    manifest, raw = read_manifest(Path(bundle), "`yggdrasil compile RECIPE --out BUNDLE`")
    print(describe(manifest, raw))
    _print_this_cpu(manifest, Path(bundle))
    layout = BundleLayout(Path(bundle))
    if layout.weights.is_dir():
        from yggdrasil.runtime.deployed import describe_weights

        print("\n".join(describe_weights(layout.weights)))
    if layout.selection.is_file():
        body = layout.read_selection()
        print(f"{'selection':<10} draft widths {body['draft_widths'] or 'none (plain decoding)'}, "
              f"verify widths {body['verify_widths']}")
        print(f"{'picked':<10} " + ", ".join(f"{k} x{v}" for k, v in list(body["picked"].items())[:8]))
        print(f"{'dropped':<10} draft widths {body['dropped_draft_widths'] or '-'}, "
              f"verify widths {body['dropped_verify_widths'] or '-'}")
    _print_stage_plans(layout)
    _print_policy(layout, manifest.stats)
    _print_measurement(manifest, Path(bundle))
    return 0


def _print_this_cpu(manifest, bundle: Path) -> None:
    """Whether this CPU runs the bundle's graphs, and whether its step times were measured on it."""
    from yggdrasil.cpu import cpu_fingerprint

    built, isa, here = manifest.environment.cpu, manifest.isa, cpu_fingerprint()
    if built is None:
        return
    recipe = manifest.recipe.get("source") or manifest.recipe.get("name")
    missing = here.lacks(isa.requires) if isa is not None else ()
    if built.machine != here.machine or missing:
        print(f"{'this cpu':<10} cannot run it: it lacks {', '.join(missing) or built.machine}; compile with "
              f"--isa {here.portable_isa() or 'native'} for a portable bundle, or rebuild it here")
    elif not built.same_cpu(here):
        print(f"{'this cpu':<10} runs it ({here.summary()}), but its step times were measured on another CPU: "
              f"`yggdrasil compile {recipe} --out {bundle} --reprofile` re-measures them here")
    else:
        print(f"{'this cpu':<10} the kind it was built and measured on")


def _print_policy(layout, stats: dict | None = None) -> None:
    """Which speculation policy ships (depth predictor or best constant bucket) and why, with
    predicted vs realised AAL on held-out calibration prompts, and per bucket the AAL and step
    time predicted vs realised that the manifest recorded (issue 25)."""
    import yaml

    from yggdrasil.storage.layout import PREDICTOR_SUMMARY
    from yggdrasil.predictor.confidence import describe_confidence
    from yggdrasil.policy.confidence import load_confidence
    from yggdrasil.predictor.pipeline import describe_policy
    from yggdrasil.policy.auto import shipped_policy

    directory = layout.calibration
    if not directory.is_dir():
        return
    summary, skipped = directory / PREDICTOR_SUMMARY, directory / "predictor.skipped"
    body = yaml.safe_load(summary.read_text()) if summary.is_file() else None
    report = load_confidence(directory)[1]
    runs = shipped_policy(body, report)
    for line in describe_policy(body, skipped.read_text().strip()[:160] if skipped.is_file() else None, runs):
        print(line)
    for line in describe_policy_buckets((stats or {}).get("policy_buckets")):
        print(line)
    for line in describe_confidence(report, runs):
        print(line)


def describe_policy_buckets(buckets: dict | None) -> list[str]:
    """The manifest's per-bucket verdict: for each policy and bucket it picked on held-out
    calibration prompts, AAL and step ms predicted vs realised (and measured on the graphs)."""
    if not buckets:
        return []
    lines = [f"{'':<10} per bucket, held out: AAL predicted/realised; step ms predicted/realised"
             "/on the bundle's graphs"]
    for policy, rows in buckets.items():
        for name, row in list(rows.items())[:6]:
            graphs = row.get("step_ms_graphs")
            lines.append(f"{'':<10} {policy:<9} {name:<12} x{row['picked']:<5} AAL {row['aal_predicted']:.2f}/"
                         f"{row['aal_realised']:.2f}; step {row['step_ms_predicted']:.2f}/"
                         f"{row['step_ms_realised']:.2f}/{'-' if graphs is None else f'{graphs:.2f}'} ms")
    return lines


def _print_measurement(manifest, bundle: Path) -> None:
    """How the step times were measured, and what to do when the machine was busy then (a
    loaded machine makes speculation look costly, so the bundle may hardly speculate)."""
    quality = manifest.stats.get("measurement_quality")
    if quality is None:
        print(f"{'measured':<10} not recorded (built by an older yggdrasil)")
        return
    print(f"{'measured':<10} {quality}, {manifest.stats.get('threads', '?')} thread(s)")
    if quality == "noisy":
        recipe = manifest.recipe.get("source") or manifest.recipe.get("name")
        print(f"{'':<10} the machine was busy while step times were measured, so the bucket selection may be "
              f"wrong: re-run `yggdrasil compile {recipe} --out {bundle} --reprofile` on a quiet machine")


def _print_stage_plans(layout) -> None:
    body = layout.read_stage_plans()
    if body is None:
        return
    costs = body["costs"]
    print(f"{'stages':<10} {body['source']}; contention {costs['contention']:.2f}, {costs['streams']} stream(s); "
          f"other buckets: {body['default']}")
    for bucket, entry in list(body["buckets"].items())[:8]:
        print(f"{'':<10} {bucket:<12} {entry['plan']:<34} predicted {entry['predicted_ms']:.2f} ms "
              f"(sequential {entry['sequential_ms']:.2f} ms)")


def main(args) -> int:
    return run(args.bundle)
