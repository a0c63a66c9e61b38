"""`yggdrasil profile`: measure target and draft on this device, write the YAML and the PNG."""

from __future__ import annotations

from pathlib import Path

import torch

from yggdrasil.cpu import cpu_fingerprint
from yggdrasil.progress import Progress
from yggdrasil.runtime.steps import StepRunner

from yggdrasil.predictor.measure import copy_bandwidth, merge, profile_model
from yggdrasil.predictor.plot import plot_profile
from yggdrasil.policy.device_profile import DeviceProfile, device_name, now_iso


def _profile_one(loaded, opts, bar: Progress):
    capacity = max(opts.contexts) + max(max(opts.sizes), max(opts.chunks)) + 1
    tick = lambda label: bar.update(step=1)  # noqa: E731 - one tick per measured point
    sha = loaded.source.sha256
    eager = profile_model(loaded.source.name, sha, StepRunner(loaded.model, capacity, compile=False),
                          opts.sizes, opts.contexts, opts.chunks, opts.repeats, tick)
    if not opts.compile:
        return eager
    compiled_runner = StepRunner(loaded.model, capacity, compile=True)
    compiled = profile_model(loaded.source.name, sha, compiled_runner, opts.sizes, opts.contexts,
                             opts.chunks, opts.repeats, tick)
    return merge(compiled, eager)


def _points_per_model(opts) -> int:
    eager = len(opts.sizes) * len(opts.contexts) + len(opts.chunks)
    return eager + (len(opts.sizes) + len(opts.chunks) if opts.compile else 0)


def profile_device(target, draft, opts, out: Path) -> tuple[DeviceProfile, Path]:
    models = [m for m in (target, draft) if m is not None]
    bar = Progress("profiling", _points_per_model(opts) * len(models))
    measured = [_profile_one(m, opts, bar) for m in models]
    bar.close()
    profile = DeviceProfile(
        device=device_name(opts.device), torch_version=torch.__version__,
        dtype=str(target.model.dtype).replace("torch.", ""), target=measured[0],
        draft=measured[1] if draft is not None else None,
        bandwidth=copy_bandwidth(opts.device), created=now_iso(),
        cpu=cpu_fingerprint(torch.get_num_threads()).as_dict())
    profile.save(out)
    png = plot_profile(profile, out.with_suffix(".png"))
    return profile, png
