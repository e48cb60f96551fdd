"""The benchmark harness: every format on every workload, sizes, speeds, memory, exactness.

For each workload (a list of bf16 state dicts, one per optimizer step) and each format, every
step k >= 1 is encoded against step k-1, decoded and applied to a copy of step k-1, and
checked bit for bit against step k. Reported per (workload, format):

* bytes per version, median and max over steps;
* ``x full``: how many times smaller than the ``full`` safetensors snapshot (median/median);
* ``/ H0``: median over steps of bytes / order-0 entropy estimate (1.0 = the estimate);
* encode and decode+apply throughput in GB/s of model scanned (model bytes / seconds,
  summed over steps, one thread of Python driving each format);
* extra peak RSS during encode + decode+apply of the last step, as a multiple of the model's
  bytes, measured in a fresh subprocess (``benchmarks.rss``);
* whether every step round-tripped bit-exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from benchmarks import peers
from benchmarks.workload import DEFAULT_WORKLOADS, WORKLOADS, change_stats, load_workload

logger = logging.getLogger(__name__)

# --quick: three steps per workload is enough to exercise every path and see the sizes.
QUICK_STEPS = 3
ENTROPY = "entropy (H0)"
# The RSS probe reloads torch and two snapshots; a minute is ample on two cores.
RSS_TIMEOUT_S = 180
# Each encode and decode is timed this many times and the fastest kept: the machine is shared,
# and the minimum is the least disturbed estimate of what the format itself costs.
REPEATS = 3
# Every format runs on one thread (torch intra-op and ZipNN alike), so throughputs compare the
# formats rather than how well each one parallelises on a shared two-core machine.
THREADS = 1


@dataclasses.dataclass(frozen=True)
class Result:
    """One (workload, format) cell of the table."""

    workload: str
    format: str
    kind: str
    steps: int
    model_bytes: int
    bytes_median: float
    bytes_max: float
    x_full: float  # full median / this median
    over_entropy: float  # median over steps of bytes / entropy estimate
    encode_gbps: float | None
    decode_gbps: float | None
    rss_extra_x: float | None  # extra peak RSS / model bytes
    exact: bool | None
    note: str = ""


def _equal(a: peers.StateDict, b: peers.StateDict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def _rss_probe(workload: str, fmt: str, step: int) -> dict | None:
    cmd = [sys.executable, "-m", "benchmarks.rss", workload, fmt, str(step)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=RSS_TIMEOUT_S,
                             check=True, cwd=root)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-1:]
        logger.warning("RSS probe failed for %s/%s: %s", workload, fmt, tail or exc)
        return None
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        logger.warning("RSS probe failed for %s/%s: %s", workload, fmt, exc)
        return None


def bench_workload(name: str, sds: list[peers.StateDict], formats: list[str],
                   rss: bool = True, repeats: int = REPEATS) -> list[Result]:
    """Measure ``formats`` on consecutive pairs of ``sds``; the entropy row comes first."""
    steps = len(sds) - 1
    model_bytes = sum(t.numel() * t.element_size() for t in sds[0].values())
    pairs = list(zip(sds, sds[1:]))
    ent = [peers.entropy_bytes(a, b) for a, b in pairs]
    sizes: dict[str, list[int]] = {}
    results: list[Result] = []
    timing: dict[str, tuple[float, float, bool]] = {}
    for fname in formats:
        fmt = peers.FORMATS[fname]
        why = peers.unavailable(fname)
        if why:
            logger.warning("skipping %s: %s", fname, why)
            timing[fname] = (float("nan"), float("nan"), False)
            sizes[fname] = []
            results.append(Result(name, fname, fmt.kind, steps, model_bytes, float("nan"),
                                  float("nan"), float("nan"), float("nan"), None, None, None,
                                  None, f"skipped: {why}"))
            continue
        fmt.encode(*pairs[0])  # warm-up: lazy imports, allocator growth
        t_enc = t_dec = 0.0
        exact = True
        sizes[fname] = []
        for prev, new in pairs:
            best_enc = best_dec = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                blob = fmt.encode(prev, new)
                best_enc = min(best_enc, time.perf_counter() - t0)
                target = {k: v.clone() for k, v in prev.items()}
                t0 = time.perf_counter()
                out = fmt.decode_apply(target, blob)
                best_dec = min(best_dec, time.perf_counter() - t0)
                exact &= _equal(out, new)
            t_enc += best_enc
            t_dec += best_dec
            sizes[fname].append(len(blob))
        if not exact:
            logger.error("%s on %s did NOT round-trip bit-exactly", fname, name)
        timing[fname] = (t_enc, t_dec, exact)
        logger.info("%s/%s: median %d B", name, fname, statistics.median(sizes[fname]))

    full_med = statistics.median(sizes["full"]) if sizes.get("full") else float(model_bytes)
    results.append(Result(name, ENTROPY, "reference", steps, model_bytes, statistics.median(ent),
                          max(ent), full_med / max(statistics.median(ent), 1e-9), 1.0,
                          None, None, None, None, "order-0: n*H(p) + count*H(xor)"))
    for fname in formats:
        if not sizes[fname]:
            continue
        s = sizes[fname]
        t_enc, t_dec, exact = timing[fname]
        rss_x = None
        if rss:
            r = _rss_probe(name, fname, steps)
            if r is not None:
                rss_x = r["extra_bytes"] / r["model_bytes"]
                exact &= r["exact"]
        fmt = peers.FORMATS[fname]
        results.append(Result(
            name, fname, fmt.kind, steps, model_bytes, statistics.median(s), max(s),
            full_med / statistics.median(s),
            statistics.median(b / e for b, e in zip(s, ent) if e > 0) if any(ent) else float("nan"),
            model_bytes * steps / t_enc / 1e9, model_bytes * steps / t_dec / 1e9, rss_x, exact,
            fmt.note,
        ))
    order = {ENTROPY: -1, **{f: i for i, f in enumerate(formats)}}
    return sorted(results, key=lambda r: order[r.format])


def _fmt_bytes(n: float) -> str:
    if n != n:  # NaN
        return "-"
    for unit, div in (("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def table(results: list[Result]) -> str:
    """A plain-text table, one line per (workload, format)."""
    head = ("workload", "format", "median/step", "max/step", "x full", "/ H0",
            "enc GB/s", "dec GB/s", "RSS +xM", "exact")
    rows = [head]
    for r in results:
        rows.append((
            r.workload, r.format, _fmt_bytes(r.bytes_median), _fmt_bytes(r.bytes_max),
            _num(r.x_full, ".1f"), _num(r.over_entropy, ".2f"), _num(r.encode_gbps, ".2f"),
            _num(r.decode_gbps, ".2f"), _num(r.rss_extra_x, ".2f"),
            "-" if r.exact is None else ("yes" if r.exact else "NO"),
        ) + ((f"  ({r.note})",) if r.note.startswith("skipped") else ()))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for i, row in enumerate(rows):
        cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells) + "".join(row[len(head):]))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _codec_revision() -> str:
    """Commit of the working tree, with ``+dirty`` if the codec (deltastore/codec/) has local edits."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "deltastore/codec"],
                               cwd=root).returncode != 0
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "deltastore_revision": _codec_revision()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def run(workloads: list[str], formats: list[str], quick: bool = False, rss: bool = True,
        json_path: str | None = None, repeats: int = REPEATS) -> list[Result]:
    """Benchmark ``formats`` on ``workloads``; print the table; optionally write JSON."""
    torch.set_num_threads(THREADS)
    steps = QUICK_STEPS if quick else None
    logger.info("deltastore revision %s", _codec_revision())
    all_results: list[Result] = []
    changes = {}
    for name in workloads:
        t0 = time.perf_counter()
        sds = load_workload(name, steps)
        logger.info("loaded %s (%d steps) in %.1f s", name, len(sds) - 1, time.perf_counter() - t0)
        st = change_stats(name, sds)
        changes[name] = dataclasses.asdict(st)
        print(f"{name}: % bf16 elements changed per step "
              f"[{', '.join(f'{100 * f:.2f}' for f in st.per_step)}], "
              f"tensors changed {min(st.tensors_changed)}-{max(st.tensors_changed)} "
              f"of {st.n_tensors}, ever changed {100 * st.ever_changed:.2f}%", flush=True)
        all_results += bench_workload(name, sds, formats, rss=rss, repeats=repeats)
    print()
    print(table(all_results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": machine(), "quick": quick, "repeats": repeats,
                       "threads": THREADS, "changes": changes,
                       "results": [dataclasses.asdict(r) for r in all_results]}, f, indent=1)
        logger.info("wrote %s", json_path)
    return all_results


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description="Compare deltastore with peer weight-sync formats.")
    p.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS),
                   choices=list(WORKLOADS))
    p.add_argument("--formats", nargs="+", default=list(peers.FORMATS),
                   choices=list(peers.FORMATS))
    p.add_argument("--quick", action="store_true", help=f"only {QUICK_STEPS} steps per workload")
    p.add_argument("--no-rss", dest="rss", action="store_false",
                   help="skip the per-format peak-RSS subprocesses")
    p.add_argument("--repeat", type=int, default=REPEATS,
                   help="time each encode/decode this many times, keep the fastest")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    formats = list(dict.fromkeys(["full", *args.formats]))  # "x full" needs the full row
    run(args.workloads, formats, quick=args.quick, rss=args.rss, json_path=args.json,
        repeats=max(1, args.repeat))
