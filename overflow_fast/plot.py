"""The ``report --png`` picture: headroom per module over steps (matplotlib, Agg backend).

Importing this module raises ImportError when matplotlib is missing (the CLI turns that into a
message naming ``pip install overflow_fast[plot]``).
"""

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402  (a matplotlib dependency)
from matplotlib import colors  # noqa: E402

from .logsummary import headroom, printable  # noqa: E402

DPI = 100
MAX_LABELS = 60


def _edges(starts, width):
    """x edges of the used columns: each cell spans its bin, widened over unrecorded gaps."""
    centres = [s + (width - 1) / 2 for s in starts]
    if len(centres) == 1:
        return [centres[0] - width / 2, centres[0] + width / 2]
    mids = [(a + b) / 2 for a, b in zip(centres, centres[1:])]
    return [centres[0] - (mids[0] - centres[0])] + mids + [centres[-1] + (centres[-1] - mids[-1])]


def draw(summary, path, size=None, curves=5, title_source=""):
    """Write the picture of ``summary`` (a ``logsummary.Summary``) to ``path``; returns (width, height) px."""
    modules = summary.plot_modules()
    used = set()
    for name in modules:
        used.update(summary.cells.get(name, ()))
        used.update(summary.bad_cells.get(name, ()))
    columns = sorted(used)
    starts = [summary.bin_steps(i)[0] for i in columns]
    width = summary.width
    grid = np.full((len(modules), len(columns)), np.nan)
    bad = np.zeros((len(modules), len(columns)), dtype=bool)
    position = {c: j for j, c in enumerate(columns)}
    for i, name in enumerate(modules):
        for c, ratio in summary.cells.get(name, {}).items():
            grid[i, position[c]] = headroom(ratio)
        for c in summary.bad_cells.get(name, ()):
            bad[i, position[c]] = True
            grid[i, position[c]] = 0.0

    hottest = [name for name, _, _ in summary.hottest(max(curves, 0))] if curves else []
    rows = len(modules)
    if size is None:
        heat_in = max(3.0, min(0.17 * rows + 1.0, 26.0))
        fig_w, fig_h = 14.0, heat_in + (3.6 if hottest else 0) + 1.4
    else:
        fig_w, fig_h = size[0] / DPI, size[1] / DPI
    ratios = [max(3.0, min(0.17 * rows + 1.0, 26.0)), 3.6] if hottest else [1]
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(ratios), 1, gridspec_kw={"height_ratios": ratios}, squeeze=False)[:, 0]
    heat = axes[0]

    finite = grid[np.isfinite(grid)]
    vmax = float(np.percentile(finite, 99)) if finite.size else 16.0
    vmax = max(vmax, 1.0)
    cmap = plt.get_cmap("RdYlBu").with_extremes(bad="#e8e8e8")  # grey: no record in that bin
    x = _edges(starts, width) if columns else [0, 1]
    y = np.arange(rows + 1) - 0.5
    mesh = heat.pcolormesh(x, y, np.ma.masked_invalid(grid), cmap=cmap,
                           norm=colors.Normalize(vmin=0.0, vmax=vmax), shading="flat")
    if bad.any():
        heat.pcolormesh(x, y, np.ma.masked_where(~bad, np.ones_like(grid)),
                        cmap=colors.ListedColormap(["black"]), shading="flat")
    heat.set_ylim(rows - 0.5, -0.5)  # first module at the top
    labels = [printable(name) if name else "(model)" for name in modules]
    step = max(1, math.ceil(rows / MAX_LABELS))
    heat.set_yticks(range(0, rows, step))
    heat.set_yticklabels(labels[::step], fontsize=7 if rows > 30 else 8)
    heat.set_ylabel("module (in the order it first appears in the log)" if not summary.modules_dropped
                    else f"the {rows} modules closest to their limit (in the order they first appear)")
    per_column = summary.steps_per_column()
    per_column = width if per_column is None else per_column
    heat.set_xlabel("training step" + (f" (a column covers {width} steps, up to {per_column} of them recorded: "
                                       "its lowest headroom is shown)" if per_column > 1 else ""))
    heat_in = fig_h * ratios[0] / sum(ratios)
    shrink = min(1.0, 10.0 / heat_in)  # a bar at most ~10 inches long and ~0.2 inch wide
    bar = fig.colorbar(mesh, ax=heat, extend="max", pad=0.01, shrink=shrink,
                       aspect=max(12.0, heat_in * shrink / 0.2), extendfrac=0.03)
    bar.set_label("headroom: bits below the dtype's largest value\n(0 = overflow; red = close to it)")

    first = summary.first_nonfinite
    legend = []
    if bad.any():
        legend.append(plt.Rectangle((0, 0), 1, 1, color="black", label="nan/inf recorded"))
    if first is not None and first["module"] in modules:
        fx = first["step"]
        fy = modules.index(first["module"])
        heat.plot([fx], [fy], marker="o", markersize=13, markerfacecolor="none", markeredgecolor="red",
                  markeredgewidth=2.5, linestyle="none")
        name = printable(first["module"]) or "(model)"
        text = f"first nan/inf: step {first['step']} ({first['phase']})\n{name} {printable(first['entry'])}"
        right = fx > (x[0] + x[-1]) / 2
        heat.annotate(text, xy=(fx, fy), xytext=(-18 if right else 18, 18 if fy > rows / 2 else -18),
                      textcoords="offset points", ha="right" if right else "left",
                      va="bottom" if fy > rows / 2 else "top", color="red", fontsize=9, fontweight="bold",
                      bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="red", alpha=0.9),
                      arrowprops=dict(arrowstyle="->", color="red", lw=1.5))
        legend.append(plt.Line2D([], [], marker="o", color="red", markerfacecolor="none", linestyle="none",
                                 markersize=9, markeredgewidth=2, label="first nan/inf"))
    legend.append(plt.Rectangle((0, 0), 1, 1, color="#e8e8e8", label="not recorded / all zero / integer"))
    heat.legend(handles=legend, loc="upper left", bbox_to_anchor=(0, 1.0), fontsize=8, framealpha=0.9,
                ncol=len(legend))
    title = "Headroom before overflow, per module and step"
    if title_source:
        title += f" — {title_source}"
    heat.set_title(title + "\nheadroom = log2(largest finite value of the dtype / largest |value| seen): "
                   "each bit lost is a doubling toward inf", fontsize=11)

    if hottest:
        ax = axes[1]
        index = {name: i for i, name in enumerate(modules)}
        centres = np.array([s + (width - 1) / 2 for s in starts], dtype=float)
        for name in hottest:
            values = grid[index[name]]
            keep = np.isfinite(values)
            ax.plot(centres[keep], values[keep], marker="." if keep.sum() < 60 else None, linewidth=1.6,
                    label=f"{printable(name) if name else '(model)'} ({printable(summary.modules[name][0])})")
        ax.axhline(0, color="red", linewidth=1, linestyle="--")
        ax.text(x[0], 0, " overflow (inf)", color="red", va="bottom", fontsize=8)
        if first is not None:
            ax.axvline(first["step"], color="red", linewidth=1, linestyle=":")
        ax.set_xlim(x[0], x[-1])
        ax.set_ylim(bottom=-0.5)
        ax.set_xlabel("training step")
        ax.set_ylabel("headroom (bits)")
        ax.set_title(f"The {len(hottest)} modules that came closest to overflow (lowest headroom)", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)
    return int(round(fig_w * DPI)), int(round(fig_h * DPI))
