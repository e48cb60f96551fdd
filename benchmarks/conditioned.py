"""What a *buildable* conditioned delta coder gets on the cached RL steps.

    python -m benchmarks.conditioned [--workload rl-1e-6 tf265m-rl-1e-6] [--classes 4 8 16]

Design 003 measured that conditioning on the receiver's old value cuts the order-0 cost of
positions to 0.68-0.70× and of values to 0.84×. This measures what a coder the decoder can
follow actually spends, per 16 MiB chunk as the publisher cuts tensors, with the same entropy
coder as today (zstd's Huffman through ``deltastore.codec.planes.encode_sections``):

* every element of the chunk gets a *class* from its old bf16 exponent, ``clip(e, lo, lo+K-1)``,
  ``lo`` chosen per chunk (stored: one byte) so that the top class starts at the exponent
  below which 99.9 % of the chunk's elements lie;
* **crossers** (changed elements whose new exponent falls in another class) go first, in an
  unconditioned add-sparse list over the whole chunk: a decoder holding the *new* values
  (rollback, ``inverse=True``) must see the same classes for everything else;
* for each class, the changed elements that are not crossers are coded as add-sparse gaps of
  their *rank among the class's elements* (one-byte symbols with escapes, as ``add-sparse/1``)
  and their paired 4-bit zigzag differences, each stream its own sections;
* headers: today's 25-byte segment header, 5 bytes per section, 1 byte for ``lo`` and 8 bytes
  per class (changed and escaped counts).

Reported per workload (medians over steps, whole model): today's ``encode_delta`` bytes, the
conditioned coder's bytes, both over the harness's order-0 estimate H0 (``peers.entropy_bytes``),
the parts (positions, values, crossers, headers) in bytes per changed element, and the ideal
conditional position cost ``Σ_c n_c·H(k_c/n_c)`` (what a perfect coder of the same classes
would spend). Results to ``benchmarks/results/conditioned.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from deltastore.codec.delta import encode_delta
from deltastore.codec.delta import code_positions, code_values
from deltastore.codec.planes import encode_sections

RESULTS = Path(__file__).resolve().parent / "results"
# Chunks as the publisher cuts them (deltastore.layout.tensors.CHUNK_TARGET_BYTES): 16 MiB of bf16.
CHUNK_ELEMENTS = 8 * 1024 * 1024
# DSG2 framing (docs/codec-format.md): 25-byte header, 5 bytes per section table entry.
SEGMENT_HEADER = 25
SECTION_ENTRY = 5
# Per class: changed count and escaped count (u32 each) — what the decoder needs to split streams.
CLASS_HEADER = 8
# lo is set so that this fraction of the chunk's elements lie below the top class's exponent.
TOP_QUANTILE = 0.999
# The kernel is timed on chunks of at least this many elements (4 MiB of bf16): smaller ones
# are timed by call overhead more than by the pass over the chunk.
MIN_KERNEL_CHUNK = 2 * 1024 * 1024
# Below this many changes a chunk is coded as today (a table per class would cost more).
MIN_CHANGES = 4096


def _exp(u: np.ndarray) -> np.ndarray:
    return ((u >> np.uint16(7)) & np.uint16(0xFF)).astype(np.uint8)


def _stream_bytes(planes: list[np.ndarray]) -> int:
    secs = encode_sections(planes, None)
    return sum(len(b) for _, b, _ in secs) + SECTION_ENTRY * len(secs)


def _h(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def conditioned_chunk(old: np.ndarray, new: np.ndarray, k: int) -> dict:
    """Bytes of the conditioned coder for one chunk (uint16 views), by part."""
    pos = np.flatnonzero(old != new)
    n_changed = int(pos.size)
    out = {"changed": n_changed, "positions": 0, "values": 0, "crossers": 0, "crosser_n": 0,
           "headers": 0, "fallback": 0, "ideal_positions_bits": 0.0}
    if n_changed == 0:
        return out
    if n_changed < MIN_CHANGES:
        seg = encode_delta(old, new)
        out["fallback"] = len(seg.data)  # coded as today, all of it
        return out
    e = _exp(old)
    hi = int(np.quantile(e, TOP_QUANTILE, method="lower"))
    lo = max(0, hi - k + 1)
    cls = (np.clip(e, lo, lo + k - 1) - lo).astype(np.uint8)
    d = (new[pos] - old[pos]).astype(np.uint16)
    cls_new = (np.clip(_exp(new[pos]), lo, lo + k - 1) - lo).astype(np.uint8)
    cls_pos = cls[pos]
    cross = cls_pos != cls_new
    n_cross = int(cross.sum())
    out["crosser_n"] = n_cross
    if n_cross:
        out["crossers"] = (_stream_bytes(code_positions(pos[cross]).planes)
                           + _stream_bytes(code_values(d[cross]).planes) + CLASS_HEADER)
    keep = ~cross
    for c in range(k):
        members = cls == c
        n_c = int(members.sum())
        sel = keep & (cls_pos == c)
        k_c = int(sel.sum())
        out["headers"] += CLASS_HEADER
        if k_c == 0:
            continue
        rank = np.cumsum(members, dtype=np.int64) - 1
        r = rank[pos[sel]]
        out["positions"] += _stream_bytes(code_positions(r).planes)
        out["values"] += _stream_bytes(code_values(d[sel]).planes)
        out["ideal_positions_bits"] += n_c * _h(k_c / n_c)
    out["headers"] += SEGMENT_HEADER + 1
    return out


def class_window(old: np.ndarray, k: int) -> int:
    """``lo`` of the chunk's class window ``clip(e, lo, lo+k-1)`` (see ``conditioned_chunk``)."""
    hi = int(np.quantile(_exp(old), TOP_QUANTILE, method="lower"))
    return max(0, hi - k + 1)


