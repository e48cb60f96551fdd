"""Sharded publishing: publish throughput with 1, 2 and 4 ranks, per-rank memory.

``python -m benchmarks.sharded [--workload synthetic rl fixed] [--repeat 3]`` publishes the same
model to a local file store, once per configuration and repeat, the configurations interleaved
(1, 2, 4 ranks, then again) so that a shared machine's load falls on all of them alike:

- ``Publisher``: one process, the unsharded writer (the reference);
- ``ShardedPublisher`` with 1, 2 and 4 ranks (gloo over 127.0.0.1), one encode thread per rank,
  so that N ranks use N cores as an FSDP job's N processes would;
- ``independent`` (``--independent``, on by default): the same N processes, each an ordinary
  ``Publisher`` of its own rows to a store of its own — no collectives, no join, no shared
  commit. It is the ceiling without the protocol: what N processes publishing these shards at
  once reach on this machine, so ``sharded / independent`` is what the protocol costs and
  ``independent / 1 rank`` what is left when only the shards' own work remains;
- ``alone`` (with ``--independent``): the same N independent processes one after another, so
  each has the machine to itself; their CPU against the independent run's is what the cores
  lose to each other, and against one rank's what splitting every tensor's rows costs;
- ``preloaded`` and ``pipelined`` (``--pipelined``, on by default), 1 and N ranks: every step's
  rows read first, then the deltas back to back by ``publish`` (preloaded) or by
  ``publish_async`` and one ``flush`` (pipelined: rank 0 commits a version while the ranks
  encode the next, design 010 D10); their ratio is what overlapping the commit gives, on the
  same data read the same way (a step read just before its publish, as the other modes do,
  leaves part of it in cache).

Workloads:

``synthetic`` (``--tensors 8 --rows 4096 --cols 1024 --steps 8 --density 0.01``)
    bf16 ``tensors`` × [rows, cols]; each rank builds only its own rows (seeded per block of
    rows, so every configuration publishes the same bits) and changes ``density`` of its
    elements per step.
``rl`` (``--rl-workload tf265m-rl-1e-6``)
    The cached real workload (531 MB of bf16, a Llama-shaped decoder after real AdamW steps at
    lr 1e-6, 1.5–3.7 % of elements changed per step). Every tensor's rows are split among the
    ranks as FSDP2 splits them (``torch.chunk`` on dimension 0: ``ceil(rows / N)`` per rank,
    the last ranks possibly short or empty); each rank reads only its rows of each step from
    the safetensors file and copies them into its parameters in place, as an optimizer step
    does, before the timed publish.
``fixed``
    The per-version fixed cost: a tiny model (8 × bf16[64, 16]) published unchanged
    ``--fixed-versions`` times; per version the median time, and per rank the store requests
    (gets, heads, lists: reads; puts) and object collectives.

Reported per configuration: the anchor's time, the median time of a delta publish (from a
barrier to the committed HEAD on the last rank to return; median over the steps of a run, then
median over repeats),
throughput (model bytes / median delta time) and its ratio to one rank, the CPU seconds of a
delta publish on the busiest rank (its process's CPU time, every thread; on a shared machine
the ranks wait for cores, and this is the time a publish takes when each rank has a core of
its own, less what it waits for the others and the store) and its ratio, every rank's CPU
seconds (rank 0 also joins and commits), and per rank the peak RSS above the process's RSS
before it built its rows, next to its shard's bytes (the reference copy is one more shard).
Goal: 2 ranks ≥ 1.7× one rank.

``scan`` (``--scan-bytes``, default the rl model's 531 MB)
    The machine's ceiling without deltastore: one process scans the bytes (memcmp of two equal
    buffers, as the encoder compares a shard with its reference; memmove, as it advances the
    reference), then 1, 2, 4 processes at once scan a 1/N share each. If N processes are not
    N× faster here, N ranks cannot be either (memory bandwidth, or cores taken by others).

``--step-cpu`` also times each step of a sharded publish on every rank with thread-CPU timers
(the caller thread's CPU in the collectives, ``encode_version``, the part manifest, rank 0's
join and commit; design 010 D8) and reports them per rank beside the process's CPU.

Every configuration's last version is pulled by an unsharded Subscriber and compared with the
model published, bit for bit. Results: benchmarks/results/sharded.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import pickle
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.sharded_rank import (
    BLOCK_ROWS,
    FIXED_COLS,
    FIXED_ROWS,
    FIXED_TENSORS,
    OWN_STORES,
    STEP_TIMERS,
    free_port,
    fsdp_range,
    rank_context,
    rl_path,
    run_rank,
    safetensors_header,
    shard_rows,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The goal: publish throughput with 2 ranks over 1 rank.
GOAL_2_OVER_1 = 1.7
#: The real workload of ``--workload rl`` (cached under benchmarks/.cache; 7 steps: an anchor and 6 deltas).
RL_WORKLOAD = "tf265m-rl-1e-6"
#: Steps of the cached RL workload published (step 0 is the anchor).
RL_STEPS = 6


#: Scans per process and configuration of ``--workload scan`` (the median is reported).
SCAN_REPEATS = 9


def _scan_proc(nbytes: int, q: Any, barrier: Any) -> None:
    """One process of the scan ceiling: memcmp and memmove of ``nbytes``, timed between barriers."""
    import ctypes

    import numpy as np

    libc = ctypes.CDLL(None)
    libc.memcmp.restype = ctypes.c_int
    libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    b, c = a.copy(), np.empty_like(a)  # equal buffers: memcmp reads both to the end
    cmp_s, move_s, cpu_s = [], [], []
    barrier.wait()
    for _ in range(SCAN_REPEATS):
        t0, c0 = time.perf_counter(), time.thread_time()
        libc.memcmp(a.ctypes.data, b.ctypes.data, nbytes)
        cmp_s.append(time.perf_counter() - t0)
        cpu_s.append(time.thread_time() - c0)
        barrier.wait()
        t0 = time.perf_counter()
        ctypes.memmove(c.ctypes.data, a.ctypes.data, nbytes)
        move_s.append(time.perf_counter() - t0)
        barrier.wait()
    q.put((statistics.median(cmp_s), statistics.median(move_s), statistics.median(cpu_s)))


def scan_ceiling(nbytes: int, worlds: list[int]) -> list[dict[str, Any]]:
    """Per process count: the slowest process's median memcmp and memmove times of its share."""
    ctx = mp.get_context("fork")
    rows = []
    for n in worlds:
        q, barrier = ctx.Queue(), ctx.Barrier(n)
        procs = [ctx.Process(target=_scan_proc, args=(nbytes // n, q, barrier)) for _ in range(n)]
        for p in procs:
            p.start()
        res = [q.get() for _ in procs]
        for p in procs:
            p.join()
        rows.append({"processes": n, "memcmp_s": round(max(r[0] for r in res), 4), "memmove_s": round(max(r[1] for r in res), 4),
                     "cpu_over_wall": round(min(r[2] / r[0] for r in res), 2)})
    return rows


def _steps(workload: str, args: argparse.Namespace) -> int:
    return {"synthetic": args.steps, "rl": RL_STEPS, "fixed": args.fixed_versions}[workload]


def run_config(workload: str, world: int, mode: str, args: argparse.Namespace, tmp: Path, threads: int = 1,
               repeat: int = 0) -> dict[str, Any]:
    """One run of one configuration: its ranks' times, requests and memory."""
    name = f"{workload}-{mode}-{world}-{threads}-{repeat}"
    s3 = args.s3  # --rtt-ms: an S3 server behind a shaped link
    url = f"{s3['base']}/{name}-{os.urandom(4).hex()}" if s3 else f"file://{tmp}/store-{name}"
    out = tmp / f"out-{name}"
    out.mkdir()
    cfg = {"workload": workload, "mode": mode, "rows": args.rows, "cols": args.cols, "tensors": args.tensors,
           "steps": _steps(workload, args), "density": args.density, "threads": threads, "rl_workload": args.rl_workload,
           "pin": args.pin, "step_cpu": args.step_cpu, "storage_options": s3["storage_options"] if s3 else None}
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, url, cfg, str(out))) for r in range(world)]
    for p in procs:
        p.start()
        if mode == "alone":  # one after another: each process has the machine to itself
            p.join()
    for p in procs:
        p.join()
    ranks = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for r in ranks:
        if "error" in r:
            raise RuntimeError(f"{name} rank {r['rank']} failed:\n{r['error']}")
    if mode in OWN_STORES:
        for r in range(world):
            _check(f"{url}-r{r}", workload, args, rows_of=(r, world))
            shutil.rmtree(tmp / f"store-{name}-r{r}", ignore_errors=True)
    else:
        _check(url, workload, args)
        shutil.rmtree(tmp / f"store-{name}", ignore_errors=True)  # a 531 MB anchor per run adds up
    return {"ranks": ranks}


