"""The history benchmark's report (``python -m benchmarks.history``): markdown tables of a results
document, a sparkline and a plot of the store's size per version."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """Max over ``width`` buckets, scaled 0..max."""
    if not values:
        return ""
    step = max(1, -(-len(values) // width))
    buckets = [max(values[i:i + step]) for i in range(0, len(values), step)]
    top = max(buckets) or 1
    return "".join(SPARK[min(len(SPARK) - 1, int(b / top * (len(SPARK) - 1) + 0.5))] for b in buckets)


def plot(sizes: Sequence[int], gc_every: int, path: Path) -> bool:
    """A PNG of store size per version, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(range(1, len(sizes) + 1), [s / 1e6 for s in sizes], lw=1)
    for v in range(gc_every, len(sizes) + 1, gc_every):
        ax.axvline(v, color="grey", lw=0.3)
    ax.set_xlabel("version")
    ax.set_ylabel("store size (MB)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_svg(sizes: Sequence[int], gc_every: int, path: Path, *, width: int = 800, height: int = 300) -> None:
    """The same plot as :func:`plot` as a plain SVG (no plotting library needed): store size
    per version, a grey line at every GC."""
    pad_l, pad_b, pad_t, pad_r = 60, 30, 10, 10
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    n, top = len(sizes), max(sizes) or 1

    def x(v: float) -> float:
        return pad_l + (v - 1) / max(1, n - 1) * w

    def y(b: float) -> float:
        return pad_t + h - b / top * h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
             f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" fill="none" stroke="black" stroke-width="0.5"/>']
    parts += [f'<line x1="{x(v):.1f}" y1="{pad_t}" x2="{x(v):.1f}" y2="{pad_t + h}" stroke="#ccc" stroke-width="0.5"/>'
              for v in range(gc_every, n + 1, gc_every)]
    points = " ".join(f"{x(i + 1):.1f},{y(b):.1f}" for i, b in enumerate(sizes))
    parts.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="1"/>')
    for frac in (0, 0.5, 1):
        parts.append(f'<text x="{pad_l - 5}" y="{y(top * frac) + 4:.1f}" text-anchor="end">{top * frac / 1e6:.1f} MB</text>')
    for v in (1, n // 2, n):
        parts.append(f'<text x="{x(v):.1f}" y="{height - 10}" text-anchor="middle">{v}</text>')
    parts.append(f'<text x="{pad_l + w / 2:.1f}" y="{height - 0}" text-anchor="middle">version (GC every {gc_every})</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def _mb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def _r(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(res: dict[str, Any]) -> str:
    """Markdown tables of a results document."""
    out: list[str] = []
    out.append(f"revision {res.get('revision')}, {res.get('date')}, quick={res.get('quick')}")
    if res.get("catchup"):
        _catchup_tables(res, out)
    ret = res.get("retention")
    if ret:
        _retention_tables(ret, out)
    return "\n".join(out) + "\n"


def _catchup_tables(res: dict[str, Any], out: list[str]) -> None:
    out.append("")
    out.append("Catch-up: bytes a worker k versions behind fetched (every GET: HEAD, manifests, index, "
               "packs) against one squashed delta from its version to head.")
    out.append("")
    out.append("| workload | set | k | fetched | metadata (HEAD, manifests, index) | requests (manifest / all) | squash | "
               "fetched / squash | squash (offline) | fetched / offline | chain deltas / offline | bit-exact |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for w in res.get("catchup", []):
        for r in w["catchup"]:
            chain = r["chain_delta_bytes"] / r["squash_offline_bytes"] if r["squash_offline_bytes"] else None
            meta = sum(v for kk, v in r["fetched_by_kind"].items() if kk != "pack")
            out.append(f"| {w['workload']} | {r['set']} | {r['k']} | {_mb(r['fetched_bytes'])} | {_mb(meta)} | "
                       f"{r['manifest_requests']} / {r['requests']} | {_mb(r['squash_bytes'])} | {_r(r['ratio'])} | "
                       f"{_mb(r['squash_offline_bytes'])} | {_r(r['ratio_offline'])} | {_r(chain)} | "
                       f"{'yes' if r['bit_exact'] else 'NO'} |")
    out.append("")
    out.append("Bytes per delta version (medians over the delta versions; H0 = order-0 entropy estimate).")
    out.append("")
    out.append("| workload | versions | packs | manifest | H0 | packs / H0 | (packs + manifest) / H0 | "
               "manifest / packs | follower fetched / H0 | follower requests |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in res.get("catchup", []):
        b = w["bytes_per_version"]
        if not b.get("versions"):
            continue
        out.append(f"| {w['workload']} | {b['versions']} | {_mb(b['pack_bytes'])} | {_mb(b['manifest_bytes'])} | "
                   f"{_mb(b['h0_bytes'])} | {_r(b['pack_over_h0'], '{:.3f}')} | "
                   f"{_r(b['pack_manifest_over_h0'], '{:.3f}')} | {_r(100 * b['manifest_over_pack'], '{:.1f}%')} | "
                   f"{_r(b['fetched_over_h0'], '{:.3f}')} | {b['follower_requests']:.0f} |")


def _retention_tables(ret: dict[str, Any], out: list[str]) -> None:
    out.append("")
    gc = f"GC every {ret['gc_every']} (keep_last={ret['keep_last']}, grace 0)"
    out.append(f"Retention: {ret['versions']} versions of a {_mb(ret['model_bytes'])} model, {gc}, "
               f"{ret['seconds']:.0f} s.")
    if ret.get("aborted"):
        out.append("")
        out.append(f"**Stopped early**: {ret['aborted']}")
    out.append("")
    out.append(f"store size per version (max per bucket, 0..{_mb(ret['max_bytes'])}): "
               f"`{sparkline(ret['sizes'])}`")
    out.append("")
    out.append(f"final {_mb(ret['final_bytes'])} in {ret['final_objects']} objects; max "
               f"{_mb(ret['max_bytes'])}; second half min/max {_mb(ret['min_bytes_second_half'])} / "
               f"{_mb(ret['max_bytes_second_half'])}; at versions " +
               ", ".join(f"{v}: {_mb(b)}" for v, b in ret["bytes_at"].items()))
    out.append("")
    out.append("| worker | outcome | bit-exact | notes |")
    out.append("|---|---|---|---|")
    labels = [f"lagging {ret['lag']} versions (heartbeats its version)",
              f"held version {ret['restart_from']}, resumed (same Subscriber)",
              f"held version {ret['restart_from']}, restarted (fresh Subscriber, kept tensors)"]
    for label, wk in zip(labels, ret["workers"]):
        notes = []
        if "checks" in wk:
            notes.append(f"{wk['checks']} lagged versions checked, {wk['mismatches']} mismatches, "
                         f"{wk['n_errors']} errors")
        if wk.get("pull_into_error"):
            notes.append(f"pull_into raised {wk['pull_into_error'][:120]}")
        if wk.get("fetched"):
            notes.append(f"fetched {_mb(wk['fetched']['total_bytes'])}")
        out.append(f"| {label} | {wk.get('outcome', wk.get('error'))} | "
                   f"{'yes' if wk.get('bit_exact') else 'NO'} | {'; '.join(notes)} |")
