"""The ``report --png`` picture (matplotlib, Agg backend): headroom per module over steps, the
curves of the modules closest to overflow, and the underflow hot spots' fractions. What is drawn
comes from ``summary.Picture`` (plain data, tested there); this module only draws it.

Importing this module raises ImportError when matplotlib is missing (the CLI turns that into a
message naming ``pip install overflow_fast[plot]``).
"""

import math
import textwrap

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402  (a matplotlib dependency)
from matplotlib import colors, patches, transforms  # noqa: E402

from .summary import ALL_ZERO, INTEGER_ONLY, NONFINITE, Picture  # noqa: E402
from .text import LABEL_CHARS, label  # noqa: E402

DPI = 100
MAX_LABELS = 60
# the heatmap's cells without headroom, told apart (the legend names each)
NOT_RECORDED_HATCH = dict(facecolor="white", edgecolor="#b0b0b0", hatch="////", linewidth=0)
ALL_ZERO_COLOR = "#8c8c8c"
INTEGER_COLOR = "#c7b5e3"
NONFINITE_COLOR = "black"
EVAL_COLOR = "#1b7837"
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))  # overlapping curves stay apart
LABEL_FONT = 8  # points: the end-of-curve labels


def _flat_cells(heat, x, y, grid, kinds, colours):
    """The hatch of cells not recorded behind the heatmap, and the cells of each kind in
    ``colours`` ((kind, colour) pairs) in that one colour."""
    heat.add_patch(patches.Rectangle((0, 0), 1, 1, transform=heat.transAxes, zorder=0, **NOT_RECORDED_HATCH))
    heat.set_facecolor("none")
    for kind, colour in colours:
        mask = kinds == kind
        if mask.any():
            heat.pcolormesh(x, y, np.ma.masked_where(~mask, np.ones_like(grid)), shading="flat",
                            cmap=colors.ListedColormap([colour]))


def _edges(starts, width):
    """x edges of the used columns: each cell spans its bin, widened over unrecorded gaps."""
    centres = [s + (width - 1) / 2 for s in starts]
    if len(centres) == 1:
        return [centres[0] - width / 2, centres[0] + width / 2]
    mids = [(a + b) / 2 for a, b in zip(centres, centres[1:])]
    return [centres[0] - (mids[0] - centres[0])] + mids + [centres[-1] + (centres[-1] - mids[-1])]


def place_labels(targets, gap, lo=None, hi=None):
    """Positions for labels wanted at ``targets`` (one axis), at least ``gap`` apart, in the
    targets' order, each as near its target as that allows (a run of labels that would overlap
    is centred on its targets), within [lo, hi] when they fit there (when they do not, they
    spread upward from ``lo``). Returns the positions in the order of ``targets``."""
    n = len(targets)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (targets[i], i))
    if lo is not None and hi is not None and (n - 1) * gap > hi - lo:
        hi = lo + (n - 1) * gap  # they cannot fit: let them run past the top
    wanted = [targets[i] for i in order]
    if lo is not None:
        wanted = [max(y, lo) for y in wanted]
    if hi is not None:
        wanted = [min(y, hi) for y in wanted]

    def clamp(start, size):
        if hi is not None:
            start = min(start, hi - (size - 1) * gap)
        if lo is not None:
            start = max(start, lo)
        return start

    clusters = []  # [first index in order, size, position of its first label]
    for j, y in enumerate(wanted):
        clusters.append([j, 1, clamp(y, 1)])
        while len(clusters) > 1:
            a, b = clusters[-2], clusters[-1]
            if a[2] + a[1] * gap <= b[2]:
                break
            first, size = a[0], a[1] + b[1]
            # the start that moves the labels least (squared): the mean of each one's wish
            start = sum(wanted[k] - (k - first) * gap for k in range(first, first + size)) / size
            clusters[-2:] = [[first, size, clamp(start, size)]]
    placed = [0.0] * n
    for first, size, start in clusters:
        for k in range(size):
            placed[order[first + k]] = start + k * gap
    return placed


def _label_ends(fig, ax, ends, fontsize=LABEL_FONT):
    """Text at each curve's last point, in the margin right of ``ax``, nudged apart so that no
    two overlap, with a thin leader to the point. ``ends``: [(x, y, text, colour)] in data
    coordinates. Needs the layout done (the gap is in points)."""
    if not ends:
        return
    height = ax.get_window_extent().height  # pixels
    gap = fontsize * 1.35 * fig.dpi / 72 / max(height, 1.0)
    to_axes = ax.transData + ax.transAxes.inverted()
    wanted = [float(to_axes.transform((x, y))[1]) for x, y, _, _ in ends]
    placed = place_labels(wanted, gap, lo=0.0, hi=1.0)
    for (x, y, text, colour), ty in zip(ends, placed):
        ax.annotate(text, xy=(x, y), xycoords="data", xytext=(1.012, ty), textcoords="axes fraction",
                    ha="left", va="center", fontsize=fontsize, color=colour, annotation_clip=False,
                    arrowprops=dict(arrowstyle="-", color=colour, lw=0.7, alpha=0.7, shrinkA=0, shrinkB=2))


