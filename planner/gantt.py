"""Gantt charts of simulated plans: the chosen plan per bucket next to the sequential one."""

from __future__ import annotations

from pathlib import Path

from yggdrasil.plotting import pyplot, save

from .dag import SEQUENTIAL, iteration_graph
from .schedule import WINDOW, PlanChoice, simulate

LANES = ("host", "main", "side")
COLORS = {"head": "#4c72b0", "draft": "#64b5cd", "prune": "#dd8452", "verify": "#c44e52",
          "accept": "#937860", "compact": "#8c8c8c", "tail": "#55a868"}


def _color(stage: str) -> str:
    return COLORS.get(stage.split("_")[0], "#cccccc")


def draw_plans(choices: list[PlanChoice], costs, path: Path, title: str = "") -> Path:
    """One row per bucket: its sequential schedule (left) and the chosen plan (right), over
    WINDOW iterations on the host / main stream / side stream lanes."""
    plt = pyplot()
    from matplotlib.patches import Patch  # optional, like pyplot: only when a plot is drawn

    rows = max(len(choices), 1)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 1.9 * rows + 0.8), squeeze=False)
    for row, choice in enumerate(choices):
        horizon = 0.0
        for col, plan in enumerate((SEQUENTIAL, choice.plan)):
            slots = simulate(iteration_graph(choice.bucket, costs, plan, WINDOW), costs.contention)
            ax = axes[row][col]
            for slot in slots:
                lane = LANES.index(slot.lane)
                ax.barh(lane, (slot.end - slot.start) * 1e3, left=slot.start * 1e3, height=0.7,
                        color=_color(slot.stage), edgecolor="white", linewidth=0.4)
            horizon = max(horizon, max(s.end for s in slots) * 1e3)
            seconds = choice.sequential_seconds if col == 0 else choice.seconds
            b = choice.bucket
            ax.set_title(f"D{b.depth}xW{b.width}/V{b.verify}: {plan} — {seconds * 1e3:.2f} ms/iteration",
                         fontsize=9)
            ax.set_yticks(range(len(LANES)), LANES, fontsize=8)
            ax.set_xlabel("ms", fontsize=8)
        for col in (0, 1):
            axes[row][col].set_xlim(0, horizon * 1.02)
    handles = [Patch(color=c, label=n) for n, c in COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title or "stage plans (simulated)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    return save(fig, path, dpi=110, layout=False)
