"""End-to-end throughput and memory of the real pipeline: Publisher.publish and
Subscriber.pull_into on every core, through a local store, each role in a fresh process.

    python -m benchmarks.pipeline --workload rl-1e-6

The codec table (``python -m benchmarks``) times each format's encode and decode on one
thread; this measures what a trainer and a worker actually spend per version: change
detection, encoding, hashing, packing and writing (publisher), and polling, fetching,
verifying, decoding, applying and checking digests (subscriber). Throughput is model bytes
per second of wall time; memory is the peak RSS above the interpreter's baseline, in units of
the model's size, read from VmHWM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.rss import reset_peak as _reset_peak
from benchmarks.rss import status_kb as _status_kb
from deltastore.write.policy import WriterPolicy


def _role(role: str, workload: str, url: str, threads: int) -> dict:
    import torch

    from safetensors import safe_open

    from benchmarks.workload import WORKLOADS, load_step
    from benchmarks.workload import step_path
    from deltastore import Publisher, Subscriber

    torch.set_num_threads(1)  # deltastore's own threads do the work
    steps = WORKLOADS[workload].steps
    baseline = _status_kb("VmRSS")
    first = load_step(workload, 0)
    model = sum(t.numel() * t.element_size() for t in first.values())
    times: list[float] = []
    peaks: list[int] = []
    if role == "publisher":
        state = {k: v.clone() for k, v in first.items()}  # the trainer's tensors, updated in place
        del first
        with Publisher(url, writer_policy=WriterPolicy(threads=threads)) as pub:
            pub.publish(state, step=0)
            first_peak = _status_kb("VmHWM")
            _reset_peak()
            for s in range(1, steps + 1):
                with safe_open(str(step_path(workload, s)), framework="pt") as f:
                    for k in f.keys():
                        state[k].copy_(f.get_tensor(k))  # in place, as an optimizer step would
                _reset_peak()  # the benchmark's own file reads are not the publisher's memory
                t0 = time.perf_counter()
                pub.publish(state, step=s)
                times.append(time.perf_counter() - t0)
                peaks.append(_status_kb("VmHWM"))
    else:
        del first
        with Subscriber(url, threads=threads) as sub:
            t0 = time.perf_counter()
            target = sub.pull(1)
            first_pull = time.perf_counter() - t0
            first_peak = _status_kb("VmHWM")
            _reset_peak()
            for v in range(2, steps + 2):
                _reset_peak()
                t0 = time.perf_counter()
                sub.pull_into(target, version=v)
                times.append(time.perf_counter() - t0)
                peaks.append(_status_kb("VmHWM"))
        times_first = first_pull
    peak = max(peaks)
    out = {
        "role": role,
        "model_bytes": model,
        "median_s": statistics.median(times),
        "gbps": model / statistics.median(times) / 1e9,
        "peak_over_model": (peak - baseline) * 1024 / model,
        "first_peak_over_model": (first_peak - baseline) * 1024 / model,
    }
    if role == "subscriber":
        out["first_pull_s"] = times_first
    return out


def scaling(matrices: int = 6, dim: int = 4096, steps: int = 4) -> None:
    """Throughput on large tensors, in one process: ``matrices`` dim×dim bf16 weights updated by
    real AdamW steps at lr 1e-6 on random gradients (a scaling check, not a realistic
    workload: it shows the per-tensor overhead that dominates MiniLM's many small tensors)."""
    import numpy as np
    import torch

    from deltastore import Publisher, Subscriber

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(dim, dim) * 0.02) for _ in range(matrices)]
    opt = torch.optim.AdamW(weights, lr=1e-6, weight_decay=0.0)

    def export() -> dict:
        return {f"w{i}": w.detach().bfloat16() for i, w in enumerate(weights)}

    states = [export()]
    for _ in range(steps):
        opt.zero_grad()
        for w in weights:
            w.grad = torch.randn_like(w)
        opt.step()
        states.append(export())
    model = sum(t.numel() * t.element_size() for t in states[0].values())
    print(f"scaling: {matrices} x {dim}x{dim} bf16 ({model / 1e6:.0f} MB), AdamW lr 1e-6, memory://")
    for threads in (1, len(os.sched_getaffinity(0))):
        state = {k: v.clone() for k, v in states[0].items()}
        url = f"memory://scaling-{threads}"
        with Publisher(url, writer_policy=WriterPolicy(threads=threads)) as pub, Subscriber(url, threads=threads) as sub:
            pub.publish(state)
            target = sub.pull()
            pub_t, sub_t = [], []
            for s in range(1, steps + 1):
                for k in state:
                    state[k].copy_(states[s][k])
                t0 = time.perf_counter()
                pub.publish(state)
                pub_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sub.pull_into(target)
                sub_t.append(time.perf_counter() - t0)
        print(f"  {threads} thread(s): publish {model / np.median(pub_t) / 1e9:.2f} GB/s, "
              f"pull_into {model / np.median(sub_t) / 1e9:.2f} GB/s of model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="rl-1e-6")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--scaling", action="store_true", help="also time six 4096x4096 bf16 matrices")
    parser.add_argument("--role", choices=["publisher", "subscriber"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        print(json.dumps(_role(args.role, args.workload, args.url, args.threads)))
        return 0
    from benchmarks.workload import ensure_workload

    ensure_workload(args.workload)
    with tempfile.TemporaryDirectory() as tmp:
        url = str(Path(tmp) / "store")
        rows = []
        for role in ("publisher", "subscriber"):
            cmd = [sys.executable, "-m", "benchmarks.pipeline", "--workload", args.workload,
                   "--threads", str(args.threads), "--role", role, "--url", url]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"workload {args.workload}, {args.threads} threads, model {rows[0]['model_bytes'] / 1e6:.1f} MB")
    for r in rows:
        if r["role"] == "publisher":
            what, first = "publish (delta)", "first publish (anchor)"
        else:
            what, first = "pull_into (one version)", f"first pull {r['first_pull_s']:.2f} s"
        print(f"  {what:<24} median {r['median_s'] * 1e3:7.1f} ms = {r['gbps']:5.2f} GB/s of model; "
              f"peak RSS {r['peak_over_model']:.2f}x model ({first}: {r['first_peak_over_model']:.2f}x)")
    if args.scaling:
        scaling()
    return 0


if __name__ == "__main__":
    sys.exit(main())
