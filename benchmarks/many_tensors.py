"""Many small tensors against the same bytes in a few large ones (design 007).

    python -m benchmarks.many_tensors [--scale 1.0] [--repeats 3] [--no-ungrouped] [--scan-ab]

Two bf16 models of the same bytes: 20,000 tensors of 4,096 elements ("many") and 20 tensors of
4,096,000 ("few"), 164 MB each at scale 1. Each step changes 1 % of the elements by ±1-2 ulp (an
Adam step at lr ~1e-6 after bf16 rounding). For each model, and for "many" with tensor groups on
and off, this measures the median over ``--repeats`` steps of:

- ``publish``: a delta ``Publisher.publish`` (change detection, encoding, hashing, packing, the
  manifest, the commit), through a ``memory://`` store;
- ``pull_into``: ``Subscriber.pull_into`` of that version into a target holding the previous one;
- ``pull``: a fresh ``Subscriber.pull`` of the latest version (manifests read and parsed, anchor
  and deltas applied);

and the PULSE-style baseline (benchmarks/peers.py: COO int32 positions + values, zstd-3, one
thread) encoding and applying the same step. ``gc_share`` is the fraction of each operation's
wall time spent in Python's cyclic garbage collector (gc.callbacks). All figures come from one
run, side by side; the ratios (many / few) are what the goal is stated in (≤ 3×).
Results go to benchmarks/results/many_tensors.{json,md}.

``--scan-ab`` also measures the grouped case with the native tensor scan (design 007) on and
off, alternating step by step in one process: wall time and the caller thread's CPU time
(``time.thread_time``, steadier than wall time on a shared machine) of each operation.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import peers
from deltastore.write.policy import AnchorPolicy, LayoutPolicy

RESULTS = Path(__file__).parent / "results"
#: The shapes: 20,000 × 4,096 vs 20 × 4,096,000 bf16 elements (same bytes).
MANY = (20_000, 4_096)
FEW = (20, 4_096_000)
#: Fraction of elements a step changes, and the largest step in ulps (Adam at lr ~1e-6, bf16).
CHANGED = 0.01
MAX_ULPS = 2


class _GCTimer:
    """Seconds spent in the cyclic GC while active (gc.callbacks start/stop pairs)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t

    def __enter__(self) -> _GCTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, GC seconds, result) of ``fn()``."""
    with _GCTimer() as g:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    return dt, g.seconds, out


def model(n: int, numel: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    flat = (torch.randn(n * numel, generator=g) * 0.02).to(torch.bfloat16)
    return {f"layer.{i}.weight": t.clone() for i, t in enumerate(flat.view(n, numel))}


def step(state: dict[str, torch.Tensor], rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with CHANGED of its elements moved by ±1..MAX_ULPS ulp."""
    out = {}
    for name, t in state.items():
        c = t.clone()
        b = c.view(torch.int16).numpy().reshape(-1)
        k = max(1, int(b.size * CHANGED))
        idx = rng.choice(b.size, size=k, replace=False) if b.size < 65536 else np.unique(rng.integers(0, b.size, size=k))
        delta = rng.integers(1, MAX_ULPS + 1, size=idx.size, dtype=np.int16) * rng.choice(np.array([-1, 1], np.int16), size=idx.size)
        b[idx] += delta
        out[name] = c
    return out