def _first_label(fig, heat, picture, x_range):
    """The first nan/inf: a red circle on its cell, and its label above the heatmap (in the
    margin, never over a cell) with an arrow down to the circle."""
    first = picture.first
    if first is None:
        return
    x0, x1 = x_range
    fx, fy = first["x"], first["row"]
    above = transforms.offset_copy(transforms.blended_transform_factory(heat.transData, heat.transAxes),
                                   fig=fig, y=16, units="points")
    box = dict(boxstyle="round,pad=0.3", fc="white", ec="red")
    style = dict(color="red", fontsize=9, fontweight="bold", va="bottom", bbox=box, annotation_clip=False)
    if fx is None:  # no place on the timeline: the label alone, at the left
        return heat.annotate(first["text"], xy=(x0, 1.0), xycoords=above, ha="left", **style)
    frac = (fx - x0) / (x1 - x0) if x1 > x0 else 0.5
    ha = "right" if frac > 0.66 else "left" if frac < 0.34 else "center"
    if fy is not None:
        heat.plot([fx], [fy], marker="o", markersize=13, markerfacecolor="none", markeredgecolor="red",
                  markeredgewidth=2.5, linestyle="none", zorder=5, clip_on=False)
        target, coords = (fx, fy), "data"
    else:  # in eval: point at its eval mark on the top edge
        target, coords = (fx, 1.0), transforms.blended_transform_factory(heat.transData, heat.transAxes)
    return heat.annotate(first["text"], xy=target, xycoords=coords, xytext=(fx, 1.0), textcoords=above, ha=ha,
                         arrowprops=dict(arrowstyle="->", color="red", lw=1.5, shrinkB=8 if fy is not None else 2),
                         **style)


def _keep_over(heat, label):
    """Slide the first nan/inf's label sideways to lie over the heatmap's width (it may have
    stuck out over the module names); its arrow still points at the cell. Needs the layout done."""
    if label is None:
        return
    box, span = label.get_window_extent(), heat.get_window_extent()
    shift = span.x0 - box.x0 if box.x0 < span.x0 else span.x1 - box.x1 if box.x1 > span.x1 else 0.0
    if shift and box.width <= span.width:
        x0, x1 = heat.get_xlim()
        x, y = label.xyann
        label.xyann = (x + shift * (x1 - x0) / span.width, y)


def draw(summary, path, size=None, curves=5, title_source=""):
    """Write the picture of ``summary`` (a ``summary.Summary``) to ``path``; returns (width, height) px."""
    picture = Picture(summary, curves)
    modules = picture.modules
    rows = len(modules)
    grid = np.array([[np.nan if v is None else v for v in row] for row in picture.values], dtype=float)
    grid = grid.reshape(rows, len(picture.columns))
    shares = np.array([[np.nan if v is None else v for v in row] for row in picture.shares], dtype=float)
    shares = shares.reshape(rows, len(picture.columns))
    kinds = np.array(picture.kinds, dtype=object).reshape(rows, len(picture.columns))
    underflow = picture.underflow[:max(curves, 0)]
    hottest = picture.curves

    heat_in = max(3.0, min(0.17 * rows + 1.0, 26.0))
    if size is None:
        fig_w, fig_h = 14.0, None
    else:
        fig_w, fig_h = size[0] / DPI, size[1] / DPI
        # a small picture keeps the panels it has room for (about 2.5 inches each), from the top
        room = max(0, int((fig_h - 4.5) // 2.5))
        hottest = hottest if room >= 1 else []
        underflow = underflow if room >= 1 + bool(hottest) else []
    # the heatmap (its key under it: never over a cell), the curves, the underflow panel
    ratios = [heat_in] + ([3.4] if hottest else []) + ([2.8] if underflow else [])
    if fig_h is None:
        fig_h = sum(ratios) + 2.6
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=DPI, layout="constrained")
    axes = list(fig.subplots(len(ratios), 1, gridspec_kw={"height_ratios": ratios}, squeeze=False)[:, 0])
    heat = axes.pop(0)
    curve_ax = axes.pop(0) if hottest else None
    under_ax = axes.pop(0) if underflow else None

    (x_lo, x_hi), bar, first_label = _draw_heatmap(fig, heat, picture, summary, shares, kinds)
    _draw_key(bar, picture, fig_w)
    _draw_title(fig, picture, title_source, fig_w)
    ends = []  # (axes, [(x, y, text, colour)]): labelled once the layout is known
    if curve_ax is not None:
        ends.append((curve_ax, _draw_curves(curve_ax, picture, hottest, grid)))
    if under_ax is not None:
        ends.append((under_ax, _draw_underflow(under_ax, underflow)))
    for ax in (curve_ax, under_ax):
        if ax is not None:
            _finish_panel(ax, picture, (x_lo, x_hi))
    _place_end_labels(fig, heat, first_label, ends)
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)
    return int(round(fig_w * DPI)), int(round(fig_h * DPI))


