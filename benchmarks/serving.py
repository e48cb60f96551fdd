"""Serving streams (SPEC §15): what an FP8 or MXFP8 stream costs beside the bf16 one, measured.

    python -m benchmarks.serving [--workload tf125m-rl-1e-6] [--steps 6] [--repeats 2]
                                 [--out benchmarks/results/serving.json]

Publishes the same real fine-tuning steps (benchmarks.workload: a Llama-shaped decoder trained
with full-parameter AdamW at lr 1e-6, fp32 masters, bf16 exports) seven ways side by side, each
into a local store on tmpfs: bf16 alone (today's publish), bf16 + ``fp8-block128``, bf16 +
``mxfp8``, each format again with every chunk in two steps (``deltastore.write.requant.ONE_STEP``
off: classified on the encode threads, walked after the store's encode; the paired before/after
of the one-step path), and each with every version derived in full
(``deltastore.write.requant.ENABLED`` off: quantize the whole state, diff every byte; the
paired before/after of the incremental derivation). Each state is published by all seven in
turn (lockstep; the order rotated per state), with a memory copy of the bf16 model timed beside
them (``copy_`` into preallocated tensors, as benchmarks/perf.py measures it): every figure is
a difference or ratio of timings taken within a fraction of a second of each other, so that
the machine's drift cancels out. It reports, per format and as ratios:

- bytes per version (delta versions; the first and last versions are anchors and left out):
  the stream's against the bf16 stream's, and against a full quantized checkpoint per version
  (what a trainer uploading the quantized model at every step would upload);
- the extra publish time of a delta version with the format over the bf16-only publish of the
  same state (derive, diff, encode, store), as a multiple of the copy timed beside it: the
  median and quartiles over every delta version of every round, incrementally, in two steps
  and in full;
- the extra publish time of an anchor after deltas (the last version: the middle step again,
  ``anchor=True``), as a multiple of the copy, and spread over the versions between anchors
  under the default anchor policy (the bf16 anchor's bytes over its delta bytes per version);
- bit identity: at every version, a worker's applied stream (``Subscriber(format=...)``
  fast-forwarded with ``pull_into``) against the reference quantization of that version's bf16
  state (:func:`deltastore.serving.formats.derive` and the plain reference kernels of
  :mod:`deltastore.serving.quantize`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
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
#: Memory copies timed per thread count to pick the faster (their median).
COPY_REPEATS = 7

logger = logging.getLogger(__name__)


def copy_timer(state: dict[str, torch.Tensor]) -> Callable[[], float]:
    """A timer of one ``copy_`` of every tensor of ``state`` into preallocated, faulted-in
    tensors, torch on one thread or on every core, whichever was faster over ``COPY_REPEATS``
    (the denominator benchmarks/perf.py uses): each call returns the median of three copies."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        dst[k].copy_(v)
    threads = torch.get_num_threads()

    def once() -> float:
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        return time.perf_counter() - t0

    best = {}
    for nt in sorted({1, threads}):
        torch.set_num_threads(nt)
        best[nt] = statistics.median(once() for _ in range(COPY_REPEATS))
    fastest = min(best, key=best.__getitem__)
    torch.set_num_threads(threads)

    def timed() -> float:
        torch.set_num_threads(fastest)
        try:
            return statistics.median(once() for _ in range(3))
        finally:
            torch.set_num_threads(threads)

    return timed


#: The configurations published side by side: (name, formats, derivation: "incremental" (today's),
#: "two-step" (every chunk classified on the encode threads, then rescaled and walked after the
#: store's encode: ``requant.ONE_STEP`` off) or "full" (``requant.ENABLED`` off)).
CONFIGS = (("bf16", (), "incremental"), *((f, ("bf16", f), "incremental") for f in FORMATS),
           *((f + " two-step", ("bf16", f), "two-step") for f in FORMATS),
           *((f + " full", ("bf16", f), "full") for f in FORMATS))


def lockstep_round(states: list[dict[str, torch.Tensor]], root: Path,
                   copy: Callable[[], float]) -> tuple[dict[str, list[float]], list[float], dict[str, str]]:
    """One round: a publisher per configuration (CONFIGS) into new stores under ``root``, each
    state published by all of them in turn (the order rotated per state) and a copy timed
    beside them, so that every configuration's version is timed within a fraction of a second
    of the others' (the machine's drift cancels out in their differences); the last state as an
    anchor (``anchor=True``: after deltas, with a base). Per configuration its seconds per
    version; the copy's seconds per state; the stores' urls."""
    urls = {name: str(root / ("store-" + name.replace(" ", "-"))) for name, _, _ in CONFIGS}
    for url in urls.values():
        shutil.rmtree(url, ignore_errors=True)
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in CONFIGS}
    copies = []
    with contextlib.ExitStack() as stack:
        pubs = {name: stack.enter_context(Publisher(urls[name], formats=formats)) for name, formats, _ in CONFIGS}
        for v, state in enumerate(states):
            for name, _, derivation in CONFIGS[v % len(CONFIGS):] + CONFIGS[:v % len(CONFIGS)]:
                requant.ENABLED = derivation != "full"
                requant.ONE_STEP = derivation == "incremental"
                try:
                    t0 = time.perf_counter()
                    pubs[name].publish(state, anchor=v == len(states) - 1 and v > 0)
                    seconds[name].append(time.perf_counter() - t0)
                finally:
                    requant.ENABLED = requant.ONE_STEP = True
            copies.append(copy())
    return seconds, copies, urls