def summarise(workload: str, world: int, mode: str, threads: int, runs: list[dict[str, Any]],
              model_bytes: int) -> dict[str, Any]:
    """Medians over a configuration's runs (each run: the median of its delta publishes). A
    version's time is the last rank's (every rank starts from a barrier): on ShardedPublisher
    every rank returns after rank 0's commit, the independent publishers each after their own."""
    def walls(run: dict[str, Any]) -> list[tuple[str, float]]:  # (kind, seconds) per version
        per = zip(*(r["times"] for r in run["ranks"]))
        if mode == "alone":  # the processes took turns: a version took all of their times
            return [(v[0][0], sum(t for _, t, _ in v)) for v in per]
        return [(v[0][0], max(t for _, t, _ in v)) for v in per]

    run_deltas = [statistics.median(t for kind, t in walls(run) if kind in ("delta", "unchanged")) for run in runs]
    all_deltas = [t for run in runs for kind, t in walls(run) if kind in ("delta", "unchanged")]
    anchors = [walls(run)[0][1] for run in runs]
    delta_s = statistics.median(run_deltas)
    # CPU seconds of a delta publish on the busiest rank (median over its publishes, then over
    # runs): what one publish costs when every rank has a core of its own, whatever the load.
    def rank_cpu(r: dict[str, Any]) -> float:  # one rank's median CPU seconds of a delta publish
        return statistics.median(c for (kind, _, _), c in zip(r["times"], r["cpu"]) if kind in ("delta", "unchanged"))

    busiest_cpu = statistics.median(max(rank_cpu(r) for r in run["ranks"]) for run in runs)
    # every rank's (median over runs): rank 0 also commits, the others wait for it
    per_rank_cpu = [statistics.median(rank_cpu(run["ranks"][i]) for run in runs) for i in range(world)]
    row = {
        "workload": workload, "mode": mode, "ranks": world, "threads_per_rank": threads, "runs": len(runs),
        "anchor_s": round(statistics.median(anchors), 3), "anchor_mb_s": round(model_bytes / statistics.median(anchors) / 1e6, 1),
        "delta_median_s": round(delta_s, 4), "delta_runs_s": [round(t, 4) for t in run_deltas],
        "delta_min_max_s": [round(min(all_deltas), 4), round(max(all_deltas), 4)], "deltas": len(all_deltas),
        "delta_bytes_median": int(statistics.median(sum(bs) for run in runs
                                                    for bs in zip(*([b for _, _, b in r["times"][1:]] for r in run["ranks"])))
                                  if mode in OWN_STORES else
                                  statistics.median(b for run in runs for k, _, b in run["ranks"][0]["times"][1:])),
        "throughput_mb_s": round(model_bytes / delta_s / 1e6, 1),
        "delta_cpu_s_busiest_rank": round(busiest_cpu, 4),
        "delta_cpu_s_per_rank": [round(c, 4) for c in per_rank_cpu],
        "per_rank": [{"rank": r["rank"], "shard_bytes": r["shard_bytes"],
                      "peak_rss_above_base": max(run["ranks"][i]["peak_rss_above_base"] for run in runs)}
                     for i, r in enumerate(runs[0]["ranks"])],
    }
    if mode == "sharded" and any(run["ranks"][0].get("step_cpu", [{}])[-1] for run in runs):
        # --step-cpu: per rank, median ms of the caller thread's CPU in each step of a delta
        # publish (over its publishes and runs); "main" is the whole publish on that thread
        def step_ms(i: int, label: str) -> float:
            return round(1e3 * statistics.median(
                (m if label == "main" else s.get(label, 0.0))
                for run in runs
                for (kind, _, _), m, s in zip(run["ranks"][i]["times"], run["ranks"][i]["main_cpu"], run["ranks"][i]["step_cpu"])
                if kind in ("delta", "unchanged")), 2)

        row["step_cpu_ms"] = [{label: step_ms(i, label) for label in ("main", *dict.fromkeys(t[0] for t in STEP_TIMERS))}
                              for i in range(world)]
    if workload == "fixed":  # requests and collectives per steady version (after the anchor), per rank
        row["per_version"] = [
            {k: statistics.median(q[k] for run in runs for q in run["ranks"][i]["requests"][1:]) for k in ("reads", "writes", "collectives")}
            for i in range(world)
        ]
    return row


