"""PNG plots of the suites' results; `pyplot` and `save` (yggdrasil/plotting.py) are what every
bench plot loads matplotlib and writes a figure with."""

from __future__ import annotations

from pathlib import Path

from yggdrasil.plotting import pyplot, save


BACKEND_COLOURS = {"HF eager": "#999999", "eager": "#7fa7d9", "torch.compile": "#e0a040",
                   "bundle": "#3a7d44", "llama.cpp": "#b0487f"}


def _verify_axis(ax, widths: list[int]) -> None:
    """Verify widths are powers of two: a log axis labelled with the widths themselves."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(widths))
    ax.set_xticks(ticks, labels=[str(t) for t in ticks])
    ax.set_xlabel("verify width V")


def compare(rows: list[dict], title: str, path: Path) -> None:
    """TPOT per variant (bars coloured by backend), AAL and speed-up written beside each bar."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.6), dpi=120)
    names = [r["variant"] for r in rows][::-1]
    values = [r["tpot_ms"] or 0 for r in rows][::-1]
    colours = [BACKEND_COLOURS.get(r["backend"], "#555555") for r in rows][::-1]
    ax.barh(names, values, color=colours)
    for y, r in enumerate(rows[::-1]):
        bits = [f"{r['tpot_ms']:.1f} ms"]
        if r.get("aal"):
            bits.append(f"AAL {r['aal']:.2f}")
        if r.get("x_ar-compiled"):
            bits.append(f"{r['x_ar-compiled']:.2f}x AR compiled")
        if r["valid"] is False:
            bits.append("INVALID")
        ax.text(r["tpot_ms"] or 0, y, "  " + ", ".join(bits), va="center", fontsize=8)
    ax.set_xlabel("time per output token, ms (lower is better)")
    ax.set_xlim(0, max(values) * 1.7 if values else 1)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in BACKEND_COLOURS.values()]
    ax.legend(handles, BACKEND_COLOURS.keys(), loc="lower right", fontsize=8)
    save(fig, path, title)


def ablation(rows: list[dict], title: str, path: Path) -> None:
    """Cumulative speed-up over O1 for O1..O5, with the autoregressive references as lines."""
    plt = pyplot()
    steps = [r for r in rows if r["variant"].startswith("O")]
    refs = [r for r in rows if not r["variant"].startswith("O")]
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    labels = [r["variant"] for r in steps]
    values = [r.get("x_O1") or (1.0 if r["variant"].startswith("O1") else 0) for r in steps]
    bars = ax.bar(labels, values, color="#3a7d44")
    for bar, r, value in zip(bars, steps, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.2f}x\n{r['tpot_ms']:.1f} ms",
                ha="center", va="bottom", fontsize=8)
    for r, style in zip(refs, ("--", ":")):
        if r.get("x_O1"):
            ax.axhline(r["x_O1"], linestyle=style, color="#555555", label=f"{r['variant']} ({r['x_O1']:.2f}x)")
    ax.set_ylabel("speed-up over O1 (per-token latency)")
    ax.set_ylim(0, max(values + [r.get("x_O1") or 0 for r in refs]) * 1.3)
    ax.tick_params(axis="x", labelsize=7)
    if refs:
        ax.legend(fontsize=8, loc="upper left")
    save(fig, path, title)


def trees(rows: list[dict], title: str, path: Path) -> None:
    """AAL and objective speed-up against verify width, one line per tree structure."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for structure in dict.fromkeys(r["structure"] for r in rows):
        mine = sorted((r for r in rows if r["structure"] == structure), key=lambda r: r["verify"])
        xs = [r["verify"] for r in mine]
        left.plot(xs, [r["aal"] for r in mine], marker="o", label=structure)
        right.plot(xs, [r["objective_speedup"] for r in mine], marker="o", label=structure)
    for ax, label in ((left, "AAL (tokens per target forward)"), (right, "objective 3.1 speed-up")):
        _verify_axis(ax, [r["verify"] for r in rows])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    right.axhline(1.0, color="#999999", linewidth=0.8)
    left.legend(fontsize=8)
    save(fig, path, title)


def sensitivity(grid_rows: list[dict], temp_rows: list[dict], title: str, path: Path) -> None:
    """TPOT over the (D, W, V) grid (one line per (D, W)) and per temperature."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), dpi=120)
    for key in dict.fromkeys((r["depth"], r["width"]) for r in grid_rows):
        mine = sorted((r for r in grid_rows if (r["depth"], r["width"]) == key), key=lambda r: r["verify"])
        left.plot([r["verify"] for r in mine], [r["tpot_ms"] for r in mine], marker="o",
                  label=f"D{key[0]} W{key[1]}")
    ar = next((r for r in temp_rows if r["variant"] == "ar-compiled" and r["temperature"] == 0), None)
    if ar:
        left.axhline(ar["tpot_ms"], color="#555555", linestyle="--", label="AR compiled")
    _verify_axis(left, [r["verify"] for r in grid_rows])
    left.set_ylabel("time per output token, ms")
    left.legend(fontsize=7, ncol=2)
    left.grid(alpha=0.3)
    temps = sorted({r["temperature"] for r in temp_rows})
    names = list(dict.fromkeys(r["kind"] for r in temp_rows))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        values = [next((r["tpot_ms"] for r in temp_rows if r["kind"] == name and r["temperature"] == t), 0)
                  for t in temps]
        right.bar([i + k * width for i in range(len(temps))], values, width, label=name)
    right.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(temps))])
    right.set_xticklabels([f"T={t:g}" for t in temps])
    right.set_ylabel("time per output token, ms")
    right.legend(fontsize=8)
    save(fig, path, title)