def stored_bytes(url: str, versions: int) -> dict[str, list[int]]:
    """The store's per-version bytes, by format."""
    history = History(open_store(url))
    head = history.read_head()
    assert head is not None
    sizes: dict[str, list[int]] = {"bf16": []}
    for v in range(1, versions + 1):
        _, m = history.resolve(v, head[0])
        sizes["bf16"].append(m.stats.bytes_stored)
        for ref in m.streams:
            sizes.setdefault(ref.format, []).append(ref.bytes)
    return sizes


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
    # the steps, then the middle one again as an anchor (an anchor after deltas: what the anchor
    # policy writes now and then)
    states = load_workload(args.workload, args.steps)
    states.append(states[len(states) // 2])
    model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    copy = copy_timer(states[0])
    full = {fmt: sum(t.numel() * t.element_size() for t in derive(states[0], serving_format(fmt)).values())
            for fmt in FORMATS}
    seconds: dict[str, list[list[float]]] = {name: [] for name, _, _ in CONFIGS}  # per round, per version
    copies: list[list[float]] = []
    shm = Path("/dev/shm")  # a tmpfs when present, so that no disk is timed (as benchmarks/perf.py)
    with tempfile.TemporaryDirectory(prefix="deltastore-serving-", dir=shm if shm.is_dir() else None) as tmp:
        for _ in range(args.repeats):
            got, round_copies, urls = lockstep_round(states, Path(tmp), copy)
            for name, xs in got.items():
                seconds[name].append(xs)
            copies.append(round_copies)
        sizes = {name: stored_bytes(urls[name], len(states)) for name, _, _ in CONFIGS}
        identical = {fmt: bit_identity(urls[fmt], fmt, states) for fmt in FORMATS}
    for fmt in FORMATS:  # the derivations store the same streams
        assert sizes[fmt] == sizes[fmt + " two-step"] == sizes[fmt + " full"], fmt

    def deltas(name: str) -> list[float]:
        """Seconds of the delta versions (the anchors, first and last, left out), all rounds."""
        return [x for xs in seconds[name] for x in xs[1:-1]]

    def x_copy(name: str) -> list[float]:
        """Per delta version of each round: the extra publish time of ``name`` over bf16 alone
        for the same state, as a multiple of the copy timed beside them."""
        return [(x - b) / c for xs, bs, cs in zip(seconds[name], seconds["bf16"], copies)
                for x, b, c in zip(xs[1:-1], bs[1:-1], cs[1:-1])]

    def anchor_x_copy(name: str) -> list[float]:
        """Per round: the extra publish time of ``name`` over bf16 alone for the last version,
        an anchor after deltas, as a multiple of the copy timed beside them."""
        return [(xs[-1] - bs[-1]) / cs[-1] for xs, bs, cs in zip(seconds[name], seconds["bf16"], copies)]

    def quartiles(xs: list[float]) -> list[float]:
        return statistics.quantiles(xs, n=4) if len(xs) > 1 else xs * 3

    copy_s = statistics.median(c for cs in copies for c in cs)
    base_s = statistics.median(deltas("bf16"))
    bf16_bytes = statistics.mean(sizes["bf16"]["bf16"][1:-1])
    # versions per anchor under the default anchor policy (the cost rule, beta = 1): an anchor
    # once the delta bytes since the last one reach its full bytes
    cadence = sizes["bf16"]["bf16"][0] / bf16_bytes
    result: dict[str, Any] = {
        "workload": args.workload, "versions": len(states), "rounds": args.repeats, "model_bytes": model_bytes,
        "memcpy_s": copy_s, "publish_bf16_s": base_s, "bf16_bytes_per_version": bf16_bytes,
        "publish_bf16_x_memcpy": base_s / copy_s, "anchor_cadence_versions": cadence, "formats": {},
    }
    for fmt in FORMATS:
        stream = sizes[fmt][fmt]
        per_version = statistics.mean(stream[1:-1])
        ratios, full_ratios, anchor = x_copy(fmt), x_copy(fmt + " full"), statistics.median(anchor_x_copy(fmt))
        result["formats"][fmt] = {
            "bytes_per_version": per_version,
            "x_bf16_stream": per_version / bf16_bytes,
            "full_checkpoint_bytes": full[fmt],
            "x_full_checkpoint": per_version / full[fmt],
            "anchor_bytes": stream[0],
            "publish_with_format_s": statistics.median(deltas(fmt)),
            "extra_s": statistics.median(x - b for x, b in zip(deltas(fmt), deltas("bf16"))),
            "extra_x_memcpy": statistics.median(ratios),
            "extra_x_memcpy_quartiles": quartiles(ratios),
            "extra_two_step_x_memcpy": statistics.median(x_copy(fmt + " two-step")),
            "extra_two_step_x_memcpy_quartiles": quartiles(x_copy(fmt + " two-step")),
            "extra_full_s": statistics.median(x - b for x, b in zip(deltas(fmt + " full"), deltas("bf16"))),
            "extra_full_x_memcpy": statistics.median(full_ratios),
            "extra_full_x_memcpy_quartiles": quartiles(full_ratios),
            "anchor_extra_x_memcpy": anchor,
            "anchor_extra_amortized_x_memcpy": anchor / cadence,
            "bit_identical_versions": identical[fmt],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps(result, indent=1, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