def _draw_heatmap(fig, heat, picture, summary, grid, kinds):
    """The heatmap of ``grid`` (each cell's headroom as a share of its dtype's): layers from the
    back (not recorded) to the front (nan/inf), its axes and the colour bar under it. Returns the x
    range, the colour bar and the first nan/inf's label."""
    modules, width = picture.modules, picture.width
    rows = len(modules)
    x = _edges([c * width for c in picture.columns], width) if picture.columns else [0, 1]
    x_lo, x_hi = x[0], x[-1]
    if picture.eval_x:
        x_lo, x_hi = min(x_lo, picture.eval_x[0] - width / 2), max(x_hi, picture.eval_x[-1] + width / 2)
    y = np.arange(rows + 1) - 0.5
    _flat_cells(heat, x, y, grid, kinds, ((ALL_ZERO, ALL_ZERO_COLOR), (INTEGER_ONLY, INTEGER_COLOR)))
    mesh = heat.pcolormesh(x, y, np.ma.masked_invalid(100 * grid), cmap=plt.get_cmap("RdYlBu"),
                           norm=colors.Normalize(vmin=0.0, vmax=100.0), shading="flat")
    bad = kinds == NONFINITE
    if bad.any():
        heat.pcolormesh(x, y, np.ma.masked_where(~bad, np.ones_like(grid)), shading="flat",
                        cmap=colors.ListedColormap([NONFINITE_COLOR]))
    heat.set_xlim(x_lo, x_hi)
    heat.set_ylim(rows - 0.5, -0.5)  # first module at the top
    labels = modules
    every = max(1, math.ceil(rows / MAX_LABELS))
    heat.set_yticks(range(0, rows, every))
    heat.set_yticklabels(labels[::every], fontsize=7 if rows > 30 else 8)
    heat.set_ylabel("module (in the order it first appears in the log)" if not summary.modules_dropped
                    else f"the {rows} modules closest to their limit (in the order they first appear)")
    heat.set_xlabel(picture.xlabel)
    # the key under the heatmap: the colour bar at the left, the legend at its right
    bar = fig.colorbar(mesh, ax=heat, location="bottom", shrink=0.32, aspect=22, anchor=(0.0, 1.0),
                       extend="max", extendfrac=0.03)
    bar.set_label("headroom, in % of the dtype's own at 1.0 (16 bits in float16, 128 in float32)\n"
                  "0 = overflow, red = close to it for that dtype", fontsize=9)
    if picture.eval_x:  # in the margin above the top edge, never over a cell
        mark = transforms.offset_copy(transforms.blended_transform_factory(heat.transData, heat.transAxes),
                                      fig=fig, y=5, units="points")
        heat.plot(picture.eval_x, [1.0] * len(picture.eval_x), transform=mark, marker="v", markersize=6,
                  color=EVAL_COLOR, linestyle="none", clip_on=False)
    first_label = _first_label(fig, heat, picture, (x_lo, x_hi))

    return (x_lo, x_hi), bar, first_label


def _draw_key(bar, picture, fig_w):
    """The legend, at the colour bar's right."""
    legend = [
        patches.Patch(label="not recorded", **NOT_RECORDED_HATCH),
        patches.Patch(facecolor=ALL_ZERO_COLOR, label="all zero (floating point)"),
        patches.Patch(facecolor=INTEGER_COLOR, label="integer / bool only (no headroom)"),
        patches.Patch(facecolor=NONFINITE_COLOR, label="nan/inf recorded"),
    ]
    if picture.first is not None and picture.first["row"] is not None:
        legend.append(plt.Line2D([], [], marker="o", color="red", markerfacecolor="none", linestyle="none",
                                 markersize=9, markeredgewidth=2, label="first nan/inf"))
    if picture.eval_x:
        legend.append(plt.Line2D([], [], marker="v", color=EVAL_COLOR, linestyle="none", markersize=7,
                                 label="eval ran here (not in the cells)"))
    columns = max(1, min(3, int((fig_w * 0.66 - 0.6) / 2.7)))  # a column of the legend: about 2.7 inches
    bar.ax.legend(handles=legend, loc="center left", bbox_to_anchor=(1.12, 0.0), ncol=columns, fontsize=9,
                  frameon=False, handlelength=2.2, handleheight=1.2)


