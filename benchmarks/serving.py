"""Serving streams (SPEC §15): what an FP8 or MXFP8 stream costs beside the bf16 one, measured.

    python -m benchmarks.serving [--workload tf125m-rl-1e-6] [--steps 6] [--repeats 2]
                                 [--out benchmarks/results/serving.json]

Publishes the same real fine-tuning steps (benchmarks.workload: a Llama-shaped decoder trained
with full-parameter AdamW at lr 1e-6, fp32 masters, bf16 exports) three ways into a local
store, in alternation: bf16 alone (today's publish), bf16 + ``fp8-block128``, bf16 + ``mxfp8``.
It reports, per format and as ratios:

- bytes per version (delta versions; the first version is an anchor everywhere and left out):
  the stream's against the bf16 stream's, and against a full quantized checkpoint per version
  (what a trainer uploading the quantized model at every step would upload);
- publish time per delta version with the extra format against the bf16-only publish of the
  same state (median over versions and runs; the store on tmpfs); the difference is the extra
  format's cost (derive, diff, encode, store), given as a multiple of one memory copy of the
  bf16 model (``copy_`` into preallocated tensors, as benchmarks/perf.py measures it); the same
  with every version derived in full (``deltastore.write.requant.ENABLED`` off: quantize the
  whole state, diff every byte), the paired before/after of the incremental derivation;
- bit identity: at every version, a worker's applied stream (``Subscriber(format=...)``
  fast-forwarded with ``pull_into``) against the reference quantization of that version's bf16
  state (:func:`deltastore.serving.formats.derive` and the plain reference kernels of
  :mod:`deltastore.serving.quantize`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import load_workload
from deltastore import Publisher, Subscriber
from deltastore.format.history import History
from deltastore.serving.formats import derive, serving_format
from deltastore.storage import open_store
from deltastore.write import requant

RESULTS_DIR = Path(__file__).parent / "results"
FORMATS = ("fp8-block128", "mxfp8")
#: Memory copies timed per thread count for the reference figure (their median).
COPY_REPEATS = 7

logger = logging.getLogger(__name__)


def memcpy_s(state: dict[str, torch.Tensor]) -> float:
    """Seconds of one ``copy_`` of every tensor of ``state`` into preallocated, faulted-in
    tensors (median of ``COPY_REPEATS``), torch on one thread and on every core, the faster:
    the denominator benchmarks/perf.py uses."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        dst[k].copy_(v)
    threads = torch.get_num_threads()
    medians = []
    for nt in sorted({1, threads}):
        torch.set_num_threads(nt)
        times = []
        for _ in range(COPY_REPEATS):
            t0 = time.perf_counter()
            for k, v in state.items():
                dst[k].copy_(v)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    torch.set_num_threads(threads)
    return min(medians)


def publish_run(states: list[dict[str, torch.Tensor]], formats: tuple[str, ...], root: Path, *,
                incremental: bool = True) -> dict[str, Any]:
    """Publish ``states`` with ``formats`` into a new store under ``root``; per-version seconds
    and the store's per-version bytes by format. ``incremental``: False derives every version
    of the streams in full."""
    url = str(root / ("store-" + "-".join(formats or ("bf16",)) + ("" if incremental else "-full")))
    shutil.rmtree(url, ignore_errors=True)
    seconds = []
    requant.ENABLED = incremental
    try:
        with Publisher(url, formats=formats) as pub:
            for s in states:
                t0 = time.perf_counter()
                pub.publish(s)
                seconds.append(time.perf_counter() - t0)
    finally:
        requant.ENABLED = True
    history = History(open_store(url))
    head = history.read_head()
    assert head is not None
    sizes: dict[str, list[int]] = {"bf16": []}
    for v in range(1, len(states) + 1):
        _, m = history.resolve(v, head[0])
        sizes["bf16"].append(m.stats.bytes_stored)
        for ref in m.streams:
            sizes.setdefault(ref.format, []).append(ref.bytes)
    return {"url": url, "seconds": seconds, "bytes": sizes}