def bench_deltastore(state0: dict[str, torch.Tensor], steps: list[dict[str, torch.Tensor]], *, groups: bool) -> dict[str, Any]:
    from deltastore import Publisher, Subscriber

    url = f"memory://many-{uuid.uuid4().hex[:8]}"
    rows: dict[str, list[tuple[float, float]]] = {"publish": [], "pull_into": [], "pull": []}
    with Publisher(url, anchor_policy=AnchorPolicy(every=10_000), layout_policy=LayoutPolicy(group_small_tensors=groups)) as pub:
        pub.publish(state0)
        with Subscriber(url) as sub:
            target = sub.pull()
            units = len(sub.units())
            for s in steps:
                dt, g, _ = _timed(lambda s=s: pub.publish(s))
                rows["publish"].append((dt, g))
                dt, g, _ = _timed(lambda: sub.pull_into(target))
                rows["pull_into"].append((dt, g))
            assert all(torch.equal(target[n].view(torch.int16), steps[-1][n].view(torch.int16)) for n in target)
        for _ in steps:
            def fresh_pull() -> dict[str, torch.Tensor]:
                with Subscriber(url) as s2:
                    return s2.pull()

            dt, g, out = _timed(fresh_pull)
            rows["pull"].append((dt, g))
            del out
    return {"units": units, **{k: _summary(v) for k, v in rows.items()}}


