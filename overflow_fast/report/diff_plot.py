"""The ``diff --png`` picture (matplotlib, Agg backend): the divergence of the two runs per module
over steps, and the curves of the modules that diverge most. What is drawn comes from
``diff.Picture`` (plain data, tested there); this module only draws it, as ``plot`` draws the
report's.

Importing this module raises ImportError when matplotlib is missing (the CLI turns that into a
message naming ``pip install overflow_fast[plot]``).
"""

import math
import textwrap

import numpy as np  # (a matplotlib dependency)
from matplotlib import colors, patches, transforms

from .diff import IDENTICAL, NONFINITE, ONE_RUN, Picture
from .plot import DPI, LINESTYLES, MAX_LABELS, NOT_RECORDED_HATCH, _edges, _flat_cells, _place_end_labels, plt
from .text import LABEL_CHARS, label

IDENTICAL_COLOR = "#d9ead3"
NONFINITE_COLOR = "black"
ONE_RUN_STYLE = dict(facecolor="#c7b5e3", edgecolor="#8e7cc3", hatch="\\\\\\\\", linewidth=0)
LOWEST = 1e-7  # the colour scale's bottom: smaller divergences take its colour


def draw(diff, path, size=None, curves=5, title_source=""):
    """Write the picture of ``diff`` (a ``diff.Diff`` read with ``grid=True``) to ``path``;
    returns (width, height) in pixels."""
    picture = Picture(diff, curves)
    rows, columns = len(picture.modules), len(picture.columns)
    grid = np.array([[np.nan if v is None else v for v in row] for row in picture.values], dtype=float)
    grid = grid.reshape(rows, columns)
    kinds = np.array(picture.kinds, dtype=object).reshape(rows, columns)
    heat_in = max(3.0, min(0.17 * rows + 1.0, 26.0))
    if size is None:
        fig_w, fig_h = 14.0, None
        with_curves = bool(picture.curves)
    else:
        fig_w, fig_h = size[0] / DPI, size[1] / DPI
        with_curves = bool(picture.curves) and fig_h - 4.5 >= 2.5  # room for a panel under the heatmap
    ratios = [heat_in] + ([3.4] if with_curves else [])
    if fig_h is None:
        fig_h = sum(ratios) + 2.6
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=DPI, layout="constrained")
    axes = list(fig.subplots(len(ratios), 1, gridspec_kw={"height_ratios": ratios}, squeeze=False)[:, 0])
    heat = axes[0]
    x_range, bar, first_label = _draw_heatmap(fig, heat, picture, grid, kinds)
    _draw_key(bar, picture, fig_w)
    title = picture.title + (f" — {label(title_source, 2 * LABEL_CHARS)}" if title_source else "")
    explained = picture.explained
    chars = max(40, int(fig_w * DPI / 8))
    fig.suptitle("\n".join(textwrap.wrap(title, chars) + textwrap.wrap(explained, chars)), fontsize=11)
    ends = []
    if with_curves:
        curve_ax = axes[1]
        ends.append((curve_ax, _draw_curves(curve_ax, picture, grid, kinds)))
        curve_ax.set_xlim(*x_range)
        curve_ax.set_xlabel(picture.xlabel.split(";")[0])
        curve_ax.grid(True, alpha=0.3)
        if picture.first is not None and picture.first["x"] is not None:
            curve_ax.axvline(picture.first["x"], color="red", linewidth=1, linestyle=":")
    _place_end_labels(fig, heat, first_label, ends)
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)
    return int(round(fig_w * DPI)), int(round(fig_h * DPI))


def _draw_heatmap(fig, heat, picture, grid, kinds):
    rows, width = len(picture.modules), picture.width
    x = _edges([c * width for c in picture.columns], width) if picture.columns else [0, 1]
    y = np.arange(rows + 1) - 0.5
    _flat_cells(heat, x, y, grid, kinds, ((IDENTICAL, IDENTICAL_COLOR), (NONFINITE, NONFINITE_COLOR)))
    one_run = kinds == ONE_RUN
    for i, j in zip(*np.nonzero(one_run)):
        heat.add_patch(patches.Rectangle((x[j], y[i]), x[j + 1] - x[j], 1.0, **ONE_RUN_STYLE))
    norm = colors.LogNorm(vmin=LOWEST, vmax=1.0, clip=True)
    mesh = heat.pcolormesh(x, y, np.ma.masked_invalid(np.clip(grid, LOWEST, 1.0)), cmap=plt.get_cmap("YlOrRd"),
                           norm=norm, shading="flat")
    heat.set_xlim(x[0], x[-1])
    heat.set_ylim(rows - 0.5, -0.5)
    labels = picture.labels
    every = max(1, math.ceil(rows / MAX_LABELS))
    heat.set_yticks(range(0, rows, every))
    heat.set_yticklabels(labels[::every], fontsize=7 if rows > 30 else 8)
    heat.set_ylabel("module (in the order first compared)")
    heat.set_xlabel(picture.xlabel)
    bar = fig.colorbar(mesh, ax=heat, location="bottom", shrink=0.32, aspect=22, anchor=(0.0, 1.0),
                       extend="both", extendfrac=0.03)
    bar.set_label("divergence (relative difference); the line: --rtol", fontsize=9)
    if LOWEST < picture.rtol < 1.0:
        bar.ax.axvline(picture.rtol, color="blue", linewidth=2)
    return (x[0], x[-1]), bar, _first_label(fig, heat, picture, (x[0], x[-1]))