def class_lut(old: np.ndarray, k: int) -> np.ndarray:
    """Class of every (sign, exponent) value, ``old >> 7`` of a bf16 element, as the coder sets
    it for this chunk."""
    lo = class_window(old, k)
    return (np.clip(np.arange(512) & 0xFF, lo, lo + k - 1) - lo).astype(np.uint8)


def ranks_of(old: np.ndarray, new: np.ndarray, lut: np.ndarray, k: int):
    """What the decoder is given (crossers; per-class ranks and offsets) and the positions it
    must find (class by class): the numpy reference, one cumulative count per class."""
    pos = np.flatnonzero(old != new)
    cls = lut[old >> np.uint16(7)]
    cp, cn = cls[pos], lut[new[pos] >> np.uint16(7)]
    cross = cp != cn
    xs = pos[cross].astype(np.int64)
    counted = np.ones(old.size, dtype=bool)
    counted[xs] = False
    ranks, want, offs = [], [], [0]
    for c in range(k):
        sel = pos[~cross & (cp == c)]
        rank = np.cumsum((cls == c) & counted, dtype=np.int64) - 1
        ranks.append(rank[sel])
        want.append(sel)
        offs.append(offs[-1] + sel.size)
    return (xs, np.concatenate(ranks).astype(np.int64), np.array(offs, dtype=np.int64),
            np.concatenate(want).astype(np.int64))


