"""What the column grid costs a whole worker (design 011 D10 step 6): the A/B that
``python -m benchmarks.scale --only grid`` runs.

Two arms on the same real workload, both ``slice_align=8``, one with
``column_slices=ROW_PARALLEL`` (:data:`GRID_ARMS`): each role (a publisher, then a whole worker)
in a fresh interpreter per arm, the arms interleaved; then both arms paired call by call in one
interpreter, which a shared machine's load disturbs less. Every worker is checked bit for bit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from benchmarks.rss import reset_peak, status_kb
from deltastore import Publisher, Subscriber
from deltastore.layout.select import ROW_PARALLEL
from deltastore.layout.tensors import bits
from deltastore.write.policy import AnchorPolicy, LayoutPolicy


def _states(steps: int, workload: str) -> list[dict[str, torch.Tensor]]:
    from benchmarks.workload import load_step

    return [load_step(workload, s) for s in range(steps + 1)]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[k].contiguous()), bits(b[k].contiguous())) for k in a)


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


#: The whole-worker A/B of the column grid (design 011 D10 step 6): both arms ``slice_align=8``,
#: one with ``column_slices=ROW_PARALLEL``.
GRID_ARMS = (("slice_align=8", None), ("slice_align=8 + grid", ROW_PARALLEL))


def _timed(fn: Any, model: int) -> tuple[Any, float, float, float]:
    """``fn()``, its wall time, the rise of peak RSS (VmHWM, restarted from the current RSS
    through /proc/self/clear_refs) above the RSS before it, in units of ``model`` bytes, and its
    CPU time (every thread of the process: what other jobs on a shared machine disturb least)."""
    reset_peak()
    before = status_kb("VmRSS")
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    dt, dc = time.perf_counter() - t, time.process_time() - c
    return out, dt, (status_kb("VmHWM") - before) * 1024 / model, dc


def _grid_publisher(workload: str, steps: int, url: str, cols: tuple[str, ...] | None) -> dict[str, Any]:
    """The A/B's publisher, in a fresh interpreter: an anchor, then a delta per step."""
    states = _states(steps, workload)
    model = _nbytes(states[0])
    out: dict[str, Any] = {"model_bytes": model}
    with Publisher(url, anchor_policy=AnchorPolicy(every=1000),
                   layout_policy=LayoutPolicy(slice_align=8, column_slices=cols)) as pub:
        _, out["anchor_s"], out["anchor_peak"], out["anchor_cpu_s"] = _timed(lambda: pub.publish(states[0]), model)
        pubs = [_timed(lambda s=s: pub.publish(s), model) for s in states[1:]]
    assert all(i.kind == "delta" for i, *_ in pubs)
    out.update(publish_s=statistics.median(t for _, t, _, _ in pubs), publish_peak=max(p for _, _, p, _ in pubs),
               publish_cpu_s=statistics.median(c for *_, c in pubs),
               delta_bytes=statistics.median(i.bytes_stored for i, *_ in pubs))
    return out


def _grid_worker(workload: str, steps: int, url: str) -> dict[str, Any]:
    """The A/B's whole worker, in a fresh interpreter: ``pull`` of the anchor, ``pull_into`` of
    each delta, ``pull`` of the last version (the anchor plus every delta); bit-exact."""
    states = _states(steps, workload)
    model = _nbytes(states[0])
    out: dict[str, Any] = {}
    with Subscriber(url) as sub:
        held, out["pull_s"], out["pull_peak"], out["pull_cpu_s"] = _timed(lambda: sub.pull(1), model)
        out["chunks"] = sum(u.n_chunks for u in sub.units().values())
        out["gridded"] = sum(u.chunk_cols > 0 for u in sub.units().values())
        intos = [_timed(lambda v=v: sub.pull_into(held, v), model) for v in range(2, len(states) + 1)]
        exact = _equal(held, states[-1])
        held.clear()  # the chain pull below allocates its own model
        last, out["pull_chain_s"], out["pull_chain_peak"], _ = _timed(lambda: sub.pull(len(states)), model)
        exact = exact and _equal(last, states[-1])
    out.update(pull_into_s=statistics.median(t for _, t, _, _ in intos), pull_into_peak=max(p for _, _, p, _ in intos),
               pull_into_cpu_s=statistics.median(c for *_, c in intos), bit_exact=exact)
    return out


