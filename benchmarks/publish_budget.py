"""Where a delta publish's time goes, stage by stage, as ratios to a memory copy.

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

Two store writes are timed per rep beside the stages, as references (not stages): the bytes a
publish stores (``bytes_stored``) written in the pack writer's pieces into a **new** file next
to the store (fresh page-cache pages, as every pack write takes) and **rewritten** over an
existing file of that size (pages already there). Their difference is what allocating fresh
pages costs this machine per publish: on a guest whose hypervisor reclaims freed memory (virtio
free page reporting) a page not touched for a while costs a fault on the host as well
(design 006).

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
WRITES = ("write_fresh", "write_reused")  # references timed beside the stages (module doc)


def _tmp_root() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def _write(path: Path, payload: bytes, piece: int) -> Dur:
    """Write ``payload`` to ``path`` (created, or overwritten in place) in ``piece``-byte
    writes and fsync it, as a local store's streamed pack write does."""
    t0 = _now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        view = memoryview(payload)
        for off in range(0, len(view), piece):
            os.pwrite(fd, view[off:off + piece], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return _since(t0)


def budget(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], *, reps: int, threads: int) -> dict:
    """Time every stage ``reps`` times, interleaved; the step ``old`` → ``new``."""
    from deltastore import Publisher
    from deltastore.write.policy import WriterPolicy
    from deltastore._util import kernels
    from deltastore.codec.delta import DIGEST_IF_CHANGED, DIGEST_NONE
    from deltastore.write.encode import STREAM_WRITE_BYTES, LayoutWorks, encode_chunk
    from deltastore.layout.tensors import CHUNK_TARGET_BYTES, bits, spec_for

    torch.set_num_threads(threads)
    native = kernels.encode_add is not None
    with tempfile.TemporaryDirectory(prefix="ds-budget-", dir=_tmp_root()) as root, \
            Publisher(str(Path(root) / "store"), writer_policy=WriterPolicy(threads=threads)) as pub, \
            ThreadPoolExecutor(threads, thread_name_prefix="budget") as pool:
        state = {k: v.clone() for k, v in old.items()}  # the trainer's tensors
        dst = {k: torch.zeros_like(v) for k, v in old.items()}  # the copy's destination
        pub.publish(state, step=0)  # the anchor: the publisher's reference is now ``old``
        # The staged encode: the publisher's chunks (an ungrouped layout: spec_for with the
        # publisher's settings, checked below against what the publish stores), its jobs.
        work = LayoutWorks()({n: spec_for(n, t, CHUNK_TARGET_BYTES, pub.layout_policy.slice_align) for n, t in old.items()})
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
                        digest = DIGEST_IF_CHANGED if stage == "digest" else DIGEST_NONE
                        changed += kernels.encode_add(o, n, o.itemsize, True, digest)[0]
                return changed, stored

            t0 = _now()
            results = list(pool.map(job, work.jobs))
            return _since(t0), sum(c for c, _ in results), sum(s for _, s in results)

        times: dict[str, list[Dur]] = {s: [] for s in STAGES + WRITES}
        check: dict[str, set] = {"changed": set(), "stored": set()}
        step = 0
        payload = b""  # bytes_stored bytes, made at the first rep (the writes' references)
        for rep in range(reps):
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
                    if not payload:
                        payload = os.urandom(info.bytes_stored)
                        _write(Path(root) / "reused", payload, STREAM_WRITE_BYTES)  # its pages, once
            times["write_fresh"].append(_write(Path(root) / f"fresh-{rep}", payload, STREAM_WRITE_BYTES))
            times["write_reused"].append(_write(Path(root) / "reused", payload, STREAM_WRITE_BYTES))
    if len(check["changed"]) != 1 or len(check["stored"]) != 1:
        raise AssertionError(f"the staged encode and the publish disagree: elements changed {sorted(check['changed'])}, "
                             f"bytes stored {sorted(check['stored'])}")
    out: dict = {"native": native, "threads": threads, "reps": reps,
                 "model_bytes": sum(v.numel() * v.element_size() for v in old.values()),
                 "elements_changed": check["changed"].pop(), "bytes_stored": check["stored"].pop(), "stages": {}}
    copy = times["copy"]
    out["writes"] = {}
    for stage in STAGES + WRITES:
        ts = times[stage]
        if not ts:
            continue
        out["writes" if stage in WRITES else "stages"][stage] = {
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
    if res.get("writes"):
        lines += ["", f"References (not stages): the {res['bytes_stored']:,} stored bytes written to the store's "
                  "file system, as the pack writes are.", "",
                  "| write | ms (wall / CPU, median) | / copy (wall) | / copy (CPU) |", "|---|---|---|---|"]
        for name, label in (("write_fresh", "into a new file (fresh pages)"), ("write_reused", "over an existing file")):
            w = res["writes"][name]
            lines.append(f"| {label} | {w['median_ms']:.1f} / {w['median_cpu_ms']:.1f} | {w['over_copy']:.2f} | "
                         f"{w['over_copy_cpu']:.2f} |")
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