def bit_identity(url: str, fmt: str, states: list[dict[str, torch.Tensor]]) -> int:
    """Versions at which a worker following ``fmt`` holds exactly the reference quantization
    (raises AssertionError naming the first difference)."""
    f = serving_format(fmt)
    with Subscriber(url, format=fmt) as sub:
        target = sub.pull(1)
        for v, state in enumerate(states, start=1):
            if v > 1:
                sub.pull_into(target, version=v)
            want = derive(state, f)
            assert target.keys() == want.keys(), f"{fmt} v{v}: tensor names differ"
            for name, t in want.items():
                got = target[name]
                assert got.dtype == t.dtype and got.shape == t.shape, f"{fmt} v{v} {name}: dtype/shape"
                assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                    f"{fmt} v{v} {name}: bits differ from the reference quantization"
    return len(states)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="tf125m-rl-1e-6")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "serving.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    states = load_workload(args.workload, args.steps)
    model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    copy_s = memcpy_s(states[0])
    full = {fmt: sum(t.numel() * t.element_size() for t in derive(states[0], serving_format(fmt)).values())
            for fmt in FORMATS}
    runs: dict[str, list[dict[str, Any]]] = {"bf16": [], **{f: [] for f in FORMATS}, **{f + " full": [] for f in FORMATS}}
    shm = Path("/dev/shm")  # a tmpfs when present, so that no disk is timed (as benchmarks/perf.py)
    with tempfile.TemporaryDirectory(prefix="deltastore-serving-", dir=shm if shm.is_dir() else None) as tmp:
        for _ in range(args.repeats):  # alternated, so drift of the machine hits every configuration alike
            runs["bf16"].append(publish_run(states, (), Path(tmp)))
            for fmt in FORMATS:
                runs[fmt].append(publish_run(states, ("bf16", fmt), Path(tmp)))
                runs[fmt + " full"].append(publish_run(states, ("bf16", fmt), Path(tmp), incremental=False))
        identical = {fmt: bit_identity(runs[fmt][-1]["url"], fmt, states) for fmt in FORMATS}
        for fmt in FORMATS:  # the two derivations store the same streams
            assert runs[fmt][-1]["bytes"] == runs[fmt + " full"][-1]["bytes"], fmt

    def per_delta(xs: list[float]) -> float:
        return statistics.median(xs[1:])

    base_s = statistics.median(per_delta(r["seconds"]) for r in runs["bf16"])
    bf16_bytes = statistics.mean(runs["bf16"][0]["bytes"]["bf16"][1:])
    result: dict[str, Any] = {
        "workload": args.workload, "versions": len(states), "model_bytes": model_bytes,
        "memcpy_s": copy_s, "publish_bf16_s": base_s, "bf16_bytes_per_version": bf16_bytes,
        "publish_bf16_x_memcpy": base_s / copy_s, "formats": {},
    }
    for fmt in FORMATS:
        with_s = statistics.median(per_delta(r["seconds"]) for r in runs[fmt])
        full_s = statistics.median(per_delta(r["seconds"]) for r in runs[fmt + " full"])
        stream = runs[fmt][0]["bytes"][fmt]
        per_version = statistics.mean(stream[1:])
        result["formats"][fmt] = {
            "bytes_per_version": per_version,
            "x_bf16_stream": per_version / bf16_bytes,
            "full_checkpoint_bytes": full[fmt],
            "x_full_checkpoint": per_version / full[fmt],
            "anchor_bytes": stream[0],
            "publish_with_format_s": with_s,
            "extra_s": with_s - base_s,
            "extra_x_memcpy": (with_s - base_s) / copy_s,
            "extra_full_s": full_s - base_s,
            "extra_full_x_memcpy": (full_s - base_s) / copy_s,
            "bit_identical_versions": identical[fmt],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps(result, indent=1, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