def _grid_ab_arm(workload: str, steps: int, cols: tuple[str, ...] | None) -> dict[str, Any]:
    """One arm of the A/B: the publisher, then the worker, each in a fresh interpreter (no role
    inherits another's heap, so peaks compare) on a tmpfs store."""
    import shutil
    import tempfile

    ctx = mp.get_context("spawn")
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="scale-grid-")
    url = os.path.join(d, "store")
    try:
        with ctx.Pool(1) as pool:
            out = pool.apply(_grid_publisher, (workload, steps, url, cols))
        with ctx.Pool(1) as pool:
            out.update(pool.apply(_grid_worker, (workload, steps, url)))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _grid_paired(workload: str, steps: int, rounds: int) -> dict[str, Any]:
    """The A/B's times, paired: both arms in one interpreter, call by call (a publish of each
    arm per step, a ``pull_into`` of each per version, the order alternating), so that both
    calls of a pair see the same load on a shared machine; ``rounds`` fresh store pairs. Per
    figure: every call's wall and CPU seconds per arm, and the per-pair ratios grid / none."""
    import shutil
    import tempfile

    states = _states(steps, workload)
    labels = [label for label, _ in GRID_ARMS]
    calls: dict[str, dict[str, list[float]]] = {label: {} for label in labels}

    def clock(label: str, figure: str, fn: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        calls[label].setdefault(figure + "_s", []).append(time.perf_counter() - t)
        calls[label].setdefault(figure + "_cpu_s", []).append(time.process_time() - c)
        return out

    exact = True
    for rnd in range(rounds):
        root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="scale-grid-")
        urls = {label: os.path.join(root, str(i)) for i, label in enumerate(labels)}
        order = labels if rnd % 2 == 0 else labels[::-1]
        try:
            pubs = {label: Publisher(urls[label], anchor_policy=AnchorPolicy(every=1000),
                                     layout_policy=LayoutPolicy(slice_align=8, column_slices=cols))
                    for label, cols in GRID_ARMS}
            try:
                for i, s in enumerate(states):
                    for label in order if i % 2 == 0 else order[::-1]:
                        clock(label, "anchor" if i == 0 else "publish", partial(pubs[label].publish, s))
            finally:
                for pub in pubs.values():
                    pub.close()
            subs = {label: Subscriber(urls[label]) for label in labels}
            try:
                held = {label: clock(label, "pull", partial(subs[label].pull, 1)) for label in order}
                for v in range(2, len(states) + 1):
                    for label in order if v % 2 == 0 else order[::-1]:
                        clock(label, "pull_into", partial(subs[label].pull_into, held[label], v))
                exact = exact and all(_equal(h, states[-1]) for h in held.values())
            finally:
                for sub in subs.values():
                    sub.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    none, grid = labels
    ratios = {m: [g / n for g, n in zip(calls[grid][m], calls[none][m])] for m in calls[none]}
    return {"rounds": rounds, "calls": calls, "bit_exact": exact,
            "medians": {label: {m: statistics.median(v) for m, v in c.items()} for label, c in calls.items()},
            "ratio": {m: statistics.median(r) for m, r in ratios.items()},
            "ratio_quartiles": {m: [float(np.percentile(r, 25)), float(np.percentile(r, 75))] for m, r in ratios.items()},
            "pairs": {m: len(r) for m, r in ratios.items()}}


#: The A/B's figures: wall times (``_s``) and CPU times of every thread (``_cpu_s``) are
#: medians over a role's versions, peaks the largest rise of peak RSS over the role's calls,
#: in model units.
GRID_AB_METRICS = ("publish_s", "pull_into_s", "pull_s", "pull_chain_s", "anchor_s",
                   "publish_cpu_s", "pull_into_cpu_s", "pull_cpu_s", "anchor_cpu_s",
                   "publish_peak", "pull_into_peak", "pull_peak", "pull_chain_peak", "anchor_peak")


