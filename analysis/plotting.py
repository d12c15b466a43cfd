"""The plotting helpers every figure of analysis/ shares; the one place that picks matplotlib's backend.

Agg (no display) is set here, once, before pyplot is imported: a module that draws imports `plt` from
here, never matplotlib.pyplot itself, so no other file calls matplotlib.use.

PNGs are written compact (`save_png`): at DPI dots per inch, then reduced to an adaptive palette of at
most PALETTE_COLORS colors without dithering, saved with zlib's best compression and recompressed
losslessly by oxipng. A figure of flat lines, bands and text has few distinct colors outside its
anti-aliased edges, so the image keeps every line's color: re-encoded this way (from 256 colors, without
oxipng), the 234 committed figures went from 20.6 MB to 14.2 MB, and a report committed under
docs/results/ stays within its budget (tests/unit/analysis/test_committed_reports.py).
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import oxipng  # noqa: E402
from PIL import Image  # noqa: E402  (a matplotlib dependency)

__all__ = ["DPI", "MAX_GROUP_PANELS", "PALETTE_COLORS", "band_plot", "finish", "group_colors", "plt", "save_png"]

DPI = 100
PALETTE_COLORS = 64
MAX_GROUP_PANELS = 8
"""A figure with one panel per group draws them up to this many groups; above it, one faceted figure
(one panel per quantity, one line per group) whose size does not grow with the group count."""


def group_colors(labels) -> dict[str, tuple]:
    """One color per label, in order (tab10 up to 10 labels, tab20 cycled above), the same in every figure."""
    labels = list(labels)
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def band_plot(ax, x, mean, lo, hi, color, label, raw=None) -> None:
    """Mean line with its CI band (error bars for a single point); `raw`: the unsmoothed mean, drawn faint."""
    if raw is not None:
        ax.plot(x, raw, color=color, alpha=0.25, linewidth=1)
    ax.plot(x, mean, color=color, label=label, marker="." if len(x) < 30 else None)
    if len(x) > 1:
        ax.fill_between(x, lo, hi, color=color, alpha=0.2, linewidth=0)
    else:
        ax.errorbar(x, mean, yerr=[mean - lo, hi - mean], color=color, capsize=3)


def save_png(fig, path: Path) -> Path:
    """Save `fig` as a palette PNG at DPI (module docstring) and close it; returns `path`."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    buf.seek(0)
    with Image.open(buf) as image:
        rgb = image.convert("RGB")
    rgb.quantize(PALETTE_COLORS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, format="PNG", optimize=True
    )
    oxipng.optimize(path, level=2)
    return path


def finish(fig, axes, path: Path, title: str) -> Path:
    """Title, layout and one legend below the figure holding every labelled artist of every panel (each
    label once, first panel first); save (save_png) and close."""
    by_label = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            by_label.setdefault(label, handle)
    handles, labels = list(by_label.values()), list(by_label)
    fig.suptitle(title)
    fig.tight_layout()
    if handles:
        fig.legend(
            handles,
            labels,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=min(3, len(labels)),
            fontsize="small",
            frameon=False,
        )
    return save_png(fig, path)
