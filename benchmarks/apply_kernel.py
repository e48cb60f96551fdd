"""The decode-and-apply kernel alone (deltastore/_native/apply.c), one thread: the changed chunks of
one real version applied from memory, two builds of the extension side by side in one process.

The workload is ``tf265m-rl-1e-6`` (531 MB of bf16, AdamW at lr 1e-6); the segments are steps
A -> B of it, cut into the chunks a publisher writes (``tensors.spec_for``) and encoded with the
codec, their sections decompressed once up front. Each pass applies every segment to one
531 MB target (forward and undo alternately, so the target returns to step A), with the
digests a pull asks for (``--want``: 2 after only, 3 before and after). Builds are interleaved
pass by pass, so both see the same machine load; the figure is the median of ``--reps`` passes
of thread CPU time. Copy the old build aside first, e.g.::

    cp deltastore/_native*.so /tmp/old_native.so     # before the change
    python -m benchmarks.apply_kernel /tmp/old_native.so deltastore/_native*.so --reps 11

Correctness is checked once per build before timing (the target's XXH3-128 after a forward and
an undo pass).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

from benchmarks.workload import load_step
from deltastore.codec.delta import encode_delta
from deltastore.codec.container import read_header
from deltastore.codec.planes import decode_sections
from deltastore.layout.tensors import spec_for

WORKLOAD = "tf265m-rl-1e-6"
KIND = {"add-sparse/1": 0, "add-dense/1": 1}  # apply.c K_*


def load_build(path: str):
    """The extension module built at ``path`` (any file name), loaded beside any other build."""
    loader = importlib.machinery.ExtensionFileLoader("deltastore._native", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("deltastore._native", path, loader=loader))
    loader.exec_module(module)
    return module


def flat_bits(state: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1) for t in state.values()])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", help="paths of _native .so files to compare")
    ap.add_argument("--steps", type=int, nargs=2, default=(3, 4), metavar=("A", "B"))
    ap.add_argument("--reps", type=int, default=11, help="timed passes per build (median reported)")
    ap.add_argument("--want", type=int, default=2, help="digests: 2 after only, 3 before and after, 0 none")
    args = ap.parse_args(argv)

    a, b = (load_step(WORKLOAD, s) for s in args.steps)
    target, goal = flat_bits(a), xxhash.xxh3_128_hexdigest(flat_bits(b))
    start = xxhash.xxh3_128_hexdigest(target)
    jobs, off, changes = [], 0, 0
    for name, ta in a.items():
        old, new = flat_bits({name: ta}), flat_bits({name: b[name]})
        spec = spec_for(name, ta)
        per = spec.chunk_rows * spec.row_elems
        for s in range(0, old.size, per):
            e = min(s + per, old.size)
            seg = encode_delta(old[s:e], new[s:e])
            if seg is None:
                continue
            h = read_header(seg.data, seg.codec, 2, e - s)
            changes += h.n_changed
            jobs.append((target[off + s : off + e], KIND[seg.codec], h.width, h.gap_width,
                         tuple(decode_sections(seg.data, h)), h.n_changed, h.n_gap_escaped, h.n_escaped))
        off += old.size
    del a, b
    print(f"{WORKLOAD} steps {args.steps[0]}->{args.steps[1]}: {len(jobs)} segments, "
          f"{changes} changes in {target.size} elements, want={args.want}")

    def one_pass(module, inverse: bool) -> float:
        apply_segment = module.apply_segment
        t0 = time.thread_time()
        for view, *rest in jobs:
            if apply_segment(view, *rest, inverse, args.want)[0]:
                raise SystemExit("a segment was refused")
        return time.thread_time() - t0

    builds = [load_build(p) for p in args.builds]
    for path, module in zip(args.builds, builds):
        one_pass(module, False)
        ok = xxhash.xxh3_128_hexdigest(target) == goal
        one_pass(module, True)
        if not ok or xxhash.xxh3_128_hexdigest(target) != start:
            raise SystemExit(f"{path} does not reproduce step {args.steps[1]}")
    times: dict[str, list[float]] = {p: [] for p in args.builds}
    for r in range(args.reps):
        for path, module in zip(args.builds, builds):
            times[path].append(one_pass(module, r % 2 == 1) * 1e3)
    if args.reps % 2:
        one_pass(builds[0], True)
    for path in args.builds:
        t = times[path]
        print(f"{Path(path).name}: median {statistics.median(t):.1f} ms, min {min(t):.1f} "
              f"({statistics.median(t) * 1e6 / changes:.1f} ns per change); passes {' '.join(f'{x:.0f}' for x in t)}")


if __name__ == "__main__":
    main()