def _compile_kernel(tmp: Path):
    """benchmarks/ctx_select.c as a shared library (cc -O3), or None without a compiler."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    so = tmp / "ctx_select.so"
    src = Path(__file__).resolve().parent / "ctx_select.c"
    subprocess.run([cc, "-O3", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    P = ctypes.c_void_p
    lib.ctx_select.argtypes = [P, ctypes.c_int64, P, ctypes.c_int, P, ctypes.c_int64, P, P, P]
    lib.ctx_select.restype = ctypes.c_int
    if hasattr(lib, "ctx_has_avx2") and lib.ctx_has_avx2():
        lib.ctx_select_avx2.argtypes = [P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, P, ctypes.c_int64, P, P, P]
        lib.ctx_select_avx2.restype = ctypes.c_int
        lib.avx2 = True
    else:
        lib.avx2 = False
    return lib


def kernel_speed(workload: str, step: int, k: int, repeats: int = 5, max_chunks: int = 16) -> dict:
    """Per chunk of one step (the first ``max_chunks`` with a change and ≥ MIN_KERNEL_CHUNK
    elements; ratios to the copy of the same chunk do not depend on its size), best of
    ``repeats`` each: the prototype rank->position kernel, a copy of the chunk, XXH3-128 of it,
    today's ``apply_delta`` and the numpy reference (once). Milliseconds of the calling
    thread's CPU time, medians over chunks."""
    import tempfile

    import xxhash

    from benchmarks.peers import u16
    from benchmarks.workload import load_step
    from deltastore.codec.apply import apply_delta

    def best(fn) -> float:
        # CPU time of this thread, not wall time: on a shared machine a 30 ms call is preempted
        # where a 0.5 ms copy is not, and wall-time ratios would favour the short operation.
        ts = []
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            ts.append(time.thread_time() - t0)
        return min(ts)

    prev, new = load_step(workload, step - 1), load_step(workload, step)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lib = _compile_kernel(Path(tmp))
        if lib is None:
            return {"unavailable": "no C compiler"}
        for name, t in new.items():
            o_all, n_all = u16(prev[name]), u16(t)
            for start in range(0, o_all.size, CHUNK_ELEMENTS):
                o = o_all[start:start + CHUNK_ELEMENTS].copy()
                n = n_all[start:start + CHUNK_ELEMENTS].copy()
                if o.size < MIN_KERNEL_CHUNK or len(rows) >= max_chunks or not (o != n).any():
                    continue
                lut = class_lut(o, k)
                t0 = time.thread_time()
                xs, rk, off, want = ranks_of(o, n, lut, k)
                numpy_s = time.thread_time() - t0
                out = np.empty_like(rk)
                args = (o.ctypes.data, o.size, lut.ctypes.data, k, xs.ctypes.data, xs.size,
                        rk.ctypes.data, off.ctypes.data, out.ctypes.data)
                kern_s = best(lambda args=args: lib.ctx_select(*args))
                assert lib.ctx_select(*args) == 0 and np.array_equal(out, want), name
                avx2_s = None
                if lib.avx2:
                    out[:] = -1
                    args2 = (o.ctypes.data, o.size, class_window(o, k), k, *args[4:])
                    avx2_s = best(lambda args2=args2: lib.ctx_select_avx2(*args2))
                    assert lib.ctx_select_avx2(*args2) == 0 and np.array_equal(out, want), name
                dst = np.empty_like(o)
                copy_s = best(lambda dst=dst, o=o: np.copyto(dst, o))
                xxh_s = best(lambda o=o: xxhash.xxh3_128(o).digest())
                seg = encode_delta(o, n)
                apply_s = best(lambda dst=dst, o=o, seg=seg: (np.copyto(dst, o), apply_delta(dst, seg.data, codec=seg.codec)))
                apply_s -= copy_s
                rows.append({"tensor": name, "start": start, "changed": int(np.count_nonzero(o != n)),
                             "kernel_ms": kern_s * 1e3, "copy_ms": copy_s * 1e3, "xxh3_ms": xxh_s * 1e3,
                             "kernel_avx2_ms": None if avx2_s is None else avx2_s * 1e3,
                             "apply_today_ms": apply_s * 1e3, "numpy_reference_ms": numpy_s * 1e3})
    med = {key: statistics.median(r[key] for r in rows)
           for key in ("kernel_ms", "copy_ms", "xxh3_ms", "apply_today_ms", "numpy_reference_ms")}
    med["kernel_over_copy"] = statistics.median(r["kernel_ms"] / r["copy_ms"] for r in rows)
    if rows and rows[0]["kernel_avx2_ms"] is not None:
        med["kernel_avx2_ms"] = statistics.median(r["kernel_avx2_ms"] for r in rows)
        med["kernel_avx2_over_copy"] = statistics.median(r["kernel_avx2_ms"] / r["copy_ms"] for r in rows)
    med["kernel_over_xxh3"] = statistics.median(r["kernel_ms"] / r["xxh3_ms"] for r in rows)
    return {"workload": workload, "step": step, "classes": k, "chunks": len(rows), "median": med, "rows": rows}


def _tensor_h0_bits(old: np.ndarray, new: np.ndarray) -> float:
    idx = np.flatnonzero(old != new)
    k, n = idx.size, old.size
    if k == 0:
        return 0.0
    xor = old[idx] ^ new[idx]
    counts = np.bincount(xor, minlength=1 << 16)
    q = counts[counts > 0] / k
    return n * _h(k / n) + k * float(-(q * np.log2(q)).sum())


