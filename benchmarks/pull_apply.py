"""pull_into and stage of a ≥500 MB transformer-shaped model against a memory copy of it, with
the native decode-and-apply kernel and with the numpy path, side by side in one run
(SPEC §7, one-pass verification).

The workload is ``tf265m-rl-1e-6`` (531 MB of bf16, AdamW at lr 1e-6, ~2-4 % changed per step;
benchmarks/workload.py). Steps 0..N are published once into a local store; then, for each
version v = 2..N+1, the script times one memory copy of the model (numpy ``copyto`` of every
tensor, best of two), ``pull_into`` from v-1 to v, and ``stage`` from v-1 to v (then ``swap``),
once with the kernel and once with it switched off, in the same process. Wall-clock seconds
and CPU seconds (all threads) are both reported as ratios to the copy: on a shared machine the
CPU ratio is the steadier one.

    python -m benchmarks.pull_apply [--steps 5] [--threads 2] [--store DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.workload import load_step
from deltastore import Publisher, Subscriber
from deltastore.write.policy import WriterPolicy
from deltastore._util import kernels

WORKLOAD = "tf265m-rl-1e-6"


def _timed(f) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    f()
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="steps published after step 0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--store", help="store directory (reused if it exists; default: a temporary one)")
    args = ap.parse_args(argv)
    tmp = None
    if args.store is None:
        tmp = tempfile.TemporaryDirectory(prefix="ds-pull-apply-")
        args.store = str(Path(tmp.name) / "store")
    if not Path(args.store).exists():
        with Publisher(args.store, writer_policy=WriterPolicy(threads=args.threads)) as pub:
            for k in range(args.steps + 1):
                pub.publish(load_step(WORKLOAD, k))
    kernel = kernels.apply_segment
    paths = ["native", "numpy"] if kernel is not None else ["numpy"]
    if kernel is None:
        print("deltastore._native is not built: the numpy path only")

    subs = {(p, op): Subscriber(args.store, threads=args.threads) for p in paths for op in ("pull_into", "stage")}
    targets = {k: s.pull(version=1) for k, s in subs.items()}
    first = next(iter(targets.values()))
    src = [t.view(torch.int16).numpy().copy() if t.element_size() == 2 else t.numpy().copy() for t in first.values()]
    dst = [np.ones_like(a) for a in src]
    print(f"{WORKLOAD}: {sum(a.nbytes for a in src) / 1e6:.0f} MB, threads {args.threads}")

    def copy() -> None:
        for a, b in zip(src, dst):
            np.copyto(b, a)

    rows: dict[str, list[tuple[float, float]]] = {"copy": []}
    for v in range(2, args.steps + 2):
        rows["copy"].append(min((_timed(copy) for _ in range(2)), key=lambda x: x[0]))
        line = [f"v{v}: copy {rows['copy'][-1][0]:.3f}s"]
        for p in paths:
            kernels.apply_segment = kernel if p == "native" else None
            try:
                sub, tgt = subs[(p, "pull_into")], targets[(p, "pull_into")]
                rows.setdefault(f"pull_into {p}", []).append(_timed(lambda: sub.pull_into(tgt, version=v)))
                sub, tgt = subs[(p, "stage")], targets[(p, "stage")]
                staged = []
                rows.setdefault(f"stage {p}", []).append(_timed(lambda: staged.append(sub.stage(tgt, version=v))))
                sub.swap(staged[0], tgt)
            finally:
                kernels.apply_segment = kernel
            line += [f"{k} {rows[k][-1][0]:.3f}s" for k in (f"pull_into {p}", f"stage {p}")]
        print(", ".join(line), flush=True)

    want = load_step(WORKLOAD, args.steps)  # version steps + 1
    for k, t in targets.items():
        assert all(torch.equal(t[n].view(torch.int16), want[n].view(torch.int16)) for n in want), k

    wall = statistics.median(w for w, _ in rows["copy"])
    cpu = statistics.median(c for _, c in rows["copy"])
    print(f"median over versions, as a multiple of one memory copy ({wall:.3f}s wall, {cpu:.3f}s CPU):")
    for k, r in rows.items():
        if k != "copy":
            print(f"  {k:18s} wall {statistics.median(w for w, _ in r) / wall:5.2f}x   CPU {statistics.median(c for _, c in r) / cpu:5.2f}x")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