def bench_grid_ab(workload: str, steps: int, reps: int = 4, rounds: int = 3) -> dict[str, Any]:
    """What the column grid costs a whole worker (design 011 D10 step 6): GRID_ARMS interleaved
    ``reps`` times (the order alternating), each role in a fresh interpreter; per-arm
    medians of every GRID_AB_METRICS figure and the grid / none ratio of each (per repetition and
    the median of those); then the times paired call by call in one interpreter
    (:func:`_grid_paired`, ``rounds`` store pairs), which a shared machine's load disturbs less."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k, _ in GRID_ARMS}
    for rep in range(reps):
        for label, cols in GRID_ARMS if rep % 2 == 0 else GRID_ARMS[::-1]:
            r = _grid_ab_arm(workload, steps, cols)
            r["load_avg"] = os.getloadavg()[0]
            runs[label].append(r)
            print(f"grid A/B rep {rep} {label}: " + ", ".join(f"{m} {r[m]:.3f}" for m in GRID_AB_METRICS), flush=True)
    (none, _), (grid, _) = GRID_ARMS
    med = {k: {m: statistics.median(r[m] for r in rows) for m in (*GRID_AB_METRICS, "chunks", "gridded", "delta_bytes")}
           for k, rows in runs.items()}
    per_rep = {m: [g[m] / n[m] for g, n in zip(runs[grid], runs[none])] for m in GRID_AB_METRICS}
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        paired = pool.apply(_grid_paired, (workload, steps, rounds))
    print("grid A/B paired: " + ", ".join(f"{m} {r:.3f}" for m, r in paired["ratio"].items()), flush=True)
    return {"reps": reps, "steps": steps, "runs": runs, "medians": med, "paired": paired,
            "ratio_per_rep": per_rep, "ratio": {m: statistics.median(v) for m, v in per_rep.items()},
            "bit_exact": all(r["bit_exact"] for rows in runs.values() for r in rows)}


def grid_markdown(g: dict[str, Any]) -> list[str]:
    """The section of ``python -m benchmarks.scale``'s report on :func:`bench_grid_ab`'s result ``g``."""
    lines: list[str] = []
    (none, _), (grid, _) = GRID_ARMS
    lines += ["## What the column grid costs a whole worker (design 011 D10 step 6)", "",
              (f"Both arms `slice_align=8`; `{grid}` adds `column_slices=ROW_PARALLEL`. Local store on tmpfs, "
               f"the arms interleaved {g['reps']} times (order alternating), publisher and worker each in a fresh interpreter; "
               f"{g['steps']} delta versions per arm; bit-exact: {g['bit_exact']}. Times (wall `_s`, CPU of all threads `_cpu_s`): medians over the "
               "versions, then over repetitions; peaks: rise of peak RSS above the RSS before the call, "
               "in model units. Ratio: grid / none per repetition, median (range)."), "",
              f"| figure | {none} | {grid} | ratio |", "|---|---|---|---|"]
    for m in GRID_AB_METRICS:
        v = g["ratio_per_rep"][m]
        lines.append(f"| {m} | {g['medians'][none][m]:.3f} | {g['medians'][grid][m]:.3f} | "
                     f"{g['ratio'][m]:.2f} ({min(v):.2f}-{max(v):.2f}) |")
    for m in ("chunks", "gridded", "delta_bytes"):
        lines.append(f"| {m} | {g['medians'][none][m]:.0f} | {g['medians'][grid][m]:.0f} | |")
    if "paired" in g:
        pg = g["paired"]
        lines += ["", (f"Paired (both arms in one interpreter, call by call, order alternating; {pg['rounds']} "
                       f"store pairs; bit-exact: {pg['bit_exact']}): medians per arm, and the median (quartiles) "
                       "of the per-pair ratios grid / none."), "",
                  f"| figure | pairs | {none} | {grid} | ratio |", "|---|---|---|---|---|"]
        for m, r in pg["ratio"].items():
            q = pg["ratio_quartiles"][m]
            lines.append(f"| {m} | {pg['pairs'][m]} | {pg['medians'][none][m]:.3f} | {pg['medians'][grid][m]:.3f} | "
                         f"{r:.2f} ({q[0]:.2f}-{q[1]:.2f}) |")
    loads = [r["load_avg"] for rows in g["runs"].values() for r in rows]
    lines += ["", f"Load average after each role: {min(loads):.2f}-{max(loads):.2f}.", ""]
    return lines