def _draw_title(fig, picture, title_source, fig_w):
    title = "Headroom before overflow, per module and " + (
        "optimizer step" if picture.unit == "optimizer" else "batch")
    if title_source:
        title += f" — {label(title_source, 2 * LABEL_CHARS)}"
    explained = ("headroom = log2(largest finite value of the dtype / largest |value| seen): "
                 "each bit lost is a doubling toward inf")
    chars = max(40, int(fig_w * DPI / 8))  # what fits on a line at 11 points
    fig.suptitle("\n".join(textwrap.wrap(title, chars) + textwrap.wrap(explained, chars)), fontsize=11)


def _draw_curves(ax, picture, hottest, grid):
    """The headroom curves of the modules closest to overflow; returns their end labels."""
    centres = np.array(picture.centres, dtype=float)
    labelled = []
    for k, (row, text) in enumerate(hottest):
        values = grid[row]
        keep = np.isfinite(values)
        if not keep.any():
            continue
        colour = f"C{k % 10}"
        ax.plot(centres[keep], values[keep], marker="." if keep.sum() < 60 else None, linewidth=1.6,
                color=colour, linestyle=LINESTYLES[k % len(LINESTYLES)])
        last = np.flatnonzero(keep)[-1]
        labelled.append((centres[last], values[last], text, colour))
    ax.axhline(0, color="red", linewidth=1, linestyle="--")
    ax.set_ylim(bottom=-0.5)
    ax.set_ylabel("headroom (bits below\nthe dtype's largest value)\n0 = overflow (red line)")
    ax.set_title(f"The {len(hottest)} modules that came closest to overflow (lowest headroom), "
                 f"labelled at their ends", fontsize=10)
    return labelled


def _draw_underflow(ax, underflow):
    """The underflow hot spots' subnormal and zero fractions; returns their end labels."""
    labelled = []
    for k, ((module, entry), xs, subs, zeros) in enumerate(underflow):
        colour = f"C{(k + 5) % 10}"  # not the headroom curves' colours: other things
        name = f"{label(module, 32) if module else '(model)'} {label(entry, 24)}"
        xs = np.array(xs, dtype=float)
        subs = 100 * np.array(subs, dtype=float)
        zeros = 100 * np.array(zeros, dtype=float)
        ax.plot(xs, subs, color=colour, linewidth=1.6, marker="." if len(xs) < 60 else None)
        labelled.append((xs[-1], subs[-1], f"{name}: subnormal", colour))
        if zeros.any():
            ax.plot(xs, zeros, color=colour, linewidth=1.4, linestyle="--")
            labelled.append((xs[-1], zeros[-1], f"{name}: zero", colour))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("% of the entry's values")
    ax.set_title(f"Underflow hot spots: the {len(underflow)} entries with the most subnormal values — "
                 f"fraction subnormal (solid) and zero (dashed), the largest in each column", fontsize=10)
    return labelled


def _finish_panel(ax, picture, x_range):
    ax.set_xlim(*x_range)
    ax.set_xlabel(picture.xlabel.split(";")[0])
    ax.grid(True, alpha=0.3)
    first = picture.first
    if first is not None and first["x"] is not None:
        ax.axvline(first["x"], color="red", linewidth=1, linestyle=":")


def _place_end_labels(fig, heat, first_label, ends):
    # the labels at the curves' ends: placed with their final widths so the layout makes room for
    # them, then moved apart once the axes' height (what a gap in points is in axes units) is known
    provisional = []
    for ax, labelled in ends:
        for x_end, y_end, text, colour in labelled:
            provisional.append(ax.annotate(text, xy=(x_end, y_end), xytext=(1.012, 0.5),
                                           textcoords="axes fraction", fontsize=LABEL_FONT, va="center",
                                           annotation_clip=False))
    fig.draw_without_rendering()
    for artist in provisional:
        artist.remove()
    fig.set_layout_engine("none")  # keep the layout that made room for the labels
    _keep_over(heat, first_label)
    for ax, labelled in ends:
        _label_ends(fig, ax, labelled)
