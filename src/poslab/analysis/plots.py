"""Figures and number files, written next to a run: DIR/analysis/<kind>.json and <kind>*.png.

matplotlib runs on the Agg backend (no display); it is imported on the first figure, not with the
command line. Every file is written to a temporary sibling and renamed into place, so a crash never
leaves half a figure or half a JSON behind.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from poslab.files import atomic_write, atomic_write_text


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _clean(value: Any) -> Any:
    """JSON cannot hold NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, data: dict) -> Path:
    text = json.dumps(_clean(data), indent=2, allow_nan=False)
    return atomic_write_text(path, text + "\n")


def save_figure(fig, path: Path) -> Path:
    out = atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png"))
    _pyplot().close(fig)
    return out


# Series of an untrained copy are named "init X" beside the trained model's "trained X" (commands._models).
MODEL_LABELS = ("trained", "init")
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "x")


def _styles(names: list[str]) -> dict[str, dict]:
    """A distinct (colour, line style, marker) per series: "init X" dashed in the colour of "trained X", and
    past the colour cycle's length further line styles, then markers, so no two series look alike."""
    def split(name: str) -> tuple[int, str]:
        first, _, rest = name.partition(" ")
        return (MODEL_LABELS.index(first), rest) if first in MODEL_LABELS and rest else (0, name)

    rests = list(dict.fromkeys(split(n)[1] for n in names))
    colours = _pyplot().get_cmap("tab10" if len(rests) <= 10 else "tab20").colors
    styles = {}
    for name in names:
        model, rest = split(name)
        cycle, i = divmod(rests.index(rest), len(colours))
        styles[name] = {"color": colours[i], "linestyle": LINESTYLES[(model + 2 * cycle) % len(LINESTYLES)],
                        "marker": MARKERS[cycle // 2 % len(MARKERS)]}
    return styles


def _draw_lines(ax, series: dict[str, tuple[list, list]], logx: bool, hline: float | None) -> None:
    styles = _styles(list(series))
    for name, (x, y) in series.items():
        ax.plot(x, [math.nan if v is None else v for v in y], markersize=3, label=name, **styles[name])
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle=":", linewidth=1)
    if logx:
        ax.set_xscale("log")
    elif all(isinstance(v, int) for x, _ in series.values() for v in x):  # layers, positions: no 0.5 ticks
        ax.xaxis.set_major_locator(_pyplot().MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _legend(ax, count: int) -> None:
    """Inside the axes for a few series, beside them for more (where it would hide the lines)."""
    if count > 6:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    elif count > 1:
        ax.legend(fontsize=8)


def lines(path: Path, series: dict[str, tuple[list, list]], title: str, xlabel: str, ylabel: str,
          logx: bool = False, hline: float | None = None, ylim: tuple[float, float] | None = None) -> Path:
    """One line per named (x, y) series; ``ylim`` fixes the y range (a share: (0, 1), which a flat curve at 0
    would otherwise stretch to +-0.04)."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 4.2))
    _draw_lines(ax, series, logx, hline)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if ylim is not None:  # a little beyond the range, so that a line along its edge stays visible
        ax.set_ylim(ylim[0] - 0.02 * (ylim[1] - ylim[0]), ylim[1] + 0.02 * (ylim[1] - ylim[0]))
    _legend(ax, len(series))
    return save_figure(fig, path)


def line_panels(path: Path, panels: dict[str, dict[str, tuple[list, list]]], title: str, xlabel: str,
                ylabel: str, logy: bool = False) -> Path:
    """One panel of lines per key (e.g. per probe target), sharing axes' labels, in rows of up to three;
    ``logy``: a log y axis (for positive values; a None or NaN is a gap)."""
    k = len(panels)
    cols = max(1, min(k, 3))
    rows = math.ceil(k / cols)
    fig, axes = _pyplot().subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, series) in zip(axes.flat, panels.items()):
        _draw_lines(ax, series, False, None)
        if logy:
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        _legend(ax, len(series))
    for ax in list(axes.flat)[k:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def heatmap(path: Path, values, title: str, xlabel: str, ylabel: str, yticklabels: list[str] | None = None,
            xticklabels: list[str] | None = None, cmap: str = "viridis", vmin=None, vmax=None,
            annotations: list[list[str]] | None = None) -> Path:
    """values (rows, cols) as an image, row 0 on top."""
    fig, ax = _pyplot().subplots(figsize=(max(4.0, 0.35 * len(values[0]) + 2), max(3.0, 0.35 * len(values) + 1.5)))
    im = ax.imshow(values, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    fig.colorbar(im, ax=ax)
    if yticklabels is not None:
        ax.set_yticks(range(len(yticklabels)), yticklabels, fontsize=7)
    if xticklabels is not None:
        ax.set_xticks(range(len(xticklabels)), xticklabels, fontsize=7, rotation=90)
    if annotations is not None:
        for i, row in enumerate(annotations):
            for j, text in enumerate(row):
                ax.text(j, i, text, ha="center", va="center", fontsize=6, color="white")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return save_figure(fig, path)


def matrices(path: Path, mats: dict[str, Any], title: str, vmin: float = -1.0, vmax: float = 1.0) -> Path:
    """Square matrices side by side (e.g. cosine self-similarity per layer)."""
    k = len(mats)
    cols = min(k, 4)
    rows = math.ceil(k / cols)
    fig, axes = _pyplot().subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (name, m) in zip(axes.flat, mats.items()):
        im = ax.imshow(m, cmap="magma", vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=6)
        for axis in (ax.xaxis, ax.yaxis):  # positions: whole numbers, a few of them
            axis.set_major_locator(_pyplot().MaxNLocator(5, integer=True))
    for ax in list(axes.flat)[k:]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.suptitle(title)
    return save_figure(fig, path)


def bars(path: Path, groups: dict[str, dict[str, float]], title: str, ylabel: str) -> Path:
    """Grouped bars: one group per outer key, one bar per inner key."""
    names = list(groups)
    inner = list(dict.fromkeys(k for g in groups.values() for k in g))
    width = 0.8 / max(1, len(inner))
    fig, ax = _pyplot().subplots(figsize=(max(5.0, 1.2 * len(names) + 2), 4.0))
    for j, key in enumerate(inner):
        values = [groups[n].get(key) for n in names]
        ax.bar([i + (j - (len(inner) - 1) / 2) * width for i in range(len(names))],
               [math.nan if v is None else v for v in values], width, label=key)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set(title=title, ylabel=ylabel)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # never over a bar
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)
