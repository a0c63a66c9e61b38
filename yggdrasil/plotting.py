"""The one matplotlib setup (headless, loaded only when a plot is drawn: optional and slow to
import) for everything that writes a PNG: bench, calibration, profiles, stage-plan timelines."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib  # optional and slow to import: only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    return plt


def save(fig, path: Path, title: str | None = None, dpi: int | None = None, layout: bool = True) -> Path:
    """Lay the figure out (unless the caller did), write it as PNG and let it go."""
    if title:
        fig.suptitle(title, fontsize=10)
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)