def _check(url: str, workload: str, args: argparse.Namespace, rows_of: tuple[int, int] | None = None) -> None:
    """The last version, pulled by an unsharded Subscriber, is the model published (with
    ``rows_of=(rank, world)``: that rank's rows of it, as FSDP2 splits them)."""
    import torch

    from deltastore import Subscriber

    s3 = args.s3
    with Subscriber(url, storage_options=s3["storage_options"] if s3 else None) as sub:
        got = sub.pull()
    step = _steps(workload, args) + 1
    if workload == "synthetic":
        want = {f"layer{ti}.weight": shard_rows(ti, 0, args.rows, step, args.cols, args.density) for ti in range(args.tensors)}
    elif workload == "fixed":
        want = {f"t{i}": torch.full((FIXED_ROWS, FIXED_COLS), float(i), dtype=torch.bfloat16) for i in range(FIXED_TENSORS)}
    else:
        from safetensors.torch import load_file

        want = load_file(str(rl_path(args.rl_workload, step - 1)))
    if rows_of is not None:
        want = {k: t[slice(*fsdp_range(t.shape[0], *rows_of))] for k, t in want.items()}
    if set(got) != set(want):
        raise AssertionError(f"{url}: tensors {sorted(set(got) ^ set(want))[:5]} differ between the store and the model")
    for name, t in want.items():
        if not torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{url}: {name} differs from the model published")


