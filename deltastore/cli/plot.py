"""``deltastore log URL --plot FILE.png``: what a store's history costs, as one picture.

Top panel: bytes each version stored (log scale), anchors and deltas in two colours, each
registered squash ``from → to`` as a horizontal bar over the versions it replaces. Bottom panel:
the fraction of elements each version changed. Anchors are marked by dashed lines across both.

matplotlib is an optional extra (``pip install 'deltastore-weights[plot]'``); it is imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Figure size in inches and resolution: readable on a laptop screen and in a pull request.
FIGURE_SIZE = (11.0, 6.5)
FIGURE_DPI = 120
#: Colours (colour-blind safe, Okabe-Ito): anchors, deltas, squashes, changed fraction.
COLOURS = {"anchor": "#E69F00", "delta": "#0072B2", "squash": "#009E73", "changed": "#CC79A7"}
#: Above this many versions, bars get no edge lines (they would be all edge).
EDGE_MAX_VERSIONS = 200


@dataclass(frozen=True)
class VersionPoint:
    """One version as the plot needs it."""

    version: int
    kind: str
    bytes_stored: int
    elements_changed: int
    elements_total: int


@dataclass(frozen=True)
class SquashPoint:
    """One registered squash: bytes that replace the deltas ``from_ + 1 … to``."""

    from_: int
    to: int
    bytes: int


def pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "deltastore log --plot needs matplotlib: pip install 'deltastore-weights[plot]' (or pip install matplotlib)"
        ) from e
    matplotlib.use("Agg")  # files only: never open a window or need a display
    import matplotlib.pyplot as plt

    return plt


def _size(n: float) -> str:
    """Decimal units: the log axis has its ticks at powers of ten, which read as 1 kB, 10 kB, ..."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def plot_history(points: Sequence[VersionPoint], squashes: Sequence[SquashPoint], path: str, *, title: str) -> None:
    """Draw ``points`` (and ``squashes``) into the PNG (or any matplotlib format) at ``path``.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
        OSError: ``path`` cannot be written.
    """
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=FIGURE_SIZE, dpi=FIGURE_DPI,
                                      gridspec_kw={"height_ratios": [2, 1]})
    edge = "white" if len(points) <= EDGE_MAX_VERSIONS else "none"
    for kind in ("anchor", "delta"):
        sel = [p for p in points if p.kind == kind]
        if sel:
            top.bar([p.version for p in sel], [max(p.bytes_stored, 1) for p in sel], width=0.8,
                    color=COLOURS[kind], edgecolor=edge, linewidth=0.5,
                    label=f"{kind} ({len(sel)}, {_size(sum(p.bytes_stored for p in sel))})")
    for i, s in enumerate(squashes):
        top.hlines(max(s.bytes, 1), s.from_ + 0.6, s.to + 0.4, colors=COLOURS["squash"], linewidth=3,
                   label=f"squash from→to ({len(squashes)}, {_size(sum(q.bytes for q in squashes))})" if i == 0 else None)
    anchors = [p.version for p in points if p.kind == "anchor"]
    for ax in (top, bottom):
        for v in anchors:
            ax.axvline(v, color=COLOURS["anchor"], linestyle="--", linewidth=0.8, alpha=0.6, zorder=0)
        ax.grid(axis="y", alpha=0.3)
    top.set_yscale("log")
    top.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _size(y)))
    top.set_ylabel("bytes stored")
    top.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, frameon=False)
    total = sum(p.bytes_stored for p in points) + sum(s.bytes for s in squashes)
    fig.suptitle(f"{title}: {len(points)} versions, {_size(total)} stored", x=0.01, ha="left")

    versions = [p.version for p in points]
    # Anchors change "everything" by definition: only deltas are drawn, so their scale shows.
    deltas = [p for p in points if p.kind != "anchor"]
    frac = [p.elements_changed / p.elements_total if p.elements_total else 0.0 for p in deltas]
    bottom.plot([p.version for p in deltas], frac, color=COLOURS["changed"], linestyle="none" if len(deltas) < 2 else "-",
                marker="o", markersize=3 if len(points) < 100 else 0, linewidth=1.2)
    bottom.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
    bottom.set_ylim(bottom=0, top=max(frac, default=0.01) * 1.15 or 0.01)
    bottom.set_ylabel("elements changed\n(deltas)")
    bottom.set_xlabel("version (dashed: anchors)")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    if points:
        bottom.set_xlim(min(versions) - 0.6, max(versions) + 0.6)
    fig.tight_layout()
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)


def points_of_store(store, check=None, *, since: int = 1) -> tuple[list[VersionPoint], list[SquashPoint]]:
    """The versions ``since`` … head of ``store`` (oldest first) and its registered squashes."""
    from deltastore.format.history import History

    return points_of_history(History(store, check), since=since)


def points_of_history(history, *, since: int = 1) -> tuple[list[VersionPoint], list[SquashPoint]]:
    """:func:`points_of_store` through a History already open (its checks and cached manifests)."""
    got = history.read_head()
    if got is None or got[0].manifest is None:
        return [], []
    head = got[0]
    top = history.head_manifest(head)
    assert top is not None
    chain = history.chain(*top, down_to=since)
    points = sorted(
        (VersionPoint(m.version, m.kind, m.stats.bytes_stored, m.stats.elements_changed, m.stats.elements_total)
         for _, m in chain),
        key=lambda p: p.version,
    )
    index = history.index(head)
    squashes = [SquashPoint(s.from_, s.to, s.bytes) for s in index.squashes] if index is not None else []
    return points, squashes