def _first_label(fig, heat, picture, x_range):
    """The first parting: a circle on its cell and its label above the heatmap, with an arrow."""
    first = picture.first
    if first is None:
        return None
    x0, x1 = x_range
    above = transforms.offset_copy(transforms.blended_transform_factory(heat.transData, heat.transAxes),
                                   fig=fig, y=16, units="points")
    style = dict(color="red", fontsize=9, fontweight="bold", va="bottom", annotation_clip=False,
                 bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="red"))
    if first["x"] is None:  # no place on the timeline: the label alone, at the left
        return heat.annotate(first["text"], xy=(x0, 1.0), xycoords=above, ha="left", **style)
    width = picture.width
    fx, fy = first["x"] // width * width + (width - 1) / 2, first["row"]  # its column's centre
    frac = (fx - x0) / (x1 - x0) if x1 > x0 else 0.5
    ha = "right" if frac > 0.66 else "left" if frac < 0.34 else "center"
    if fy is None:
        return heat.annotate(first["text"], xy=(fx, 1.0), xycoords=above, ha=ha, **style)
    heat.plot([fx], [fy], marker="o", markersize=13, markerfacecolor="none", markeredgecolor="blue",
              markeredgewidth=2.5, linestyle="none", zorder=5, clip_on=False)
    return heat.annotate(first["text"], xy=(fx, fy), xycoords="data", xytext=(fx, 1.0), textcoords=above, ha=ha,
                         arrowprops=dict(arrowstyle="->", color="red", lw=1.5, shrinkB=8), **style)


def _draw_key(bar, picture, fig_w):
    legend = [
        patches.Patch(label="not recorded", **NOT_RECORDED_HATCH),
        patches.Patch(label="in one run only", **ONE_RUN_STYLE),
        patches.Patch(facecolor=IDENTICAL_COLOR, label="identical statistics"),
        patches.Patch(facecolor=NONFINITE_COLOR, label="nan/inf in one run only"),
    ]
    if picture.first is not None and picture.first["row"] is not None:
        legend.append(plt.Line2D([], [], marker="o", color="blue", markerfacecolor="none", linestyle="none",
                                 markersize=9, markeredgewidth=2, label="first parting"))
    columns = max(1, min(3, int((fig_w * 0.66 - 0.6) / 2.7)))
    bar.ax.legend(handles=legend, loc="center left", bbox_to_anchor=(1.12, 0.0), ncol=columns, fontsize=9,
                  frameon=False, handlelength=2.2, handleheight=1.2)


def _draw_curves(ax, picture, grid, kinds):
    """The divergence of the modules that diverge most, per column (log scale; identical
    statistics at its bottom); returns their end labels."""
    centres = np.array(picture.centres, dtype=float)
    labelled = []
    for k, row in enumerate(picture.curves):
        values = np.where(kinds[row] == IDENTICAL, LOWEST, grid[row])
        keep = np.isfinite(values)
        if not keep.any():
            continue
        colour = f"C{k % 10}"
        ax.plot(centres[keep], np.maximum(values[keep], LOWEST), marker="." if keep.sum() < 60 else None,
                linewidth=1.6, color=colour, linestyle=LINESTYLES[k % len(LINESTYLES)])
        last = np.flatnonzero(keep)[-1]
        labelled.append((centres[last], max(values[last], LOWEST), picture.labels[row], colour))
    ax.set_yscale("log")
    ax.set_ylim(bottom=LOWEST / 2)
    if picture.rtol > 0:
        ax.axhline(picture.rtol, color="blue", linewidth=1, linestyle="--")
    ax.set_ylabel("divergence\n(dashed: --rtol)")
    ax.set_title(f"The {len(picture.curves)} modules with the largest divergence, labelled at their ends "
                 f"(nan/inf in one run only: not on this scale)", fontsize=10)
    return labelled