def _model_bytes(workload: str, args: argparse.Namespace) -> int:
    if workload == "synthetic":
        return args.tensors * args.rows * args.cols * 2
    if workload == "fixed":
        return FIXED_TENSORS * FIXED_ROWS * FIXED_COLS * 2
    import torch

    header, _ = safetensors_header(rl_path(args.rl_workload, 0))
    return sum(math.prod(shape) * getattr(torch, dtype).itemsize for dtype, shape, _ in header.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="sharded publishing: throughput with 1, 2, 4 ranks; per-rank memory")
    ap.add_argument("--workload", nargs="+", choices=["synthetic", "rl", "fixed", "scan"], default=["fixed", "synthetic", "rl"])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each configuration, interleaved")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the unsharded Publisher and one rank with two threads")
    ap.add_argument("--independent", action=argparse.BooleanOptionalAction, default=True,
                    help="also run N > 1 independent processes (each a Publisher of its own rows to a store of "
                         "its own), at once and one after another: the ceiling without the protocol")
    ap.add_argument("--pipelined", action=argparse.BooleanOptionalAction, default=True,
                    help="also run ShardedPublisher.publish_async back to back on preloaded steps (1 rank and N): "
                         "throughput when rank 0 commits a version while the ranks encode the next (design 010 D10)")
    ap.add_argument("--rtt-ms", type=float, default=0.0,
                    help="publish to a moto S3 server behind a shaping proxy adding this round-trip time per "
                         "request (testkit.shaper) instead of a file store: what the commit's round trips cost "
                         "each version, and what publish_async hides of them")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=False,
                    help="pin each rank to cores of its own (rank r: cores [r·threads, (r+1)·threads)), as a "
                         "node with cores per rank runs them; without it the ranks share every core")
    ap.add_argument("--step-cpu", action=argparse.BooleanOptionalAction, default=False,
                    help="also time each step of a sharded publish on every rank (main-thread CPU: collectives, "
                         "encoding, part manifest, rank 0's join and commit; design 010 D8)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--rl-workload", default=RL_WORKLOAD)
    ap.add_argument("--fixed-versions", type=int, default=30)
    ap.add_argument("--scan-bytes", type=int, default=None, help="bytes of --workload scan (default: the rl model's)")
    ap.add_argument("--tmp", type=Path, default=None, help="where the stores go (default: the system's temp dir)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.rows % (4 * BLOCK_ROWS):
        ap.error(f"--rows must be a multiple of {4 * BLOCK_ROWS}")
    if 1 not in args.worlds:
        ap.error("--worlds must include 1 (the ratios are to one rank)")
    args.s3 = None  # the S3 server and its options, with --rtt-ms
    with contextlib.ExitStack() as stack:
        if args.rtt_ms > 0:
            from testkit.servers import moto
            from testkit.shaper import Link, LinkShaper

            server = stack.enter_context(moto())
            shaper = stack.enter_context(LinkShaper(server.endpoint_url, Link(rtt_s=args.rtt_ms / 1e3)))
            args.s3 = {"base": f"s3://{server.bucket}/sharded-bench",
                       "storage_options": server.storage_options(endpoint_url=shaper.endpoint_url)}
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    load0 = os.getloadavg()[0]
    out: dict[str, Any] = {"cpus": os.cpu_count(), "repeat": args.repeat, "rtt_ms": args.rtt_ms, "workloads": {}}
    lines: list[str] = []
    for workload in args.workload:
        if workload == "scan":
            nbytes = args.scan_bytes or _model_bytes("rl", args)
            rows = [r for _ in range(args.repeat) for r in scan_ceiling(nbytes, args.worlds)]  # interleaved
            out["workloads"]["scan"] = {"bytes": nbytes, "rows": rows}
            lines += _scan_report(nbytes, rows, args.worlds)
            continue
        model_bytes = _model_bytes(workload, args)
        configs = [("sharded", w, 1) for w in args.worlds]
        if args.independent and workload != "fixed":
            configs += [(m, w, 1) for m in OWN_STORES for w in args.worlds if w > 1]
        if args.pipelined and workload != "fixed":
            configs += [(m, w, 1) for m in ("preloaded", "pipelined") for w in args.worlds]
        if args.reference and workload != "fixed":
            configs = [("unsharded", 1, 1), *configs, ("sharded", 1, 2)]
        runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {c: [] for c in configs}
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            for rep in range(args.repeat):  # interleaved: a burst of load falls on every configuration
                for mode, world, threads in configs:
                    runs[(mode, world, threads)].append(run_config(workload, world, mode, args, Path(tmp), threads, rep))
        rows = [summarise(workload, w, m, t, runs[(m, w, t)], model_bytes) for m, w, t in configs]
        one = _config(rows, "sharded", 1)
        assert one is not None
        for r in rows:
            r["vs_1_rank"] = round(r["throughput_mb_s"] / one["throughput_mb_s"], 2)
            r["anchor_vs_1_rank"] = round(r["anchor_mb_s"] / one["anchor_mb_s"], 2)
            r["cpu_vs_1_rank"] = round(one["delta_cpu_s_busiest_rank"] / r["delta_cpu_s_busiest_rank"], 2)
        entry: dict[str, Any] = {"model_bytes": model_bytes, "steps": _steps(workload, args), "configs": rows, "bit_exact": True}
        lines += _report(workload, args, entry)
        out["workloads"][workload] = entry
    out["load_average"] = [round(load0, 1), round(os.getloadavg()[0], 1)]
    lines.append(f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs")
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.out / "sharded.md").write_text(md)
    print(md)
    return 0


def _scan_report(nbytes: int, rows: list[dict[str, Any]], worlds: list[int]) -> list[str]:
    """The markdown of the scan ceiling (medians over repeats)."""
    lines = [f"### scan ceiling: {nbytes:,} B scanned by 1 process, or by N processes at once (1/N each); no deltastore", "",
             "| processes | memcmp s (vs 1) | memmove s (vs 1) | CPU / wall of a scan (lowest process) |", "|---|---|---|---|"]
    med = {n: {k: statistics.median(r[k] for r in rows if r["processes"] == n) for k in ("memcmp_s", "memmove_s", "cpu_over_wall")}
           for n in worlds}
    for n in worlds:
        m = med[n]
        lines.append(f"| {n} | {m['memcmp_s']:.4f} ({med[1]['memcmp_s'] / m['memcmp_s']:.2f}×) "
                     f"| {m['memmove_s']:.4f} ({med[1]['memmove_s'] / m['memmove_s']:.2f}×) | {m['cpu_over_wall']:.2f} |")
    return [*lines, ""]


def _config(rows: list[dict[str, Any]], mode: str, ranks: int, threads: int = 1) -> dict[str, Any] | None:
    """The summary row of one configuration, None if it did not run."""
    return next((r for r in rows if (r["mode"], r["ranks"], r["threads_per_rank"]) == (mode, ranks, threads)), None)


def _report(workload: str, args: argparse.Namespace, entry: dict[str, Any]) -> list[str]:
    """The markdown of one workload."""
    rows, model_bytes = entry["configs"], entry["model_bytes"]
    what = {
        "synthetic": f"synthetic: {args.tensors} × bf16[{args.rows}, {args.cols}] = {model_bytes:,} B; {args.steps} delta steps "
                     f"at {100 * args.density:g} % changed",
        "rl": f"rl: {args.rl_workload} ({model_bytes:,} B of bf16, real AdamW steps at lr 1e-6), rows split as FSDP2 "
              f"splits them; {RL_STEPS} delta steps",
        "fixed": f"fixed cost: {FIXED_TENSORS} × bf16[{FIXED_ROWS}, {FIXED_COLS}] published unchanged {args.fixed_versions} times",
    }[workload]
    pinned = "; each rank pinned to cores of its own (--pin)" if args.pin else ""
    where = f"moto S3 server behind a link adding {args.rtt_ms:g} ms of round trip per request" if args.rtt_ms else "file store"
    lines = [f"### {what}; {where}; {args.repeat} interleaved runs per configuration{pinned}; every run bit-exact", ""]
    if workload == "fixed":
        lines += ["| ranks | per version: median s (runs) | per rank: store reads / writes / object collectives per version |",
                  "|---|---|---|"]
        for r in rows:
            per = ", ".join(f"{q['reads']:g} / {q['writes']:g} / {q['collectives']:g}" for q in r["per_version"])
            lines.append(f"| {r['ranks']} | {r['delta_median_s']} ({', '.join(map(str, r['delta_runs_s']))}) | {per} |")
        return [*lines, ""]
    lines += [
        ("| writer | ranks × threads | anchor s (vs 1 rank) | delta s, median (per run) | delta: MB/s of model | delta vs 1 rank "
         "| delta CPU s, busiest rank (vs 1 rank) | delta CPU s per rank | per-rank peak RSS above base / shard |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = ", ".join(f"{p['peak_rss_above_base'] / 2**20:.0f}/{p['shard_bytes'] / 2**20:.0f} MiB" for p in r["per_rank"])
        writer = {"unsharded": "Publisher", "sharded": "ShardedPublisher", "independent": "independent Publishers",
                  "alone": "independent Publishers, one at a time",
                  "preloaded": "ShardedPublisher, back to back", "pipelined": "ShardedPublisher.publish_async, back to back"}[r["mode"]]
        lines.append(f"| {writer} | {r['ranks']} × "
                     f"{r['threads_per_rank']} | {r['anchor_s']} ({r['anchor_vs_1_rank']}×) | {r['delta_median_s']} "
                     f"({', '.join(map(str, r['delta_runs_s']))}) | {r['throughput_mb_s']} | {r['vs_1_rank']}× "
                     f"| {r['delta_cpu_s_busiest_rank']} ({r['cpu_vs_1_rank']}×) "
                     f"| {', '.join(f'{c:.3f}' for c in r['delta_cpu_s_per_rank'])} | {mem} |")
    timed = [r for r in rows if "step_cpu_ms" in r]
    if timed:
        labels = [k for k in timed[0]["step_cpu_ms"][0] if k != "main"]
        lines += ["", ("Caller thread's CPU ms per delta publish, by step (--step-cpu; medians; `part` holds "
                       "`encode_version` and `encode_part`, `commit` holds `join`; the encode threads' CPU is not in these):"), "",
                  f"| ranks × threads | rank | publish (caller thread) | {' | '.join(labels)} | process CPU (all threads) |",
                  "|---|---|---|" + "---|" * len(labels) + "---|"]
        for r in timed:
            for i, st in enumerate(r["step_cpu_ms"]):
                lines.append(f"| {r['ranks']} × {r['threads_per_rank']} | {i} | {st['main']:.1f} | "
                             f"{' | '.join(f'{st[k]:.1f}' for k in labels)} | {1e3 * r['delta_cpu_s_per_rank'][i]:.1f} |")
    two = _config(rows, "sharded", 2)
    if two is not None:
        entry["two_over_one"] = two["vs_1_rank"]
        entry["goal_met"] = two["vs_1_rank"] >= GOAL_2_OVER_1
        lines += ["", (f"2 ranks / 1 rank: delta publish {two['vs_1_rank']}×, anchor {two['anchor_vs_1_rank']}× "
                      f"(goal ≥ {GOAL_2_OVER_1}×: {'met' if entry['goal_met'] else 'not met'} on this machine); "
                      f"by the busiest rank's CPU time {two['cpu_vs_1_rank']}×")]
        ceiling, one = _config(rows, "independent", 2), _config(rows, "sharded", 1)
        assert one is not None
        if ceiling is not None:
            entry["two_independent_over_one"] = ceiling["vs_1_rank"]
            entry["sharded_over_independent"] = round(two["throughput_mb_s"] / ceiling["throughput_mb_s"], 2)
            lines.append(f"2 independent processes / 1 rank (the ceiling without the protocol): {ceiling['vs_1_rank']}×; "
                         f"2 sharded ranks reach {entry['sharded_over_independent']}× of it")
            alone = _config(rows, "alone", 2)
            if alone is not None:  # CPU per version of a half: two at once against one alone, one alone against half of one rank
                at_once, by_itself = ceiling["delta_cpu_s_per_rank"], alone["delta_cpu_s_per_rank"]
                entry["corun_cpu"] = round(sum(at_once) / sum(by_itself), 2)
                entry["halves_cpu"] = round(sum(by_itself) / one["delta_cpu_s_busiest_rank"], 2)
                lines.append(f"CPU per version of the two halves: {entry['corun_cpu']}× when the two processes run at once "
                             f"than one at a time (what the cores lose to each other), and one at a time "
                             f"{entry['halves_cpu']}× one rank's for the whole model (what twice as many, half-size "
                             "chunks cost)")
        one_p, two_p = _config(rows, "pipelined", 1), _config(rows, "pipelined", 2)
        one_b, two_b = _config(rows, "preloaded", 1), _config(rows, "preloaded", 2)
        if None not in (one_p, two_p, one_b, two_b):
            entry["pipelined_two_over_one"] = round(two_p["throughput_mb_s"] / one_p["throughput_mb_s"], 2)  # type: ignore[index]
            entry["pipelined_goal_met"] = entry["pipelined_two_over_one"] >= GOAL_2_OVER_1
            entry["pipelined_over_preloaded"] = [round(p["throughput_mb_s"] / b["throughput_mb_s"], 2)  # type: ignore[index]
                                                 for p, b in ((one_p, one_b), (two_p, two_b))]
            lines.append(f"back to back on preloaded steps, 2 ranks / 1 rank: publish_async {entry['pipelined_two_over_one']}× "
                         f"(goal ≥ {GOAL_2_OVER_1}×: {'met' if entry['pipelined_goal_met'] else 'not met'} on this machine), "
                         f"publish {round(two_b['throughput_mb_s'] / one_b['throughput_mb_s'], 2)}×; "  # type: ignore[index]
                         f"publish_async / publish: 1 rank {entry['pipelined_over_preloaded'][0]}×, "
                         f"2 ranks {entry['pipelined_over_preloaded'][1]}×")
    return [*lines, ""]


if __name__ == "__main__":
    raise SystemExit(main())
