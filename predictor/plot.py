"""PNG plot of a device profile: T(n) for target and draft, compiled and eager."""

from __future__ import annotations

from pathlib import Path

from yggdrasil.plotting import pyplot, save
from yggdrasil.policy.device_profile import DeviceProfile, ModelProfile


def _series(model: ModelProfile):
    """(label, sizes, milliseconds) per (mode, context) present in the profile."""
    keys = sorted({(p.mode, p.context) for p in model.steps})
    for mode, context in keys:
        pts = sorted((p.n, p.median_s * 1e3, p.min_s * 1e3, p.max_s * 1e3)
                     for p in model.steps if (p.mode, p.context) == (mode, context))
        yield f"{model.name} {mode} @ctx {context}", pts


def plot_profile(profile: DeviceProfile, path: Path) -> Path:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for model in filter(None, (profile.target, profile.draft)):
        for label, pts in _series(model):
            sizes = [p[0] for p in pts]
            ax.errorbar(sizes, [p[1] for p in pts],
                        yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                        marker="o", capsize=3, label=label,
                        linestyle="-" if "compiled" in label else "--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens per forward (n)")
    ax.set_ylabel("step time, ms (median, min-max)")
    ax.set_title(f"{profile.device}, {profile.dtype}, torch {profile.torch_version}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)
