"""Where a delta publish's time goes, stage by stage, as ratios to a memory copy (issue 9).

``benchmarks.perf`` says how a delta publish compares with a copy of the model; this says what
the publish spends it on. One step of a workload (default: tf265m-rl-1e-6, step 3 against step
2, ~2 % of the weights changed) is encoded five ways, each adding one piece of the publish to
the one before, rep by rep in one process next to a copy (so every rep's stages share the
machine's state of the moment):

* **copy**: ``dst.copy_(src)`` of every tensor, torch on one thread and on ``--threads``, the
  faster (the denominator of ``benchmarks.perf``);
* **scan**: the native encode kernel on every chunk of the publisher's layout, on ``--threads``
  threads in the publisher's jobs: compare the reference with the new bits, emit the change
  planes, advance the reference (``digest`` off);
* **digest**: the same with the XXH3-128 of each changed chunk (what the kernel does in a
  publish);
* **segment**: ``encode.encode_chunk`` per chunk: the above, then the segment (zstd of the
  planes, header) and its SHA-256, which is what the publisher's encode threads do;
* **publish**: ``Publisher.publish`` of the step to a local store on tmpfs: the above plus the
  packs (appended, SHA-256, written as they fill), the chunk table, the manifest and the commit.

Each stage's figure is the median over reps of its time over the copy of the same rep (wall
and CPU time of all threads). The stage before it subtracted gives what that piece costs. The
staged encode is checked against the publish: the same elements changed and the same bytes
stored. Without the native kernels only ``copy``, ``segment`` (the numpy path) and ``publish``
run.

    python -m benchmarks.publish_budget [--workload NAME] [--step 3] [--reps 9] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from benchmarks.perf import Dur, _now, _paired_copy, _since

DEFAULT_WORKLOAD = "tf265m-rl-1e-6"
RESULTS = Path(__file__).resolve().parent / "results"
STAGES = ("copy", "scan", "digest", "segment", "publish")


def _tmp_root() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def budget(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], *, reps: int, threads: int) -> dict:
    """Time every stage ``reps`` times, interleaved; the step ``old`` → ``new``."""
    from deltastore import Publisher
    from deltastore.codec import _kernels
    from deltastore.codec.delta import _DIGEST_IF_CHANGED, _DIGEST_NONE
    from deltastore.encode import LayoutWorks, encode_chunk
    from deltastore.tensors import CHUNK_TARGET_BYTES, bits, spec_for

    torch.set_num_threads(threads)
    native = _kernels.encode_add is not None
    with tempfile.TemporaryDirectory(prefix="ds-budget-", dir=_tmp_root()) as root, \
            Publisher(str(Path(root) / "store"), threads=threads) as pub, \
            ThreadPoolExecutor(threads, thread_name_prefix="budget") as pool:
        state = {k: v.clone() for k, v in old.items()}  # the trainer's tensors
        dst = {k: torch.zeros_like(v) for k, v in old.items()}  # the copy's destination
        pub.publish(state, step=0)  # the anchor: the publisher's reference is now ``old``
        # The staged encode: the publisher's chunks (an ungrouped layout: spec_for with the
        # publisher's settings, checked below against what the publish stores), its jobs.
        work = LayoutWorks()({n: spec_for(n, t, CHUNK_TARGET_BYTES, pub.slice_align) for n, t in old.items()})
        floating = work.floating
        ref = {k: bits(v.clone()) for k, v in old.items()}
        old_bits = {k: bits(v) for k, v in old.items()}
        new_bits = {k: bits(v) for k, v in new.items()}

        def staged(stage: str) -> tuple[Dur, int, int]:
            for k, r in ref.items():  # the reference back at ``old`` (not timed)
                np.copyto(r, old_bits[k])

            def job(group: list) -> tuple[int, int]:
                changed = stored = 0
                for ti, ci, name, a, b in group:
                    o, n = ref[name][a:b], new_bits[name][a:b]
                    if stage == "segment":
                        enc = encode_chunk(ti, ci, n, o, "delta", floating[name])
                        if enc is not None and enc.delta is not None:
                            changed += enc.delta.n_changed
                            stored += len(enc.delta.data)
                    else:
                        digest = _DIGEST_IF_CHANGED if stage == "digest" else _DIGEST_NONE
                        changed += _kernels.encode_add(o, n, o.itemsize, True, digest)[0]
                return changed, stored

            t0 = _now()
            results = list(pool.map(job, work.jobs))
            return _since(t0), sum(c for c, _ in results), sum(s for _, s in results)

        times: dict[str, list[Dur]] = {s: [] for s in STAGES}
        check: dict[str, set] = {"changed": set(), "stored": set()}
        step = 0
        for _ in range(reps):
            times["copy"].append(_paired_copy(new, dst, threads))
            for stage in ("scan", "digest", "segment") if native else ("segment",):
                d, changed, stored = staged(stage)
                times[stage].append(d)
                check["changed"].add(changed)
                if stage == "segment":
                    check["stored"].add(stored)
            # the publish of ``new`` (timed), then back to ``old`` (not timed: the reference is
            # ``old`` again for the next rep)
            for src, timed in ((new, True), (old, False)):
                for k, v in src.items():
                    state[k].copy_(v)
                step += 1
                t0 = _now()
                info = pub.publish(state, step=step)
                if timed:
                    times["publish"].append(_since(t0))
                    check["changed"].add(info.elements_changed)
                    check["stored"].add(info.bytes_stored)
    if len(check["changed"]) != 1 or len(check["stored"]) != 1:
        raise AssertionError(f"the staged encode and the publish disagree: elements changed {sorted(check['changed'])}, "
                             f"bytes stored {sorted(check['stored'])}")
    out: dict = {"native": native, "threads": threads, "reps": reps,
                 "model_bytes": sum(v.numel() * v.element_size() for v in old.values()),
                 "elements_changed": check["changed"].pop(), "bytes_stored": check["stored"].pop(), "stages": {}}
    copy = times["copy"]
    for stage in STAGES:
        ts = times[stage]
        if not ts:
            continue
        out["stages"][stage] = {
            "wall_s": [float(t) for t in ts], "cpu_s": [t.cpu for t in ts],
            "median_ms": statistics.median(ts) * 1e3, "median_cpu_ms": statistics.median(t.cpu for t in ts) * 1e3,
            "over_copy": statistics.median(t / c for t, c in zip(ts, copy)),
            "over_copy_cpu": statistics.median(t.cpu / c.cpu for t, c in zip(ts, copy)),
        }
    return out


def markdown(res: dict) -> str:
    lines = [f"# Delta publish, stage by stage: {res['workload']} step {res['step']}, {res['threads']} threads, "
             f"{res['reps']} reps", "",
             f"Model {res['model_bytes'] / 1e6:.1f} MB; {res['elements_changed']:,} elements changed; "
             f"{res['bytes_stored']:,} bytes stored; native kernels: {'yes' if res['native'] else 'no'}.", "",
             "| stage | ms (wall / CPU, median) | / copy (wall) | / copy (CPU) | over the stage above (wall) |",
             "|---|---|---|---|---|"]
    prev = None
    for stage in STAGES:
        s = res["stages"].get(stage)
        if s is None:
            continue
        added = "" if prev is None else f"+{s['over_copy'] - prev:.2f}"
        lines.append(f"| {stage} | {s['median_ms']:.1f} / {s['median_cpu_ms']:.1f} | {s['over_copy']:.2f} | "
                     f"{s['over_copy_cpu']:.2f} | {added} |")
        prev = s["over_copy"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--step", type=int, default=3, help="the step published as a delta against step-1")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    parser.add_argument("--out", type=Path, default=None, help="results (.json, .md next to it)")
    args = parser.parse_args(argv)
    from benchmarks.workload import load_step

    threads = args.threads or len(os.sched_getaffinity(0))
    old, new = load_step(args.workload, args.step - 1), load_step(args.workload, args.step)
    res = {"workload": args.workload, "step": args.step, "load_avg_1m_at_start": os.getloadavg()[0],
           **budget(old, new, reps=args.reps, threads=threads)}
    out = args.out or RESULTS / "publish_budget.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"written: {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
