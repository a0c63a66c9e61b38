"""`yggdrasil calibrate`: run the deepest/widest EGT over a prompt set, train the depth predictor,
and write the calibration directory that `generate --spec egt --auto` reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from yggdrasil.errors import InvalidRequestError
from .common import DEFAULT_MODEL, add_device_args, add_weights_arg, int_list


def add_parser(sub) -> None:
    cal = sub.add_parser("calibrate", help="run deep EGT over prompts, train the depth predictor, "
                                           "write the calibration directory for --spec egt --auto")
    cal.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})")
    cal.add_argument("--draft", default="lookup", help="draft model sharing the tokenizer, or lookup")
    cal.add_argument("--prompts", default="humaneval,mtbench",
                     help="comma-separated prompt sets: humaneval, mtbench, sharegpt or FILE.jsonl "
                          '(lines {"prompt": ...} or {"chat": ...}); the calibration split is used '
                          "(default humaneval,mtbench)")
    cal.add_argument("--num-prompts", type=int, default=24, help="prompts per set (default 24)")
    cal.add_argument("--max-new-tokens", type=int, default=64, help="reply length per prompt (default 64)")
    cal.add_argument("--depths", default="1,2,3,4,5,6", help="draft depths of the grid (default 1..6)")
    cal.add_argument("--widths", default="1,2,4", help="draft widths of the grid (default 1,2,4)")
    cal.add_argument("--verify", default="1,2,4,8,16,32", help="verify widths (default 1,2,4,8,16,32)")
    cal.add_argument("--profile", default=None,
                     help="device profile from `yggdrasil profile` (default: measure eager step times here)")
    cal.add_argument("--out", required=True, help="directory to write (created if missing)")
    add_device_args(cal)
    add_weights_arg(cal)  # acceptance is measured on the models as they would be deployed
    cal.add_argument("--reuse", action="store_true",
                     help="keep the iterations already recorded in --out (same models and grid) and "
                          "only retrain the predictor, with --profile's latency if given")
    cal.add_argument("--max-context", type=int, default=2048,
                     help="cache size; longer prompts are skipped (default 2048)")


@dataclass(frozen=True)
class CalibrateOptions:
    model: str
    draft: str
    prompts: tuple[str, ...]
    num_prompts: int
    max_new_tokens: int
    depths: tuple[int, ...]
    widths: tuple[int, ...]
    verifies: tuple[int, ...]
    profile: str | None
    out: str
    device: str
    dtype: str | None
    max_context: int
    reuse: bool = False
    weights: str = "fp32"

    @classmethod
    def from_args(cls, args) -> "CalibrateOptions":
        if args.num_prompts < 1 or args.max_new_tokens < 1:
            raise InvalidRequestError("--num-prompts and --max-new-tokens must be >= 1")
        return cls(args.model, args.draft, tuple(p.strip() for p in args.prompts.split(",") if p.strip()),
                   args.num_prompts, args.max_new_tokens, int_list(args.depths, "--depths"),
                   int_list(args.widths, "--widths"), int_list(args.verify, "--verify"), args.profile,
                   args.out, args.device, args.dtype, args.max_context, args.reuse, args.weights or "fp32")


def run(opts: CalibrateOptions) -> int:
    import torch

    from yggdrasil.buckets import Grid, chain_depths
    from yggdrasil.cpu import cpu_fingerprint
    from yggdrasil.device import check_device, device_name, now_iso
    from yggdrasil.runtime.assembly import assemble_runtime, grid_drafter
    from yggdrasil.generator import profile_latency
    from yggdrasil.runtime.latency import measure_checked, measure_profile
    from yggdrasil.models.loader import check_same_vocabulary, load, parse_dtype
    from yggdrasil.predictor import prompts as prompt_sets
    from yggdrasil.predictor.calibrate import Calibrator
    from yggdrasil.predictor.calibration_data import save_run
    from yggdrasil.predictor.pipeline import train_and_report

    check_device(opts.device)
    # with width 1 the chain that fills each verify width is calibrated too (buckets.py)
    grid = Grid(chain_depths(opts.depths, opts.widths, opts.verifies), opts.widths, opts.verifies)
    texts = prompt_sets.select(list(opts.prompts), "calibration", opts.num_prompts)
    dtype = parse_dtype(opts.dtype) if opts.dtype else None
    target = load(opts.model, dtype=dtype, device=opts.device, weights=opts.weights)
    draft = None
    if opts.draft != "lookup":
        draft = load(opts.draft, dtype=target.model.dtype, device=opts.device, weights=opts.weights)
        check_same_vocabulary(target, draft)
    runtime = assemble_runtime(target.model, draft.model if draft else None, opts.max_context)
    runner, drafter = runtime.runner, grid_drafter(grid, runtime.draft_runner)
    latency = profile_latency(opts.profile, target, drafter.kind, draft) if opts.profile else None
    out = Path(opts.out)
    if opts.reuse and (out / "calibration.yaml").is_file():
        return _retrain(out, grid, target, draft, latency)
    if latency is None:
        print("no --profile given: measuring eager step times for the grid here", flush=True)
        latency = measure_checked(
            lambda: measure_profile(runner, drafter, grid.verifies, repeats=5,
                                    draft_widths=() if drafter.kind == "lookup" else grid.widths),
            runner.device, what="eager step times", hint="; re-run on a quiet machine, or give --profile")
    ids = [prompt_sets.encode(p, target.tokenizer) for p in texts]
    # widths above 1 are built to the depths asked for; the chains' deeper depths are width 1's
    run = Calibrator(runner, drafter, grid, max(opts.depths)).run(ids, opts.max_new_tokens,
                                                                  target.tokenizer.stop_ids)
    meta = {"created": now_iso(), "device": device_name(opts.device),
            "cpu": cpu_fingerprint(torch.get_num_threads()).as_dict(),
            "dtype": str(target.model.dtype).replace("torch.", ""), "weights": opts.weights,
            "target": target.source.name, "target_sha256": target.source.sha256,
            "draft": draft.source.name if draft else "lookup",
            "draft_sha256": draft.source.sha256 if draft else None,
            "prompt_sets": list(opts.prompts), "split": "calibration",
            "prompt_ids": [p.id for p in texts], "max_new_tokens": opts.max_new_tokens,
            "latency_source": opts.profile or "measured in place (eager)",
            **({"profile_quality": latency.quality.as_dict()} if latency.quality is not None else {})}
    save_run(run, out, meta, latency)
    print(f"calibration: {run.accepted_max.numel()} iterations from {len(ids) - run.skipped_prompts} "
          f"prompts ({run.skipped_prompts} too long for --max-context), written to {out}")
    summary = train_and_report(out)
    print_summary(summary)
    return 0


def _retrain(out: Path, grid, target, draft, latency) -> int:
    """--reuse: keep the recorded iterations (same models and grid), optionally with a new
    latency profile, and only retrain and re-judge the predictor."""
    from yggdrasil.predictor.calibration_data import save_run
    from yggdrasil.policy.calibration import load_run
    from yggdrasil.predictor.pipeline import train_and_report

    run, meta, _ = load_run(out)
    wanted = {"target_sha256": target.source.sha256, "draft_sha256": draft.source.sha256 if draft else None}
    diffs = [f"{k} {meta.get(k)!r} vs {v!r}" for k, v in wanted.items() if meta.get(k) != v]
    if run.grid != grid:
        diffs.append(f"grid {run.grid.as_dict()} vs {grid.as_dict()}")
    if diffs:
        raise InvalidRequestError(f"--reuse: {out} was calibrated for something else ({'; '.join(diffs)}); "
                                  "drop --reuse to calibrate again")
    if latency is not None:
        meta["latency_source"] = "replaced with --reuse --profile"
        save_run(run, out, meta, latency)
    print(f"reusing {run.accepted_max.numel()} calibration iterations in {out}")
    print_summary(train_and_report(out))
    return 0


def print_summary(summary: dict) -> None:
    held, objective = summary["held_out"], summary["objective"]
    print(f"depth predictor on {held['records']} held-out iterations: accuracy {held['accuracy']:.1%} "
          f"(within one {held['within_one']:.1%}; always-majority {held['majority_accuracy']:.1%}), "
          f"log-loss {held['log_loss']:.3f} vs constant {held['constant_log_loss']:.3f}, "
          f"{held['inference_us']:.0f} us per prediction -> {'used' if held['useful'] else 'NOT used'}")
    print(f"objective 3.1 on held-out iterations (plain decode = 1.00): best constant "
          f"{objective['constant_shape']} {objective['constant_speedup']:.2f} | predicted "
          f"{objective['predicted_speedup']:.2f} | oracle {objective['oracle_speedup']:.2f}")
    for budget, text in summary.get("sequoia", {}).items():
        print(f"Sequoia tree for verify {budget[1:]}: {text}")


def main(args) -> int:
    return run(CalibrateOptions.from_args(args))