def measure_step(prev: dict, new: dict, ks: tuple[int, ...]) -> dict:
    """Whole-model bytes of today's codec and of the conditioned coder for each K."""
    from benchmarks.peers import u16

    res = {"h0": 0.0, "today": 0, "changed": 0, "by_k": {k: {} for k in ks}}
    for name, t in new.items():
        o_all, n_all = u16(prev[name]), u16(t)
        res["h0"] += _tensor_h0_bits(o_all, n_all) / 8
        for start in range(0, o_all.size, CHUNK_ELEMENTS):
            o, n = o_all[start:start + CHUNK_ELEMENTS], n_all[start:start + CHUNK_ELEMENTS]
            seg = encode_delta(o, n)
            if seg is None:
                continue
            res["today"] += len(seg.data)
            res["changed"] += int(np.count_nonzero(o != n))
            for k in ks:
                part = conditioned_chunk(o, n, k)
                acc = res["by_k"][k]
                for key, v in part.items():
                    if key != "changed":
                        acc[key] = acc.get(key, 0) + v
    for k in ks:
        acc = res["by_k"][k]
        acc["total"] = sum(acc.get(x, 0) for x in ("positions", "values", "crossers", "headers", "fallback"))
    return res


def run(workloads: list[str], ks: tuple[int, ...], steps: int | None, out: Path | None) -> dict:
    from benchmarks.workload import WORKLOADS, load_step

    res: dict = {"classes": list(ks), "chunk_elements": CHUNK_ELEMENTS, "workloads": {}}
    for w in workloads:
        n = min(steps or WORKLOADS[w].steps, WORKLOADS[w].steps)
        rows = []
        prev = load_step(w, 0)
        for s in range(1, n + 1):
            cur = load_step(w, s)
            t0 = time.perf_counter()
            r = measure_step(prev, cur, ks)
            r["step"], r["seconds"] = s, time.perf_counter() - t0
            rows.append(r)
            prev = cur
            print(f"{w} step {s}: today/H0 {r['today'] / r['h0']:.3f}, "
                  + ", ".join(f"K={k} {r['by_k'][k]['total'] / r['h0']:.3f}" for k in ks), flush=True)
        summary = {"today_over_h0": statistics.median(r["today"] / r["h0"] for r in rows)}
        for k in ks:
            per = [r["by_k"][k] for r in rows]
            ch = [r["changed"] for r in rows]
            summary[f"K={k}"] = {
                "over_h0": statistics.median(p["total"] / r["h0"] for p, r in zip(per, rows)),
                "over_today": statistics.median(p["total"] / r["today"] for p, r in zip(per, rows)),
                **{f"{part}_B_per_chg": statistics.median(p.get(part, 0) / c for p, c in zip(per, ch))
                   for part in ("positions", "values", "crossers", "headers", "fallback")},
                "ideal_positions_B_per_chg": statistics.median(
                    p["ideal_positions_bits"] / 8 / c for p, c in zip(per, ch)),
                "crosser_fraction": statistics.median(p["crosser_n"] / c for p, c in zip(per, ch)),
            }
        res["workloads"][w] = {"steps": rows, "summary": summary}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=float))
        out.with_suffix(".md").write_text(markdown(res))
    return res


def markdown(res: dict) -> str:
    lines = [("| workload | coder | bytes / H0 | / today | positions B/chg | values B/chg | crossers B/chg "
              "| headers B/chg | small chunks (as today) B/chg | ideal positions B/chg | crossers % |"),
             "|---" * 11 + "|"]
    for w, d in res["workloads"].items():
        s = d["summary"]
        lines.append(f"| {w} | today (add-sparse/1) | {s['today_over_h0']:.3f} | 1 | | | | | | | |")
        for k in res["classes"]:
            c = s[f"K={k}"]
            lines.append(f"| {w} | conditioned K={k} | {c['over_h0']:.3f} | {c['over_today']:.3f} | "
                         f"{c['positions_B_per_chg']:.3f} | {c['values_B_per_chg']:.3f} | "
                         f"{c['crossers_B_per_chg']:.3f} | {c['headers_B_per_chg']:.4f} | {c['fallback_B_per_chg']:.3f} | "
                         f"{c['ideal_positions_B_per_chg']:.3f} | {100 * c['crosser_fraction']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", nargs="+", default=["rl-1e-6", "tf265m-rl-1e-6"])
    p.add_argument("--classes", nargs="+", type=int, default=[4, 8, 16])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "conditioned.json")
    p.add_argument("--kernel", action="store_true",
                   help="instead: time the prototype decode kernel (benchmarks/ctx_select.c) on the "
                        "full 16 MiB chunks of the first workload's step 2, K = the first --classes")
    a = p.parse_args(argv)
    if a.kernel:
        res = kernel_speed(a.workload[0], 2, a.classes[0])
        a.out.with_name("conditioned-kernel.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res.get("median", res), indent=1))
        return 0
    res = run(a.workload, tuple(a.classes), a.steps, a.out)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
