"""Peak host memory of a TRL weight sync through deltastore, three ways, side by side.

    python -m benchmarks.trl_backend [--params 32e6] [--syncs 3]

Each way runs in a fresh interpreter: an fp32 model is built, then ``--syncs`` syncs each drain
a stream of ``(name, fresh fp32 tensor)`` as TRL's ``_streaming_iter`` yields under FSDP2
(``full_tensor()`` allocates a new tensor per parameter) and publish it as bf16 to a local
store, waiting for each commit. Reported: how far the peak RSS rose above the resident size
before the first sync, in units of the bf16 model (the publisher's reference copy is one),
with glibc's default allocator and with a fixed mmap threshold (see ALLOCATORS).

- ``naive``: ``publish_async(dict(iterator))`` — holds the fp32 stream, then a bf16 snapshot.
- ``bf16+copy``: cast each tensor to bf16 as it arrives, then ``publish_async`` (a second copy).
- ``backend``: ``DeltastoreWeightTransfer.send_weights`` — cast as it arrives, handed over
  without a copy (``publish_async(copy=False)``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.rss import reset_peak as _reset_peak
from benchmarks.rss import status_kb as _status_kb

WAYS = ("naive", "bf16+copy", "backend")
#: glibc raises its mmap threshold after the first large free, so freed tensors of a few MB then
#: stay in the heap and in RSS: the default allocator shows what a process really holds; a
#: fixed threshold (64 KiB) returns freed tensors at once and shows what each way keeps alive.
ALLOCATORS = (("glibc default", {}), ("MALLOC_MMAP_THRESHOLD_", {"MALLOC_MMAP_THRESHOLD_": "65536"}))
#: Tensors in the synthetic model: enough that one tensor's transient copy is small next to it.
N_TENSORS = 32


def _probe(way: str, params: int, syncs: int, store: str) -> dict:
    import torch

    from deltastore.integrations.trl import DeltastoreWeightTransfer
    from deltastore.write.publisher import Publisher
    from deltastore.write.policy import WriterPolicy

    torch.manual_seed(0)
    per = params // N_TENSORS
    model = {f"layers.{i}.weight": torch.randn(per // 1024, 1024) * 0.02 for i in range(N_TENSORS)}
    bf16_bytes = sum(t.numel() * 2 for t in model.values())

    def stream():
        for n, p in model.items():
            yield n, p.detach().clone()  # FSDP2's full_tensor(): a new tensor per parameter

    def step():
        with torch.no_grad():
            for p in model.values():
                p.add_(torch.randn_like(p), alpha=1e-5)  # an RL-sized update: most bf16 bits stay

    _reset_peak()
    base = _status_kb("VmRSS")
    t0 = time.perf_counter()
    if way == "backend":
        wt = DeltastoreWeightTransfer(store, threads=1)
        wt.init_weight_transfer()
        for _ in range(syncs):
            wt.send_weights(stream())
            wt.flush()
            step()
        wt.destroy()
    else:
        with Publisher(store, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1)) as pub:
            for _ in range(syncs):
                if way == "naive":
                    pub.publish_async(dict(stream())).result()
                else:
                    state = {n: t.to(torch.bfloat16) for n, t in stream()}
                    pub.publish_async(state).result()
                    del state
                step()
    dt = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    return {"way": way, "params": params, "bf16_model_bytes": bf16_bytes, "extra_bytes": (peak - base) * 1024,
            "extra_in_bf16_models": round((peak - base) * 1024 / bf16_bytes, 2), "seconds_per_sync": round(dt / syncs, 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=32e6)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # the child's role
    p.add_argument("--store", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.way:
        print(json.dumps(_probe(a.way, int(a.params), a.syncs, a.store)))
        return
    print(f"{'way':10s} {'allocator':22s} {'extra peak RSS':>15s} {'× bf16 model':>13s} {'s/sync':>7s}")
    for label, extra_env in ALLOCATORS:
        for way in WAYS:
            with tempfile.TemporaryDirectory() as tmp:
                out = subprocess.run([sys.executable, "-m", "benchmarks.trl_backend", "--way", way, "--params", str(a.params),
                                      "--syncs", str(a.syncs), "--store", os.path.join(tmp, "store")],
                                     check=True, capture_output=True, text=True, env={**os.environ, **extra_env})
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{way:10s} {label:22s} {r['extra_bytes'] / 1e6:12.1f} MB {r['extra_in_bf16_models']:13.2f} "
                  f"{r['seconds_per_sync']:7.2f}")


if __name__ == "__main__":
    main()
