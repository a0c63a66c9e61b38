"""`yggdrasil profile`: measure step times of a target (and draft) on this device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from yggdrasil.errors import InvalidRequestError
from .common import DEFAULT_MODEL, add_device_args, add_weights_arg, int_list


def add_parser(sub) -> None:
    prof = sub.add_parser("profile", help="measure step times of a target (and draft) on this device")
    prof.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})")
    prof.add_argument("--draft", default=None,
                      help="draft model to profile too (same tokenizer); `lookup` (prompt lookup, as generate "
                           "takes it) has no model and nothing to time, so only the target is profiled")
    prof.add_argument("--out", required=True, help="profile YAML to write (a PNG plot goes next to it)")
    prof.add_argument("--sizes", default="1,2,4,8,16,32", help="new-token counts n (default 1,2,4,8,16,32)")
    prof.add_argument("--contexts", default="128,512,1024",
                      help="cached context lengths for the eager points (default 128,512,1024)")
    prof.add_argument("--chunks", default="32,64,128", help="prefill chunk sizes (default 32,64,128)")
    prof.add_argument("--repeats", type=int, default=5, help="timed repeats per point (default 5)")
    prof.add_argument("--no-compile", action="store_true", help="measure eager steps only (faster)")
    add_device_args(prof)
    add_weights_arg(prof)


@dataclass(frozen=True)
class ProfileOptions:
    model: str
    draft: str | None
    out: str
    sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]
    repeats: int
    compile: bool
    device: str
    dtype: str | None
    weights: str = "fp32"

    @classmethod
    def from_args(cls, args) -> "ProfileOptions":
        if args.repeats < 1:
            raise InvalidRequestError(f"--repeats must be >= 1, got {args.repeats}")
        draft = None if args.draft == "lookup" else args.draft  # prompt lookup runs no model: no steps to time
        return cls(args.model, draft, args.out, int_list(args.sizes, "--sizes"),
                   int_list(args.contexts, "--contexts"), int_list(args.chunks, "--chunks"),
                   args.repeats, not args.no_compile, args.device, args.dtype, args.weights or "fp32")


def run(opts: ProfileOptions) -> int:
    import torch

    from yggdrasil.device import check_device, cpu_snapshot, cpu_window, reference_seconds
    from yggdrasil.runtime.latency import NoiseLimits, judge
    from yggdrasil.models.loader import check_same_vocabulary, load, parse_dtype
    from yggdrasil.policy.costs import leave_one_out
    from yggdrasil.predictor.profile_run import profile_device

    check_device(opts.device)
    dtype = parse_dtype(opts.dtype) if opts.dtype else None
    target = load(opts.model, dtype=dtype, device=opts.device, weights=opts.weights)
    draft = load(opts.draft, dtype=target.model.dtype, device=opts.device, weights=opts.weights) if opts.draft else None
    if draft is not None:
        check_same_vocabulary(target, draft)
    out = Path(opts.out)
    device = torch.device(opts.device)
    reference, before = reference_seconds(device), cpu_snapshot()
    profile, png = profile_device(target, draft, opts, out)
    window, reference_after = cpu_window(before, cpu_snapshot()), reference_seconds(device)
    print(f"wrote {out} and {png}")
    quality = judge(_worst_spread(profile), window, (reference, reference_after), torch.get_num_threads(),
                    NoiseLimits())
    print(f"measurement: {quality.summary()}")
    if quality.verdict == "noisy":
        print("WARNING: the machine was busy while profiling, so these step times are likely too slow; "
              "re-run `yggdrasil profile` on a quiet machine")
    curve = profile.target.curve()
    print(f"{profile.target.name}: T(1) {curve(1) * 1e3:.1f} ms, T({curve.sizes[-1]}) "
          f"{curve(curve.sizes[-1]) * 1e3:.1f} ms")
    for model_profile in filter(None, (profile.target, profile.draft)):
        loo = leave_one_out(model_profile.curve())
        print(f"{model_profile.name}: interpolated T(n) error, each interior point left out: mean "
              f"{loo.mean_abs_pct_error:.1f}% max {loo.max_abs_pct_error:.1f}% over {loo.held_out} points")
    model, report = profile.target.linear_model()
    print(f"linear model T = {model.alpha * 1e6:.2f} us/context token + {model.gamma * 1e3:.3f} ms/new "
          f"token + {model.delta * 1e3:.2f} ms; held-out error mean {report.mean_abs_pct_error:.1f}% "
          f"max {report.max_abs_pct_error:.1f}% over {report.held_out} points")
    return 0


def _worst_spread(profile) -> float:
    """The largest (max - min) / median over every measured point (a rough spread: the
    profile keeps each point's extremes, not its samples)."""
    points = [p for m in (profile.target, profile.draft) if m is not None for p in m.steps + m.prefill_chunks]
    return max((p.max_s - p.min_s) / max(p.median_s, 1e-3) for p in points)


def main(args) -> int:
    return run(ProfileOptions.from_args(args))