def bench_pulse(state0: dict[str, torch.Tensor], steps: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    fmt = peers.FORMATS["pulse"]
    enc, app = [], []
    prev = state0
    target = {n: t.clone() for n, t in state0.items()}
    for s in steps:
        dt, g, blob = _timed(lambda s=s, prev=prev: fmt.encode(prev, s))
        enc.append((dt, g))
        dt, g, _ = _timed(lambda blob=blob: fmt.decode_apply(target, blob))
        app.append((dt, g))
        prev = s
    return {"publish": _summary(enc), "pull_into": _summary(app)}


def bench_scan_ab(state0: dict[str, torch.Tensor], steps: list[dict[str, torch.Tensor]], rounds: int) -> dict[str, Any]:
    """The grouped case with ``kernels.scan_tensors`` on and off, alternating step by step in
    one process (the same store, publisher and target): medians of wall and caller-thread CPU
    seconds per operation and mode."""
    from deltastore import Publisher, Subscriber
    from deltastore._util import kernels

    kernel = kernels.scan_tensors
    rows: dict[str, dict[str, list[float]]] = {m: {k: [] for k in ("publish", "publish_cpu", "pull_into", "pull_into_cpu")}
                                               for m in ("native", "python")}
    url = f"memory://scan-ab-{uuid.uuid4().hex[:8]}"
    try:
        with Publisher(url, anchor_policy=AnchorPolicy(every=10_000),
                       layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
            pub.publish(state0)
            with Subscriber(url) as sub:
                target = sub.pull()
                for i in range(2 * rounds + 2):  # the first two steps warm both modes up
                    mode = "native" if i % 2 == 0 else "python"
                    kernels.scan_tensors = kernel if mode == "native" else None
                    ops = (("publish", functools.partial(pub.publish, steps[i % len(steps)])),
                           ("pull_into", functools.partial(sub.pull_into, target)))
                    for op, fn in ops:
                        t0, c0 = time.perf_counter(), time.thread_time()
                        fn()
                        if i >= 2:
                            rows[mode][op].append(time.perf_counter() - t0)
                            rows[mode][op + "_cpu"].append(time.thread_time() - c0)
    finally:
        kernels.scan_tensors = kernel
    return {m: {k: statistics.median(v) for k, v in r.items()} for m, r in rows.items()}


def _summary(rows: list[tuple[float, float]]) -> dict[str, float]:
    return {"s": statistics.median(r[0] for r in rows), "gc_share": sum(r[1] for r in rows) / max(1e-12, sum(r[0] for r in rows))}


def bench_copy(state: dict[str, torch.Tensor]) -> float:
    """Seconds to copy the model once in memory (the reference the other goals use)."""
    return min(_timed(lambda: [t.clone() for t in state.values()])[0] for _ in range(3))


def run(scale: float, repeats: int, *, ungrouped: bool = True, scan_ab: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    shapes = {"many": (MANY[0], max(1, int(MANY[1] * scale))), "few": (FEW[0], max(1, int(FEW[1] * scale)))}
    out: dict[str, Any] = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads; "
                   f"load average {os.getloadavg()[0]:.2f} at the start",
        "scale": scale, "repeats": repeats, "changed": CHANGED, "shapes": shapes, "cases": {},
    }
    for name, (n, numel) in shapes.items():
        state0 = model(n, numel, seed=1)
        steps = [state0]
        for _ in range(repeats):
            steps.append(step(steps[-1], rng))
        steps = steps[1:]
        nbytes = sum(t.numel() * t.element_size() for t in state0.values())
        case: dict[str, Any] = {"tensors": n, "bytes": nbytes, "copy_s": bench_copy(state0)}
        if ungrouped or name == "few":  # "few" has no small tensors: grouping changes nothing there
            case["deltastore"] = bench_deltastore(state0, steps, groups=False)
        if name == "many":
            case["deltastore+groups"] = bench_deltastore(state0, steps, groups=True)
            if scan_ab:
                case["scan_ab"] = bench_scan_ab(state0, steps, rounds=max(5, repeats))
        case["pulse"] = bench_pulse(state0, steps)
        out["cases"][name] = case
        del state0, steps
        gc.collect()
    many, few = out["cases"]["many"], out["cases"]["few"]
    out["ratios"] = {
        f"{impl}/{op}": many[impl][op]["s"] / few[base][op]["s"]
        for impl, base in (("deltastore", "deltastore"), ("deltastore+groups", "deltastore"), ("pulse", "pulse"))
        for op in ("publish", "pull_into", "pull") if impl in many and op in many[impl]
    }
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"Many small tensors vs the same bytes in few large ones (`python -m benchmarks.many_tensors "
        f"--scale {r['scale']} --repeats {r['repeats']}`), bf16, {r['changed']:.0%} of elements changed by ±1-2 ulp "
        f"per step; {r['machine']}. Medians of {r['repeats']} steps, one run.",
        "",
        "| model | implementation | layout rows | publish s | pull_into s | pull s | GC share publish / pull_into / pull |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, case in r["cases"].items():
        label = f"{name}: {case['tensors']} × {case['bytes'] // case['tensors'] // 2} ({case['bytes'] / 1e6:.0f} MB, copy {case['copy_s'] * 1e3:.0f} ms)"
        for impl in ("deltastore", "deltastore+groups", "pulse"):
            if impl not in case:
                continue
            c = case[impl]
            cells = [f"{c[op]['s']:.3f}" if op in c else "–" for op in ("publish", "pull_into", "pull")]
            gcs = " / ".join(f"{c[op]['gc_share']:.0%}" if op in c else "–" for op in ("publish", "pull_into", "pull"))
            lines.append(f"| {label} | {impl} | {c.get('units', '–')} | {' | '.join(cells)} | {gcs} |")
    lines += ["", "| ratio many / few (goal ≤ 3) | value |", "|---|---|"]
    lines += [f"| {k} | {v:.1f}× |" for k, v in r["ratios"].items()]
    ab = r["cases"]["many"].get("scan_ab")
    if ab:
        lines += ["", "| many, grouped: tensor scan (alternating steps, medians, ms) | publish wall | publish caller CPU | pull_into wall | pull_into caller CPU |",
                  "|---|---|---|---|---|"]
        lines += [f"| {m} | " + " | ".join(f"{ab[m][k] * 1e3:.1f}" for k in ("publish", "publish_cpu", "pull_into", "pull_into_cpu")) + " |"
                  for m in ("native", "python")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="elements per tensor, relative to the default shapes")
    ap.add_argument("--repeats", type=int, default=3, help="delta steps measured per case")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for many_tensors.{json,md}")
    ap.add_argument("--no-ungrouped", action="store_true",
                    help="skip the many-tensor case without groups (the slowest part: ~1 min on a quiet machine)")
    ap.add_argument("--scan-ab", action="store_true",
                    help="also time the grouped case with the native tensor scan on and off, alternating (one process)")
    args = ap.parse_args()
    r = run(args.scale, args.repeats, ungrouped=not args.no_ungrouped, scan_ab=args.scan_ab)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "many_tensors.json").write_text(json.dumps(r, indent=1) + "\n")
    md = markdown(r)
    (args.out / "many_tensors.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
